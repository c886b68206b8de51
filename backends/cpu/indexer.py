"""Reference lightning indexer: every score, then a stable sort."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def clamp_key_ranges(
    k_start: torch.Tensor, k_end: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` int32 key ranges cut to ``[0, N]``: the intersection of ``[start, end)``
    with ``[0, N)``, as ``0 <= start <= end <= N`` (empty: ``start == end``). The
    identity on checked ranges; unchecked under ``GLMPORT_VALIDATE=meta``."""
    start = k_start.clamp(0, n)
    return start, torch.maximum(k_end.clamp(0, n), start)


def _scores(q, k, weights, k_start, k_end, q_scale, k_scale) -> torch.Tensor:
    """``[T, N]`` scores in the compute dtype, ``-inf`` outside each query's key range."""
    acc = acc_dtype()
    dots = torch.einsum("thd,nd->thn", q.to(acc), k.to(acc))  # [T, Hi, N]
    if q_scale is not None:
        dots = dots * q_scale.to(acc)[:, :, None] * k_scale.to(acc)[None, None, :]
    scores = torch.einsum("th,thn->tn", weights.to(acc), dots.relu())
    slots = torch.arange(k.shape[0], device=k.device)
    valid = (slots >= k_start[:, None]) & (slots < k_end[:, None])
    return scores.masked_fill(~valid, float("-inf"))


def indexer_logits(q, k, weights, k_start, k_end, q_scale=None, k_scale=None):
    return _scores(q, k, weights, k_start, k_end, q_scale, k_scale).to(out_dtype(torch.float32))


def lightning_indexer(q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None):
    k_start, k_end = clamp_key_ranges(k_start, k_end, k.shape[0])
    scores = _scores(q, k, weights, k_start, k_end, q_scale, k_scale)
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
    return indices, values
