"""The lightning indexer: indexer scores and a fused top-k over them.

``score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` for ``s`` in the query's key range
(fp8: the dot times ``q_scale[t, h] * k_scale[s]``; ``q_scale`` is folded into the
weights, ``w * qs * relu(dot * ks)``, equal for the positive scales the op takes).

``indexer_logits``: a program per (block of ``BLOCK_T`` queries, tile of ``BLOCK_N``
keys). Its ``BLOCK_T * BLOCK_H`` query-head rows (``Hi`` padded to ``BLOCK_H >= 16``)
meet the key tile in one ``[BLOCK_N, Di] x [Di, BLOCK_T * BLOCK_H]`` dot (keys as rows:
64 or more make it a wgmma / tcgen05 tile, e4m3 operands included, whatever the head
count); ReLU, the weights and the head reduction are its epilogue, then the range
mask and an fp32 store. A tile outside every range of its query block skips the dot.

``lightning_indexer``: top-k fused, never a ``[T, N]`` score matrix. Prefill: a program
per query token. Decode (fewer queries than SMs) and any top-k wider than
``_MAX_SORT``: each query's key range is split (:func:`plan_key_split`: a batch-1
decode at 65536 keys runs 256 programs of 256 keys on an H200), every split keeps its
own best keys as below and writes them, sorted, for :func:`_merge_kernel`, which
merges ``_MERGE_FAN`` lists a program and level with the same half-cleaner.

Scores become packed int64 sort keys, so one integer sort orders by score and breaks
ties to the lower slot:

- high 32 bits: the fp32 score's bits with the 31 low bits flipped for negatives,
  which makes signed-int order equal float order (``-0.0`` is made ``+0.0`` first);
- low 32 bits: ``2**31 - 1 - slot``, larger for lower slots;
- a slot outside the range gets ``_EMPTY`` (``-2**63``), below every real key.

The program keeps the best ``TILE`` keys so far, sorted descending, in registers:
``TILE`` is ``min(topk, N)`` rounded up to a power of two, at least ``_MIN_TILE`` (or
``N`` rounded up, if smaller). It walks its key range ``TILE`` keys at a time: a
tile's scores are computed ``CHUNK = min(BLOCK_N, TILE)`` keys per dot
(``[CHUNK, Di] x [Di, BLOCK_H]``, as in the logits kernel) and assembled into a
``[TILE / CHUNK, CHUNK]`` register tile by a select on the chunk row. When the tile's
best key beats the current ``topk``-th best, the tile is sorted ascending and merged
by Batcher's half-cleaner: for a descending ``A`` and an ascending ``B`` of equal
length, ``max(A[i], B[i])`` holds exactly the larger half of ``A | B`` (keys are
unique) as a bitonic sequence, which one bitonic merge (``log2(TILE)`` steps) sorts
descending into the new buffer. A merge never holds ``2 * TILE`` keys; a tile that
cannot improve the top-k skips it. At the end the first ``min(topk, N)`` keys decode
to (slot, score) and ``_EMPTY`` to ``-1`` / ``-inf``; columns from ``N`` on are
padding filled by the wrapper.

The bitonic network is written here (:func:`_bitonic`), not ``tl.sort``, whose
partner exchange is an ``xor_sum`` reduction that Triton's interpreter runs as a
Python loop per element (about 7 s per 2048-key sort). Here partners ``2**j`` apart
meet through ``reshape`` / ``trans`` / ``split`` and ``join`` back, core builtins
that the interpreter hands to numpy and that a GPU compiles to register moves and
shuffles (checked: it compiles for sm_90 without spills at ``TILE = 2048``).
Interpreter speed is Python per op and per call of a jitted function (milliseconds
each), so the interpreter configs use large blocks and ``_INTERPRETER_MIN_TILE``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmport.core.formats import FP8_DTYPE
from glmport.core.specs.indexer import scores_as_asked

from .quant import native_fp8
from .runtime import (
    dot_dtype,
    interpreter_plan,
    next_pow2,
    row_invariant_dot,
    sm_count,
    to_dot,
    tuned,
)

# The sort key of a slot outside the query's range: below every real key (whose low
# half, 2**31 - 1 - slot, is positive for any slot below 2**31 - 1).
_EMPTY: tl.constexpr = tl.constexpr(-(2**63))
# The smallest top-k buffer unless N is smaller: few merges for a small topk; under the
# interpreter larger, for fewer and larger (numpy-bound) steps.
_MIN_TILE = 256
_INTERPRETER_MIN_TILE = 1024
# The decode heuristic: split each query's keys when fewer queries than SMs would run,
# into splits of at least _MIN_SPLIT_KEYS keys, about two programs per SM; the splits'
# sorted lists are merged _MERGE_FAN at a time. Under the interpreter: 4 stand-in SMs
# and longer splits, so that only few-query calls over long key ranges split.
_MIN_SPLIT_KEYS = 256
_MERGE_FAN = 8
# The widest buffer a program sorts (wider top-k: split and merged), and the bytes of
# the splits' lists one launch may hold (queries in chunks beyond).
_MAX_SORT = 2048
_PART_BYTES = 1 << 28
# D per fp32 FMA dot, the widest whose default configs spill nothing on sm_90a and
# sm_100a at GLM-5's shapes (all of D = 128 spilled 4-7 KB): the top-k kernel also
# holds its sorted buffer in registers.
_LOGITS_FMA_CHUNK = 32
_TOPK_FMA_CHUNK = 16
_INTERPRETER_SMS = 4
_INTERPRETER_MIN_SPLIT_KEYS = 1024


def _dot_dtype(dtype: torch.dtype, device: torch.device):
    """The ``tl.dot`` operand dtype for inputs of ``dtype`` on ``device``: e4m3 itself
    where the GPU multiplies it natively (sm_89+: e4m3 wgmma / tcgen05 on Hopper and
    Blackwell), else float16, in which e4m3 values are exact."""
    if dtype == FP8_DTYPE:
        if interpreter_plan():
            return tl.float32
        return tl.float8e4nv if native_fp8(device) else tl.float16
    return dot_dtype(dtype)


@triton.jit
def _weighted_relu_dots(
    q,
    q_rows,
    q_mask,
    w,
    k_ptr,
    ks_ptr,
    offs_n,
    n_valid,
    offs_d,
    d_mask,
    Di,
    sqd,
    skn,
    skd,
    sks,
    FP8: tl.constexpr,
    FMA_CHUNK: tl.constexpr,
):
    """``w[None, :] * relu(k[offs_n] @ q.T * ks[offs_n, None])``: ``[BLOCK_N, M]`` fp32
    for ``q`` ``[M, BLOCK_D]`` (dot dtype), ``w`` ``[M]`` fp32, ``offs_n`` the rows of
    ``k`` to read (a paged call's physical rows); keys outside ``n_valid`` read as 0 and
    are never touched in memory. Keys are the dot's rows: at least 64 of
    them make it a wgmma / tcgen05 tile (e4m3 included) whatever the head count.

    ``FMA_CHUNK`` > 0 (fp32: IEEE dots on the FMA units): the dot runs over ``Di`` in
    chunks of that width, ``q``'s rows read again from ``q_rows [M]`` (pointers, masked
    by ``q_mask``): one FMA dot over all of ``Di`` holds both operands' rows in
    registers and spills kilobytes; chunks of 16-32 spill nothing."""
    if FMA_CHUNK > 0:
        dots = tl.zeros([offs_n.shape[0], w.shape[0]], tl.float32)
        for d0 in tl.static_range(0, offs_d.shape[0], FMA_CHUNK):
            od = d0 + tl.arange(0, FMA_CHUNK)
            kc = tl.load(
                k_ptr + offs_n[:, None].to(tl.int64) * skn + od[None, :] * skd,
                mask=n_valid[:, None] & (od < Di)[None, :],
                other=0.0,
            )
            qc = tl.load(
                q_rows[:, None] + od[None, :] * sqd,
                mask=q_mask[:, None] & (od < Di)[None, :],
                other=0.0,
            )
            dots += row_invariant_dot(to_dot(kc, q.dtype), tl.trans(to_dot(qc, q.dtype)), IEEE=True)
    else:
        kt = tl.load(
            k_ptr + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :] * skd,
            mask=n_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        dots = row_invariant_dot(to_dot(kt, q.dtype), tl.trans(q), IEEE=False)
    if FP8:
        ks = tl.load(ks_ptr + offs_n.to(tl.int64) * sks, mask=n_valid, other=0.0)
        dots = dots * ks[:, None]
    # A NaN dot (+inf and -inf inside it) stays NaN, to rank first: max.f32 would give 0.
    return tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]


@triton.jit
def _clamp_range(start, end, N):
    """A key range ``[start, end)`` cut to ``[0, N)``: both clamped to ``[0, N]``, empty
    when ``start >= end`` (docs/ops.md, unchecked values in meta mode)."""
    start = tl.minimum(tl.maximum(start, 0), N)
    return start, tl.maximum(tl.minimum(tl.maximum(end, 0), N), start)


@tuned(
    configs=[
        triton.Config({"BLOCK_T": bt, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        # (1, 64): the smallest shared-memory footprint, for the widest heads in fp32.
        for bt, bn, w, s in (
            (1, 64, 4, 1),
            (1, 128, 4, 2),
            (2, 64, 4, 2),
            (4, 64, 8, 2),
            (4, 128, 8, 2),
        )
    ],
    key=["Hi", "Di"],
    interpreter={"BLOCK_T": 8, "BLOCK_N": 1024},
)
@triton.jit
def _logits_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    start_ptr,
    end_ptr,
    qs_ptr,
    ks_ptr,
    out_ptr,
    T,
    N,
    Hi,
    Di,
    sqt,
    sqh,
    sqd,
    skn,
    skd,
    swt,
    swh,
    sst,
    ssh,
    sks,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    DOT: tl.constexpr,
    FMA_CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[T, N]`` fp32 scores, ``-inf`` outside each query's range; the program id
    runs over query blocks fastest, so neighbouring programs share a key tile."""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    t0 = (pid % num_t) * BLOCK_T
    n0 = (pid // num_t) * BLOCK_N
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_n = n0 + tl.arange(0, BLOCK_N)
    start, end = _clamp_range(
        tl.load(start_ptr + offs_t, mask=t_mask, other=0),
        tl.load(end_ptr + offs_t, mask=t_mask, other=0),
        N,
    )
    scores = tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32)
    lo = tl.min(tl.where(t_mask, start, N), axis=0)
    hi = tl.max(tl.where(t_mask, end, 0), axis=0)
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        # Rows are (query, head) pairs: row r is query t0 + r // BLOCK_H, head r % BLOCK_H.
        rows = tl.arange(0, BLOCK_T * BLOCK_H)
        rt = t0 + rows // BLOCK_H
        rh = rows % BLOCK_H
        r_mask = (rt < T) & (rh < Hi)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < Di
        q_rows = q_ptr + rt.to(tl.int64) * sqt + rh * sqh
        q = tl.load(
            q_rows[:, None] + offs_d[None, :] * sqd,
            mask=r_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q = to_dot(q, DOT)
        w = tl.load(w_ptr + rt.to(tl.int64) * swt + rh * swh, mask=r_mask, other=0.0)
        if FP8:
            w = w * tl.load(qs_ptr + rt.to(tl.int64) * sst + rh * ssh, mask=r_mask, other=0.0)
        heads = _weighted_relu_dots(
            q, q_rows, r_mask, w, k_ptr, ks_ptr, offs_n, offs_n < N, offs_d, d_mask, Di, sqd,
            skn, skd, sks, FP8, FMA_CHUNK,
        )  # fmt: skip
        total = tl.trans(tl.sum(tl.reshape(heads, [BLOCK_N, BLOCK_T, BLOCK_H]), axis=2))
        valid = (offs_n[None, :] >= start[:, None]) & (offs_n[None, :] < end[:, None])
        scores = tl.where(valid, total, scores)
    tl.store(
        out_ptr + offs_t[:, None].to(tl.int64) * N + offs_n[None, :],
        scores,
        mask=t_mask[:, None] & (offs_n[None, :] < N),
    )


@triton.jit
def _sort_keys(scores, slots, valid):
    """Packed int64 keys whose descending order is (score descending, slot ascending).
    A NaN score (an overflow to +inf and -inf inside it) counts as +inf: an overflowed
    score ranks first and keeps its slot (docs/ops.md), whatever NaN's sign bit."""
    scores = tl.where(scores != scores, float("inf"), scores)
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)  # -0.0 -> +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | (2147483647 - slots).to(tl.int64)
    return tl.where(valid, keys, _EMPTY)


