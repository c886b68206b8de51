"""glmport's indexer ops on ``torch_npu.npu_lightning_indexer``.

The op (torch_npu: ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md``
in https://gitcode.com/Ascend/op-plugin, read at commit 517f2e7d; CANN:
``attention/lightning_indexer/docs/aclnnLightningIndexer.md`` in
https://gitcode.com/cann/ops-transformer) scores the keys of a BATCH of queries and
keeps the top ``sparse_count``, with a causal mask aligned to the last key
(``sparse_mode=3``) or none (``sparse_mode=0``). glmport gives every query its own key
range ``[k_start, k_end)`` of one key pool, so the adapters cut the queries into
batches the op's masks reproduce exactly:

- a causal run: consecutive queries with one ``k_start`` whose ``k_end`` grows by one
  per query. With S1 queries over keys ``[k_start, k_end[last])`` (S2 of them),
  ``sparse_mode=3`` lets query ``i`` see keys ``j <= i + S2 - S1``: exactly its range.
  glmport's packed prefill and its cached steps (each sequence's new tokens over that
  sequence's keys, sequences packed one after the other) are one causal run per
  sequence, all in one call whose TND key tensor is ``k`` itself (no copy).
- a shared run: two or more consecutive queries with one range, ``sparse_mode=0``.
- anything else: one query per batch (``sparse_mode=3`` with S1 = 1 sees its range).

So any ranges are served by at most two calls (mode 3, mode 0). Indices come back as
positions within the batch's keys: the batch's ``k_start`` is added. The op does not
document the order of a row, so rows are re-sorted best first (ties to the lower slot).
Scores are the op's ``sparse_values`` (``return_value=True``), which it returns in the
query's dtype: scores are rounded to bf16 / fp16 (within glmport's bf16 / fp16
tolerance; the choice itself is the op's).

Constraints the manifest declares (Atlas A2 / A3, same pages): q bf16 / fp16 (fp32 and
fp8 run on generic: the quantised ``npu_quant_lightning_indexer`` takes int8 q / k on
A3, float8_e4m3fn only on Ascend 950, and returns no scores), Hi <= 64, Di = 128,
``topk <= 8192`` (``sparse_count`` in ``[1, 2048]`` or 3072 .. 8192 in steps of 1024:
a ``topk`` between is requested as the next step and trimmed), and for
:func:`indexer_logits` ``N <= 8192`` (every key of a range must fit one row).

``return_value=True`` is documented for non-paged keys only and, on A2 / A3, not in
graph mode. The pages before March 2026 allowed only N1 = 64 and weights in the query's
dtype: on such a build (:class:`~.profile.NpuProfile`, from the torch_npu version) the
query is padded to 64 heads whose weights are 0 (``relu(0 . k) = 0``: the scores do not
change) and the weights are passed in the query's dtype. What a multi-batch call's
indices count from is undocumented; the start-up check (:mod:`.profile`) measures it
and the adapters convert either convention to global slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glmport.backends.cpu.indexer import clamp_key_ranges
from glmport.core.specs.indexer import scores_as_asked, slots_of_positions

from .profile import GLOBAL, INDEXER_HEADS, NEWEST_PAGES, NpuProfile

# Every score of an fp16 call stays below this (fp16's largest finite value is 65504).
_FP16_SAFE = 2.0**15


def sparse_count_for(width: int) -> int:
    """The smallest ``sparse_count`` the op takes that is ``>= width`` (``1 <= width <=
    8192``): ``width`` itself up to 2048, else the next multiple of 1024."""
    return width if width <= 2048 else -(-width // 1024) * 1024


@dataclass(frozen=True)
class _Call:
    """One op call: ``B`` batches of consecutive queries, in query order.

    All host int64 tensors: ``rows [Tc]`` the queries (ascending), ``counts [B]`` queries
    per batch, ``key_start`` / ``key_end [B]`` each batch's keys ``[start, end)``."""

    mode: int
    rows: torch.Tensor
    counts: torch.Tensor
    key_start: torch.Tensor
    key_end: torch.Tensor


