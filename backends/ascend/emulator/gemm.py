"""torch_npu's quantised GEMMs on the CPU, as documented for Atlas A2 / A3 (Ascend 910B /
910_93): ``npu_quant_matmul``, ``npu_weight_quant_batchmatmul`` and
``npu_convert_weight_to_int4pack``; ``npu_grouped_matmul`` is in :mod:`.grouped_gemm`.
The layouts and accumulation rules the documents share are :mod:`.gemm_common`'s.

Calls outside the documented ranges raise :class:`NpuContractError`; documented modes
the emulator does not model (NZ weights, int64 scales with offsets) raise
NotImplementedError.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .contract import require
from .gemm_common import (
    HALF,
    antiquant_weight,
    as_float,
    check_none,
    int4_weight,
    logical_kn,
    pack_int4_values,
    requantise_int8,
    transposed,
    unpack_int32,
)

__all__ = [
    "npu_convert_weight_to_int4pack",
    "npu_quant_matmul",
    "npu_weight_quant_batchmatmul",
]

QUANT_MATMUL_DOC = "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_quant_matmul.md"
WEIGHT_QUANT_BMM_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md"
)
INT4PACK_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_convert_weight_to_int4pack.md"
)

# npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535"; npu_weight_quant_batchmatmul:
# "K、N的范围为[1, 65535]".
MAX_MATMUL_DIM = 65535


# -- npu_convert_weight_to_int4pack --------------------------------------------------


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """``torch_npu.npu_convert_weight_to_int4pack(weight, inner_k_tiles=0) -> Tensor``.

    Source: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_convert_weight_to_int4pack.md``; nibble
    order from op-plugin ``op_plugin/ops/opapi/ConvertWeightToINT4PackKernelNpuOpApi.cpp``
    (``convert_to_int4_pack``: the eight values of each int32 in bits 0, 4, ..., 28).
    The real op copies the weight to the host and back (a sync): a load-time call.

    Args:
        weight: int32 ``(k, n)`` or ``(n, k)``, contiguous, no empty dim, last dim a
            multiple of 8, values in ``[-8, 7]``.
        inner_k_tiles: reserved ("预留参数，暂未使用"), ignored.

    Returns:
        int32 ``weight.shape[:-1] + (last // 8,)`` (:func:`pack_int4_values` order).
    """
    op = "npu_convert_weight_to_int4pack"
    require(weight.dtype == torch.int32, op, f"weight must be int32, got {weight.dtype}")
    require(weight.dim() == 2, op, f"weight must be 2-D, got {weight.dim()} dims")
    require(weight.is_contiguous(), op, "weight must be contiguous (不支持非连续的Tensor)")
    require(
        all(s > 0 for s in weight.shape), op, f"weight dims must be > 0, got {list(weight.shape)}"
    )
    require(
        weight.shape[-1] % 8 == 0,
        op,
        f"weight's last dim must be a multiple of 8 (8 int4 per int32), got {weight.shape[-1]}",
    )
    require(
        bool(((weight >= -8) & (weight <= 7)).all()),
        op,
        "weight's values must lie in the int4 range [-8, 7]",
    )
    return pack_int4_values(weight)


# -- npu_quant_matmul ----------------------------------------------------------------

# Table 2 of the doc (Atlas A2 / A3): x1/x2 dtype, scale, offset, bias, pertoken_scale
# (None allowed where listed) -> output dtype. The int4 row with a float16 offset is the
# 2-D-scale per-group mode (emulated only as far as its checks).
_I8, _I32, _I64 = torch.int8, torch.int32, torch.int64
_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_QMM_TABLE = (
    (_I8, {_I64, _F32}, {None}, {_I32, None}, {None}, {_F16}),
    (_I8, {_I64, _F32}, {_F32, None}, {_I32, None}, {None}, {_I8}),
    (_I8, {_F32, _BF16}, {None}, {_I32, _BF16, _F32, None}, {_F32, None}, {_BF16}),
    (_I8, {_F32}, {None}, {_I32, _BF16, _F32, None}, {_F32}, {_F16}),
    (_I32, {_I64, _F32}, {None}, {_I32, None}, {None}, {_F16}),
    (_I32, {_F32}, {_F16}, {None}, {_F32}, {_BF16, _F16}),
    (_I8, {_F32, _BF16}, {None}, {_I32, None}, {None}, {_I32}),
)


def _in_row(combo: tuple, row: tuple) -> bool:
    return combo[0] == row[0] and all(v in ok for v, ok in zip(combo[1:], row[1:], strict=True))


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    x1_dtype: torch.dtype | None = None,
    x2_dtype: torch.dtype | None = None,
    pertoken_scale_dtype: torch.dtype | None = None,
    scale_dtype: torch.dtype | None = None,
    group_sizes: Sequence[int] | None = None,
    y_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch_npu.npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None,
    bias=None, output_dtype=None, group_sizes=None) -> Tensor`` (Atlas A2 / A3).

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_quant_matmul.md``.
    ``x1_dtype``, ``x2_dtype``, ``pertoken_scale_dtype``, ``scale_dtype`` and ``y_scale``
    are in the schema (``op_plugin_functions.yaml``) but not on the A2 / A3 page: only
    None is taken.

    ``out = (x1 @ x2 [+ int32 bias]) * scale [* pertoken_scale] [+ float bias] [+ offset]``
    with the integer product exact.

    Args:
        x1: int8 ``[..., m, k]``, or int32 ``(m, k // 8)`` contiguous (int4 x8).
        x2: ``x1``'s dtype; int8 ``[..., k, n]`` (any strides), or int32 ``(k, n // 8)``
            contiguous or the transpose of a contiguous ``(n, k // 8)``. 2-6 dims.
        scale: ``(1,)`` or ``(n,)``; float32 | bfloat16 | int64 (``npu_trans_quant_param``).
        offset: float32 ``(1,)`` / ``(n,)`` (int8 output only).
        pertoken_scale: float32 ``(m,)``.
        bias: ``(n,)`` (or ``(batch, 1, n)`` for a 3-D output); int32 | bf16 | fp16 | fp32.
        output_dtype: None (int8) | int8 | float16 | bfloat16 | int32; the dtype
            combinations of the doc's table 2.
        group_sizes: None or 3 non-negative ints (a granularity hint; the emulated modes
            are per-channel / per-token, so it does not change the result).

    Raises:
        NpuContractError: dtypes / combinations outside table 2, shapes, K or N above
            65535 ("x1与x2最后一维的shape大小不能超过65535", applied to the logical K and
            N, int4 values counted one each), non-contiguous int4 operands.
    """
    op = "npu_quant_matmul"
    check_none(
        op,
        x1_dtype=x1_dtype,
        x2_dtype=x2_dtype,
        pertoken_scale_dtype=pertoken_scale_dtype,
        scale_dtype=scale_dtype,
        y_scale=y_scale,
    )
    require(x1.dtype in (_I8, _I32), op, f"x1 must be int8 or int32 (int4 x8), got {x1.dtype}")
    require(x2.dtype == x1.dtype, op, f"x2 must have x1's dtype {x1.dtype}, got {x2.dtype}")
    for name, t in (("x1", x1), ("x2", x2)):
        require(2 <= t.dim() <= 6, op, f"{name} must have 2 to 6 dims, got {t.dim()}")
    if group_sizes is not None:
        require(
            len(group_sizes) == 3 and all(int(g) >= 0 for g in group_sizes),
            op,
            f"group_sizes must be 3 non-negative ints [group_m, group_n, group_k], got "
            f"{list(group_sizes)}",
        )
    out_dtype = _I8 if output_dtype is None else output_dtype
    combo = (
        x1.dtype,
        scale.dtype,
        None if offset is None else offset.dtype,
        None if bias is None else bias.dtype,
        None if pertoken_scale is None else pertoken_scale.dtype,
        out_dtype,
    )
    require(
        any(_in_row(combo, row) for row in _QMM_TABLE),
        op,
        "(x1, scale, offset, bias, pertoken_scale, output_dtype) dtypes "
        f"{tuple(str(v).removeprefix('torch.') for v in combo)} are not a combination of "
        "the doc's table 2 for Atlas A2 / A3",
    )
    if x1.dtype == _I32:
        require(
            x1.dim() == 2 and x1.is_contiguous(), op, "int4 x1 must be a contiguous (m, k // 8)"
        )
        require(
            x2.dim() == 2 and (x2.is_contiguous() or transposed(x2)),
            op,
            "int4 x2 must be a contiguous (k, n // 8) or the transpose of a contiguous (n, k // 8)",
        )
        a = unpack_int32(x1)
        b = int4_weight(x2)
        if offset is not None:
            raise NotImplementedError(f"{op}: the 2-D scale per-group int4 mode is not emulated")
    else:
        a, b = x1.to(torch.int64), x2.to(torch.int64)
    m, k = a.shape[-2], a.shape[-1]
    k2, n = b.shape[-2], b.shape[-1]
    require(k == k2, op, f"x1's k {k} must equal x2's k {k2}")
    require(
        k <= MAX_MATMUL_DIM and n <= MAX_MATMUL_DIM,
        op,
        f"the last dims of x1 and x2 (k={k}, n={n}) must not exceed {MAX_MATMUL_DIM}",
    )
    require(
        scale.dim() == 1 and scale.shape[0] in (1, n),
        op,
        f"scale must be 1-D (1,) or (n,) = ({n},), got {list(scale.shape)}",
    )
    if offset is not None:
        require(
            offset.dim() == 1 and offset.shape[0] in (1, n),
            op,
            f"offset must be 1-D (1,) or (n,) = ({n},), got {list(offset.shape)}",
        )
    if pertoken_scale is not None:
        require(
            pertoken_scale.dim() == 1 and pertoken_scale.shape[0] == m,
            op,
            f"pertoken_scale must be 1-D (m,) = ({m},), got {list(pertoken_scale.shape)}",
        )
    acc = torch.matmul(a, b)  # exact: int64 here, int32 on the chip
    if bias is not None:
        ok = (bias.dim() == 1 and bias.shape[0] == n) or (
            acc.dim() == 3 and tuple(bias.shape) == (acc.shape[0], 1, n)
        )
        require(
            ok,
            op,
            f"bias must be (n,) = ({n},), or (batch, 1, n) for a 3-D output, got "
            f"{list(bias.shape)}",
        )
    int_bias = bias is not None and bias.dtype == _I32
    if int_bias:
        acc = acc + bias.to(torch.int64)
    if out_dtype == _I32:
        return acc.to(torch.int32)
    y = acc.to(torch.float32) * as_float(scale, op)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float()[:, None]
    if bias is not None and not int_bias:
        y = y + bias.float()
    if offset is not None:
        y = y + offset.float()
    return requantise_int8(y) if out_dtype == _I8 else y.to(out_dtype)


# -- npu_weight_quant_batchmatmul ----------------------------------------------------


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
    weight_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale,
    antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
    antiquant_group_size=0, inner_precise=0) -> Tensor`` (Atlas A2 / A3, ND weights).

    Source: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md``.
    ``weight_dtype`` is in the schema (``op_plugin_functions.yaml``), not on the page:
    only None is taken.

    ``y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias``, the dequantised
    weight rounded to ``x``'s dtype, the product accumulated in float32; with
    ``quant_scale``: ``round((...) * quant_scale + quant_offset)`` to int8.

    Args:
        x: float16 | bfloat16 ``(M, K)`` (a transposed view allowed), not empty.
        weight: int8 ``(K, N)`` or int32 int4 x8 (``(K, N // 8)`` or the transpose of
            an ``(N, K // 8)``), 2-D, not empty. ``K, N`` in ``[1, 65535]``.
        antiquant_scale: ``x``'s dtype; ``(1,)`` / ``(1, 1)`` per tensor, ``(N,)`` /
            ``(1, N)`` per channel, ``(ceil(K / antiquant_group_size), N)`` per group
            (transposed views allowed). int64 scales are not emulated.
        antiquant_offset: ``antiquant_scale``'s shape and dtype.
        quant_scale, quant_offset: float32 ``(N,)`` / ``(1, N)`` / ``(1,)``; the offset
            only with a scale.
        bias: ``(N,)`` / ``(1, N)``; float32 for bf16 ``x``, float16 for fp16 ``x``.
        antiquant_group_size: 0, or per group a multiple of 32 in ``[32, K - 1]``.
        inner_precise: 0 (high precision) or 1 (high performance; same result here).

    Returns:
        ``(M, N)`` in ``x``'s dtype, int8 with ``quant_scale``.
    """
    op = "npu_weight_quant_batchmatmul"
    check_none(op, weight_dtype=weight_dtype)
    require(x.dtype in HALF, op, f"x must be float16 or bfloat16, got {x.dtype}")
    require(x.dim() == 2, op, f"x must be 2-D (M, K), got {x.dim()} dims")
    require(
        weight.dtype in (_I8, _I32), op, f"weight must be int8 or int32 (int4), got {weight.dtype}"
    )
    require(weight.dim() == 2, op, f"weight must be 2-D (K, N), got {weight.dim()} dims")
    require(x.numel() > 0 and weight.numel() > 0, op, "empty tensors are not supported")
    k, n = logical_kn(weight)
    require(x.shape[1] == k, op, f"x's K {x.shape[1]} must equal weight's K {k}")
    require(
        1 <= k <= MAX_MATMUL_DIM and 1 <= n <= MAX_MATMUL_DIM,
        op,
        f"K and N must lie in [1, {MAX_MATMUL_DIM}], got K={k}, N={n}",
    )
    if antiquant_scale.dtype == _I64:
        raise NotImplementedError(f"{op}: int64 antiquant_scale is not emulated")
    require(
        antiquant_scale.dtype == x.dtype,
        op,
        f"antiquant_scale must have x's dtype {x.dtype}, got {antiquant_scale.dtype}",
    )
    shape = tuple(antiquant_scale.shape)
    group = antiquant_group_size
    if group:
        require(
            group % 32 == 0 and 32 <= group <= k - 1,
            op,
            f"antiquant_group_size must be a multiple of 32 in [32, K-1] = [32, {k - 1}], "
            f"got {group}",
        )
        want = (-(-k // group), n)
        require(
            shape == want,
            op,
            f"per-group antiquant_scale must be (ceil(K / group), N) = {want}, got {list(shape)}",
        )
    else:
        require(
            shape in ((1,), (1, 1), (n,), (1, n)),
            op,
            f"antiquant_scale must be (1,), (1, 1), (N,) or (1, N) with N={n} (per group: "
            f"set antiquant_group_size), got {list(shape)}",
        )
    if antiquant_offset is not None:
        require(
            tuple(antiquant_offset.shape) == shape and antiquant_offset.dtype == x.dtype,
            op,
            f"antiquant_offset must match antiquant_scale ({list(shape)}, {x.dtype}), got "
            f"{list(antiquant_offset.shape)} {antiquant_offset.dtype}",
        )
    require(
        quant_offset is None or quant_scale is not None,
        op,
        "quant_offset needs quant_scale",
    )
    for name, t in (("quant_scale", quant_scale), ("quant_offset", quant_offset)):
        if t is None:
            continue
        if t.dtype == _I64:
            raise NotImplementedError(f"{op}: int64 {name} is not emulated")
        require(t.dtype == _F32, op, f"{name} must be float32, got {t.dtype}")
        require(
            tuple(t.shape) in ((n,), (1, n), (1,)),
            op,
            f"{name} must be (N,), (1, N) or (1,) with N={n}, got {list(t.shape)}",
        )
    if bias is not None:
        want_dtype = _F32 if x.dtype == _BF16 else _F16
        require(
            bias.dtype == want_dtype,
            op,
            f"bias must be {want_dtype} for {x.dtype} x, got {bias.dtype}",
        )
        require(
            tuple(bias.shape) in ((n,), (1, n)),
            op,
            f"bias must be (N,) or (1, N) with N={n}, got {list(bias.shape)}",
        )
    require(inner_precise in (0, 1), op, f"inner_precise must be 0 or 1, got {inner_precise}")
    values = int4_weight(weight) if weight.dtype == _I32 else weight.to(torch.int64)
    s2 = antiquant_scale.reshape(-1, antiquant_scale.shape[-1])
    o2 = None if antiquant_offset is None else antiquant_offset.reshape(s2.shape)
    w = antiquant_weight(values, s2, o2, group or k, x.dtype)
    y = x.float() @ w.float()
    if bias is not None:
        y = y + bias.float().reshape(-1)
    if quant_scale is None:
        return y.to(x.dtype)
    y = y * quant_scale.float().reshape(-1)
    if quant_offset is not None:
        y = y + quant_offset.float().reshape(-1)
    return requantise_int8(y)
