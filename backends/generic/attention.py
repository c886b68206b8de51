"""Sparse attention in query chunks, each computed one of two ways, numerically the same op:

* gather: only the selected slots are copied (``index_select``), then small per-query
  GEMMs. Extra memory is O(chunk * K * D), never O(T * N).
* dense window: when a chunk's valid slots all lie in a window ``[lo, hi)`` not much
  wider than ``K`` (:func:`_window_ratio`; causal prefill's early rows, or decode with
  every key selected), the chunk attends to the whole window in one GEMM per kv head,
  without a gather, and a ``[Tc, W]`` count built from the indices does the selecting:
  a slot not listed is masked, a slot listed twice has its ``exp`` counted twice.

Values steer only real tensors: traced calls (fake tensors, e.g. the backward under
torch.compile) always take the masked gather.
"""

from __future__ import annotations

import torch

from glmport.core.specs.attention import lse_as_asked

from .tiling import rows_per_tile

# How much wider than K a dense window may be and still beat the gather on a CPU
# (bench/generic.py's prefill and decode shapes, 1 thread). The window costs H * W
# dot products per query in large GEMMs; the gather copies K rows of every kv head
# per query and runs small GEMMs. With one shared kv head (absorbed MLA) the copy is
# cheap and the window must be nearly K (one query: W = K measured 1.13x faster, W =
# 1.25 K 0.84x; 32 queries: 1.5 K break-even); with a kv head per query head the
# gather is several times slower and a 2 K window still wins 2.9x.
WINDOW_RATIO_SHARED = (1.0, 1.5)  # (one query, a chunk of queries)
WINDOW_RATIO_PER_HEAD = 4.0


def _window_ratio(hkv: int, heads: int, queries: int) -> float:
    if hkv * 8 <= heads:  # K / V shared by 8 or more query heads
        return WINDOW_RATIO_SHARED[queries > 1]
    return WINDOW_RATIO_PER_HEAD


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


def _joined(k: torch.Tensor, k_rope: torch.Tensor | None) -> torch.Tensor:
    """Key rows ``[..., Dk]``: ``k`` itself, or ``k`` and ``k_rope`` side by side (rows
    already selected or windowed: never the whole cache)."""
    return k if k_rope is None else torch.cat((k, k_rope), dim=-1)


