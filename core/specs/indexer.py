"""Lightning indexer ops (DeepSeek Sparse Attention): score keys, choose top-k."""

from __future__ import annotations

import torch

from ..formats import FP8_DTYPE
from ..validate import FLOAT_DTYPES, Checker, Level
from .base import OpSpec, invoke

_QK_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)


def _check_scores_inputs(
    c: Checker, q, k, weights, k_start, k_end, q_scale, k_scale, values, block_table=None
):
    c.tensor("q", q, ndim=3, dtypes=_QK_DTYPES)
    t, hi, di = q.shape
    if block_table is None:
        c.tensor("k", k, shape=(None, ("Di", di)), dtypes=_QK_DTYPES)
        n = k.shape[0]  # the ranges' bound: keys
        key_axes = (("N", n),)
    else:
        c.tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
        c.tensor("block_table", block_table, shape=(("T", t), None))
        c.tensor("k", k, shape=(None, None, ("Di", di)), dtypes=_QK_DTYPES)
        n = key_capacity(k, block_table)  # the ranges' bound: a table's positions
        key_axes = (("blocks", k.shape[0]), ("block_size", k.shape[1]))
    c.same_dtype(q=q, k=k)
    c.tensor("weights", weights, shape=(("T", t), ("Hi", hi)), dtypes=(torch.float32,))
    c.tensor("k_start", k_start, shape=(("T", t),), dtypes=(torch.int32,))
    c.tensor("k_end", k_end, shape=(("T", t),), dtypes=(torch.int32,))
    fp8 = q.dtype == FP8_DTYPE
    for name, s, shape in (
        ("q_scale", q_scale, (("T", t), ("Hi", hi))),
        ("k_scale", k_scale, key_axes),
    ):
        if fp8 and s is None:
            c.fail(name, "a float32 scale tensor when q and k are float8_e4m3fn", "None")
        if not fp8 and s is not None:
            c.fail(
                name, "None unless q and k are float8_e4m3fn", f"a scale with q of dtype {q.dtype}"
            )
        if s is not None:
            c.tensor(name, s, shape=shape, dtypes=(torch.float32,))
    tensors = dict(q=q, k=k, weights=weights, k_start=k_start, k_end=k_end)
    c.same_device(**tensors, q_scale=q_scale, k_scale=k_scale, block_table=block_table)
    if values:
        c.in_range("k_start", k_start, 0, n + 1)
        c.in_range("k_end", k_end, 0, n + 1)
        if block_table is not None:
            _check_pages(c, k, block_table, k_start, k_end)

        def first_crossed() -> str:
            row = int((k_start > k_end).nonzero()[0, 0])
            return f"k_start[{row}]={int(k_start[row])} > k_end[{row}]={int(k_end[row])}"

        c.require((k_start <= k_end).all(), "k_start", "<= k_end for every query", first_crossed)
        w_max = c.finite("weights", weights)
        q_max = c.finite("q", q)  # a NaN score would make the chosen set arbitrary
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
            if s is not None:  # k_scale: one float per slot, 1/Di of the key cache
                c.finite_positive(name, s)
    if values >= Level.STRICT:  # the whole key cache: as long as the decode step itself
        k_max = c.finite("k", k)
        if fp8:  # the dot products of dequantised rows
            q_max *= c.magnitude(q_scale)
            k_max *= c.magnitude(k_scale)
        # q . k per head, then a weighted sum over the Hi heads.
        bound = q_max * k_max * di * max(1.0, hi * w_max)
        c.within_range("q", bound, "the scores (max|q| * max|k| * Di * max(1, Hi * max|weights|))")


def _check_pages(c: Checker, k, block_table, k_start, k_end) -> None:
    """A paged call reads each sequence from its start, through blocks that exist."""

    def first_start() -> str:
        t = int(k_start.nonzero()[0, 0])
        return f"k_start[{t}] = {int(k_start[t])}"

    c.require((k_start == 0).all(), "k_start", "0 for every query of a paged call", first_start)
    blocks, size = k.shape[0], k.shape[1]
    read = torch.arange(block_table.shape[1], device=k_end.device) * size < k_end[:, None]
    bad = read & ((block_table < 0) | (block_table >= blocks))

    def first_bad() -> str:
        t, j = (int(x) for x in bad.nonzero()[0])
        return f"block_table[{t}, {j}] = {int(block_table[t, j])}"

    c.require(
        ~bad.any(), "block_table", f"block ids in [0, {blocks}) where a range reads", first_bad
    )