def _plan(start: torch.Tensor, end: torch.Tensor) -> list[_Call]:
    """Queries with key ranges ``[start, end)`` (host int64 ``[T]``, clamped) as causal
    runs (one ``sparse_mode=3`` call, lone queries included) and shared runs (one
    ``sparse_mode=0`` call)."""
    t = start.numel()
    same_start = start[1:] == start[:-1]
    causal = torch.ones(t, dtype=torch.bool)  # query t starts a causal run
    causal[1:] = ~(same_start & (end[1:] == end[:-1] + 1))
    run = causal.cumsum(0) - 1
    lone = torch.bincount(run)[run] == 1
    # A lone query with the previous lone query's range joins its shared run.
    join = torch.zeros(t, dtype=torch.bool)
    join[1:] = lone[1:] & lone[:-1] & same_start & (end[1:] == end[:-1])
    shared = join.clone()
    shared[:-1] |= join[1:]
    batch = (causal & ~join).cumsum(0)
    calls = []
    for mode, member in ((3, ~shared), (0, shared)):
        rows = member.nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        counts = torch.unique_consecutive(batch[rows], return_counts=True)[1]
        last = counts.cumsum(0) - 1
        first = last - counts + 1
        calls.append(_Call(mode, rows, counts, start[rows[first]], end[rows[last]]))
    return calls


def _packed_keys(k: torch.Tensor, call: _Call) -> torch.Tensor:
    """The TND key tensor ``[T2, 1, Di]``: each batch's keys, batch after batch. A view
    of ``k`` when the non-empty ranges follow each other (the model's packed keys)."""
    lengths = call.key_end - call.key_start
    filled = lengths > 0
    starts, ends = call.key_start[filled], call.key_end[filled]
    if bool((starts[1:] == ends[:-1]).all()):
        keys = k[int(starts[0]) : int(ends[-1])]
    else:
        # Overlapping or unordered ranges: gather a copy of the keys each batch reads.
        before = lengths.cumsum(0) - lengths
        slots = torch.repeat_interleave(call.key_start - before, lengths)
        slots = slots + torch.arange(slots.numel())
        keys = k.index_select(0, slots.to(k.device))
    return keys.contiguous().unsqueeze(1)  # the op takes no non-contiguous key


def _fp16_weights(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights / scale, scale [T])``: fp16 ``sparse_values`` overflow past 65504, so
    each query's fp32 weights are divided by a power of two (exact) that brings the
    bound ``sum_h |w_h| |q_h| max_s |k_s|`` on its scores under 2**15; the scores are
    multiplied back in fp32."""
    q_norm = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32)  # [T, Hi]
    k_norm = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax()
    bound = (weights.abs() * q_norm).sum(dim=1) * k_norm
    scale = torch.exp2(torch.ceil(torch.log2(bound / _FP16_SAFE)).clamp_min(0))
    return weights / scale[:, None], scale


def _selections(
    npu: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    cap: int,
    profile: NpuProfile,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(rows [Tc], slots [Tc, C] int64, scores [Tc, C] fp32)`` per op call: each
    query's best ``min(cap, its range length)`` keys as global slots (``-1`` / ``-inf``
    after them), in the op's order, as ``profile``'s build takes and answers the call.
    ``N >= 1``, ``T >= 1``."""
    # Meta mode leaves ranges unchecked: cut them to [0, N] (the identity otherwise).
    k_start, k_end = clamp_key_ranges(k_start, k_end, k.shape[0])
    # Host copy (one sync): the op takes per-batch sequence lengths, and the batches
    # follow from the range values.
    start, end = k_start.cpu().long(), k_end.cpu().long()
    scale = None
    if q.dtype == torch.float16:
        weights, scale = _fp16_weights(q, k, weights)
    if not profile.indexer_any_heads:
        q, weights = _padded_heads(q, weights)
    device = q.device
    out = []
    for call in _plan(start, end):
        lengths = call.key_end - call.key_start
        width = min(cap, int(lengths.max()))
        if width == 0:
            continue  # no keys in any batch (the op takes no empty key tensor)
        sparse_count = sparse_count_for(width)
        rows = call.rows.to(device)
        every = call.rows.numel() == q.shape[0]
        # weights stay fp32: the op takes fp32 weights with a bf16 / fp16 query.
        q_c = q if every else q.index_select(0, rows)
        w_c = weights if every else weights.index_select(0, rows)
        indices, values = npu.npu_lightning_indexer(
            q_c.contiguous(),
            _packed_keys(k, call),
            w_c.contiguous(),
            actual_seq_lengths_query=call.counts.cumsum(0).to(device, torch.int32),
            actual_seq_lengths_key=lengths.cumsum(0).to(device, torch.int32),
            layout_query="TND",
            layout_key="TND",
            sparse_count=sparse_count,
            sparse_mode=call.mode,
            return_value=True,
        )
        indices = indices.reshape(-1, sparse_count).long()
        values = values.reshape(-1, sparse_count).float()
        if scale is not None:
            values = values * scale.index_select(0, rows)[:, None]
        # The op's positions count from each batch's keys or from the packed key tensor.
        offset = call.key_start
        if profile.indexer_positions == GLOBAL:
            offset = offset - (lengths.cumsum(0) - lengths)
        offset = torch.repeat_interleave(offset, call.counts).to(device)
        valid = indices >= 0  # the value of a -1 slot is undocumented: ignore it
        slots = torch.where(valid, indices + offset[:, None], -1)
        out.append((rows, slots, torch.where(valid, values, float("-inf"))))
    return out


