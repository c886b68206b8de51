"""The canonical quantized formats, defined once for every backend.

A backend converts these to its native layout once, at weight-load time (for example
int32 x8 packing on Ascend), never per call. All quantisation arithmetic is defined in
float32: ``q = round_half_even(x / scale)`` with ``x`` upcast to float32 and scales
stored as float32. Everything here is symmetric (no zero points).

Formats (``x`` is 2-D ``[R, C]``; a weight is ``[N, K]``, an activation ``[M, K]``):

``int8_row``
    int8 ``[R, C]`` in ``[-127, 127]``; scale float32 ``[R]`` = ``amax(|row|) / 127``
    (``amax`` floored at ``1e-12`` so scales stay finite and positive). Per-token for
    activations, per-output-channel for weights.
``int4_group``
    Signed int4 in ``[-8, 7]`` (values produced by quantisation lie in ``[-7, 7]``),
    packed two per byte into uint8 ``[R, C // 2]``: column ``2j`` in the LOW nibble,
    column ``2j + 1`` in the HIGH nibble, each nibble two's complement. Scale float32
    ``[R, C // group_size]`` = ``amax(|group|) / 7``; ``C`` must be a multiple of
    ``group_size`` (which must be even).
``fp8_group`` / ``fp8_group_pow2``
    ``torch.float8_e4m3fn`` ``[R, C]``; scale float32 ``[R, ceil(C / group_size)]`` =
    ``amax(|group|) / 448`` (``amax`` floored at ``1e-4``, as DeepSeek's kernels do); the
    last group may be short. The ``_pow2`` variant rounds each scale UP to a power of
    two (DeepSeek's "ue8m0" scales), so ``|x / scale| <= 448`` still holds.
``fp8_block`` / ``fp8_block_pow2``
    ``torch.float8_e4m3fn`` ``[R, C]``; scale float32
    ``[ceil(R / group_size), ceil(C / group_size)]``, one per ``group_size x group_size``
    tile (128 x 128 for FP8-block weights).

Schemes pair a weight format with an activation format (activations are quantised
dynamically inside ``quant_gemm``):

========================  ====================  ==========================
scheme                    weight                activation
========================  ====================  ==========================
``w8a8``                  ``int8_row``          ``int8_row`` (per token)
``w4a8``                  ``int4_group``        ``int8_row`` (per token)
``w4a16``                 ``int4_group``        none (x stays float)
``fp8_block``             ``fp8_block`` 128     ``fp8_group`` 1 x 128
``fp8_block_ue8m0``       ``fp8_block_pow2``    ``fp8_group_pow2`` 1 x 128
========================  ====================  ==========================

Integer schemes accumulate exactly in int32 within each weight scale group, then apply
the scales in float: ``y[m, n] = sx[m] * sum_g sw[n, g] * sum_{k in g} qx[m, k] qw[n, k]``.
FP8-block accumulates each 128-wide K block in float32 and applies
``sx[m, kb] * sw[nb, kb]`` per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7
INT4_QMAX = 7
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT_AMAX_FLOOR = 1e-12
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
# The scheme name of an unquantised (float) weight in grouped_gemm.
FLOAT_WEIGHT = "none"


@dataclass(frozen=True)
class QuantFormat:
    """One packed format: its storage dtype and how scales tile the tensor."""

    name: str
    storage: torch.dtype
    granularity: str  # "row" | "group" | "block"
    pow2_scales: bool = False

    def scale_shape(self, rows: int, cols: int, group_size: int) -> tuple[int, ...]:
        """Shape of the float32 scale tensor for an ``[rows, cols]`` input."""
        if self.granularity == "row":
            return (rows,)
        if self.granularity == "group":
            return (rows, math.ceil(cols / group_size))
        return (math.ceil(rows / group_size), math.ceil(cols / group_size))

    def packed_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Shape of the quantised tensor for an ``[rows, cols]`` input."""
        return (rows, cols // 2) if self.storage == torch.uint8 else (rows, cols)


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("int8_row", torch.int8, "row"),
        QuantFormat("int4_group", torch.uint8, "group"),
        QuantFormat("fp8_group", FP8_DTYPE, "group"),
        QuantFormat("fp8_group_pow2", FP8_DTYPE, "group", pow2_scales=True),
        QuantFormat("fp8_block", FP8_DTYPE, "block"),
        QuantFormat("fp8_block_pow2", FP8_DTYPE, "block", pow2_scales=True),
    )
}