def paged_slots(block_table: torch.Tensor, block_size: int, blocks: int) -> torch.Tensor:
    """``[T, M * block_size]`` int64: the slot of a paged cache of ``blocks`` blocks
    (flattened) that holds each query's logical key position, ``block_table [T, M]``
    int32 naming the blocks in order. Entries a query does not read may name any block:
    they are clamped into ``[0, blocks)`` (callers mask positions outside the range)."""
    pos = torch.arange(block_table.shape[1] * block_size, device=block_table.device)
    table = block_table.long().clamp(0, max(blocks - 1, 0))
    return table[:, pos // block_size] * block_size + pos % block_size


def slots_of_positions(
    positions: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Logical positions ``[T, K]`` (``-1``: none) of each query's sequence, as a paged
    call returns them, as the pool's slots ``[T, K]`` int64 through ``block_table [T, M]``
    (``-1`` kept)."""
    p = positions.long().clamp_min(0)
    block = block_table.long().gather(1, p // block_size)
    return torch.where(positions >= 0, block * block_size + p % block_size, -1)


def _range_lengths(k_start, k_end, n):
    """``[T]`` keys in each query's range (the ranges are checked from ``full`` up)."""
    return (k_end.clamp(0, n) - k_start.clamp(0, n)).clamp_min(0)


_SCORE_FEATURES = ("dtype", "q_heads", "head_dim", "keys")


def _features(q, k, *_args) -> dict[str, object]:
    return {"dtype": q.dtype, "q_heads": q.shape[1], "head_dim": q.shape[2], "keys": k.shape[0]}


def _indexer_features(
    q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, block_table=None, *_args
) -> dict[str, object]:
    if block_table is None:
        return {**_features(q, k), "topk": topk, "block_size": None}
    # keys: the most a query can read (its table's positions)
    keys = key_capacity(k, block_table)
    return {**_features(q, k), "keys": keys, "topk": topk, "block_size": k.shape[1]}


# -- lightning_indexer -------------------------------------------------------------


def _check_indexer(
    c: Checker, q, k, weights, k_start, k_end, topk, q_scale, k_scale, block_table=None,
    need_scores=True, *, values,
):  # fmt: skip
    _check_scores_inputs(c, q, k, weights, k_start, k_end, q_scale, k_scale, values, block_table)
    c.int_in_range("topk", topk, 1)
    if not isinstance(need_scores, bool):
        c.fail("need_scores", "a bool", repr(need_scores))


def _guarded_indexer(
    outs, q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, block_table=None,
    need_scores=True,
):  # fmt: skip
    """Only the ``-1`` tail of a short range scores ``-inf``; an overflowed score is
    NaN, ``+inf``, or a ``-inf`` (a negative weight times ``+inf``) in place of a key.
    Without scores nothing shows an overflow."""
    if not need_scores:
        return []
    lengths = _range_lengths(k_start, k_end, key_capacity(k, block_table))
    return [("scores", outs[1], (topk - lengths).clamp_min(0).sum())]


def _fake_indexer(
    q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, block_table=None,
    need_scores=True,
):  # fmt: skip
    t = q.shape[0]
    return (
        q.new_empty((t, topk), dtype=torch.int32),
        q.new_empty(scores_shape(t, topk, need_scores), dtype=torch.float32),
    )


def scores_as_asked(scores: torch.Tensor, need_scores: bool) -> torch.Tensor:
    """A kernel's ``scores [T, topk]`` as the op returns them: themselves when the
    caller asked, else an empty ``[0]`` of their dtype and device."""
    return scores if need_scores else scores.new_empty((0,))


def key_capacity(k: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """The bound of the key ranges: ``k``'s rows, or a paged table's positions."""
    return k.shape[0] if block_table is None else block_table.shape[1] * k.shape[1]


def scores_shape(t: int, topk: int, need_scores: bool) -> tuple[int, ...]:
    """``scores``' shape: ``[T, topk]`` when the caller asked for them, else ``[0]``."""
    return (t, topk) if need_scores else (0,)


LIGHTNING_INDEXER = OpSpec(
    name="lightning_indexer",
    schema="(Tensor q, Tensor k, Tensor weights, Tensor k_start, Tensor k_end, int topk, "
    "Tensor? q_scale=None, Tensor? k_scale=None, Tensor? block_table=None, "
    "bool need_scores=True) -> (Tensor indices, Tensor scores)",
    check=_check_indexer,
    fake=_fake_indexer,
    features=_indexer_features,
    feature_names=(*_SCORE_FEATURES, "topk", "block_size"),
    tie_outputs=(0,),
    result_guard=_guarded_indexer,
)


def lightning_indexer(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the ``topk`` best key slots per query token.

    ``score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` over slots ``s`` in
    ``[k_start[t], k_end[t])`` (fold any softmax-style scale such as ``Di**-0.5`` into
    ``weights``: relu is positively homogeneous). With fp8 inputs the dot product is
    ``q_scale[t, h] * k_scale[s] * (q[t, h] . k[s])``.

    Args:
        q: ``[T, Hi, Di]`` fp32 | bf16 | fp16 | float8_e4m3fn (indexer query heads).
        k: ``[N, Di]``, same dtype as ``q`` (one shared key head; slots may be paged).
        weights: ``[T, Hi]`` fp32 per-head weights.
        k_start, k_end: ``[T]`` int32, ``0 <= k_start <= k_end <= N``.
        topk: number of slots to return, ``>= 1``.
        q_scale: ``[T, Hi]`` fp32, only (and always) with fp8 ``q``.
        k_scale: ``[N]`` fp32, only (and always) with fp8 ``k``.
        block_table: ``[T, M]`` int32 or None. Given, the keys are a paged cache: ``k``
            is ``[blocks, block_size, Di]`` (``k_scale`` ``[blocks, block_size]``) and
            query ``t``'s key at logical position ``p`` is
            ``k[block_table[t, p // block_size], p % block_size]``
            (:func:`paged_slots`). Ranges and the returned indices are then logical
            positions: ``k_start`` is 0 (a sequence is read from its start), ``k_end[t]
            <= M * block_size``, and the blocks a range reads lie in ``[0, blocks)``.
            Nothing is gathered into a packed copy: what vendors' paged indexers take
            (Ascend's ``layout_key="PA_BSND"``).
        need_scores: whether the caller reads ``scores``. Inference passes False:
            vendor kernels then run without returning values (Ascend documents
            ``return_value`` only for unpaged keys), and the valid indices of a row
            may come in any order (still ``-1`` after them).

    Returns:
        indices: ``[T, topk]`` int32 slot ids (logical positions when paged), best
        first; ties go to the lower slot. When a query has fewer than ``topk`` valid
        slots the tail is ``-1``.
        scores: ``[T, topk]`` fp32 matching scores, ``-inf`` where the index is ``-1``;
        an empty ``[0]`` fp32 tensor without ``need_scores``.

    A score beyond float32 is refused with an ``OpInputError`` naming ``q`` (before
    the kernel under ``GLMPORT_VALIDATE=strict``, from the outputs under ``full``).
    Unchecked (``meta``), an overflowed score is ``+inf`` (NaN where it came from
    ``+inf`` and ``-inf`` terms): it ranks first (ties to the lower slot) and keeps its
    slot, never ``-1``.
    """
    args = (q, k, weights, k_start, k_end, topk, q_scale, k_scale, block_table, need_scores)
    return invoke(LIGHTNING_INDEXER, *args)


# -- indexer_logits ----------------------------------------------------------------


def _check_logits(c: Checker, q, k, weights, k_start, k_end, q_scale, k_scale, *, values):
    _check_scores_inputs(c, q, k, weights, k_start, k_end, q_scale, k_scale, values)


def _guarded_logits(out, q, k, weights, k_start, k_end, *_scales):
    """Only the keys outside a query's range score ``-inf``."""
    n = k.shape[0]
    return [("scores", out, (n - _range_lengths(k_start, k_end, n)).sum())]


def _fake_logits(q, k, weights, k_start, k_end, q_scale=None, k_scale=None):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


INDEXER_LOGITS = OpSpec(
    name="indexer_logits",
    schema="(Tensor q, Tensor k, Tensor weights, Tensor k_start, Tensor k_end, "
    "Tensor? q_scale=None, Tensor? k_scale=None) -> Tensor",
    check=_check_logits,
    fake=_fake_logits,
    features=_features,
    feature_names=_SCORE_FEATURES,
    differentiable=("q", "k", "weights"),
    result_guard=_guarded_logits,
)


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every indexer score: the full ``[T, N]`` matrix behind :func:`lightning_indexer`.

    Same inputs as :func:`lightning_indexer` (without ``topk``). Returns fp32
    ``[T, N]`` with ``-inf`` outside ``[k_start[t], k_end[t])``. Differentiable in
    ``q``, ``k`` and ``weights`` (the indexer's KL training loss uses it).
    """
    return invoke(INDEXER_LOGITS, q, k, weights, k_start, k_end, q_scale, k_scale)