@triton.jit
def _bitonic(x, LOG_N: tl.constexpr, FIRST: tl.constexpr, DESCENDING: tl.constexpr):
    """Stages ``FIRST..LOG_N`` of a bitonic sorting network on integers ``x``
    ``[2**LOG_N]``: ``FIRST = 1`` sorts, ``FIRST = LOG_N`` sorts a bitonic sequence;
    ascending, or descending when ``DESCENDING`` is 1.

    Stage ``s`` merges runs of ``2**s`` into runs sorted in alternating directions (the
    last stage in the requested one). Its descending runs are complemented first
    (``~x`` reverses integer order exactly) and back after, so every step sorts
    ascending: each pair ``2**j`` apart, ``[N / 2**(j+1), 2, 2**j]`` permuted to put
    the pair axis last, split, ``minimum`` / ``maximum``, joined back. Only core
    builtins, no nested jitted calls (``tl.min`` / ``tl.max`` are jitted): each call
    costs the interpreter milliseconds."""
    N: tl.constexpr = 1 << LOG_N
    idx = tl.arange(0, N)
    for s in tl.static_range(FIRST, LOG_N + 1):
        flip = -((((idx >> s) & 1) ^ DESCENDING).to(x.dtype))  # all ones: a descending run
        x = x ^ flip
        for i in tl.static_range(s):
            # Step j = s - 1 - i: partners 2**j apart (a constexpr cannot be reassigned).
            a, b = tl.split(tl.trans(tl.reshape(x, [N >> (s - i), 2, 1 << (s - 1 - i)]), 0, 2, 1))
            pair = tl.join(tl.minimum(a, b), tl.maximum(a, b))
            x = tl.reshape(tl.trans(pair, 0, 2, 1), [N])
        x = x ^ flip
    return x


