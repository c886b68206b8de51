"""torch_npu's ``npu_grouped_matmul`` on the CPU, as documented for Atlas A2 / A3 (Ascend
910B / 910_93): the m-axis grouping of one ``x`` by one 3-D weight, in the float, int8
(per channel / per token) and weight-only (antiquant) modes of the doc's table 2. The
layouts and accumulation rules it shares with the other GEMMs are :mod:`.gemm_common`'s.

Calls outside the documented ranges raise :class:`NpuContractError`; documented modes
the emulator does not model (NZ weights, fused activations, multi-tensor lists) raise
NotImplementedError.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .contract import NpuContractError, require
from .gemm_common import (
    FLOATS,
    HALF,
    antiquant_weight,
    as_float,
    check_none,
    int4_weight,
    logical_kn,
    requantise_int8,
    transposed,
)

__all__ = ["npu_grouped_matmul"]

GROUPED_MATMUL_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md"
)
# "内轴限制InnerLimit为65536", the last dim of each x / weight "应小于".
GROUPED_INNER_LIMIT = 65536
GROUPED_MAX_GROUPS = 1024

_I8, _I32, _I64 = torch.int8, torch.int32, torch.int64
_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32


def _gmm_mode(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    antiquant_scale: torch.Tensor | None,
    antiquant_offset: torch.Tensor | None,
    per_token_scale: torch.Tensor | None,
    out: torch.dtype,
) -> str:
    """The row of the doc's table 2 (Tensor group_list, Atlas A2 / A3) the dtypes match:
    ``"float"``, ``"perchannel"``, ``"pertoken"`` or ``"antiquant"``; raises otherwise."""
    op = "npu_grouped_matmul"
    bias_t = None if bias is None else bias.dtype
    if x.dtype in FLOATS and w.dtype == x.dtype:
        want_bias = _F16 if x.dtype == _F16 else _F32
        ok = scale is None and antiquant_scale is None and per_token_scale is None
        require(ok, op, "a float GEMM takes no scale, antiquant_scale or per_token_scale")
        require(bias_t in (None, want_bias), op, f"bias must be {want_bias} for {x.dtype} x")
        require(out == x.dtype, op, f"output_dtype must be None or {x.dtype} for {x.dtype} x")
        return "float"
    if x.dtype == _I8 and w.dtype == _I8:
        require(antiquant_scale is None, op, "int8 x takes scale, not antiquant_scale")
        require(scale is not None, op, "int8 x and weight need scale")
        require(bias_t in (None, _I32), op, f"bias must be int32 for int8 x, got {bias_t}")
        if per_token_scale is None:
            allowed = {_I64: _I8, _BF16: _BF16, _F32: _F16}
            require(
                allowed.get(scale.dtype) == out,
                op,
                f"per-channel int8: scale int64 -> int8, bfloat16 -> bfloat16, float32 -> "
                f"float16 output; got scale {scale.dtype}, output {out}",
            )
            return "perchannel"
        require(
            per_token_scale.dtype == _F32,
            op,
            f"per_token_scale must be float32, got {per_token_scale.dtype}",
        )
        allowed = {_BF16: _BF16, _F32: _F16}
        require(
            allowed.get(scale.dtype) == out,
            op,
            f"per-token int8: scale bfloat16 -> bfloat16, float32 -> float16 output; got "
            f"scale {scale.dtype}, output {out}",
        )
        return "pertoken"
    if x.dtype == _I32 and w.dtype == _I32:
        raise NotImplementedError(f"{op}: int4 x int4 (NZ weight) is not emulated")
    if x.dtype in HALF and w.dtype in (_I8, _I32):
        require(antiquant_scale is not None, op, "weight-only quantisation needs antiquant_scale")
        require(scale is None and per_token_scale is None, op, "antiquant takes no scale")
        require(
            antiquant_scale.dtype == x.dtype,
            op,
            f"antiquant_scale must have x's dtype {x.dtype}, got {antiquant_scale.dtype}",
        )
        require(
            antiquant_offset is None or antiquant_offset.dtype == x.dtype,
            op,
            f"antiquant_offset must have x's dtype {x.dtype}",
        )
        want_bias = _F16 if x.dtype == _F16 else _F32
        require(bias_t in (None, want_bias), op, f"bias must be {want_bias} for {x.dtype} x")
        require(out == x.dtype, op, f"output_dtype must be None or {x.dtype}")
        return "antiquant"
    raise NpuContractError(
        f"{op}: x {x.dtype} with weight {w.dtype} is not a combination of the doc's table 2"
    )


def _group_bounds(group_list: torch.Tensor, group_list_type: int, m: int, e: int) -> list[int]:
    """Row bounds ``[0, end_0, ..., end_{E-1}]`` from a Tensor ``group_list``."""
    op = "npu_grouped_matmul"
    require(
        group_list.dtype == torch.int64, op, f"group_list must be int64, got {group_list.dtype}"
    )
    require(
        group_list_type in (0, 1, 2),
        op,
        f"group_list_type must be 0, 1 or 2, got {group_list_type}",
    )
    if group_list_type == 2:
        raise NotImplementedError(f"{op}: group_list_type 2 ([E, 2] pairs) is not emulated")
    require(group_list.dim() == 1, op, f"group_list must be 1-D, got {group_list.dim()} dims")
    require(
        group_list.shape[0] == e,
        op,
        f"group_list's length must equal the weight's group count {e}, got {group_list.shape[0]}",
    )
    require(
        e <= GROUPED_MAX_GROUPS, op, f"at most {GROUPED_MAX_GROUPS} groups (group_list), got {e}"
    )
    vals = group_list.tolist()  # the emulator reads the groups on the host
    require(all(v >= 0 for v in vals), op, f"group_list must be non-negative, got {vals}")
    if group_list_type == 0:
        require(
            all(b >= a for a, b in itertools.pairwise(vals)),
            op,
            f"group_list (cumsum, group_list_type 0) must be non-decreasing, got {vals}",
        )
        require(
            vals[-1] == m,
            op,
            f"group_list (cumsum)'s last value must equal x's first dim {m}, got {vals[-1]}",
        )
        return [0, *vals]
    require(e != 1, op, "group_list of counts (group_list_type 1) must not have length 1")
    require(
        sum(vals) == m,
        op,
        f"group_list (counts, group_list_type 1) must sum to x's first dim {m}, got {sum(vals)}",
    )
    bounds = [0]
    for v in vals:
        bounds.append(bounds[-1] + v)
    return bounds


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list: torch.Tensor | Sequence[int] | None = None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype: torch.dtype | None = None,
    tuning_config: Sequence[int] | None = None,
    x_dtype: torch.dtype | None = None,
    weight_dtype: torch.dtype | None = None,
    scale_dtype: torch.dtype | None = None,
    per_token_scale_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """``torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None,
    antiquant_scale=None, antiquant_offset=None, per_token_scale=None, group_list=None,
    activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
    split_item=0, group_type=None, group_list_type=0, act_type=0, output_dtype=None,
    tuning_config=None) -> List[Tensor]``.

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``.
    ``x_dtype``, ``weight_dtype``, ``scale_dtype`` and ``per_token_scale_dtype`` are in
    the schema (``op_plugin_functions.yaml``), not on the page: only None is taken.

    Emulated: the m-axis grouping (``group_type=0``) of one ``x`` ``[M, K]`` by one 3-D
    ``weight`` ``[E, K, N]`` into one ``y`` ``[M, N]`` (the doc's single-single-single
    scenario, ``split_item`` 2 or 3), with a Tensor ``group_list``: group ``e`` is rows
    ``[end_{e-1}, end_e)`` (``group_list_type`` 0: the cumulative ends; 1: the counts).
    Dtype modes of table 2 (A2 / A3): float (fp16 / bf16 / fp32); int8 x int8 per
    channel (``scale [E, N]``) or per token (``scale [E, N]``, ``per_token_scale [M]``);
    weight-only int8 / int4 (``antiquant_scale [E, N]`` per channel, ``[E, G, N]`` per
    group of ``K / G`` rows). The weight may be a transposed view (``[E, N, K]``
    contiguous, seen as ``[E, K, N]``); int4 weights are int32 ``[E, K, N // 8]`` or the
    transposed view of an ``[E, N, K // 8]``.

    Raises:
        NpuContractError: list lengths, dtypes outside table 2, ``split_item`` /
            ``group_type`` / ``group_list_type`` values, ``group_list`` not int64, not
            ``E`` long, decreasing, not ending at (summing to) ``M``, more than 1024
            groups, a transposed ``x``, an inner dim (K of ``x``; N of the weight, K
            when it is transposed) of 65536 or more, ``offset`` or the activation
            inputs not None, ``act_type`` 3 or outside 0-5, or an activation outside the
            per-token mode.
    """
    op = "npu_grouped_matmul"
    check_none(
        op,
        x_dtype=x_dtype,
        weight_dtype=weight_dtype,
        scale_dtype=scale_dtype,
        per_token_scale_dtype=per_token_scale_dtype,
        offset=offset,
        activation_input=activation_input,
        activation_quant_scale=activation_quant_scale,
        activation_quant_offset=activation_quant_offset,
    )
    require(
        0 < len(x) <= 128 and 0 < len(weight) <= 128,
        op,
        f"x and weight are lists of 1 to 128 tensors, got {len(x)} and {len(weight)}",
    )
    require(split_item in (0, 1, 2, 3), op, f"split_item must be 0-3, got {split_item}")
    require(
        group_type in (None, -1, 0, 2),
        op,
        f"group_type must be -1, 0 or 2 on Atlas A2 / A3, got {group_type}",
    )
    require(
        act_type in range(6) and act_type != 3, op, f"act_type must be 0-2, 4 or 5, got {act_type}"
    )
    if group_type != 0 or not isinstance(group_list, torch.Tensor):
        raise NotImplementedError(f"{op}: only group_type=0 with a Tensor group_list is emulated")
    if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3:
        raise NotImplementedError(
            f"{op}: only one x [M, K] with one 3-D weight [E, K, N] (single-single-single) is "
            "emulated"
        )
    require(
        split_item in (2, 3),
        op,
        f"group_type 0 with single x, weight and y needs split_item 2 or 3, got {split_item}",
    )
    xt, wt = x[0], weight[0]
    require(xt.dim() == 2, op, f"x must be 2-D [M, K], got {xt.dim()} dims")
    require(xt.stride(-1) == 1 or xt.shape[-1] == 1, op, "x must not be transposed (x不支持转置)")
    e = wt.shape[0]
    m = xt.shape[0]
    k_x = xt.shape[1] * (8 if xt.dtype == _I32 else 1)
    k, n = logical_kn(wt)
    require(k_x == k, op, f"x's K {k_x} must equal the weight's K {k}")
    inner = k if transposed(wt) else n
    require(
        k_x < GROUPED_INNER_LIMIT and inner < GROUPED_INNER_LIMIT,
        op,
        f"the last dims of x (K={k_x}) and weight ({'K' if transposed(wt) else 'N'}={inner}) "
        f"must be below the inner limit {GROUPED_INNER_LIMIT}",
    )
    lists = {
        "bias": bias,
        "scale": scale,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
    }
    one: dict[str, torch.Tensor | None] = {}
    for name, value in lists.items():
        require(
            value is None or len(value) == 1,
            op,
            f"{name} must have weight's list length 1, got {None if value is None else len(value)}",
        )
        one[name] = None if value is None else value[0]
    require(
        per_token_scale is None or len(per_token_scale) == 1,
        op,
        "per_token_scale must have x's list length 1",
    )
    pts = None if per_token_scale is None else per_token_scale[0]
    out = xt.dtype if output_dtype is None else output_dtype
    mode = _gmm_mode(
        xt, wt, one["bias"], one["scale"], one["antiquant_scale"], one["antiquant_offset"], pts, out
    )
    require(
        act_type == 0 or mode == "pertoken",
        op,
        "activations (act_type != 0) are computed only in the per-token quantised mode",
    )
    if act_type:
        raise NotImplementedError(f"{op}: fused activations (act_type {act_type}) are not emulated")
    bounds = _group_bounds(group_list, group_list_type, m, e)
    b = one["bias"]
    if b is not None:
        require(
            tuple(b.shape) == (e, n), op, f"bias must be [E, N] = [{e}, {n}], got {list(b.shape)}"
        )
    sc = one["scale"]
    if sc is not None:
        require(
            tuple(sc.shape) == (e, n),
            op,
            f"scale must be [E, N] = [{e}, {n}], got {list(sc.shape)}",
        )
    if pts is not None:
        require(
            tuple(pts.shape) == (m,),
            op,
            f"per_token_scale must be [M] = [{m}], got {list(pts.shape)}",
        )
    group = _check_antiquant(wt, one["antiquant_scale"], one["antiquant_offset"], e, k, n)
    y = torch.zeros(m, n, dtype=torch.float32)
    for g in range(e):
        r0, r1 = bounds[g], bounds[g + 1]
        if r1 == r0:
            continue
        rows = xt[r0:r1]
        if mode == "antiquant":
            we = wt[g]
            values = int4_weight(we) if we.dtype == _I32 else we.to(torch.int64)
            off = one["antiquant_offset"]
            w = antiquant_weight(
                values,
                one["antiquant_scale"][g].reshape(-1, n),
                None if off is None else off[g].reshape(-1, n),
                group,
                xt.dtype,
            )
            part = rows.float() @ w.float()
        elif mode == "float":
            part = rows.float() @ wt[g].float()
        else:
            acc = rows.to(torch.int64) @ wt[g].to(torch.int64)
            if b is not None:
                acc = acc + b[g].to(torch.int64)
            part = acc.to(torch.float32) * as_float(sc[g], op)
            if pts is not None:
                part = part * pts[r0:r1].float()[:, None]
        if b is not None and mode in ("float", "antiquant"):
            part = part + b[g].float()
        y[r0:r1] = part
    return [requantise_int8(y) if out == _I8 else y.to(out)]


def _check_antiquant(
    wt: torch.Tensor,
    scale: torch.Tensor | None,
    offset: torch.Tensor | None,
    e: int,
    k: int,
    n: int,
) -> int:
    """The K rows per scale group of a weight-only quantised ``wt`` (checked), or K."""
    op = "npu_grouped_matmul"
    if scale is None:
        return k
    if scale.dim() == 2:
        require(
            tuple(scale.shape) == (e, n),
            op,
            f"per-channel antiquant_scale must be [E, N] = [{e}, {n}], got {list(scale.shape)}",
        )
        group = k
    else:
        require(
            wt.dtype == _I32,
            op,
            "per-group antiquant needs an int4 weight (int8 weights are per-channel only)",
        )
        require(
            scale.dim() == 3 and scale.shape[0] == e and scale.shape[2] == n,
            op,
            f"per-group antiquant_scale must be [E, G, N] = [{e}, G, {n}], got {list(scale.shape)}",
        )
        groups = scale.shape[1]
        require(
            groups > 0 and k % groups == 0,
            op,
            f"the group count G={groups} must divide K={k}",
        )
        group = k // groups
        require(
            not transposed(wt) or group % 2 == 0,
            op,
            f"with a transposed int4 weight the group length K/G must be even, got {group}",
        )
    if wt.dtype == _I32:
        inner = k if transposed(wt) else n
        require(inner % 2 == 0, op, f"an int4 weight's last dim must be even, got {inner}")
    require(
        offset is None or offset.shape == scale.shape,
        op,
        "antiquant_offset must have antiquant_scale's shape",
    )
    return group
