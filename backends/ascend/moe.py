"""MoE routing onto torch_npu's fused ops: the router gate (``npu_moe_gating_top_k``),
the sort-based dispatch (``npu_moe_init_routing_v2``) and the weighted combine
(``npu_moe_token_unpermute``), the chain Ascend deployments of DeepSeek-V3 / GLM-5
run (vllm-ascend).

Each adapter takes ``npu`` first (the ``torch_npu`` module, or the emulator under
``GLMPORT_EMULATE=1``) and glmport's op arguments after it. Docs, in Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/``: ``torch_npu-npu_moe_gating_top_k.md``,
``torch_npu-npu_moe_init_routing_v2.md``; cann/ops-transformer
``moe/moe_token_unpermute/README.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from glmport.backends.generic.moe import moe_gate as _generic_moe_gate
from glmport.core.selection import current_settings, log_fallback_once

# npu_moe_gating_top_k's grouping limits (its doc): a group holds more than 2 experts,
# and group_count times the group size aligned to 32 is at most 2048.
_GATE_MAX_EXPERTS = 2048
_GATE_ALIGN = 32
_GATE_MIN_GROUP = 3
# glmport's normalisation epsilon, also the op's default ``eps``.
_EPS = 1e-20


def _op_groups(experts: int, n_group: int) -> bool:
    """Whether ``npu_moe_gating_top_k`` accepts ``group_count=n_group`` for ``experts``."""
    per_group = experts // n_group
    aligned = -(-per_group // _GATE_ALIGN) * _GATE_ALIGN * n_group
    return per_group >= _GATE_MIN_GROUP and aligned <= _GATE_MAX_EXPERTS


def moe_gate(
    npu: Any,
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
    score_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """glmport ``moe_gate`` through ``npu_moe_gating_top_k``.

    Doc: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md``.

    Mapping: ``score_func`` sigmoid / softmax -> ``norm_type`` 1 / 0; the group score
    (glmport: the best choice score without a bias, the sum of the best two with one)
    -> ``group_select_mode`` 0 / 1; ``n_group`` / ``topk_group`` -> ``group_count`` /
    ``k_group``; the bias passes as is (fp32 like the logits; the op adds it only for
    the choice, as glmport does). Ties: the page's reference code sorts stably, so equal
    group scores keep the lower group and equal choice scores the lower expert id,
    glmport's rule; the kernel's tie order is documented only through that code.

    Grouping that changes nothing is not requested (``topk_group == n_group``, or one
    expert per group: keeping the best ``topk_group >= top_k`` experts and taking the
    best ``top_k`` of them is the plain top-k). Groups the op refuses (2 experts, or
    over the 2048 aligned-size bound) are routed by the generic backend's
    device-neutral torch code instead.

    Weights: the op divides ``normOut[ids]`` by ``sum + eps`` only with the sigmoid,
    then scales. Where that matches glmport (sigmoid with ``norm_topk_prob``, softmax
    without) its ``y`` is the answer; otherwise ``normOut`` (``out_flag=True``, fp32)
    is gathered and normalised here with glmport's ``1e-20``.

    Args:
        logits: ``[T, E]`` float32, ``3 <= E <= 2048``. bias: ``[E]`` float32 or None.

    Returns:
        weights ``[T, top_k]`` float32, ids ``[T, top_k]`` int32, best first.
    """
    t, experts = logits.shape
    if t == 0:
        return logits.new_empty((0, top_k)), logits.new_empty((0, top_k), dtype=torch.int32)
    grouped = n_group > 1 and topk_group < n_group and experts // n_group > 1
    if grouped and not _op_groups(experts, n_group):
        why = f"cannot take {n_group} groups of {experts} experts in"
        log_fallback_once("ascend", "moe_gate", "generic", why)
        return _generic_moe_gate(
            logits,
            bias,
            top_k,
            n_group,
            topk_group,
            routed_scaling_factor,
            norm_topk_prob,
            score_func,
        )
    sigmoid = score_func == "sigmoid"
    fused_weights = sigmoid == norm_topk_prob
    y, ids, norm_out = npu.npu_moe_gating_top_k(
        logits,
        top_k,
        bias=bias,
        k_group=topk_group if grouped else 1,
        group_count=n_group if grouped else 1,
        group_select_mode=0 if bias is None else 1,
        renorm=0,
        norm_type=1 if sigmoid else 0,
        out_flag=not fused_weights,
        routed_scaling_factor=routed_scaling_factor if fused_weights else 1.0,
        eps=_EPS,
    )
    if fused_weights:
        return y, ids
    weights = norm_out.gather(1, ids.long())
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _EPS)
    return weights * routed_scaling_factor, ids


def moe_dispatch(
    npu: Any, x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """glmport ``moe_dispatch`` through ``npu_moe_init_routing_v2`` (drop-less).

    Doc: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md``.

    Mapping: the op sorts the flat copies ``t * k + j`` by expert with a stable sort (its
    page's reference code), exactly glmport's order, so ``expanded_x`` is ``x_sorted``.
    Checked ids (glmport's default validation) take the arguments of the page's fast
    templates: ``expert_num = E`` (GLM-5's 256), count mode (``expert_tokens_num_type=1``)
    and ``row_idx_type=1``, whose scatter index (sorted row -> flat copy) is ``src_row``
    itself. Counts (int64) become ``expert_offsets`` with a leading 0. The arguments also
    meet the older aclnnMoeInitRoutingV3 limits (``active_num = NUM_ROWS * K``, count
    mode, ``expert_tokens_num_flag=True``, ``quant_mode`` -1).

    Under GLMPORT_VALIDATE=meta an id outside ``[0, E)`` is not checked: it is set to
    ``E`` on the device and the op runs with ``E + 1`` experts, all active, so those
    copies sort after every expert's rows in ``t * k + j`` order, as glmport parks them,
    and the ``E + 1``-th count is left out of the offsets. The mode is read from
    glmport's settings (host-side, no sync).

    Args:
        x: ``[T, D]`` float32 | bfloat16 | float16, ``D >= 1``.
        ids: ``[T, k]`` int32 | int64. num_experts: ``E``, ``E + 1 <= 10240``.

    Returns:
        x_sorted ``[T*k, D]`` in x's dtype, expert_offsets ``[E + 1]`` int32, src_row
        ``[T*k]`` int32.
    """
    t, d = x.shape
    k = ids.shape[1]
    rows = t * k
    if rows == 0:
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
        return x.new_empty((0, d)), offsets, torch.empty(0, dtype=torch.int32, device=x.device)
    experts = num_experts
    expert_idx = ids.to(torch.int32)
    if not current_settings().validate_values:  # park unchecked ids on an extra expert
        experts = num_experts + 1
        expert_idx = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
        expert_idx = expert_idx.to(torch.int32)
    expanded_x, src_row, counts, _ = npu.npu_moe_init_routing_v2(
        x.contiguous(),
        expert_idx,
        active_num=rows,
        expert_num=experts,
        drop_pad_mode=0,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        quant_mode=-1,
        active_expert_range=[0, experts],
        row_idx_type=1,
    )
    offsets = torch.cat((counts.new_zeros(1), counts[:num_experts].cumsum(0))).to(torch.int32)
    return expanded_x, offsets, src_row


def moe_combine(
    npu: Any, y_sorted: torch.Tensor, src_row: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """glmport ``moe_combine`` through ``npu_moe_token_unpermute``.

    Doc: cann/ops-transformer ``moe/moe_token_unpermute/README.md`` (Atlas A2, A3 and
    Ascend 950). ``npu_moe_finalize_routing``, the other combine, is documented for A2
    only and rounds the routing weights to the rows' dtype (bf16: mean |dlogp| 0.017,
    max 0.51 on the tiny GLM-5's model check, measured under emulation, against 2e-7
    through this op in float32); vllm-ascend avoids it for
    accuracy and calls this op, as this adapter does on every generation.

    Mapping: the op wants, per token copy ``t * k + j`` (row-major), the row holding
    it: the inverse of ``src_row`` (``npu_moe_init_routing_v2``'s gather index). Rows
    and weights go in float32 (the op takes both in one dtype, see the emulator), so no
    weight is rounded; the float32 result is rounded once to ``y_sorted``'s dtype.

    Under GLMPORT_VALIDATE=meta glmport does not check that ``src_row`` is a
    permutation, and the op needs one (a repeated index is undefined). Then each slot
    takes the first row naming it, the rows no slot takes serve the slots no row names
    with weight 0, rows outside ``[0, T*k)`` are skipped, and the further rows of a
    repeated slot are added here in float32. The mode is read from glmport's settings
    (host-side, no sync) so checked calls do not pay that extra pass over ``y_sorted``.

    Args:
        y_sorted: ``[T*k, D]`` float32 | bfloat16 | float16. src_row: ``[T*k]`` int32 |
            int64. weights: ``[T, k]`` float32.

    Returns:
        ``[T, D]`` in y_sorted's dtype.
    """
    t, k = weights.shape
    d = y_sorted.shape[1]
    rows = t * k
    if rows == 0 or d == 0:
        return y_sorted.new_zeros((t, d))
    if not current_settings().validate_values:
        return _combine_unchecked(npu, y_sorted, src_row, weights)
    order = torch.arange(rows, dtype=torch.int32, device=src_row.device)
    dst = torch.empty_like(order).scatter_(0, src_row.long(), order)
    out = npu.npu_moe_token_unpermute(y_sorted.float(), dst, weights.float())
    return out.to(y_sorted.dtype)


def _combine_unchecked(
    npu: Any, y_sorted: torch.Tensor, src_row: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """:func:`moe_combine` for any ``src_row`` (docs/ops.md, meta mode): ``out[t] = sum
    over r with src_row[r] = t*k+j of weights[t, j] * y_sorted[r]``."""
    t, k = weights.shape
    rows = t * k
    src = src_row.long()
    slot = torch.where((src >= 0) & (src < rows), src, rows)
    # A stable sort groups each slot's rows in ascending order; the first of a group
    # goes through the op, the others (repeats) are added below.
    sorted_slot, order = torch.sort(slot, stable=True)
    lead = torch.ones_like(sorted_slot, dtype=torch.bool)
    lead[1:] = sorted_slot[1:] != sorted_slot[:-1]
    first = torch.full((rows + 1,), rows, dtype=torch.long, device=src.device)
    first = first.scatter_(0, torch.where(lead, sorted_slot, rows), order)[:rows]
    named = first < rows
    # The op needs a permutation: the rows no slot takes fill the unnamed slots in
    # order (there are as many), each with weight 0.
    taken = torch.zeros(rows + 1, dtype=torch.bool, device=src.device)
    taken[torch.where(named, first, rows)] = True
    spare = (~taken[:rows]).nonzero().squeeze(1)
    dst = first.clone()
    dst[(~named).nonzero().squeeze(1)] = spare
    scales = torch.where(named.view(t, k), weights, 0.0).float()
    out = npu.npu_moe_token_unpermute(y_sorted.float(), dst.to(torch.int32), scales)
    repeat_sorted = ~lead & (sorted_slot < rows)
    repeat = torch.zeros_like(repeat_sorted).scatter_(0, order, repeat_sorted)
    slot_of_repeat = slot.clamp(max=rows - 1)
    token = torch.where(repeat, slot_of_repeat // k, t)
    extra = torch.where(
        repeat[:, None], y_sorted.float() * weights.reshape(-1)[slot_of_repeat][:, None], 0.0
    )
    acc = torch.cat((out, out.new_zeros((1, out.shape[1]))))
    return acc.index_add(0, token, extra)[:t].to(y_sorted.dtype)
