"""lightning_indexer and indexer_logits mutants.

(q [T, Hi, Di], k [N, Di], weights [T, Hi], k_start [T], k_end [T], [topk,]
q_scale [T, Hi] | None, k_scale [N] | None[, block_table None, need_scores True]): the
indexer's mutations see the packed form only (a paged call arrives as its packed
equivalent); it returns (indices [T, topk] int32, scores [T, topk] float32), the logits
op scores [T, N] float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmport.core.formats import FP8_DTYPE

from .base import (
    EXACT_TIES,
    IDS_2P16,
    add,
    column_major,
    flipped,
    ids_16bit,
    mutant,
    on_args,
    ones_if_given,
    replace_args,
)

INDEXERS = ("lightning_indexer", "indexer_logits")


def _ranges(edit: Callable[[torch.Tensor, torch.Tensor, int], tuple]):
    """A mutation of the key ranges: ``edit(start, end, N) -> (start, end)``."""

    def edit_args(args: list) -> None:
        start, end = edit(args[3], args[4], args[1].shape[0])
        args[3], args[4] = start.to(args[3].dtype), end.to(args[4].dtype)

    return on_args(edit_args)


# (name, kind, what breaks, the family that kills it, the mutation of op, only)
_BOTH = (
    ("end_off_by_one", "range end", "scores one key past each range's end (k_end + 1)",
     "tiny (causal ends)", lambda op: _ranges(lambda s, e, n: (s, (e + 1).clamp_max(n))), {}),
    ("start_off_by_one", "range end", "skips each range's first key (k_start + 1)",
     "edge: packed_ragged", lambda op: _ranges(lambda s, e, n: (torch.minimum(s + 1, e), e)), {}),
    ("start_ignored", "range end", "scores every range from key 0",
     "edge: packed_ragged, empty_range",
     lambda op: _ranges(lambda s, e, n: (torch.zeros_like(s), e)), {}),
    ("fp8_scales_ignored", "scale", "ignores q_scale and k_scale (fp8 codes scored as they are)",
     "fp8 cases", lambda op: replace_args(op, q_scale=ones_if_given, k_scale=ones_if_given),
     {"dtype": (FP8_DTYPE,)}),
    ("q_scale_ignored", "scale", "applies k_scale but not q_scale", "fp8 cases",
     lambda op: replace_args(op, q_scale=ones_if_given), {"dtype": (FP8_DTYPE,)}),
    ("head_weights_ignored", "formula", "sums the heads' ReLU scores unweighted", "tiny",
     lambda op: replace_args(op, weights=torch.ones_like), {}),
    ("weights_transposed", "layout", "reads weights [T, Hi] as if stored [Hi, T]",
     "tiny (T != Hi)", lambda op: replace_args(op, weights=lambda w: column_major(w).contiguous()),
     {}),
)  # fmt: skip
for _op in INDEXERS:
    for _name, _kind, _breaks, _needs, _of_op, _only in _BOTH:
        add(_op, _name, _kind, _breaks, _needs, _of_op(_op), **_only)

add(
    "lightning_indexer",
    "drops_last_key",
    "range end",
    "leaves each range's last key out (k_end - 1)",
    "edge: ends_at_peak",
    _ranges(lambda s, e, n: (s, torch.maximum(e - 1, s))),
)


def _scores_without_relu(q, k, weights, k_start, k_end, q_scale, k_scale):
    """float32 scores ``[T, N]`` with the ReLU left out, ``-inf`` outside each range."""
    dots = torch.einsum("thd,nd->thn", q.float(), k.float())
    if q_scale is not None:
        dots = dots * q_scale.float()[:, :, None] * k_scale.float()[None, None, :]
    scores = torch.einsum("th,thn->tn", weights.float(), dots)
    slots = torch.arange(k.shape[0], device=k.device)
    valid = (slots >= k_start[:, None]) & (slots < k_end[:, None])
    return scores.masked_fill(~valid, float("-inf"))


def _top_k(scores: torch.Tensor, k_start, k_end, topk: int):
    """The indexer's outputs from ``[T, N]`` scores: best first, lower slot first
    among ties, ``-1`` / ``-inf`` past each range's length."""
    t, n = scores.shape
    best, slots = torch.sort(scores, dim=1, descending=True, stable=True)
    width = min(topk, n)
    keep = torch.arange(width, device=scores.device)[None, :] < (k_end - k_start)[:, None]
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    values = torch.full((t, topk), float("-inf"), device=scores.device)
    indices[:, :width] = torch.where(keep, slots[:, :width], -1).to(torch.int32)
    values[:, :width] = torch.where(keep, best[:, :width], float("-inf"))
    return indices, values