@tuned(
    configs=[
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((64, 8, 2), (128, 8, 2), (64, 16, 2))
    ],
    key=["Hi", "Di", "LOG_TILE"],
    interpreter={"BLOCK_N": 1024},
)
@triton.jit
def _lightning_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    start_ptr,
    end_ptr,
    qs_ptr,
    ks_ptr,
    idx_ptr,
    score_ptr,
    part_ptr,
    bt_ptr,
    N,
    Hi,
    Di,
    WIDTH,
    OUT_COLS,
    SPLIT_LEN,
    NUM_SPLITS,
    sqt,
    sqh,
    sqd,
    skn,
    skd,
    swt,
    swh,
    sst,
    ssh,
    sks,
    sbt,
    PAGE,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOG_TILE: tl.constexpr,
    FP8: tl.constexpr,
    DOT: tl.constexpr,
    FMA_CHUNK: tl.constexpr,
    PARTIAL: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(T, NUM_SPLITS)``: query ``t``'s keys ``[start + s * SPLIT_LEN, ...)`` of its
    range, split ``s``. One split: its best ``WIDTH = min(topk, N)`` slots, best first,
    into columns ``[0, WIDTH)`` of the ``[T, OUT_COLS]`` outputs (-1 / -inf padding).
    ``PARTIAL``: the split's best ``TILE`` sort keys, descending, into
    ``part [T, NUM_SPLITS, TILE]`` int64 for :func:`_merge_kernel`.

    ``PAGED``: slots are logical positions of query ``t``'s sequence, position ``p`` in
    row ``bt[t, p // PAGE] * PAGE + p % PAGE`` of the key pool (``N`` the table's
    positions); else ``bt_ptr``, ``sbt`` and ``PAGE`` are unused."""
    TILE: tl.constexpr = 1 << LOG_TILE
    CHUNK: tl.constexpr = BLOCK_N if BLOCK_N < TILE else TILE  # keys per dot
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start, end = _clamp_range(tl.load(start_ptr + t), tl.load(end_ptr + t), N)
    start = tl.minimum(start + split * SPLIT_LEN, end)
    end = tl.minimum(start + SPLIT_LEN, end)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < Hi
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < Di
    q_rows = q_ptr + t * sqt + offs_h * sqh
    q = tl.load(
        q_rows[:, None] + offs_d[None, :] * sqd,
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = to_dot(q, DOT)
    w = tl.load(w_ptr + t * swt + offs_h * swh, mask=h_mask, other=0.0)
    if FP8:
        w = w * tl.load(qs_ptr + t * sst + offs_h * ssh, mask=h_mask, other=0.0)
    pos = tl.arange(0, TILE)
    chunk_row = tl.arange(0, TILE // CHUNK)[:, None]
    best = tl.full([TILE], _EMPTY, tl.int64)  # sorted descending
    keep = tl.minimum(WIDTH, TILE)  # a split's buffer may be narrower than WIDTH
    kth = tl.max(tl.where(pos == keep - 1, best, _EMPTY), axis=0)  # the keep-th best key
    for n0 in range(start, end, TILE):
        tile = tl.full([TILE // CHUNK, CHUNK], _EMPTY, tl.int64)
        for c in range(0, TILE // CHUNK):
            c0 = n0 + c * CHUNK
            if c0 < end:  # the range's last tile is partly past its end
                offs_n = c0 + tl.arange(0, CHUNK)
                valid = offs_n < end
                rows = offs_n
                if PAGED:  # each position's block, from the query's table row
                    block = tl.load(bt_ptr + t * sbt + offs_n // PAGE, mask=valid, other=0)
                    rows = block.to(tl.int64) * PAGE + offs_n % PAGE
                heads = _weighted_relu_dots(
                    q, q_rows, h_mask, w, k_ptr, ks_ptr, rows, valid, offs_d, d_mask, Di,
                    sqd, skn, skd, sks, FP8, FMA_CHUNK,
                )  # fmt: skip
                keys = _sort_keys(tl.sum(heads, axis=1), offs_n, valid)
                tile = tl.where(chunk_row == c, keys[None, :], tile)
        if tl.max(tl.max(tile, axis=1), axis=0) > kth:
            # Half-cleaner: best descending, tile ascending -> the larger half, bitonic.
            rising = _bitonic(tl.reshape(tile, [TILE]), LOG_TILE, 1, 0)
            best = _bitonic(tl.maximum(best, rising), LOG_TILE, LOG_TILE, 1)
            kth = tl.max(tl.where(pos == keep - 1, best, _EMPTY), axis=0)
    if PARTIAL:
        tl.store(part_ptr + (t * NUM_SPLITS + split) * TILE + pos, best)
    else:
        _store_best(best, pos, t, WIDTH, OUT_COLS, idx_ptr, score_ptr)


@triton.jit
def _store_best(best, pos, t, WIDTH, OUT_COLS, idx_ptr, score_ptr):
    """Decode the first ``WIDTH`` sort keys of ``best`` to (slot, score) into row ``t``
    of the ``[T, OUT_COLS]`` outputs; ``_EMPTY`` becomes ``-1`` / ``-inf``."""
    high = (best >> 32).to(tl.int32)
    scores = (high ^ ((high >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    slots = 2147483647 - (best & 0x7FFFFFFF).to(tl.int32)
    found = best != _EMPTY
    out = t * OUT_COLS + pos
    keep = pos < WIDTH
    tl.store(idx_ptr + out, tl.where(found, slots, -1), mask=keep)
    tl.store(score_ptr + out, tl.where(found, scores, float("-inf")), mask=keep)


@triton.jit
def _merge_kernel(
    part_ptr,
    merged_ptr,
    idx_ptr,
    score_ptr,
    NUM_LISTS,
    LIST_W,
    WIDTH,
    OUT_COLS,
    LOG_TILE: tl.constexpr,
    FINAL: tl.constexpr,
    FAN: tl.constexpr,
):
    """Grid ``(T, cdiv(NUM_LISTS, FAN))``: merge lists ``[g * FAN, (g + 1) * FAN)`` of
    ``part [T, NUM_LISTS, LIST_W]`` (sort keys, each list descending, ``LIST_W <= TILE``)
    into their best ``TILE``: each list is read reversed (ascending, ``_EMPTY``-padded in
    front) and joined by the half-cleaner and one bitonic merge. ``FINAL`` (one group):
    decoded into the outputs as the fused kernel does; else into
    ``merged [T, cdiv(NUM_LISTS, FAN), TILE]``."""
    TILE: tl.constexpr = 1 << LOG_TILE
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.arange(0, TILE)
    back = TILE - 1 - pos  # list entry each position reads, reversed
    best = tl.full([TILE], _EMPTY, tl.int64)
    for i in range(0, FAN):
        s = g * FAN + i
        if s < NUM_LISTS:
            rising = tl.load(
                part_ptr + (t * NUM_LISTS + s) * LIST_W + back, mask=back < LIST_W, other=_EMPTY
            )
            best = _bitonic(tl.maximum(best, rising), LOG_TILE, LOG_TILE, 1)
    if FINAL:
        _store_best(best, pos, t, WIDTH, OUT_COLS, idx_ptr, score_ptr)
    else:
        groups = tl.num_programs(1)
        tl.store(merged_ptr + (t * groups + g) * TILE + pos, best)


def _common_args(q, k, weights, k_start, k_end, q_scale, k_scale, fma_chunk: int) -> tuple:
    """Pointers, strides and constexprs shared by both kernels' launches, float32's
    dots over D in chunks of ``fma_chunk`` on a GPU. ``k_start`` and ``k_end`` are
    cheap ``[T]`` vectors, made contiguous (unit stride)."""
    fp8 = q.dtype == FP8_DTYPE
    dot = _dot_dtype(q.dtype, q.device)
    qs = q_scale if fp8 else weights  # never read without FP8
    ks = k_scale if fp8 else weights
    strides = (
        *q.stride(),
        *k.stride(),
        *weights.stride(),
        *(qs.stride() if fp8 else (0, 0)),
        ks.stride(0) if fp8 else 0,
    )
    block_d = next_pow2(q.shape[2])
    # fp32's FMA dots over D in chunks (see _weighted_relu_dots); the interpreter takes
    # one chunk (fewer interpreted ops), gpu_plan the GPU's.
    chunk = 0
    if dot == tl.float32:
        chunk = block_d if interpreter_plan() else min(block_d, fma_chunk)
    meta = (next_pow2(q.shape[1]), block_d, fp8, dot, chunk)
    return (k_start.contiguous(), k_end.contiguous(), qs, ks), strides, meta


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Every indexer score.

    Args: q ``[T, Hi, Di]`` fp32 | bf16 | fp16 | float8_e4m3fn; k ``[N, Di]`` same dtype;
    weights ``[T, Hi]`` fp32; k_start, k_end ``[T]`` int32 (cut to ``[0, N]``);
    q_scale ``[T, Hi]`` / k_scale ``[N]`` fp32 with fp8, else None.

    Returns: ``[T, N]`` fp32, ``-inf`` outside ``[k_start[t], k_end[t])``.
    """
    t, hi, di = q.shape
    n = k.shape[0]
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return out
    (starts, ends, qs, ks), strides, meta = _common_args(
        q, k, weights, k_start, k_end, q_scale, k_scale, _LOGITS_FMA_CHUNK
    )
    grid = lambda m: (triton.cdiv(t, m["BLOCK_T"]) * triton.cdiv(n, m["BLOCK_N"]),)  # noqa: E731
    _logits_kernel[grid](q, k, weights, starts, ends, qs, ks, out, t, n, hi, di, *strides, *meta)
    return out


