"""The lightning indexer in query x key tiles with a running top-k, so a full [T, N]
score matrix is never held when N is large."""

from __future__ import annotations

import math

import torch

from glmport.backends.cpu.indexer import clamp_key_ranges
from glmport.core.specs.indexer import paged_slots, scores_as_asked

from .attention import matmul
from .tiling import rows_per_tile

KEY_TILE = 65536


def _dequant(q, k, q_scale, k_scale):
    """fp32 query / key rows; fp8 rows times their (positive) scales."""
    qf, kf = q.float(), k.float()
    if q_scale is not None:
        qf = qf * q_scale[..., None]
        kf = kf * k_scale[:, None]
    return qf, kf


def _tile_scores(qf, kf, weights, k_start, k_end, n0, n1, masked=True):
    """``[Tc, n1 - n0]`` scores of a query chunk against key tile ``[n0, n1)``; with
    ``masked`` false the caller knows every query sees the whole tile."""
    dots = torch.matmul(qf, kf[n0:n1].T).relu_()  # [Tc, Hi, Nt]
    scores = matmul(weights[:, None, :], dots).squeeze(1)
    if not masked:
        return scores
    slots = torch.arange(n0, n1, device=qf.device)
    valid = (slots >= k_start[:, None]) & (slots < k_end[:, None])
    return scores.masked_fill_(~valid, float("-inf"))


def _query_step(t: int, hi: int, tile: int) -> int:
    return rows_per_tile(4 * hi * tile * 2, t)


def indexer_logits(q, k, weights, k_start, k_end, q_scale=None, k_scale=None):
    t, hi, _ = q.shape
    n = k.shape[0]
    qf, kf = _dequant(q, k, q_scale, k_scale)
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    step = _query_step(t, hi, max(n, 1))
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        out[t0:t1] = _tile_scores(qf[t0:t1], kf, weights[t0:t1], k_start[t0:t1], k_end[t0:t1], 0, n)
    return out


def _select_exact(cand_v, cand_i, k):
    """The best ``k`` candidates per row, best first, ties to the lower slot.

    Requires equal values to appear in ascending slot order along each row (true for
    ``[running best | next tile]``: earlier tiles hold lower slots). ``topk`` finds the
    k-th value; everything above it is taken, then the first of the ties.
    """
    rows, width = cand_v.shape
    kk = min(k, width)
    kth = torch.topk(cand_v, kk, dim=1).values[:, -1:]
    above = cand_v > kth
    tied = cand_v == kth
    take = above | (tied & (tied.cumsum(1) <= kk - above.sum(1, keepdim=True)))
    pos = take.nonzero()[:, 1].view(rows, kk)  # exactly kk per row, in slot order
    sel_v, sel_i = cand_v.gather(1, pos), cand_i.gather(1, pos)
    order = torch.sort(sel_v, dim=1, descending=True, stable=True).indices
    return sel_v.gather(1, order), sel_i.gather(1, order)


def _select(cand_v, cand_i, k, offset=0):
    """What :func:`_select_exact` returns, at about the cost of one sorted ``topk``.

    ``topk`` alone may break a tie between equal finite values either way (``-inf``
    entries become ``-1``, their order is moot): inside the chosen set, or at the k-th
    value when it also occurs outside the set. Both show as equal neighbours among the
    best ``k + 1`` sorted values. Only rows with such a tie, rare with real scores,
    take the exact path. ``cand_i`` None: the candidates' slots are their columns plus
    ``offset`` (one key tile, no running best).
    """
    width = cand_v.shape[1]
    kk = min(k, width)
    value, pos = torch.topk(cand_v, min(kk + 1, width), dim=1)
    value, pos, rest = value[:, :kk], pos[:, :kk], value[:, 1:]
    slot = pos + offset if cand_i is None else cand_i.gather(1, pos)
    equal = rest == value[:, : rest.shape[1]]
    # Two ops and one sync on the common path; equal -inf pairs (masked keys) are no tie.
    if bool(equal.any()) and bool((tie := equal & torch.isfinite(rest)).any()):
        rows = tie.any(1).nonzero()[:, 0]
        if cand_i is None:
            cand_i = torch.arange(offset, offset + width, device=cand_v.device)
            cand_i = cand_i.expand(cand_v.shape[0], -1)
        value[rows], slot[rows] = _select_exact(cand_v[rows], cand_i[rows], k)
    return value, slot


def lightning_indexer(
    q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, block_table=None,
    need_scores=True,
):  # fmt: skip
    runs = None if block_table is None else _block_runs(block_table, k_end, k.shape[1])
    if runs is not None:  # every table one run of consecutive blocks: the packed call
        size, di = k.shape[1], k.shape[2]
        flat_scale = None if k_scale is None else k_scale.reshape(-1)
        end = (runs + k_end.clamp(0, block_table.shape[1] * size)).to(k_end.dtype)
        indices, scores = _packed(
            q, k.reshape(-1, di), weights, runs.to(k_end.dtype), end, topk, q_scale, flat_scale
        )
        indices = torch.where(indices >= 0, indices - runs[:, None].to(indices.dtype), -1)
    elif block_table is not None:
        indices, scores = _paged(q, k, weights, k_end, topk, q_scale, k_scale, block_table)
    else:
        indices, scores = _packed(q, k, weights, k_start, k_end, topk, q_scale, k_scale)
    return indices, scores_as_asked(scores, need_scores)


