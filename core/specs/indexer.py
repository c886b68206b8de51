"""Lightning indexer ops (DeepSeek Sparse Attention): score keys, choose top-k."""

from __future__ import annotations

import torch

from ..formats import FP8_DTYPE
from ..validate import FLOAT_DTYPES, Checker, Level
from .base import OpSpec, invoke

_QK_DTYPES = (*FLOAT_DTYPES, FP8_DTYPE)


def _check_scores_inputs(c: Checker, q, k, weights, k_start, k_end, q_scale, k_scale, values):
    c.tensor("q", q, ndim=3, dtypes=_QK_DTYPES)
    t, hi, di = q.shape
    c.tensor("k", k, shape=(None, ("Di", di)), dtypes=_QK_DTYPES)
    c.same_dtype(q=q, k=k)
    n = k.shape[0]
    c.tensor("weights", weights, shape=(("T", t), ("Hi", hi)), dtypes=(torch.float32,))
    c.tensor("k_start", k_start, shape=(("T", t),), dtypes=(torch.int32,))
    c.tensor("k_end", k_end, shape=(("T", t),), dtypes=(torch.int32,))
    fp8 = q.dtype == FP8_DTYPE
    for name, s, shape in (
        ("q_scale", q_scale, (("T", t), ("Hi", hi))),
        ("k_scale", k_scale, (("N", n),)),
    ):
        if fp8 and s is None:
            c.fail(name, "a float32 scale tensor when q and k are float8_e4m3fn", "None")
        if not fp8 and s is not None:
            c.fail(
                name, "None unless q and k are float8_e4m3fn", f"a scale with q of dtype {q.dtype}"
            )
        if s is not None:
            c.tensor(name, s, shape=shape, dtypes=(torch.float32,))
    c.same_device(
        q=q, k=k, weights=weights, k_start=k_start, k_end=k_end, q_scale=q_scale, k_scale=k_scale
    )
    if values:
        c.in_range("k_start", k_start, 0, n + 1)
        c.in_range("k_end", k_end, 0, n + 1)

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


def _range_lengths(k_start, k_end, n):
    """``[T]`` keys in each query's range (the ranges are checked from ``full`` up)."""
    return (k_end.clamp(0, n) - k_start.clamp(0, n)).clamp_min(0)


_SCORE_FEATURES = ("dtype", "q_heads", "head_dim", "keys")


def _features(q, k, *_args) -> dict[str, object]:
    return {"dtype": q.dtype, "q_heads": q.shape[1], "head_dim": q.shape[2], "keys": k.shape[0]}


def _indexer_features(q, k, weights, k_start, k_end, topk, *_args) -> dict[str, object]:
    return {**_features(q, k), "topk": topk}


# -- lightning_indexer -------------------------------------------------------------


def _check_indexer(c: Checker, q, k, weights, k_start, k_end, topk, q_scale, k_scale, *, values):
    _check_scores_inputs(c, q, k, weights, k_start, k_end, q_scale, k_scale, values)
    c.int_in_range("topk", topk, 1)


def _guarded_indexer(outs, q, k, weights, k_start, k_end, topk, *_scales):
    """Only the ``-1`` tail of a short range scores ``-inf``; an overflowed score is
    NaN, ``+inf``, or a ``-inf`` (a negative weight times ``+inf``) in place of a key."""
    pad = (topk - _range_lengths(k_start, k_end, k.shape[0])).clamp_min(0).sum()
    return [("scores", outs[1], pad)]


def _fake_indexer(q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None):
    t = q.shape[0]
    return (
        q.new_empty((t, topk), dtype=torch.int32),
        q.new_empty((t, topk), dtype=torch.float32),
    )


LIGHTNING_INDEXER = OpSpec(
    name="lightning_indexer",
    schema="(Tensor q, Tensor k, Tensor weights, Tensor k_start, Tensor k_end, int topk, "
    "Tensor? q_scale=None, Tensor? k_scale=None) -> (Tensor indices, Tensor scores)",
    check=_check_indexer,
    fake=_fake_indexer,
    features=_indexer_features,
    feature_names=(*_SCORE_FEATURES, "topk"),
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

    Returns:
        indices: ``[T, topk]`` int32 slot ids, best first; ties go to the lower slot.
        When a query has fewer than ``topk`` valid slots the tail is ``-1``.
        scores: ``[T, topk]`` fp32 matching scores, ``-inf`` where the index is ``-1``.

    A score beyond float32 is refused with an ``OpInputError`` naming ``q`` (before
    the kernel under ``GLMPORT_VALIDATE=strict``, from the outputs under ``full``).
    Unchecked (``meta``), an overflowed score is ``+inf`` (NaN where it came from
    ``+inf`` and ``-inf`` terms): it ranks first (ties to the lower slot) and keeps its
    slot, never ``-1``.
    """
    return invoke(LIGHTNING_INDEXER, q, k, weights, k_start, k_end, topk, q_scale, k_scale)


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
