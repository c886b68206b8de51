"""Reference sparse attention: gather the selected slots, masked softmax."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def sparse_attention(q, k, v, indices, scale):
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
    qg = q.to(acc).view(t, hkv, h // hkv, dk)  # query heads grouped by their kv head
    s = torch.einsum("tcgd,tkcd->tcgk", qg, kg).reshape(t, h, -1) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [T, H]; -inf when a row has no valid slot
    # Rows with no valid slot: subtract 0 instead of -inf so p is 0, not NaN.
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("tcgk,tkcd->tcgd", p.view(t, hkv, h // hkv, -1), vg).reshape(t, h, -1)
    return out.to(out_dtype(q.dtype)), lse.to(out_dtype(torch.float32))
