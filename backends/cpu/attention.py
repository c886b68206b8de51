"""Reference sparse attention: gather the selected slots, masked softmax."""

from __future__ import annotations

import torch

from glmport.core.specs.attention import lse_as_asked

from .precision import acc_dtype, out_dtype


def sparse_attention(q, k, v, indices, scale, need_lse=True, k_rope=None):
    if k_rope is not None:  # the reference joins the key: clarity over memory
        k = torch.cat((k, k_rope), dim=-1)
    out, lse = _attention(q, k, v, indices, scale)
    return out, lse_as_asked(lse, need_lse)


def _attention(q, k, v, indices, scale):
    acc = acc_dtype()
    t, h, dk = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if n == 0:  # no key slot: every row is empty
        out = torch.zeros((t, h, v.shape[-1]), dtype=out_dtype(q.dtype), device=q.device)
        lse = torch.full((t, h), float("-inf"), dtype=out_dtype(torch.float32), device=q.device)
        return out, lse
    # Slots outside [0, N) count as -1, like FlashMLA: unchecked under GLMPORT_VALIDATE=meta.
    valid = (indices >= 0) & (indices < n)  # [T, K]
    slots = torch.where(valid, indices, 0).long()
    kg = k.to(acc)[slots]  # [T, K, Hkv, Dk]
    vg = v.to(acc)[slots]  # [T, K, Hkv, Dv]
    kk, dv = indices.shape[1], v.shape[-1]
    qg = q.to(acc).view(t, hkv, h // hkv, dk)  # query heads grouped by their kv head
    # Sizes spelled out: ``-1`` cannot be inferred from an empty tensor (T = 0).
    s = torch.einsum("tcgd,tkcd->tcgk", qg, kg).reshape(t, h, kk) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p, lse = softmax_with_lse(s)
    out = torch.einsum("tcgk,tkcd->tcgd", p.view(t, hkv, h // hkv, kk), vg).reshape(t, h, dv)
    return out.to(out_dtype(q.dtype)), lse.to(out_dtype(torch.float32))


def softmax_with_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of scores ``s`` ``[..., K]`` and its natural-log lse ``[...]`` (also
    the generic backend's, on its fp32 chunks).

    ``p = exp(s - max) / sum`` (as flash attention does), not ``exp(s - lse)``: with a
    huge scale ``|lse|`` is large and ``s - lse`` loses every digit the float32 ulp of
    ``lse`` spans, while ``s - max`` is exact at the maximum. A row with no valid slot
    (all ``-inf``, or ``K = 0``) gives ``p = 0`` and ``lse = -inf``.
    """
    if s.shape[-1]:
        m = s.amax(dim=-1, keepdim=True)
    else:
        m = s.new_full((*s.shape[:-1], 1), float("-inf"))
    m = torch.where(torch.isfinite(m), m, 0.0)  # all -inf: subtract 0 so p is 0, not NaN
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, 1.0)
    return p, (m + torch.log(total)).squeeze(-1)
