"""torch_npu's quantised and grouped GEMMs on the CPU, as documented for Atlas A2 / A3
(Ascend 910B / 910_93): ``npu_quant_matmul``, ``npu_weight_quant_batchmatmul``,
``npu_convert_weight_to_int4pack`` and ``npu_grouped_matmul``.

Conventions the documents share, reproduced here:

* Weights are ``[K, N]`` (``x @ weight``), never glmport's ``[N, K]``; a weight may be
  passed as the transpose of a contiguous ``[N, K]`` tensor (a view whose second-last
  dim has stride 1).
* int4 weights travel as int32, eight values per element (``pack_int4_values``: value
  ``8i + j`` in bits ``4j``), packed along the LAST dim of the stored tensor: an
  ``[K, N // 8]`` int32 tensor, or the transpose of an ``[N, K // 8]`` one (shape
  ``[K // 8, N]``, K then packed).
* Integer products accumulate exactly (int32 on the chip, int64 here); dequantisation
  and float GEMMs accumulate in float32 and round once to the output dtype. Weight-only
  (antiquant) GEMMs dequantise the weight into ``x``'s dtype before the matmul, as the
  Cube unit multiplies fp16 / bf16 operands.

Calls outside the documented ranges raise :class:`NpuContractError`; documented modes
the emulator does not model (NZ weights, int64 scales with offsets, fused
activations, multi-tensor lists of ``npu_grouped_matmul``) raise NotImplementedError.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .contract import NpuContractError, require

__all__ = [
    "npu_convert_weight_to_int4pack",
    "npu_grouped_matmul",
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
GROUPED_MATMUL_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md"
)

# npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535"; npu_weight_quant_batchmatmul:
# "K、N的范围为[1, 65535]".
MAX_MATMUL_DIM = 65535
# npu_grouped_matmul: "内轴限制InnerLimit为65536", the last dim of each x / weight "应小于".
GROUPED_INNER_LIMIT = 65536
GROUPED_MAX_GROUPS = 1024

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# -- shared helpers ------------------------------------------------------------------


def pack_int4_values(values: torch.Tensor) -> torch.Tensor:
    """Integer values in ``[-8, 7]`` ``[..., C]`` (``C % 8 == 0``) -> int32
    ``[..., C // 8]``: value ``8i + j`` in bits ``4j .. 4j + 3`` of element ``i``, each
    nibble two's complement. This is torch_npu's int32-carries-eight-int4 layout
    (op-plugin ``ConvertWeightToINT4PackKernelNpuOpApi.cpp`` ``convert_to_int4_pack``,
    and the reference packer of ``test/test_custom_ops/test_npu_convert_weight_to_int4pack.py``).
    Read as little-endian bytes it is two values a byte, the even one in the low nibble:
    glmport's ``int4_group`` packing."""
    nib = values.to(torch.int64) & 0xF
    groups = nib.reshape(*nib.shape[:-1], nib.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (groups << shifts).sum(dim=-1)
    # Wrap the unsigned 32-bit word into int32's two's complement range.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _transposed(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are a transposed view (how torch_npu tells a
    transposed weight: the second-last dim is the contiguous one)."""
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1


def _unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C // 8]`` -> int64 values ``[..., C]`` in ``[-8, 7]``
    (the inverse of :func:`pack_int4_values`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    values = nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
    return torch.where(values >= 8, values - 16, values)


def _int4_weight(w: torch.Tensor) -> torch.Tensor:
    """The int64 ``[..., K, N]`` values of an int32 int4 weight: ``[..., K, N // 8]``
    packed along N, or the transposed view ``[..., K // 8, N]`` of an ``[..., N, K // 8]``
    tensor packed along K."""
    if _transposed(w):
        return _unpack_int32(w.transpose(-1, -2)).transpose(-1, -2)
    return _unpack_int32(w)


def _logical_kn(w: torch.Tensor) -> tuple[int, int]:
    """``(K, N)`` of a weight ``[..., K, N]``, int4 in int32 counted in int4 values."""
    k, n = w.shape[-2], w.shape[-1]
    if w.dtype != torch.int32:
        return k, n
    return (k * 8, n) if _transposed(w) else (k, n * 8)


def _decode_int64_scale(scale: torch.Tensor, op: str) -> torch.Tensor:
    """float32 values of an int64 scale from ``npu_trans_quant_param`` (the float32 bits
    in the low 32 bits; the high bits carry an offset, which is not emulated)."""
    bits = scale.to(torch.int64)
    if bool((bits >> 32).any()):
        raise NotImplementedError(f"{op}: int64 scales carrying an offset are not emulated")
    return bits.to(torch.int32).view(torch.float32)


def _as_float(scale: torch.Tensor, op: str) -> torch.Tensor:
    if scale.dtype == torch.int64:
        return _decode_int64_scale(scale, op)
    return scale.float()


def _requantise_int8(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def _check_none(op: str, **kwargs: object) -> None:
    for name, value in kwargs.items():
        require(value is None, op, f"{name} is not documented for Atlas A2 / A3: pass None")


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
    _check_none(
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
            x2.dim() == 2 and (x2.is_contiguous() or _transposed(x2)),
            op,
            "int4 x2 must be a contiguous (k, n // 8) or the transpose of a contiguous (n, k // 8)",
        )
        a = _unpack_int32(x1)
        b = _int4_weight(x2)
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
    y = acc.to(torch.float32) * _as_float(scale, op)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float()[:, None]
    if bias is not None and not int_bias:
        y = y + bias.float()
    if offset is not None:
        y = y + offset.float()
    return _requantise_int8(y) if out_dtype == _I8 else y.to(out_dtype)


# -- npu_weight_quant_batchmatmul ----------------------------------------------------


def _antiquant_weight(
    values: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``(w + offset) * scale`` of ``values`` ``[K, N]``, in ``dtype`` (the Cube unit's
    operand dtype). ``scale`` / ``offset`` ``[G, N]`` (``G`` groups of ``group`` rows
    along K, the last possibly short) or broadcastable ``[1, N]`` / ``[1, 1]``."""
    k = values.shape[0]
    s = scale.float()
    o = None if offset is None else offset.float()
    if s.shape[0] > 1:
        s = s.repeat_interleave(group, dim=0)[:k]
        o = None if o is None else o.repeat_interleave(group, dim=0)[:k]
    w = values.to(torch.float32)
    if o is not None:
        w = (w + o).to(dtype).float()
    return (w * s).to(dtype)


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
    _check_none(op, weight_dtype=weight_dtype)
    require(x.dtype in _HALF, op, f"x must be float16 or bfloat16, got {x.dtype}")
    require(x.dim() == 2, op, f"x must be 2-D (M, K), got {x.dim()} dims")
    require(
        weight.dtype in (_I8, _I32), op, f"weight must be int8 or int32 (int4), got {weight.dtype}"
    )
    require(weight.dim() == 2, op, f"weight must be 2-D (K, N), got {weight.dim()} dims")
    require(x.numel() > 0 and weight.numel() > 0, op, "empty tensors are not supported")
    k, n = _logical_kn(weight)
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
    values = _int4_weight(weight) if weight.dtype == _I32 else weight.to(torch.int64)
    s2 = antiquant_scale.reshape(-1, antiquant_scale.shape[-1])
    o2 = None if antiquant_offset is None else antiquant_offset.reshape(s2.shape)
    w = _antiquant_weight(values, s2, o2, group or k, x.dtype)
    y = x.float() @ w.float()
    if bias is not None:
        y = y + bias.float().reshape(-1)
    if quant_scale is None:
        return y.to(x.dtype)
    y = y * quant_scale.float().reshape(-1)
    if quant_offset is not None:
        y = y + quant_offset.float().reshape(-1)
    return _requantise_int8(y)


# -- npu_grouped_matmul --------------------------------------------------------------


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
    if x.dtype in _FLOATS and w.dtype == x.dtype:
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
    if x.dtype in _HALF and w.dtype in (_I8, _I32):
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
    _check_none(
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
    k, n = _logical_kn(wt)
    require(k_x == k, op, f"x's K {k_x} must equal the weight's K {k}")
    inner = k if _transposed(wt) else n
    require(
        k_x < GROUPED_INNER_LIMIT and inner < GROUPED_INNER_LIMIT,
        op,
        f"the last dims of x (K={k_x}) and weight ({'K' if _transposed(wt) else 'N'}={inner}) "
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
            values = _int4_weight(we) if we.dtype == _I32 else we.to(torch.int64)
            off = one["antiquant_offset"]
            w = _antiquant_weight(
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
            part = acc.to(torch.float32) * _as_float(sc[g], op)
            if pts is not None:
                part = part * pts[r0:r1].float()[:, None]
        if b is not None and mode in ("float", "antiquant"):
            part = part + b[g].float()
        y[r0:r1] = part
    return [_requantise_int8(y) if out == _I8 else y.to(out)]


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
            not _transposed(wt) or group % 2 == 0,
            op,
            f"with a transposed int4 weight the group length K/G must be even, got {group}",
        )
    if wt.dtype == _I32:
        inner = k if _transposed(wt) else n
        require(inner % 2 == 0, op, f"an int4 weight's last dim must be even, got {inner}")
    require(
        offset is None or offset.shape == scale.shape,
        op,
        "antiquant_offset must have antiquant_scale's shape",
    )
    return group