@mutant(
    "indexer_logits",
    "relu_missing",
    "formula",
    "leaves the ReLU out of the per-head scores",
    "tiny",
)
def _logits_no_relu(kernel):
    return _scores_without_relu


@mutant(
    "lightning_indexer",
    "relu_missing",
    "formula",
    "leaves the ReLU out of the per-head scores",
    "tiny",
)
def _indexer_no_relu(kernel):
    def mutated(q, k, weights, k_start, k_end, topk, q_scale, k_scale, *_packed):
        scores = _scores_without_relu(q, k, weights, k_start, k_end, q_scale, k_scale)
        return _top_k(scores, k_start, k_end, topk)

    return mutated


@mutant(
    "indexer_logits",
    "outside_range_zero",
    "range end",
    "writes 0 instead of -inf outside each key range",
    "tiny (causal ranges)",
)
def _logits_zero_outside(kernel):
    def mutated(*args):
        out = kernel(*args)
        return torch.where(torch.isneginf(out), 0.0, out).to(out.dtype)

    return mutated


@mutant(
    "lightning_indexer",
    "ties_to_higher_slot",
    "tie order",
    "gives exact score ties to the higher slot (docs/ops.md: the lower wins)",
    EXACT_TIES,
)
def _high_ties(kernel):
    def mutated(q, k, weights, k_start, k_end, topk, q_scale, k_scale, *_packed):
        # The kernel on the keys in reverse order: its lower slot is our higher one.
        n = k.shape[0]
        flipped_scale = None if k_scale is None else k_scale.flip(0)
        start, end = (n - k_end).to(k_start.dtype), (n - k_start).to(k_end.dtype)
        idx, vals = kernel(
            q, flipped(k, 0), weights, start, end, topk, q_scale, flipped_scale, *_packed
        )
        return torch.where(idx >= 0, n - 1 - idx, idx).to(idx.dtype), vals

    return mutated


def _indices_rewritten(change: Callable[[torch.Tensor, torch.Tensor], tuple]):
    """The indexer's ``(indices, scores)`` rewritten: ``change(idx, vals)``."""

    def wrap(kernel):
        return lambda *args: change(*kernel(*args))

    return wrap


def _slot_order(idx: torch.Tensor, vals: torch.Tensor) -> tuple:
    key = torch.where(idx >= 0, idx.long(), torch.iinfo(torch.int64).max)
    order = key.argsort(dim=1, stable=True)
    return idx.gather(1, order), vals.gather(1, order)


def _zero_padding(idx: torch.Tensor, vals: torch.Tensor) -> tuple:
    pad = idx < 0
    return idx.masked_fill(pad, 0), vals.masked_fill(pad, 0.0)


_OUTPUT_EDITS = (
    ("returned_ids_16bit", "ids width",
     "returns slot ids through uint16 (slot s comes back as s % 65536)", IDS_2P16,
     lambda idx, vals: (ids_16bit(idx), vals)),
    ("slot_order_not_score_order", "tie order", "returns the chosen keys in slot order, "
     "not best first", "tiny", _slot_order),
    ("padding_left_zero", "range end",
     "leaves the slots past a short range as 0 / 0.0 instead of -1 / -inf",
     "edge: n_lt_topk, empty_range", _zero_padding),
)  # fmt: skip
for _name, _kind, _breaks, _needs, _change in _OUTPUT_EDITS:
    add("lightning_indexer", _name, _kind, _breaks, _needs, _indices_rewritten(_change))
