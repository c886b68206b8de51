"""CPU emulation of torch_npu's MoE routing ops: ``npu_moe_gating_top_k`` (router),
``npu_moe_init_routing_v2`` (token permutation by expert) and ``npu_moe_token_unpermute``
(weighted un-permutation).

Each function follows its documentation page (torch_npu's in Ascend/op-plugin,
``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``, the same pages under
``docs/context/`` in older releases; CANN ops-transformer's where torch_npu has none):
the argument names, defaults and output tuples, the "equivalent computation"
reference code those pages give (their stable sorts fix every tie to the lower index),
and a :class:`NpuContractError` wherever the page states a constraint. Arithmetic is
float32, outputs in the documented dtypes. Output elements the real op leaves
unwritten (documented as "uninitialised" or "meaningless") are NaN for floating
tensors and the dtype's minimum for integer ones, so a caller that reads them is
caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .contract import require, unwritten

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# npu_moe_gating_top_k: "x_shape[-1] ... 不大于2048" (the expert count, also the bound on
# group_count * the group size aligned to 32).
_GATING_MAX_EXPERTS = 2048
_GATING_ALIGN = 32

# npu_moe_init_routing_v2: expert_num ranges, "key_value模式时取值范围为[0, 5120]；其他模式
# 取值范围为[0, 10240]".
_ROUTING_MAX_EXPERTS = 10240
_ROUTING_MAX_EXPERTS_KEY_VALUE = 5120
# Every quant_mode the page lists (-1 no quantisation; the others quantise expanded_x).
_QUANT_MODES = (-1, 0, 1, 2, 3, 6, 7, 8, 9, 11, 12, 13, 16, 17)


# -- npu_moe_gating_top_k -----------------------------------------------------------


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_moe_gating_top_k``: group-limited top-k MoE router.

    Doc: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md``
    (aclnn: hicann/ops-transformer ``moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md``).
    The newest page adds hash-mode ``input_ids`` / ``tid2eid`` arguments; they are not
    emulated.

    ``normOut = softmax(x)`` (``norm_type`` 0) or ``sigmoid(x)`` (1); the choice uses
    ``normOut + bias``. With ``group_count > 1`` the ``E`` experts form ``group_count``
    contiguous groups scored by their best choice value (``group_select_mode`` 0) or
    the sum of their best two (1); the best ``k_group`` groups are kept (stable sort:
    equal scores keep the lower group) and the ``k`` best experts inside them chosen
    (stable: the lower id first). ``y = normOut[expert_idx]``, divided by
    ``sum(y) + eps`` only with the sigmoid (the page's reference code renormalises
    ``norm_type`` 1 alone), times ``routed_scaling_factor``.

    Args:
        x: ``[T, E]`` float16 | bfloat16 | float32 router logits, ``E <= 2048``.
        k: experts per token, ``1 <= k <= E / group_count * k_group``.
        bias: ``[E]`` in ``x``'s dtype, or None; it affects only the choice.

    Returns:
        y ``[T, k]`` in ``x``'s dtype; expert_idx ``[T, k]`` int32, best first;
        normOut ``[T, E]`` float32 (written only when ``out_flag``).
    """
    op = "npu_moe_gating_top_k"
    require(x.dim() == 2, op, f"x must be 2D [T, E], got shape {tuple(x.shape)}")
    require(x.dtype in _FLOATS, op, f"x must be float16, bfloat16 or float32, got {x.dtype}")
    t, e = x.shape
    require(e <= _GATING_MAX_EXPERTS, op, f"x.shape[-1] (experts) must be <= 2048, got {e}")
    if bias is not None:
        require(bias.dim() == 1 and bias.shape[0] == e, op, f"bias must be 1D of shape [{e}]")
        require(bias.dtype == x.dtype, op, f"bias dtype {bias.dtype} must equal x's {x.dtype}")
    require(group_count > 0, op, f"group_count must be > 0, got {group_count}")
    require(e % group_count == 0, op, f"x.shape[-1]={e} must be divisible by group_count")
    per_group = e // group_count
    # The torch_npu page: the quotient "大于2". The CANN 8.5 aclnnMoeGatingTopK page says
    # "大于groupSelectMode" and the kernel's tiling checks >= 1 (>= 2 with mode 1); the
    # docs disagree, and the torch_npu page's bound is the one enforced here.
    require(per_group > 2, op, f"x.shape[-1] / group_count must be > 2, got {per_group}")
    aligned = -(-per_group // _GATING_ALIGN) * _GATING_ALIGN * group_count
    require(
        aligned <= _GATING_MAX_EXPERTS,
        op,
        f"x.shape[-1] / group_count aligned to 32, times group_count, must be <= 2048, "
        f"got {aligned}",
    )
    require(
        1 <= k_group <= group_count,
        op,
        f"k_group must be in [1, group_count={group_count}], got {k_group}",
    )
    require(
        1 <= k <= per_group * k_group,
        op,
        f"k must be in [1, x.shape[-1] / group_count * k_group = {per_group * k_group}], got {k}",
    )
    require(
        group_select_mode in (0, 1),
        op,
        f"group_select_mode must be 0 or 1, got {group_select_mode}",
    )
    require(renorm == 0, op, f"renorm only supports 0 (norm before top-k), got {renorm}")
    require(
        norm_type in (0, 1), op, f"norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}"
    )

    xf = x.float()
    norm_out = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, dim=-1)
    choice = norm_out if bias is None else norm_out + bias.float()
    if group_count > 1:
        grouped = choice.view(t, group_count, per_group)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.sort(group_score, dim=1, descending=True, stable=True).indices[:, :k_group]
        keep = torch.zeros(t, group_count, dtype=torch.bool).scatter(1, kept, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)
    expert_idx = torch.sort(choice, dim=1, descending=True, stable=True).indices[:, :k]
    y = norm_out.gather(1, expert_idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm_out if out_flag else unwritten((t, e), torch.float32)
    return y.to(x.dtype), expert_idx.to(torch.int32), out


# -- npu_moe_init_routing_v2 --------------------------------------------------------


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_moe_init_routing_v2``: sort the ``NUM_ROWS * K`` token copies by
    expert and gather their rows.

    Doc: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md``
    (aclnn: hicann/ops-transformer ``moe/moe_init_routing_v3/docs/aclnnMoeInitRoutingV3.md``).
    Only ``quant_mode=-1`` (no quantisation) is emulated (Atlas A2 / A3 behaviour).

    The copies, flat index ``r = t * K + j`` (row-major ``expert_idx``), are sorted by
    expert id with a STABLE sort (the page's reference code: ``argsort(kind="stable")``),
    so inside an expert they keep ascending ``r``; ids below ``expert_start`` sort last,
    ids from ``expert_end`` on after the active ones. ``available`` = the copies whose id
    is in ``[expert_start, expert_end)``.

    - ``expanded_row_idx``: ``row_idx_type`` 0 ("gather" index) maps source to
      destination, ``expanded_row_idx[sorted_row_idx[i]] = i`` for the available
      copies and -1 for the others; ``row_idx_type`` 1 ("scatter" index) maps
      destination to source, ``expanded_row_idx[i] = sorted_row_idx[i]``, the first
      ``available`` entries valid and the rest uninitialised.
    - ``expanded_x[i] = x[sorted_row_idx[i] // K]`` (drop-less: ``[NUM_ROWS * K, H]``,
      or ``min(active_num, NUM_ROWS * K)`` rows when ``active_num > 0``; rows past
      ``available`` unwritten). Drop/pad (``drop_pad_mode`` 1): ``[expert_num,
      expert_capacity, H]``, each expert's first ``expert_capacity`` copies, the rest
      dropped (their ``expanded_row_idx`` -1), zero padding.
    - ``expert_tokens_count_or_cumsum`` (int64, only with ``expert_tokens_num_flag``):
      per active expert the cumulative count (type 0), the count (type 1), or
      ``[expert_num, 2]`` rows ``(expert id, count)`` of the experts with copies, then
      zeros (type 2); counts before any capacity drop.
    - ``expanded_scale`` (float32): ``scale[sorted_row_idx[i] // K]`` when a 1D
      ``scale`` is given, else meaningless.
    """
    op = "npu_moe_init_routing_v2"
    require(x.dim() == 2, op, f"x must be 2D (NUM_ROWS, H), got shape {tuple(x.shape)}")
    require(
        x.dtype in (*_FLOATS, torch.int8),
        op,
        f"x must be float16, bfloat16, float32 or int8, got {x.dtype}",
    )
    require(expert_idx.dim() == 2, op, "expert_idx must be 2D (NUM_ROWS, K)")
    require(
        expert_idx.dtype == torch.int32, op, f"expert_idx must be int32, got {expert_idx.dtype}"
    )
    require(
        expert_idx.shape[0] == x.shape[0],
        op,
        f"expert_idx rows {expert_idx.shape[0]} must equal x's NUM_ROWS {x.shape[0]}",
    )
    require(drop_pad_mode in (0, 1), op, f"drop_pad_mode must be 0 or 1, got {drop_pad_mode}")
    require(
        expert_tokens_num_type in (0, 1, 2),
        op,
        f"expert_tokens_num_type must be 0 (cumsum), 1 (count) or 2 (key_value), "
        f"got {expert_tokens_num_type}",
    )
    require(row_idx_type in (0, 1), op, f"row_idx_type must be 0 or 1, got {row_idx_type}")
    require(quant_mode in _QUANT_MODES, op, f"quant_mode {quant_mode} is not a documented mode")
    limit = _ROUTING_MAX_EXPERTS_KEY_VALUE if expert_tokens_num_type == 2 else _ROUTING_MAX_EXPERTS
    require(
        0 <= expert_num <= limit,
        op,
        f"expert_num must be in [0, {limit}] with expert_tokens_num_type="
        f"{expert_tokens_num_type}, got {expert_num}",
    )
    span = list(active_expert_range) or [0, expert_num]
    require(len(span) == 2, op, "active_expert_range must hold [expert_start, expert_end]")
    start, end = span
    require(
        start >= 0 and 0 <= end <= expert_num,
        op,
        f"active_expert_range values must be >= 0 and expert_end <= expert_num={expert_num}, "
        f"got {span}",
    )
    n_rows, k = expert_idx.shape
    total = n_rows * k
    if drop_pad_mode == 0:
        require(
            active_num >= -1, op, f"active_num must be >= -1 without drop/pad, got {active_num}"
        )
    else:
        require(
            0 < expert_capacity < n_rows,
            op,
            f"expert_capacity must be > 0 and < NUM_ROWS={n_rows} with drop/pad, "
            f"got {expert_capacity}",
        )
        require(
            [start, end] == [0, expert_num],
            op,
            "with drop/pad, active_expert_range must be [0, expert_num]",
        )
    if quant_mode != -1:
        raise NotImplementedError(f"{op}: the emulator does not model quant_mode={quant_mode}")
    require(offset is None, op, "offset must be None without quantisation (quant_mode=-1)")
    if scale is not None:
        require(
            scale.dtype == torch.float32 and scale.dim() == 1 and scale.shape[0] == n_rows,
            op,
            f"without quantisation scale must be float32 of shape (NUM_ROWS,)=({n_rows},)",
        )
    flat = expert_idx.reshape(-1).long()
    require(
        bool(((flat >= 0) & (flat < expert_num)).all()),
        op,
        f"expert ids must name one of the expert_num={expert_num} experts",
    )

    key = torch.where(flat < start, torch.iinfo(torch.int32).max, flat)
    sorted_key, order = torch.sort(key, stable=True)
    active = (sorted_key >= start) & (sorted_key < end)
    available = int(active.sum())
    counts = torch.bincount(sorted_key[:available] - start, minlength=end - start)

    if drop_pad_mode == 0:
        n_out = total if active_num in (-1, 0) else min(active_num, total)
        n_valid = min(n_out, available)
        src = order[:n_valid]
        expanded_x = unwritten((n_out, x.shape[1]), x.dtype)
        expanded_x[:n_valid] = x[src // k]
        expanded_scale = unwritten((n_out,), torch.float32)
        if scale is not None:
            expanded_scale[:n_valid] = scale[src // k]
        if row_idx_type == 1:
            expanded_row_idx = unwritten((total,), torch.int32)
            expanded_row_idx[:available] = order[:available].to(torch.int32)
        else:
            expanded_row_idx = torch.full((total,), -1, dtype=torch.int32)
            expanded_row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
    else:
        # The rank of each sorted copy inside its expert: copies past the capacity drop.
        first_of_expert = torch.cumsum(counts, 0) - counts
        rank = torch.arange(available) - first_of_expert[sorted_key[:available]]
        kept = rank < expert_capacity
        slot = sorted_key[:available][kept] * expert_capacity + rank[kept]
        src = order[:available][kept]
        expanded_x = torch.zeros(expert_num * expert_capacity, x.shape[1], dtype=x.dtype)
        expanded_x[slot] = x[src // k]
        expanded_x = expanded_x.view(expert_num, expert_capacity, x.shape[1])
        expanded_scale = torch.zeros(expert_num * expert_capacity, dtype=torch.float32)
        if scale is not None:
            expanded_scale[slot] = scale[src // k]
        expanded_row_idx = torch.full((total,), -1, dtype=torch.int32)
        expanded_row_idx[src] = slot.to(torch.int32)

    if not expert_tokens_num_flag:
        shape = (expert_num, 2) if expert_tokens_num_type == 2 else (end - start,)
        tokens = unwritten(shape, torch.int64)
    elif expert_tokens_num_type == 0 and drop_pad_mode == 0:
        tokens = counts.cumsum(0)
    elif expert_tokens_num_type == 2 and drop_pad_mode == 0:
        ids = torch.nonzero(counts).reshape(-1)
        tokens = torch.zeros(expert_num, 2, dtype=torch.int64)
        tokens[: ids.numel(), 0] = ids + start
        tokens[: ids.numel(), 1] = counts[ids]
    else:  # count mode (the page's reference code counts in every drop/pad call)
        tokens = counts
    return expanded_x, expanded_row_idx, tokens.to(torch.int64), expanded_scale


# -- npu_moe_token_unpermute --------------------------------------------------------


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch_npu.npu_moe_token_unpermute``: the weighted inverse of a permutation.

    Doc: cann/ops-transformer ``moe/moe_token_unpermute/README.md`` and
    ``docs/aclnnMoeTokenUnpermute.md`` (Atlas A2, A3 and Ascend 950; the CANN 8.2 page
    listed A2 only), with MindSpore's mirror ``mindspore.ops.moe_token_unpermute``.

    ``out[i] = sum_j probs[i, j] * permuted_tokens[sorted_indices[i * topK + j]]``:
    ``sorted_indices`` maps each token copy (row-major ``[tokens, topK]``) to the row
    holding it. Without ``probs``, ``topK = 1`` and ``out[i] = permuted_tokens[S[i]]``.
    Computed in float32, returned in ``permuted_tokens``' dtype.

    Constraints (the pages): ``permuted_tokens`` 2-D ``[tokens * topK, H]`` and
    ``probs`` ``[tokens, topK]``, each float16 | bfloat16 | float32; ``sorted_indices``
    1-D int32 with one entry per row, each a row index; ``padded_mode`` only False and
    ``restore_shape`` only None. Two assumptions, stricter than the pages: ``probs`` in
    ``permuted_tokens``' dtype (the pages state no mixed rule; MindSpore's and
    MindSpeed-MM's callers cast the tokens to the probs' dtype first), and an index
    listed twice, documented as an undefined result, gives NaN rows here.
    """
    op = "npu_moe_token_unpermute"
    require(not padded_mode, op, "padded_mode supports only False")
    require(restore_shape is None, op, "restore_shape supports only None")
    tokens = permuted_tokens
    require(tokens.dtype in _FLOATS, op, f"permuted_tokens dtype {tokens.dtype} unsupported")
    require(tokens.dim() == 2, op, f"permuted_tokens must be 2D, got {tuple(tokens.shape)}")
    require(tokens.numel() > 0, op, "permuted_tokens must not be empty")
    rows = tokens.shape[0]
    require(
        sorted_indices.dtype == torch.int32 and tuple(sorted_indices.shape) == (rows,),
        op,
        f"sorted_indices must be 1D int32 with {rows} entries (one per permuted row)",
    )
    if probs is None:
        top_k = 1
    else:
        require(probs.dtype in _FLOATS, op, f"probs dtype {probs.dtype} unsupported")
        require(
            probs.dtype == tokens.dtype,
            op,
            f"probs must have permuted_tokens' dtype {tokens.dtype}, got {probs.dtype}",
        )
        require(
            probs.dim() == 2 and probs.numel() == rows,
            op,
            f"probs must be 2D (tokens, topK) with tokens * topK = {rows} entries, "
            f"got {tuple(probs.shape)}",
        )
        top_k = probs.shape[1]
    src = sorted_indices.long()
    require(
        bool(((src >= 0) & (src < rows)).all()),
        op,
        f"sorted_indices values must be row indices in [0, {rows - 1}]",
    )
    picked = tokens.float()[src].reshape(rows // top_k, top_k, -1)
    weight = torch.ones(rows // top_k, top_k) if probs is None else probs.float()
    out = (weight[..., None] * picked).sum(dim=1)
    repeated = torch.bincount(src, minlength=rows)[src] > 1
    out[repeated.reshape(-1, top_k).any(dim=1)] = float("nan")  # documented: undefined
    return out.to(tokens.dtype)
