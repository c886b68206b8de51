"""Sparse attention in query chunks: only the selected slots are gathered, so extra
memory is O(chunk * K * D), never O(T * N)."""

from __future__ import annotations

import torch

from glmport.backends.cpu.attention import softmax_with_lse

from .tiling import rows_per_tile


def _v_is_k_prefix(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when ``v`` is ``k[..., :Dv]`` (absorbed MLA): gather once, slice the gather."""
    return (
        torch._C._is_alias_of(v, k)  # storage identity; works on fake tensors when tracing
        and v.storage_offset() == k.storage_offset()
        and v.shape[:2] == k.shape[:2]
        and v.stride() == k.stride()
        and v.shape[-1] <= k.shape[-1]
    )


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``x[slots]`` as fp32 ``[Tc, Hkv, K, D]``: ``index_select`` copies whole rows,
    many times faster than advanced indexing on a CPU. With no slot (``N = 0``) every
    entry is masked, so zeros stand in."""
    if x.shape[0] == 0:
        return x.new_zeros((*slots.shape, x.shape[1], x.shape[2])).float().permute(0, 2, 1, 3)
    # Sizes spelled out: ``-1`` cannot be inferred from an empty tensor.
    flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2])
    rows = torch.index_select(flat, 0, slots.reshape(slots.numel()))
    return rows.view(*slots.shape, x.shape[1], x.shape[2]).float().permute(0, 2, 1, 3)


def gather_chunk(q, k, v, indices, scale, t0, t1):
    """Scores and gathered values for queries ``[t0, t1)``, all fp32.

    Returns ``qg [Tc, Hkv, G, Dk]``, ``kg [Tc, Hkv, K, Dk]``, ``vg [Tc, Hkv, K, Dv]``,
    ``s [Tc, Hkv, G, K]`` (scaled, ``-inf`` at entries outside ``[0, N)``, ``-1``
    included) and ``slots [Tc, K]`` int64 (those entries read slot 0).
    """
    h, dk = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    idx = indices[t0:t1]
    # Slots outside [0, N) count as -1, like FlashMLA: unchecked under GLMPORT_VALIDATE=meta.
    valid = (idx >= 0) & (idx < k.shape[0])
    slots = torch.where(valid, idx, 0).long()
    kg = _gather(k, slots)  # [Tc, Hkv, K, Dk]
    # Absorbed MLA's value is a prefix of the key: slice the gather instead of redoing it.
    vg = kg[..., : v.shape[-1]] if _v_is_k_prefix(k, v) else _gather(v, slots)
    qg = q[t0:t1].float().view(t1 - t0, hkv, h // hkv, dk)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return qg, kg, vg, s, slots


def chunk_rows(q, k, v, indices) -> int:
    """Queries per chunk: the gathered K and V plus scores and probabilities, in fp32."""
    kk = indices.shape[1]
    hkv, dk, dv, h = k.shape[1], k.shape[2], v.shape[2], q.shape[1]
    per_query = 4 * kk * (hkv * (dk + dv) + 2 * h)
    return rows_per_tile(per_query, q.shape[0])


def sparse_attention(q, k, v, indices, scale):
    t, h, _ = q.shape
    out = q.new_empty((t, h, v.shape[-1]))
    lse_out = torch.empty((t, h), dtype=torch.float32, device=q.device)
    step = chunk_rows(q, k, v, indices)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        _, _, vg, s, _ = gather_chunk(q, k, v, indices, scale, t0, t1)
        p, lse = softmax_with_lse(s)
        out[t0:t1] = torch.matmul(p, vg).reshape(t1 - t0, h, v.shape[-1]).to(q.dtype)
        lse_out[t0:t1] = lse.reshape(t1 - t0, h)
    return out, lse_out


def sparse_attention_backward(inputs: tuple, grads: tuple) -> tuple:
    """Closed-form gradients, chunk by chunk like the forward (FlashAttention-style):
    ``dS = P * (dP - rowsum(dO * O) + dlse)``, ``dq = scale * dS K``, and ``dk``, ``dv``
    scattered back onto the selected slots."""
    q, k, v, indices, scale = inputs
    g_out, g_lse = grads
    t, h, dk = q.shape
    hkv = k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkf = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dvf = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    step = chunk_rows(q, k, v, indices)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        tc = t1 - t0
        qg, kg, vg, s, slots = gather_chunk(q, k, v, indices, scale, t0, t1)
        p, _ = softmax_with_lse(s)
        go = g_out[t0:t1].float().view(tc, hkv, h // hkv, v.shape[-1])
        gl = g_lse[t0:t1].float().view(tc, hkv, h // hkv, 1)
        out = torch.matmul(p, vg)
        dp = torch.matmul(go, vg.transpose(-1, -2))
        ds = p * (dp - (go * out).sum(-1, keepdim=True) + gl)
        dq[t0:t1] = (torch.matmul(ds, kg) * scale).reshape(tc, h, dk)
        dkg = torch.matmul(ds.transpose(-1, -2), qg) * scale  # [Tc, Hkv, K, Dk]
        dvg = torch.matmul(p.transpose(-1, -2), go)  # [Tc, Hkv, K, Dv]
        if k.shape[0] == 0:  # no slot to scatter onto (every entry was masked)
            continue
        # Masked entries gathered slot 0 with p = 0: they add zeros. Sizes spelled out, as
        # ``-1`` cannot be inferred when K = 0.
        flat = slots.reshape(slots.numel())
        dkf.index_add_(0, flat, dkg.permute(0, 2, 1, 3).reshape(flat.shape[0], hkv, dk))
        dvg = dvg.permute(0, 2, 1, 3).reshape(flat.shape[0], hkv, v.shape[-1])
        dvf.index_add_(0, flat, dvg)
    return dq.to(q.dtype), dkf.to(k.dtype), dvf.to(v.dtype), None, None
