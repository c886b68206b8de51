"""MoE routing as Triton kernels: the group-limited router gate, the stable
counting-sort dispatch and the deterministic weighted combine.

- ``moe_gate``: one kernel, a program per block of tokens holding each token's
  ``E`` scores as a ``[tokens, groups, experts per group]`` tile: scores, group
  scores, group ranks, then ``top_k`` rounds of max / lowest index.
- ``moe_dispatch``: a counting sort without atomics. Copies are keyed by expert (an
  id outside ``[0, E)`` by the extra bucket ``E``); the copies are cut into chunks,
  a program per (bucket block, chunk) counts its buckets' copies, torch turns the
  ``[chunks, E + 1]`` counts into start positions (an O(E * chunks) cumsum), and the
  same kernel rescans the chunk writing each copy's stable position with a
  ``tl.cumsum`` of the match mask. A gather kernel then copies the rows.
- ``moe_combine``: torch sorts ``src_row`` (stable; cheap int bookkeeping) so each
  output slot ``t * k + j`` knows its rows; a program per (token block, hidden block)
  sums ``weights[t, j] * y_sorted[row]`` in a fixed order in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreter_plan, next_pow2, rounded_to, tuned

# Copies a dispatch chunk scans: on a GPU more chunks put more programs in flight; the
# interpreter is fastest with one chunk.
_DISPATCH_CHUNK = 4096
_DISPATCH_CHUNK_INTERPRETED = 1 << 20
# Elements of one interpreted gate tile: the interpreter is fastest with few programs.
_GATE_INTERPRETER_TILE = 16384
# Elements of one compiled gate tile (per program, spread over its warps).
_GATE_GPU_TILE = 1024

_WARPS = [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8)]


# -- moe_gate ----------------------------------------------------------------------


@tuned(_WARPS, key=["E", "top_k"], interpreter={})
@triton.jit
def _gate_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    G,
    GS,
    top_k,
    topk_group,
    scaling,
    stride_lt,
    stride_le,
    HAS_BIAS: tl.constexpr,
    SOFTMAX: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Route ``BLOCK_T`` tokens. Expert ``e = g * GS + i`` lives at ``[t, g, i]`` of
    the tile; padded lanes hold ``-inf`` choice scores and are never candidates."""
    neg_inf = float("-inf")
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = tok[:, None, None]
    g3 = tl.arange(0, BLOCK_G)[None, :, None]
    i3 = tl.arange(0, BLOCK_S)[None, None, :]
    expert = g3 * GS + i3
    valid = (t3 < T) & (g3 < G) & (i3 < GS)
    x = tl.load(
        logits_ptr + t3.to(tl.int64) * stride_lt + expert * stride_le, mask=valid, other=neg_inf
    )
    x = tl.where(t3 < T, x, 0.0)  # padded tokens: finite rows, no NaN
    if SOFTMAX:
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        p = tl.exp(x - row_max[:, None, None])
        s = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    else:
        z = tl.exp(-tl.abs(x))  # never overflows
        s = tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))
    c = s
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + expert, mask=(g3 < G) & (i3 < GS), other=0.0)
    # NaN (unchecked logits) ranks as -inf so that the ids stay distinct and in range.
    c = tl.where(valid & (c == c), c, neg_inf)
    cand = valid
    if GROUPED:
        best = tl.max(c, axis=2)
        if TOP2:  # "noaux_tc": the group's best two choice scores
            first = tl.min(tl.where(c == best[:, :, None], i3, BLOCK_S), axis=2)
            second = tl.max(tl.where(i3 == first[:, :, None], neg_inf, c), axis=2)
            best = best + second
        gscore = tl.where(best == best, best, neg_inf)
        # A group's rank: the groups scoring higher, or equal with a lower index.
        gi = tl.arange(0, BLOCK_G)[None, :, None]
        gj = tl.arange(0, BLOCK_G)[None, None, :]
        si = gscore[:, :, None]
        sj = gscore[:, None, :]
        ahead = ((sj > si) | ((sj == si) & (gj < gi))) & (gj < G)
        rank = tl.sum(ahead.to(tl.int32), axis=2)
        cand = cand & (rank < topk_group)[:, :, None]
    kcol = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in range(top_k):
        masked = tl.where(cand, c, neg_inf)
        top = tl.max(tl.max(masked, axis=2), axis=1)
        tied = cand & (masked == top[:, None, None])
        pick = tl.min(tl.min(tl.where(tied, expert, E), axis=2), axis=1)
        hit = expert == pick[:, None, None]
        picked_s = tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=2), axis=1)
        cand = cand & ~hit
        weights = tl.where(kcol == j, picked_s[:, None], weights)
        ids = tl.where(kcol == j, pick[:, None], ids)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    out = tok[:, None].to(tl.int64) * top_k + kcol
    omask = (tok[:, None] < T) & (kcol < top_k)
    tl.store(w_ptr + out, weights, mask=omask)
    tl.store(ids_ptr + out, ids, mask=omask)


