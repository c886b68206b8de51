"""Reference lightning indexer: every score, then a stable sort."""

from __future__ import annotations

import torch

from glmport.core.specs.indexer import key_capacity, paged_slots, scores_as_asked

from .precision import acc_dtype, out_dtype


def clamp_key_ranges(
    k_start: torch.Tensor, k_end: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` int32 key ranges cut to ``[0, N]``: the intersection of ``[start, end)``
    with ``[0, N)``, as ``0 <= start <= end <= N`` (empty: ``start == end``). The
    identity on checked ranges; unchecked under ``GLMPORT_VALIDATE=meta``."""
    start = k_start.clamp(0, n)
    return start, torch.maximum(k_end.clamp(0, n), start)


def _scores(q, k, weights, k_start, k_end, q_scale, k_scale, block_table=None) -> torch.Tensor:
    """``[T, N]`` scores in the compute dtype (``[T, M * block_size]`` over logical
    positions when paged), ``-inf`` outside each query's key range."""
    acc = acc_dtype()
    if block_table is None:
        dots = torch.einsum("thd,nd->thn", q.to(acc), k.to(acc))  # [T, Hi, N]
        k_scale = None if k_scale is None else k_scale.to(acc)[None, None, :]
    else:  # the reference gathers each query's keys, [T, L, Di]: clarity over memory
        slots = paged_slots(block_table, k.shape[1], k.shape[0])
        keys = k.to(acc).reshape(-1, k.shape[-1])[slots]
        dots = torch.einsum("thd,tld->thl", q.to(acc), keys)
        k_scale = None if k_scale is None else k_scale.to(acc).reshape(-1)[slots][:, None, :]
    if q_scale is not None:
        dots = dots * q_scale.to(acc)[:, :, None] * k_scale
    scores = torch.einsum("th,thn->tn", weights.to(acc), dots.relu())
    slots = torch.arange(scores.shape[1], device=k.device)
    valid = (slots >= k_start[:, None]) & (slots < k_end[:, None])
    return scores.masked_fill(~valid, float("-inf"))


def indexer_logits(q, k, weights, k_start, k_end, q_scale=None, k_scale=None):
    return _scores(q, k, weights, k_start, k_end, q_scale, k_scale).to(out_dtype(torch.float32))


def lightning_indexer(
    q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, block_table=None,
    need_scores=True,
):  # fmt: skip
    k_start, k_end = clamp_key_ranges(k_start, k_end, key_capacity(k, block_table))
    scores = _scores(q, k, weights, k_start, k_end, q_scale, k_scale, block_table)
    t, n = scores.shape
    # A stable descending sort keeps the lower slot first among equal scores.
    best, slots = torch.sort(scores, dim=1, descending=True, stable=True)
    width = min(topk, n)
    best, slots = best[:, :width], slots[:, :width]
    keep = torch.arange(width, device=q.device)[None, :] < (k_end - k_start)[:, None]
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    values = torch.full((t, topk), float("-inf"), dtype=out_dtype(torch.float32), device=q.device)
    indices[:, :width] = torch.where(keep, slots, -1).to(torch.int32)
    values[:, :width] = torch.where(keep, best, float("-inf")).to(values.dtype)
    return indices, scores_as_asked(values, need_scores)
