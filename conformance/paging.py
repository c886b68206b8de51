"""A paged ``lightning_indexer`` call as the packed call it equals, for the judge, the
float64 reference's scores and the mutants, which all speak the packed form.

A paged call reads query ``t``'s logical key positions ``[0, k_end[t])`` through its
row of ``block_table``; its packed equivalent lays every query's ``L = M * block_size``
logical keys out one query after another (``[T * L, Di]``) with query ``t``'s range
shifted by ``t * L``. Indices map between the two by that shift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glmport.core.specs.indexer import paged_slots, scores_as_asked


@dataclass(frozen=True)
class PackedIndexerCall:
    """``args``: the packed call (schema order, unpaged, scores asked for);
    ``offsets [T, 1]`` int64: each query's shift."""

    args: tuple
    offsets: torch.Tensor

    def to_logical(self, indices: torch.Tensor) -> torch.Tensor:
        """Packed indices ``[T, K]`` as the paged call's logical positions."""
        return torch.where(indices >= 0, indices - self.offsets, -1).to(indices.dtype)

    def to_packed(self, indices: torch.Tensor) -> torch.Tensor:
        """The paged call's logical positions ``[T, K]`` as packed indices."""
        offsets = self.offsets.to(indices.device)
        return torch.where(indices >= 0, indices + offsets, -1).to(indices.dtype)


def packed_indexer_call(args: tuple) -> PackedIndexerCall:
    """The packed equivalent of the paged ``lightning_indexer`` call ``args`` (all ten
    arguments; ``block_table`` given)."""
    q, k, weights, k_start, k_end, topk, q_scale, k_scale, table, _ = args
    slots = paged_slots(table, k.shape[1], k.shape[0])  # [T, L]
    t, length = slots.shape
    flat = slots.reshape(-1)
    keys = k.reshape(-1, k.shape[-1])[flat]
    scale = None if k_scale is None else k_scale.reshape(-1)[flat]
    offsets = torch.arange(t, device=k_end.device)[:, None] * length
    start = (k_start.long().clamp(0, length) + offsets[:, 0]).to(k_start.dtype)
    end = (k_end.long().clamp(0, length) + offsets[:, 0]).to(k_end.dtype)
    packed = (q, keys, weights, start, end, topk, q_scale, scale, None, True)
    return PackedIndexerCall(packed, offsets)


def logits_args(args: tuple) -> tuple:
    """``indexer_logits``' arguments for the ``lightning_indexer`` call ``args`` (eight
    or more): every score of the call, over its packed equivalent when paged. The
    indexer's judge reads these (its reference is the whole score matrix)."""
    if len(args) > 8 and args[8] is not None:
        args = packed_indexer_call(args).args
    q, k, weights, k_start, k_end, _, q_scale, k_scale = args[:8]
    return q, k, weights, k_start, k_end, q_scale, k_scale


def in_packed_form(kernel: Callable[..., tuple]) -> Callable[..., tuple]:
    """``kernel`` (a ``lightning_indexer`` kernel that may only know the packed form)
    as a kernel of every call: a paged one runs as its packed equivalent, scores are
    dropped where the caller asked for none."""

    def call(*args):
        need_scores = args[9]
        if args[8] is None:
            indices, scores = kernel(*args[:9], True)
        else:
            packed = packed_indexer_call(args)
            indices, scores = kernel(*packed.args)
            indices = packed.to_logical(indices)
        return indices, scores_as_asked(scores, need_scores)

    return call