def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    topk: int,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    block_table: torch.Tensor | None = None,
    need_scores: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` best key slots per query token.

    Args: as :func:`indexer_logits`, and ``topk >= 1``; with ``block_table [T, M]``
    int32 the keys are a paged pool ``k [blocks, block_size, Di]`` (``k_scale [blocks,
    block_size]``) read in place through each query's table row, slots and ranges
    logical positions (the op's paged call).

    Returns: indices ``[T, topk]`` int32, best first, ties to the lower slot, ``-1``
    past the valid keys; scores ``[T, topk]`` fp32, ``-inf`` where the index is ``-1``
    (``[0]`` without ``need_scores``: the kernels keep them to sort either way).
    """
    paged = (block_table.contiguous(), k.shape[1]) if block_table is not None else None
    if paged is not None:  # the pool's rows (a view of a contiguous pool)
        k = k.flatten(0, 1)
        k_scale = None if k_scale is None else k_scale.flatten()
    indices, scores = _indexer(q, k, weights, k_start, k_end, topk, q_scale, k_scale, paged)
    return indices, scores_as_asked(scores, need_scores)


def _indexer(q, k, weights, k_start, k_end, topk, q_scale, k_scale, paged):
    """:func:`lightning_indexer` over key rows ``k [rows, Di]``: packed keys, or a
    paged pool's rows with ``paged = (block_table [T, M] int32, block_size)``."""
    t, hi, di = q.shape
    table, page = paged if paged is not None else (k_start, 0)  # a stand-in pointer
    n = k.shape[0] if paged is None else table.shape[1] * page
    # At most N slots are ever valid: the buffer holds min(topk, N), the rest is padding.
    width = min(topk, n)
    indices = torch.empty((t, topk), dtype=torch.int32, device=q.device)
    scores = torch.empty((t, topk), dtype=torch.float32, device=q.device)
    if width < topk:
        indices[:, width:] = -1
        scores[:, width:] = float("-inf")
    if t == 0 or width == 0:
        return indices, scores
    split_len = plan_key_split(t, n, width, q.device)
    if split_len >= n:
        (starts, ends, qs, ks), strides, meta = _common_args(
            q, k, weights, k_start, k_end, q_scale, k_scale, _TOPK_FMA_CHUNK
        )
        _lightning_kernel[(t, 1)](
            q, k, weights, starts, ends, qs, ks, indices, scores, indices, table,
            n, hi, di, width, topk, n, 1, *strides, table.stride(0), page,
            *meta[:2], log_tile(width, n), *meta[2:], False, paged is not None,
        )  # fmt: skip
        return indices, scores
    splits = triton.cdiv(n, split_len)
    log_split = log_tile(min(width, split_len), split_len)
    rows = max(1, _PART_BYTES // (splits << log_split) // 8)
    for r in range(0, t, rows):  # query chunks bound the splits' lists in memory
        c = slice(r, r + rows)
        (starts, ends, qs, ks), strides, meta = _common_args(
            q[c], k, weights[c], k_start[c], k_end[c],
            None if q_scale is None else q_scale[c], k_scale, _TOPK_FMA_CHUNK,
        )  # fmt: skip
        part = torch.empty(
            (starts.shape[0], splits, 1 << log_split), dtype=torch.int64, device=q.device
        )
        _lightning_kernel[(starts.shape[0], splits)](
            q[c], k, weights[c], starts, ends, qs, ks, indices, scores, part, table[c],
            n, hi, di, width, topk, split_len, splits, *strides, table.stride(0), page,
            *meta[:2], log_split, *meta[2:], True, paged is not None,
        )  # fmt: skip
        _merge(part, indices[c], scores[c], width, topk, log_tile(width, n))
    return indices, scores


def log_tile(width: int, n: int) -> int:
    """log2 of a top-k buffer for ``width`` keys out of ``n``: ``width`` rounded up to a
    power of two, at least the minimum tile unless ``n`` is smaller."""
    min_tile = _INTERPRETER_MIN_TILE if interpreter_plan() else _MIN_TILE
    return max(next_pow2(width), min(min_tile, next_pow2(n))).bit_length() - 1


def plan_key_split(t: int, n: int, width: int, device: torch.device) -> int:
    """Keys per program along each query's range. ``n`` (one program per query, the
    fused path) unless ``t`` programs would leave SMs idle (decode): then the range is
    cut into splits of at least ``_MIN_SPLIT_KEYS`` keys (a multiple of it), about two
    programs per SM, each keeping its own best keys for :func:`_merge_kernel`. A
    ``width`` beyond ``_MAX_SORT`` always splits, into at most ``_MAX_SORT`` keys, so
    that no program sorts a wider buffer (the merges are cheap to compile, a sort
    network of 8192 is not). Under the interpreter a stand-in of ``_INTERPRETER_SMS``
    SMs and ``_INTERPRETER_MIN_SPLIT_KEYS``."""
    if interpreter_plan():
        sms, granule = _INTERPRETER_SMS, _INTERPRETER_MIN_SPLIT_KEYS
    else:
        sms, granule = sm_count(device), _MIN_SPLIT_KEYS
    splits = min(triton.cdiv(2 * sms, max(t, 1)), n // granule)
    split = n
    if t < sms and splits >= 2:
        split = triton.cdiv(triton.cdiv(n, splits), granule) * granule
    return min(split, _MAX_SORT) if width > _MAX_SORT else split


def _merge(
    part: torch.Tensor,
    indices: torch.Tensor,
    scores: torch.Tensor,
    width: int,
    topk: int,
    log_merged: int,
) -> None:
    """Merge the splits' sorted sort keys ``part [T, S, W]`` int64 into the best
    ``width`` per query, in buffers of ``2**log_merged >= width`` keys: ``_MERGE_FAN``
    lists a program and level (all of them in one
    program under the interpreter), decoded into ``indices`` / ``scores``
    ``[T, topk]`` by the last level."""
    t = part.shape[0]
    while True:
        lists = part.shape[1]
        fan = lists if interpreter_plan() else _MERGE_FAN
        groups = triton.cdiv(lists, fan)
        final = groups == 1
        merged = part if final else part.new_empty((t, groups, 1 << log_merged))
        _merge_kernel[(t, groups)](
            part, merged, indices, scores, lists, part.shape[2], width, topk,
            LOG_TILE=log_merged, FINAL=final, FAN=fan,
        )  # fmt: skip
        if final:
            return
        part = merged