def moe_gate(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    score_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k router.

    Args:
        logits: ``[T, E]`` float32 (any strides). bias: ``[E]`` float32 or None.

    Returns:
        weights ``[T, top_k]`` float32 and ids ``[T, top_k]`` int32, best first.
    """
    t, e = logits.shape
    weights = logits.new_empty((t, top_k), dtype=torch.float32)
    ids = logits.new_empty((t, top_k), dtype=torch.int32)
    if t == 0:
        return weights, ids
    per_group = e // n_group
    block_g = next_pow2(n_group, floor=1)
    block_s = next_pow2(per_group, floor=1)
    tile = _GATE_INTERPRETER_TILE if interpreter_plan() else _GATE_GPU_TILE
    block_t = min(next_pow2(t, floor=1), max(1, tile // (block_g * block_s)))
    bias_arg = bias.contiguous() if bias is not None else logits
    _gate_kernel[(triton.cdiv(t, block_t),)](
        logits,
        bias_arg,
        weights,
        ids,
        t,
        e,
        n_group,
        per_group,
        top_k,
        topk_group,
        float(routed_scaling_factor),
        logits.stride(0),
        logits.stride(1),
        HAS_BIAS=bias is not None,
        SOFTMAX=score_func == "softmax",
        GROUPED=n_group > 1,
        TOP2=bias is not None and per_group > 1,
        NORM=bool(norm_topk_prob),
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        BLOCK_K=next_pow2(top_k, floor=1),
    )
    return weights, ids


# -- moe_dispatch ------------------------------------------------------------------


@tuned(
    [
        triton.Config({"BLOCK_B": 1, "BLOCK_R": 1024}, num_warps=4),
        triton.Config({"BLOCK_B": 4, "BLOCK_R": 512}, num_warps=4),
        triton.Config({"BLOCK_B": 8, "BLOCK_R": 256}, num_warps=4),
    ],
    key=["num_buckets", "WRITE"],
    interpreter={"BLOCK_B": 512, "BLOCK_R": 1024},
)
@triton.jit
def _dispatch_scan_kernel(
    ids_ptr,
    base_ptr,
    counts_ptr,
    src_ptr,
    R,
    K,
    E,
    num_buckets,
    chunk,
    stride_it,
    stride_ik,
    WRITE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Scan copies ``[c * chunk, (c + 1) * chunk)`` for buckets ``BLOCK_B * b + [0,
    BLOCK_B)`` (bucket ``E``: ids outside ``[0, E)``). Without ``WRITE`` store each
    bucket's count in ``counts[c, bucket]``; with it, write ``src_row[p] = r`` for the
    copy ``r`` whose stable sorted position is ``p = base[c, bucket] + rank``."""
    bucket = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = bucket < num_buckets
    c = tl.program_id(1)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, R)
    cell = c * num_buckets + bucket
    if WRITE:
        running = tl.load(base_ptr + cell, mask=bmask, other=0)
    else:
        running = tl.zeros((BLOCK_B,), dtype=tl.int32)
    for start in range(lo, hi, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        rmask = r < hi
        tok = (r // K).to(tl.int64)
        idv = tl.load(ids_ptr + tok * stride_it + (r % K) * stride_ik, mask=rmask, other=E)
        key = tl.where((idv >= 0) & (idv < E), idv, E).to(tl.int32)
        match = (key[None, :] == bucket[:, None]) & rmask[None, :]
        m = match.to(tl.int32)
        if WRITE:
            pos = running[:, None] + tl.cumsum(m, axis=1) - 1
            pos_r = tl.sum(tl.where(match, pos, 0), axis=0)
            mine = tl.sum(m, axis=0) > 0
            tl.store(src_ptr + pos_r, r, mask=mine)
        running += tl.sum(m, axis=1)
    if not WRITE:
        tl.store(counts_ptr + cell, running, mask=bmask)


@tuned(
    [
        triton.Config({"BLOCK_M": 16, "BLOCK_D": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_D": 512}, num_warps=8),
        triton.Config({"BLOCK_M": 8, "BLOCK_D": 1024}, num_warps=4),
    ],
    key=["D"],
    interpreter={"BLOCK_M": 512, "BLOCK_D": 128},
)
@triton.jit
def _gather_rows_kernel(
    x_ptr,
    src_ptr,
    out_ptr,
    R,
    D,
    K,
    stride_xt,
    stride_xd,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[p] = x[src_row[p] // K]`` for a ``[BLOCK_M, BLOCK_D]`` tile (a plain copy:
    no arithmetic, so any dtype passes through bit for bit)."""
    p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    pmask = p < R
    mask = pmask[:, None] & (d < D)[None, :]
    tok = (tl.load(src_ptr + p, mask=pmask, other=0) // K).to(tl.int64)
    vals = tl.load(x_ptr + tok[:, None] * stride_xt + d[None, :] * stride_xd, mask=mask)
    tl.store(out_ptr + p.to(tl.int64)[:, None] * D + d[None, :], vals, mask=mask)


def moe_dispatch(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort of the ``T * k`` token copies by expert.

    Args:
        x: ``[T, D]`` float32 | bfloat16 | float16. ids: ``[T, k]`` int32 | int64; an
            id outside ``[0, E)`` sends its copy after every expert's rows.

    Returns:
        x_sorted ``[T*k, D]`` in x's dtype, expert_offsets ``[E + 1]`` int32, src_row
        ``[T*k]`` int32.
    """
    t, d = x.shape
    k = ids.shape[1]
    rows = t * k
    x_sorted = x.new_empty((rows, d))
    src_row = torch.empty(rows, dtype=torch.int32, device=x.device)
    if rows == 0:
        return x_sorted, torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device), src_row
    buckets = num_experts + 1
    chunk = _DISPATCH_CHUNK_INTERPRETED if interpreter_plan() else _DISPATCH_CHUNK
    chunks = triton.cdiv(rows, chunk)
    counts = torch.empty((chunks, buckets), dtype=torch.int32, device=x.device)

    def scan(base: torch.Tensor, write: bool) -> None:
        _dispatch_scan_kernel[lambda meta: (triton.cdiv(buckets, meta["BLOCK_B"]), chunks)](
            ids,
            base,
            counts,
            src_row,
            rows,
            k,
            num_experts,
            buckets,
            chunk,
            ids.stride(0),
            ids.stride(1),
            WRITE=write,
        )

    scan(counts, False)
    # Bucket b starts after every earlier bucket's copies and this bucket's copies in
    # earlier chunks.
    totals = counts.sum(0, dtype=torch.int64)
    bucket_start = totals.cumsum(0) - totals
    base = (bucket_start + counts.cumsum(0, dtype=torch.int64) - counts).to(torch.int32)
    scan(base, True)
    offsets = bucket_start.to(torch.int32)  # bucket E starts after every valid copy
    if d:
        _gather_rows_kernel[
            lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(d, meta["BLOCK_D"]))
        ](x, src_row, x_sorted, rows, d, k, x.stride(0), x.stride(1))
    return x_sorted, offsets, src_row


# -- moe_combine -------------------------------------------------------------------


@tuned(
    [
        triton.Config({"BLOCK_T": 1, "BLOCK_D": 512}, num_warps=4),
        triton.Config({"BLOCK_T": 4, "BLOCK_D": 256}, num_warps=4),
        triton.Config({"BLOCK_T": 8, "BLOCK_D": 512}, num_warps=8),
    ],
    key=["D", "K"],
    interpreter={"BLOCK_T": 256, "BLOCK_D": 128},
)
@triton.jit
def _combine_kernel(
    y_ptr,
    w_ptr,
    order_ptr,
    starts_ptr,
    out_ptr,
    T,
    D,
    K,
    stride_yr,
    stride_yd,
    stride_wt,
    stride_wk,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[t] = sum_j weights[t, j] * sum of y[order[i]]`` over ``i`` in
    ``[starts[t*K + j], starts[t*K + j + 1])``, slots and rows in ascending order,
    float32 accumulation."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = tok < T
    dmask = (d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(K):
        slot = tok * K + j
        lo = tl.load(starts_ptr + slot, mask=tmask, other=0)
        n = tl.load(starts_ptr + slot + 1, mask=tmask, other=0) - lo
        w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + j * stride_wk, mask=tmask, other=0.0)
        # A checked src_row is a permutation: exactly one row per slot.
        for i in range(tl.max(n, axis=0)):
            live = i < n
            row = tl.load(order_ptr + lo + i, mask=live, other=0).to(tl.int64)
            m = live[:, None] & dmask
            y = tl.load(y_ptr + row[:, None] * stride_yr + d[None, :] * stride_yd, mask=m)
            acc += tl.where(m, w[:, None] * y.to(tl.float32), 0.0)
    out = out_ptr + tok.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(out, rounded_to(acc, out_ptr.dtype.element_ty), mask=tmask[:, None] & dmask)


def moe_combine(
    y_sorted: torch.Tensor, src_row: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs.

    Args:
        y_sorted: ``[T*k, D]`` float32 | bfloat16 | float16 (any strides). src_row:
            ``[T*k]`` int32 | int64; values outside ``[0, T*k)`` are skipped, repeats
            add once per occurrence. weights: ``[T, k]`` float32.

    Returns:
        ``[T, D]`` in y_sorted's dtype.
    """
    t, k = weights.shape
    d = y_sorted.shape[1]
    rows = t * k
    if t == 0 or d == 0 or k == 0:
        return y_sorted.new_zeros((t, d))
    out = y_sorted.new_empty((t, d))
    src = src_row.long()
    key = torch.where((src >= 0) & (src < rows), src, rows)
    key, order = torch.sort(key, stable=True)
    slots = torch.arange(rows + 1, device=key.device)
    starts = torch.searchsorted(key, slots).to(torch.int32)
    _combine_kernel[
        lambda meta: (triton.cdiv(t, meta["BLOCK_T"]), triton.cdiv(d, meta["BLOCK_D"]))
    ](
        y_sorted,
        weights,
        order.to(torch.int32),
        starts,
        out,
        t,
        d,
        k,
        y_sorted.stride(0),
        y_sorted.stride(1),
        weights.stride(0),
        weights.stride(1),
    )
    return out