def _padded_heads(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, 64, 128]`` and ``weights [T, 64]`` in q's dtype for a build that takes
    exactly 64 heads: the added heads are zero queries with zero weights."""
    pad = INDEXER_HEADS - q.shape[1]
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    return q, torch.nn.functional.pad(weights, (0, pad)).to(q.dtype)


def _best_first(slots: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row best first, the lower slot first among equal scores, ``-1`` last."""
    last = torch.iinfo(torch.int64).max
    order = torch.sort(torch.where(slots < 0, last, slots), dim=1, stable=True)[1]
    slots, scores = slots.gather(1, order), scores.gather(1, order)
    order = torch.sort(scores, dim=1, descending=True, stable=True)[1]
    return slots.gather(1, order), scores.gather(1, order)


def lightning_indexer(
    npu: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    topk: int,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    need_scores: bool = True,
    *,
    profile: NpuProfile = NEWEST_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """glmport's ``lightning_indexer`` on ``npu.npu_lightning_indexer`` (TND layouts,
    one batch per run of queries, see the module docstring; a paged call:
    :func:`paged_lightning_indexer`).

    Args:
        npu: ``torch_npu`` or the emulator.
        q: ``[T, Hi, 128]`` bf16 / fp16, ``Hi <= 64``.
        k: ``[N, 128]``, q's dtype.
        weights: ``[T, Hi]`` fp32 (passed as fp32: no rounding of the weights).
        k_start, k_end: ``[T]`` int32 key ranges (clamped to ``[0, N]``).
        topk: ``1 .. 8192``.
        q_scale, k_scale: None (fp8 is not declared).
        block_table, need_scores: as the op's contract (``docs/ops.md``).
        profile: the build's conventions (default: the newest pages, batch-relative
            indices); the backend passes the one measured at start-up.

    Returns:
        ``indices [T, topk]`` int32 slots of ``k`` best first (ties to the lower slot)
        and ``scores [T, topk]`` fp32 (the op's bf16 / fp16 values), ``-1`` / ``-inf``
        after ``min(topk, range length)`` keys.

    Docs: ``torch_npu-npu_lightning_indexer.md`` (Ascend/op-plugin,
    ``docs/zh/custom_APIs/torch_npu/``); ``aclnnLightningIndexer.md`` (cann/ops-transformer).
    """
    if block_table is not None:
        return paged_lightning_indexer(
            npu, q, k, weights, k_end, topk, block_table, need_scores, profile=profile
        )
    t, n = q.shape[0], k.shape[0]
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((t, topk), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return indices, scores_as_asked(scores, need_scores)  # the op takes no empty tensor
    for rows, slots, values in _selections(npu, q, k, weights, k_start, k_end, topk, profile):
        slots, values = _best_first(slots, values)
        width = min(topk, slots.shape[1])  # a sparse_count above topk is trimmed
        indices[rows, :width] = slots[:, :width].to(torch.int32)
        scores[rows, :width] = values[:, :width]
    return indices, scores_as_asked(scores, need_scores)


def paged_lightning_indexer(
    npu: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_end: torch.Tensor,
    topk: int,
    block_table: torch.Tensor,
    need_scores: bool,
    *,
    profile: NpuProfile = NEWEST_PAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged call: one op call with ``layout_key="PA_BSND"`` over the cache itself.

    Each query is its own batch (TND query lengths ``1, 2, .., T``; its key length
    ``k_end[t]``; its row of ``block_table``), and ``sparse_mode=3`` with one query lets
    it see all of its ``k_end[t]`` keys, from position 0 as the contract requires. So
    nothing is copied and nothing is read back: the lengths and the table go to the op
    as they are. ``k [blocks, block_size, 128]`` is passed as a ``[blocks, block_size,
    1, 128]`` view (``block_size`` a multiple of 16 up to 1024, declared).

    The op documents ``return_value`` for unpaged keys only, so it returns positions
    alone. When the caller needs scores, or the op had to be asked for more than
    ``topk`` (a ``sparse_count`` step), the chosen keys are scored here in fp32 from a
    gather of their rows (``[T, C, 128]``, the selection's size, not the cache's) and
    sorted best first; else a row is returned in ascending position order.
    """
    t, size = q.shape[0], k.shape[1]
    length = block_table.shape[1] * size
    width = min(topk, length)
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((t, topk), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return indices, scores_as_asked(scores, need_scores)
    sparse_count = sparse_count_for(width)
    q_op, w_op = q, weights
    if q.dtype == torch.float16:  # an fp16 score past 65504 would be inf: scale (exact)
        w_op = _fp16_weights(q, k.reshape(-1, k.shape[-1]), weights)[0]
    if not profile.indexer_any_heads:
        q_op, w_op = _padded_heads(q_op, w_op)
    chosen, _ = npu.npu_lightning_indexer(
        q_op.contiguous(),
        k.contiguous().unsqueeze(2),  # the op takes no non-contiguous key (a cache is not)
        w_op.contiguous(),
        actual_seq_lengths_query=torch.arange(1, t + 1, dtype=torch.int32, device=q.device),
        actual_seq_lengths_key=k_end.contiguous(),
        block_table=block_table.contiguous(),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=sparse_count,
        sparse_mode=3,
        return_value=False,
    )
    chosen = chosen.reshape(t, sparse_count).long()
    if need_scores or sparse_count > topk:
        values = _chosen_scores(q, k, weights, chosen, block_table)
        chosen, values = _best_first(chosen, values)
        scores[:, :width] = values[:, :width]
    else:  # ascending positions, -1 last
        last = torch.iinfo(torch.int64).max
        chosen = torch.sort(torch.where(chosen < 0, last, chosen), dim=1).values
        chosen = torch.where(chosen == last, -1, chosen)
    indices[:, :width] = chosen[:, :width].to(torch.int32)
    return indices, scores_as_asked(scores, need_scores)


def _chosen_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """fp32 scores ``[T, C]`` of the logical positions ``chosen [T, C]`` (``-1``: none,
    scored ``-inf``) of a paged ``k [blocks, block_size, Di]``."""
    slots = slots_of_positions(chosen, block_table, k.shape[1]).clamp_min(0)  # -1: masked
    rows = k.reshape(-1, k.shape[-1])[slots].float()  # [T, C, Di]: the chosen rows only
    dots = torch.einsum("thd,tcd->thc", q.float(), rows).relu()
    values = torch.einsum("th,thc->tc", weights, dots)
    return torch.where(chosen >= 0, values, float("-inf"))


def indexer_logits(
    npu: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    *,
    profile: NpuProfile = NEWEST_PAGES,
) -> torch.Tensor:
    """glmport's ``indexer_logits`` on ``npu.npu_lightning_indexer``: a ``sparse_count``
    covering every range returns every score of it (``N <= 8192``, the largest
    ``sparse_count``), scattered into ``[T, N]`` fp32 with ``-inf`` outside the ranges.

    Same inputs as :func:`lightning_indexer` without ``topk`` (``profile`` likewise);
    the scores are the op's bf16 / fp16 values. Docs: as :func:`lightning_indexer`.
    """
    t, n = q.shape[0], k.shape[0]
    logits = torch.full((t, n), float("-inf"), dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return logits
    for rows, slots, values in _selections(npu, q, k, weights, k_start, k_end, n, profile):
        # -1 slots write their -inf to a spare column N.
        part = torch.full((rows.numel(), n + 1), float("-inf"), device=q.device)
        part.scatter_(1, torch.where(slots < 0, n, slots), values)
        logits.index_copy_(0, rows, part[:, :n])
    return logits