def _block_runs(table: torch.Tensor, k_end: torch.Tensor, size: int) -> torch.Tensor | None:
    """``[T]`` int64 first slots when every query's blocks that its range reads are
    consecutive (a lone sequence in a fresh cache), so its keys are one run of the pool
    and the packed path reads them in place; else None (one host read decides)."""
    if table.shape[0] == 0 or not table.is_contiguous() or not k_end.is_contiguous():
        return None
    cols = torch.arange(table.shape[1], device=table.device)
    read = cols[None, :] * size < k_end[:, None].long()
    first = torch.where(read[:, :1], table[:, :1].long(), 0)  # an empty range reads no block
    if not bool(((table.long() == first + cols[None, :]) | ~read).all()):
        return None
    return first[:, 0] * size


def _paged(q, k, weights, k_end, topk, q_scale, k_scale, block_table):
    """The paged call (``k_start`` is 0): per chunk of queries, each query's keys
    gathered in logical order ``[Tc, L, Di]`` (a gather is 1 / Hi of the scoring's
    work), scored, and the best ``topk`` logical positions kept."""
    t, hi, di = q.shape
    size = k.shape[1]
    flat = k.reshape(-1, di)
    flat_scale = None if k_scale is None else k_scale.reshape(-1)
    length = block_table.shape[1] * size
    k_end = k_end.clamp(0, length)
    step = _query_step(t, hi, length + topk)
    indices = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((t, topk), float("-inf"), device=q.device)
    positions = torch.arange(length, device=q.device)
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        slots = paged_slots(block_table[t0:t1], size, k.shape[0])  # [Tc, L]
        qf, kf = q[t0:t1].float(), flat[slots].float()
        if q_scale is not None:
            qf = qf * q_scale[t0:t1, :, None]
            kf = kf * flat_scale[slots][..., None]
        dots = torch.matmul(qf, kf.transpose(1, 2)).relu_()  # [Tc, Hi, L]
        sc = matmul(weights[t0:t1, None, :], dots).squeeze(1)
        sc.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=-math.inf)  # as _packed
        sc.masked_fill_(positions[None, :] >= k_end[t0:t1, None], float("-inf"))
        best_v, best_i = _select(sc, None, topk)
        valid = best_v != float("-inf")
        width = best_v.shape[1]
        indices[t0:t1, :width] = torch.where(valid, best_i, -1).to(torch.int32)
        scores[t0:t1, :width] = torch.where(valid, best_v, float("-inf"))
    return indices, scores


def _packed(q, k, weights, k_start, k_end, topk, q_scale, k_scale):
    """The call over packed keys ``k [N, Di]`` with key ranges."""
    t, hi, _ = q.shape
    n = k.shape[0]
    qf, kf = _dequant(q, k, q_scale, k_scale)
    # The tile loop below starts and ends at range bounds: they must lie in [0, N].
    k_start, k_end = clamp_key_ranges(k_start, k_end, n)
    tile = min(KEY_TILE, max(n, 1))
    step = _query_step(t, hi, tile + topk)
    chunks = []
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        ks, ke = k_start[t0:t1], k_end[t0:t1]
        (lo, start_max), (end_min, hi_) = torch.aminmax(ks), torch.aminmax(ke)
        lo, start_max, end_min, hi_ = int(lo), int(start_max), int(end_min), int(hi_)
        best_v = best_i = None
        # Causal prefill: a query chunk sees only [lo, hi), so only those keys are
        # scored (half of T x N at T = N); a tile that every query sees whole is not
        # masked (decode), and then, if it holds top-k keys, no score is -inf.
        may_be_short = True
        for n0 in range(lo, hi_, tile):
            n1 = min(hi_, n0 + tile)
            masked = start_max > n0 or end_min < n1
            sc = _tile_scores(qf[t0:t1], kf, weights[t0:t1], ks, ke, n0, n1, masked)
            # An overflowed score ranks first (docs/ops.md): a NaN one (from +inf and
            # -inf terms) counts as +inf, so the selection below sees ordered values.
            sc.nan_to_num_(nan=math.inf, posinf=math.inf, neginf=-math.inf)
            if best_v is None:
                best_v, best_i = _select(sc, None, topk, n0)
            else:
                slots = torch.arange(n0, n1, device=q.device).expand(t1 - t0, -1)
                cand = torch.cat((best_i, slots), 1)
                best_v, best_i = _select(torch.cat((best_v, sc), 1), cand, topk)
            may_be_short = may_be_short and (masked or n1 - n0 < topk)
        if best_v is None:  # no key in range
            best_v = torch.full((t1 - t0, 0), float("-inf"), device=q.device)
            best_i = torch.full((t1 - t0, 0), -1, dtype=torch.long, device=q.device)
        if may_be_short:
            # Only a masked key scores -inf; an overflowed one is +inf and is kept.
            valid = best_v != float("-inf")
            best_i = torch.where(valid, best_i, -1)
            best_v = torch.where(valid, best_v, float("-inf"))
        pad = topk - best_v.shape[1]
        if pad:
            best_v = torch.nn.functional.pad(best_v, (0, pad), value=float("-inf"))
            best_i = torch.nn.functional.pad(best_i, (0, pad), value=-1)
        chunks.append((best_i.to(torch.int32), best_v))
    if len(chunks) == 1:
        return chunks[0]
    if not chunks:
        empty = torch.empty((0, topk), device=q.device)
        return empty.to(torch.int32), empty
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