@dataclass(frozen=True)
class QuantScheme:
    """A quantised GEMM recipe: weight format, activation format (None: float)."""

    name: str
    weight: QuantFormat
    activation: QuantFormat | None
    # None: the weight group size is read off the scale shape (int4); an int: fixed.
    fixed_group_size: int | None

    def weight_group_size(self, k: int, w_scale: torch.Tensor) -> int:
        """The K-group size of a packed weight with ``k`` input features."""
        if self.fixed_group_size is not None:
            return self.fixed_group_size
        if self.weight.granularity == "row":
            return k
        return k // w_scale.shape[-1]


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme("w8a8", FORMATS["int8_row"], FORMATS["int8_row"], None),
        QuantScheme("w4a8", FORMATS["int4_group"], FORMATS["int8_row"], None),
        QuantScheme("w4a16", FORMATS["int4_group"], None, None),
        QuantScheme("fp8_block", FORMATS["fp8_block"], FORMATS["fp8_group"], FP8_BLOCK),
        QuantScheme(
            "fp8_block_ue8m0", FORMATS["fp8_block_pow2"], FORMATS["fp8_group_pow2"], FP8_BLOCK
        ),
    )
}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values ``[..., C]`` (an integer tensor in ``[-8, 7]``, ``C`` even) into
    uint8 ``[..., C // 2]``: even columns in the low nibble, odd in the high nibble."""
    nib = q.to(torch.int16) & 0xF
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[..., C // 2]`` -> int8 ``[..., C]``."""
    p = packed.to(torch.int16)
    nibs = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1).flatten(-2)
    return torch.where(nibs >= 8, nibs - 16, nibs).to(torch.int8)


def round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive float32 scales up to the next power of two (exact for powers)."""
    up = torch.exp2(torch.ceil(torch.log2(scale)))
    # float32 log2 of a value just above a power of two can round onto the integer
    # (2**-9 * (1 + 2**-23) -> -9), which would round the scale DOWN; double it back.
    return torch.where(up < scale, up * 2, up)


def expand_scale(scale: torch.Tensor, fmt: QuantFormat, rows: int, cols: int, group_size: int):
    """Broadcast a scale tensor to the full ``[rows, cols]`` it covers (float32)."""
    if fmt.granularity == "row":
        return scale[:, None].expand(rows, cols)
    if fmt.granularity == "group":
        return scale.repeat_interleave(group_size, dim=1)[:, :cols]
    s = scale.repeat_interleave(group_size, dim=0)[:rows]
    return s.repeat_interleave(group_size, dim=1)[:, :cols]


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, fmt: str, group_size: int, dtype=torch.float32
) -> torch.Tensor:
    """Expand a packed ``[R, C']`` tensor back to float ``[R, C]`` (exact in float64)."""
    f = FORMATS[fmt]
    values = unpack_int4(q) if f.storage == torch.uint8 else q
    rows, cols = values.shape
    s = expand_scale(scale.to(dtype), f, rows, cols, group_size)
    return values.to(dtype) * s


def quantize_tensor(
    x: torch.Tensor, fmt: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of every format: float ``[R, C]`` -> (packed values, fp32 scales).

    This is the reference the ``quantize`` op of every backend must reproduce bit for
    bit. Arithmetic in float32; rounding half to even.
    """
    f = FORMATS[fmt]
    xf = x.float()
    rows, cols = xf.shape
    # Every view names all its sizes: ``-1`` cannot be inferred when a size is 0, and an
    # empty input must still give the (empty) documented shapes.
    if f.granularity == "row":
        # A row with no column has nothing to scale: amax 0, so the scale is the floor's.
        amax = xf.abs().amax(dim=1) if cols else xf.new_zeros(rows)
    elif f.granularity == "group":
        padded = torch.nn.functional.pad(xf, (0, -cols % group_size))
        groups = padded.shape[1] // group_size
        amax = padded.abs().view(rows, groups, group_size).amax(dim=2)
    else:
        padded = torch.nn.functional.pad(xf, (0, -cols % group_size, 0, -rows % group_size))
        row_blocks, col_blocks = padded.shape[0] // group_size, padded.shape[1] // group_size
        tiles = padded.abs().view(row_blocks, group_size, col_blocks, group_size)
        amax = tiles.amax(dim=(1, 3))
    if f.storage == FP8_DTYPE:
        scale = amax.clamp_min(FP8_AMAX_FLOOR) / FP8_MAX
        if f.pow2_scales:
            scale = round_up_pow2(scale)
        scaled = xf / expand_scale(scale, f, rows, cols, group_size)
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    qmax = INT8_MAX if f.storage == torch.int8 else INT4_QMAX
    scale = amax.clamp_min(INT_AMAX_FLOOR) / qmax
    q = torch.round(xf / expand_scale(scale, f, rows, cols, group_size)).clamp(-qmax, qmax)
    q = q.to(torch.int8)
    return (pack_int4(q) if f.storage == torch.uint8 else q), scale


def fake_quant(x: torch.Tensor, fmt: str, group_size: int) -> torch.Tensor:
    """Quantise then dequantise ``x`` ``[R, C]``: float32 values on the format's grid."""
    q, scale = quantize_tensor(x, fmt, group_size)
    return dequantize(q, scale, fmt, group_size)


def fake_quant_activation(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """``x`` ``[M, K]`` as ``scheme``'s dynamic activation quantisation sees it (fp32)."""
    s = SCHEMES[scheme]
    if s.activation is None:
        return x.float()
    return fake_quant(x, s.activation.name, s.fixed_group_size or x.shape[1])


def dequantize_weight(
    w: torch.Tensor, w_scale: torch.Tensor | None, scheme: str, group_size: int
) -> torch.Tensor:
    """A ``[N, K]`` weight in float32 as ``scheme`` computes with it.

    Packed weights are dequantised; a float weight (QAT mode, ``w_scale=None``) is
    fake-quantised with ``group_size`` int4 groups.
    """
    s = SCHEMES[scheme]
    if w_scale is None:
        return fake_quant(w, s.weight.name, s.fixed_group_size or group_size)
    k = w.shape[1] * (2 if s.weight.storage == torch.uint8 else 1)
    return dequantize(w, w_scale, s.weight.name, s.weight_group_size(k, w_scale))
