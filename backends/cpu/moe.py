"""Reference MoE: group-limited router, stable-sort dispatch, weighted combine, and a
per-expert loop for the grouped GEMM."""

from __future__ import annotations

import torch

from glmport.core.formats import FLOAT_WEIGHT

from .precision import acc_dtype, out_dtype
from .quant import quant_gemm


def moe_gate(
    logits,
    bias,
    top_k,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    score_func="sigmoid",
):
    lf = logits.to(acc_dtype())
    scores = torch.sigmoid(lf) if score_func == "sigmoid" else torch.softmax(lf, dim=-1)
    choice = scores if bias is None else scores + bias.to(lf.dtype)
    t, e = choice.shape
    if n_group > 1:
        per_group = choice.view(t, n_group, e // n_group)
        # DeepSeek-V3's Gate and vLLM's grouped_topk: a group's best score without a
        # correction bias, the sum of its best two with one ("noaux_tc").
        if bias is None:
            group_score = per_group.amax(dim=-1)
        else:
            group_score = per_group.topk(min(2, e // n_group), dim=-1).values.sum(dim=-1)
        # Stable sorts here and below: equal group scores keep the lower group index,
        # equal choice scores the lower expert id.
        kept = torch.sort(group_score, dim=1, descending=True, stable=True).indices[:, :topk_group]
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=lf.device).scatter(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return weights.to(out_dtype(torch.float32)), ids.to(torch.int32)


def moe_dispatch(x, ids, num_experts):
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    # An id outside [0, E) (unchecked under GLMPORT_VALIDATE=meta) sends its copy to no
    # expert: keyed E, it sorts after every expert's rows and is left out of the offsets.
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    src_row = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=x.device)
    counts = counts.scatter_add(0, key, torch.ones_like(key))[:num_experts]
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)
    return x[src_row // k], offsets, src_row.to(torch.int32)


def moe_combine(y_sorted, src_row, weights):
    t, k = weights.shape
    acc = acc_dtype()
    rows = src_row.long()
    # A src_row outside [0, T*k) (unchecked under GLMPORT_VALIDATE=meta) names no token:
    # its row is added to a spare output row T, dropped below, so no value leaks in.
    valid = (rows >= 0) & (rows < t * k)
    rows = torch.where(valid, rows, 0)
    target = torch.where(valid, rows // k, t)
    contrib = y_sorted.to(acc) * weights.reshape(-1).to(acc)[rows][:, None]
    out = torch.zeros(t + 1, y_sorted.shape[1], dtype=acc, device=y_sorted.device)
    return out.index_add(0, target, contrib)[:t].to(out_dtype(y_sorted.dtype))


def owned_rows(expert_offsets: torch.Tensor, m: int) -> torch.Tensor:
    """``[E + 1]`` offsets made a partition of ``[0, M]``: clamped to ``[0, M]``, then a
    running maximum, so expert ``e`` owns rows ``[o[e], o[e + 1])`` and no expert the
    rows before ``o[0]`` or from ``o[E]`` on. The identity on checked offsets (they run
    from 0 to M, non-decreasing); unchecked under ``GLMPORT_VALIDATE=meta``."""
    return expert_offsets.clamp(0, m).cummax(0).values


def grouped_gemm(x, w, expert_offsets, w_scale=None, scheme=FLOAT_WEIGHT, group_size=128):
    m, n = x.shape[0], w.shape[1]
    bounds = owned_rows(expert_offsets, m).tolist()
    dtype = out_dtype(x.dtype)
    parts = [torch.zeros((bounds[0], n), dtype=dtype, device=x.device)]  # rows of no expert
    for e in range(w.shape[0]):
        rows = x[bounds[e] : bounds[e + 1]]
        if scheme == FLOAT_WEIGHT:
            parts.append((rows.to(acc_dtype()) @ w[e].to(acc_dtype()).T).to(dtype))
        else:
            scale = None if w_scale is None else w_scale[e]
            parts.append(quant_gemm(rows, w[e], scale, scheme, group_size))
    parts.append(torch.zeros((m - bounds[-1], n), dtype=dtype, device=x.device))
    return torch.cat(parts)
