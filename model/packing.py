"""Packed (varlen) batches: a padded batch ``[B, S]`` as its ``T`` real tokens
(``[T_total, ...]``, the op interface's "TND" layout), every sequence's keys a
contiguous slot range.

The layers choose their work per call (whether the indexer runs, which MLA form is
cheaper) from how many keys the queries see. :class:`Widths` holds those counts on the
host, computed once per batch where the host already has the numbers, so no layer
reads a device tensor to decide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Widths:
    """How many keys each query of a batch sees, as Python ints: ``runs[i] = (first,
    count)`` says that ``count`` queries of sequence ``i`` see ``first, first + 1, ...,
    first + count - 1`` keys (a causal run; ``first`` is 1 for a prompt, the cached
    length plus 1 for new tokens over a cache)."""

    runs: tuple[tuple[int, int], ...]

    @property
    def widest(self) -> int:
        """The most keys any query sees (0 with no query)."""
        return max((first + count - 1 for first, count in self.runs if count), default=0)

    def wider_than(self, limit: int) -> int:
        """How many queries see more than ``limit`` keys."""
        return sum(min(count, max(0, first + count - 1 - limit)) for first, count in self.runs)


@dataclass
class Packed:
    """A padded batch ``[B, S]`` packed to its ``T`` real tokens.

    ``positions [T]`` (per sequence, from 0), ``k_start`` / ``k_end [T]`` int32 causal
    key ranges in packed slots, ``flat [T]`` each token's index in the ``B * S`` grid;
    ``widths``: each query's range width ``k_end - k_start``, on the host.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    k_start: torch.Tensor
    k_end: torch.Tensor
    flat: torch.Tensor
    batch: int
    seq_len: int
    widths: Widths

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` back to ``[B, S, ...]``, zeros at padding."""
        out = packed.new_zeros((self.batch * self.seq_len, *packed.shape[1:]))
        out[self.flat] = packed
        return out.view(self.batch, self.seq_len, *packed.shape[1:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Packed:
    """Pack ``input_ids [B, S]`` with a 1/0 ``attention_mask`` (left or right padding).

    Positions count each sequence's real tokens, so padding never shifts them. The
    host reads the mask's row counts once here (nothing without a mask), for
    :class:`Widths`.
    """
    b, s = input_ids.shape
    mask = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool()
    )
    counts = mask.sum(dim=1)
    flat = mask.reshape(-1).nonzero().squeeze(1)
    positions = (mask.long().cumsum(dim=1) - 1).reshape(-1)[flat]
    starts = torch.cat((counts.new_zeros(1), counts.cumsum(0)[:-1]))
    row = flat // s
    k_start = starts[row].to(torch.int32)
    k_end = (k_start + positions + 1).to(torch.int32)
    lengths = [s] * b if attention_mask is None else counts.tolist()
    widths = Widths(tuple((1, n) for n in lengths))
    return Packed(input_ids.reshape(-1)[flat], positions, k_start, k_end, flat, b, s, widths)


def visible_slots(k_start: torch.Tensor, k_end: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` slots of each query's range ``[k_start, k_end)`` as ``[T,
    width]`` int32 indices, ``-1`` past the range end: dense causal attention through
    ``sparse_attention`` when ``width`` is the widest range (:attr:`Widths.widest`)."""
    slots = k_start[:, None] + torch.arange(width, dtype=torch.int32, device=k_start.device)
    return torch.where(slots < k_end[:, None], slots, -1).to(torch.int32)
