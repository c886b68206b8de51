"""Packed (varlen) batches: a padded batch ``[B, S]`` as its ``T`` real tokens
(``[T_total, ...]``, the op interface's "TND" layout), every sequence's keys a
contiguous slot range."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """A padded batch ``[B, S]`` packed to its ``T`` real tokens.

    ``positions [T]`` (per sequence, from 0), ``k_start`` / ``k_end [T]`` int32 causal
    key ranges in packed slots, ``flat [T]`` each token's index in the ``B * S`` grid.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    k_start: torch.Tensor
    k_end: torch.Tensor
    flat: torch.Tensor
    batch: int
    seq_len: int

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` back to ``[B, S, ...]``, zeros at padding."""
        out = packed.new_zeros((self.batch * self.seq_len, *packed.shape[1:]))
        out[self.flat] = packed
        return out.view(self.batch, self.seq_len, *packed.shape[1:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Packed:
    """Pack ``input_ids [B, S]`` with a 1/0 ``attention_mask`` (left or right padding).

    Positions count each sequence's real tokens, so padding never shifts them.
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
    return Packed(input_ids.reshape(-1)[flat], positions, k_start, k_end, flat, b, s)


def visible_slots(k_start: torch.Tensor, k_end: torch.Tensor) -> torch.Tensor:
    """Every slot of each query's range ``[k_start, k_end)`` as ``[T, max_len]`` int32
    indices, ``-1`` past the range end: dense causal attention through
    ``sparse_attention``."""
    width = int((k_end - k_start).max()) if k_start.numel() else 0
    slots = k_start[:, None] + torch.arange(width, dtype=torch.int32, device=k_start.device)
    return torch.where(slots < k_end[:, None], slots, -1).to(torch.int32)