def _softmax_(
    s: torch.Tensor, every_row_valid: bool, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax of fp32 scores ``s`` ``[..., K]`` (overwritten) and its lse ``[...]``,
    each ``exp`` counted ``weights`` times if given (a slot listed more than once).

    When every row has a finite score, torch's fused softmax, and the lse from its
    largest probability: ``p_max = exp(max - lse)`` exactly at the maximum, and
    ``p_max >= 1 / K``, so ``lse = max - log(p_max)`` keeps float32 precision. Else
    ``exp(s - max) / sum`` as the reference's ``softmax_with_lse``: a row with no valid
    entry (all ``-inf``, or ``K = 0``) gives ``p = 0`` and ``lse = -inf``.
    """
    if every_row_valid and s.shape[-1] and weights is None:
        m = s.amax(dim=-1)
        p = torch.softmax(s, dim=-1)
        return p, m - torch.log(p.amax(dim=-1))
    if s.shape[-1]:
        m = s.amax(dim=-1, keepdim=True)
    else:
        m = s.new_full((*s.shape[:-1], 1), float("-inf"))
    m = torch.where(torch.isfinite(m), m, 0.0)  # all -inf: subtract 0 so p is 0, not NaN
    p = s.sub_(m).exp_()
    if weights is not None:
        p.mul_(weights)
    total = p.sum(dim=-1, keepdim=True)
    p.div_(torch.where(total > 0, total, 1.0))
    return p, (m + torch.log(total)).squeeze(-1)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul``, as a plain GEMM when there is one batch (decode, absorbed
    MLA's one kv head): the CPU's ``bmm`` of a batch of one measured ~25% slower."""
    if a.dim() > 2 and a.shape[:-2].numel() == 1 and b.shape[:-2].numel() == 1:
        out = torch.mm(a.reshape(a.shape[-2:]), b.reshape(b.shape[-2:]))
        return out.view(*a.shape[:-2], a.shape[-2], b.shape[-1])
    return torch.matmul(a, b)


def _holds_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s values may steer the code (strategy, masking shortcuts): a plain
    tensor outside any tracing or dispatch mode, not a fake or functional one."""
    return (
        type(t) is torch.Tensor
        and not t.is_meta
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
    )


class _Chunk:
    """Queries ``[t0, t1)`` as the kernels see them: fp32 ``qg [Tc, Hkv, G, Dk]`` and,
    by strategy, either the window (``window = (lo, hi)``, ``weights [Tc, 1, 1, W]``
    when a slot is listed more than once,
    ``kw [Hkv, W, Dk]``, ``vw [Hkv, W, Dv]``) or the gather (``window`` None,
    ``slots [Tc, K]``, ``kg [Tc, Hkv, K, Dk]``, ``vg [Tc, Hkv, K, Dv]``); ``s`` holds
    the scaled scores ``[Tc, Hkv, G, W or K]``, ``-inf`` where excluded."""

    def __init__(self, q, k, v, indices, scale, t0, t1, k_rope=None):
        n, hkv, dk = k.shape[0], k.shape[1], q.shape[2]
        self.k_rope = k_rope
        idx = indices[t0:t1]
        # Slots outside [0, N) count as -1, like FlashMLA: unchecked under GLMPORT_VALIDATE=meta.
        valid = (idx >= 0) & (idx < n)
        self.qg = q[t0:t1].float().view(t1 - t0, hkv, q.shape[1] // hkv, dk)
        self.window = self.weights = None
        self.all_valid = self.every_row_valid = False
        if not _holds_data(idx):  # traced (e.g. this backward under aot): the gather, masked
            self._gathered(k, v, idx, valid, scale)
            return
        self.all_valid = bool(valid.all())  # e.g. decode past topk tokens: nothing to mask
        if self.all_valid:
            self.every_row_valid = idx.shape[1] > 0
        else:
            self.every_row_valid = bool(valid.any(1).all()) if idx.shape[1] else False
        if idx.numel() and n:
            if self.all_valid:
                lo, hi = (int(x) for x in torch.aminmax(idx))
            else:
                lo = int(torch.where(valid, idx, n).min())
                hi = int(torch.where(valid, idx, -1).max())
            hi += 1
            ratio = _window_ratio(hkv, q.shape[1], t1 - t0)
            if hi > lo and hi - lo <= ratio * idx.shape[1]:
                self.window = (lo, hi)
        if self.window is not None:
            self._dense(k, v, idx, valid, scale)
        else:
            self._gathered(k, v, idx, valid, scale)

    def _dense(self, k, v, idx, valid, scale):
        lo, hi = self.window
        width = hi - lo
        # Entries outside the window (the -1s) count into a spare last column.
        cols = torch.where(valid, idx - lo, width).long()
        count = torch.zeros((idx.shape[0], width + 1), dtype=torch.float32, device=idx.device)
        count.scatter_add_(1, cols, torch.ones(cols.shape, dtype=count.dtype, device=idx.device))
        count = count[:, None, None, :width]  # [Tc, 1, 1, W]: times each slot is listed
        # A slot listed twice weighs its exp twice (exact, as the gather's two copies);
        # adding log(2) to a score of large magnitude would round.
        self.weights = count if bool((count > 1).any()) else None
        rope = None if self.k_rope is None else self.k_rope[lo:hi]
        self.kw = _joined(k[lo:hi], rope).float().permute(1, 0, 2)  # [Hkv, W, Dk]
        self.vw = v[lo:hi].float().permute(1, 0, 2)
        # One GEMM per kv head over all of the chunk's queries.
        s = self.window_matmul(self.qg, self.kw.transpose(-1, -2)).mul_(scale)
        self.s = s.masked_fill_(count == 0, float("-inf"))

    def _gathered(self, k, v, idx, valid, scale):
        self.slots = idx.long() if self.all_valid else torch.where(valid, idx, 0).long()
        self.kg = _gather(k, self.slots)  # [Tc, Hkv, K, Dk]
        if self.k_rope is not None:
            self.kg = _joined(self.kg, _gather(self.k_rope, self.slots))
        # Absorbed MLA's value is a prefix of the key: slice the gather instead of redoing it.
        self.vg = self.kg[..., : v.shape[-1]] if _v_is_k_prefix(k, v) else _gather(v, self.slots)
        s = matmul(self.qg, self.kg.transpose(-1, -2)).mul_(scale)
        if not self.all_valid:
            s.masked_fill_(~valid[:, None, None, :], float("-inf"))
        self.s = s

    def pv(self, p: torch.Tensor) -> torch.Tensor:
        """``p @ V`` ``[Tc, Hkv, G, Dv]`` for probabilities ``p`` shaped like ``s``."""
        if self.window is None:
            return matmul(p, self.vg)
        return self.window_matmul(p, self.vw)

    @staticmethod
    def window_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [Tc, Hkv, G, X] @ w [Hkv, X, D]`` as one GEMM per kv head."""
        tc, hkv, g, _ = x.shape
        return matmul(_heads(x), w).view(hkv, tc, g, w.shape[-1]).permute(1, 0, 2, 3)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """``[Tc, Hkv, G, D]`` as ``[Hkv, Tc * G, D]``: a chunk's queries stacked per kv head."""
    tc, hkv, g, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(hkv, tc * g, d)


def chunk_rows(q, k, v, indices) -> int:
    """Queries per chunk: the gathered K and V plus scores and probabilities, in fp32
    (a dense window's scores, at most a few K wide, fit the same budget)."""
    kk = indices.shape[1]
    hkv, dk, dv, h = k.shape[1], q.shape[2], v.shape[2], q.shape[1]
    window = 2 * h * max(WINDOW_RATIO_PER_HEAD, *WINDOW_RATIO_SHARED)
    per_query = int(4 * kk * max(hkv * (dk + dv) + 2 * h, window))
    return rows_per_tile(per_query, q.shape[0])


def sparse_attention(q, k, v, indices, scale, need_lse=True, k_rope=None):
    t, h, _ = q.shape
    out = q.new_empty((t, h, v.shape[-1]))
    lse_out = torch.empty((t, h), dtype=torch.float32, device=q.device)
    step = chunk_rows(q, k, v, indices)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        c = _Chunk(q, k, v, indices, scale, t0, t1, k_rope)
        p, lse = _softmax_(c.s, c.every_row_valid, c.weights)
        out[t0:t1] = c.pv(p).reshape(t1 - t0, h, v.shape[-1])
        lse_out[t0:t1] = lse.reshape(t1 - t0, h)
    return out, lse_as_asked(lse_out, need_lse)


def sparse_attention_backward(inputs: tuple, grads: tuple) -> tuple:
    """Closed-form gradients, chunk by chunk like the forward (FlashAttention-style):
    ``dS = P * (dP - rowsum(dO * O) + dlse)``, ``dq = scale * dS K``, and ``dk``, ``dv``
    scattered back onto the selected slots (added onto the window's rows for a dense
    chunk, where ``P`` already counts a slot listed twice twice)."""
    q, k, v, indices, scale, need_lse, k_rope = inputs
    g_out, g_lse = grads
    if not need_lse:  # no lse was returned: nothing flows back through it
        g_lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    t, h, dk = q.shape
    hkv = k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkf = torch.zeros((*k.shape[:2], dk), dtype=torch.float32, device=k.device)
    dvf = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    step = chunk_rows(q, k, v, indices)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        tc = t1 - t0
        c = _Chunk(q, k, v, indices, scale, t0, t1, k_rope)
        p, _ = _softmax_(c.s, c.every_row_valid, c.weights)
        go = g_out[t0:t1].float().view(tc, hkv, h // hkv, v.shape[-1])
        gl = g_lse[t0:t1].float().view(tc, hkv, h // hkv, 1)
        out = c.pv(p)
        if c.window is not None:
            lo, hi = c.window
            dp = c.window_matmul(go, c.vw.transpose(-1, -2))
            # The window's rows, summed over the chunk's queries: [Hkv, W, Tc * G] GEMMs.
            dvf[lo:hi] += torch.matmul(_heads(p).transpose(-1, -2), _heads(go)).permute(1, 0, 2)
            ds = p.mul_(dp - (go * out).sum(-1, keepdim=True) + gl)  # p is not needed again
            dq[t0:t1] = (c.window_matmul(ds, c.kw) * scale).reshape(tc, h, dk)
            dkw = torch.matmul(_heads(ds).transpose(-1, -2), _heads(c.qg)) * scale
            dkf[lo:hi] += dkw.permute(1, 0, 2)
            continue
        dp = torch.matmul(go, c.vg.transpose(-1, -2))
        ds = p * (dp - (go * out).sum(-1, keepdim=True) + gl)
        dq[t0:t1] = (torch.matmul(ds, c.kg) * scale).reshape(tc, h, dk)
        dkg = torch.matmul(ds.transpose(-1, -2), c.qg) * scale  # [Tc, Hkv, K, Dk]
        dvg = torch.matmul(p.transpose(-1, -2), go)  # [Tc, Hkv, K, Dv]
        if k.shape[0] == 0:  # no slot to scatter onto (every entry was masked)
            continue
        # Masked entries gathered slot 0 with p = 0: they add zeros. Sizes spelled out, as
        # ``-1`` cannot be inferred when K = 0.
        flat = c.slots.reshape(c.slots.numel())
        dkf.index_add_(0, flat, dkg.permute(0, 2, 1, 3).reshape(flat.shape[0], hkv, dk))
        dvg = dvg.permute(0, 2, 1, 3).reshape(flat.shape[0], hkv, v.shape[-1])
        dvf.index_add_(0, flat, dvg)
    dn = k.shape[2]  # the key's columns in k; the rest are k_rope's
    g_rope = None if k_rope is None else dkf[..., dn:].to(k_rope.dtype)
    return dq.to(q.dtype), dkf[..., :dn].to(k.dtype), dvf.to(v.dtype), None, None, None, g_rope
