"""The builder of the ``ai.glmport`` ONNX function bodies (:class:`Body`) and the pieces
several bodies share: float8 through its uint8 bit patterns, quantisation as
``core/formats.py`` defines it, int4 packing and the batched GEMM of every scheme.

Tensors are value names (``str``) in the body being built; every helper adds nodes to
the :class:`Body` it is given and returns the names of its results. onnx is imported
inside functions only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from glmport.core.formats import (
    FLOAT_WEIGHT,
    FP8_AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    INT4_QMAX,
    INT8_MAX,
    INT_AMAX_FLOOR,
    SCHEMES,
    QuantFormat,
)

INF = float("inf")
INT64_MAX = 2**63 - 1


# -- a small builder for function bodies ---------------------------------------------


class Body:
    """Collects the nodes of one function body; each call adds a node, returns its
    output name(s)."""

    def __init__(self) -> None:
        self.nodes: list = []
        self._count = 0
        self._attrs: dict[str, str] = {}

    def __call__(self, op_type: str, *inputs: str, outputs: int = 1, **attrs: Any):
        from onnx import helper

        names = []
        for _ in range(outputs):
            self._count += 1
            names.append(f"_{op_type.lower()}{self._count}")
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else tuple(names)

    def const(self, value: object, dtype: str = "float32") -> str:
        import numpy as np
        from onnx import numpy_helper

        return self("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def ints(self, *values: int) -> str:
        """A 1-D int64 constant (axes, shapes)."""
        return self.const(list(values), "int64")

    def attr(self, name: str, kind: str) -> str:
        """A scalar constant holding the node's attribute ``name`` (int64 or float32)."""
        from onnx import AttributeProto, helper

        if name in self._attrs:
            return self._attrs[name]
        node = helper.make_node("Constant", [], [f"_attr_{name}"])
        a = node.attribute.add()
        a.name = "value_int" if kind == "int" else "value_float"
        a.type = AttributeProto.INT if kind == "int" else AttributeProto.FLOAT
        a.ref_attr_name = name
        self.nodes.append(node)
        self._attrs[name] = node.output[0]
        return node.output[0]

    def attr_1d(self, name: str) -> str:
        """An int attribute as a 1-D int64 tensor of one element (a ``K`` or a dim)."""
        return self("Reshape", self.attr(name, "int"), self.ints(1))

    # shapes
    def dim(self, x: str, axis: int) -> str:
        """``x.shape[axis]`` as a 1-D int64 tensor of one element."""
        end = {} if axis == -1 else {"end": axis + 1}
        return self("Shape", x, start=axis, **end)

    def reshape(self, x: str, *dims: str) -> str:
        """Reshape to the concatenated 1-D ``dims`` (zero sizes kept: ``allowzero``)."""
        return self("Reshape", x, self("Concat", *dims, axis=0), allowzero=1)

    def f32(self, x: str) -> str:
        return self("Cast", x, to=1)

    def full(self, value: float, *dims: str) -> str:
        """A float32 tensor of the concatenated ``dims`` filled with ``value``."""
        return self("Expand", self.const(value), self("Concat", *dims, axis=0))


# -- shared pieces of the bodies -------------------------------------------------------


@functools.cache
def _fp8_table() -> list[float]:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    return codes.float().tolist()


def from_fp8(b: Body, bits: str) -> str:
    """float8_e4m3fn bit patterns (uint8) -> float32 values, by table lookup."""
    return b("Gather", b.const(_fp8_table()), b("Cast", bits, to=6), axis=0)


def _exponent(b: Body, a: str) -> str:
    """``max(floor(log2 a), -6)`` for ``0 <= a < 512``, exactly, by comparisons with
    powers of two (float32): the e4m3 binade of ``a`` (subnormals share -6's)."""
    pows = b.const([2.0**k for k in range(-5, 9)])
    above = b("Cast", b("GreaterOrEqual", b("Unsqueeze", a, b.ints(-1)), pows), to=1)
    return b("Add", b("ReduceSum", above, b.ints(-1), keepdims=0), b.const(-6.0))


def _fp8_quantum(b: Body, a: str) -> str:
    """The e4m3 spacing at ``a``: ``2 ** (binade - 3)``."""
    return b("Pow", b.const(2.0), b("Sub", _exponent(b, a), b.const(3.0)))


def _fp8_round(b: Body, v: str) -> tuple[str, str]:
    """``v`` clamped to +-448 and rounded half to even onto the e4m3 grid: (magnitude,
    sign mask with -0.0 negative, as torch's conversion keeps it)."""
    a = b("Abs", b("Clip", v, b.const(-FP8_MAX), b.const(FP8_MAX)))
    q = _fp8_quantum(b, a)
    r = b("Mul", b("Round", b("Div", a, q)), q)
    zero = b.const(0.0)
    neg_zero = b("And", b("Equal", v, zero), b("Less", b("Reciprocal", v), zero))
    return r, b("Or", b("Less", v, zero), neg_zero)


def fp8_value(b: Body, v: str) -> str:
    """float32 ``v`` rounded onto the e4m3 grid (float32 values, same shape)."""
    r, neg = _fp8_round(b, v)
    return b("Where", neg, b("Neg", r), r)


def fp8_codes(b: Body, v: str) -> str:
    """float32 ``v`` -> float8_e4m3fn bit patterns (uint8): code = 8 * (binade + 6) +
    magnitude / spacing, which covers normals and subnormals alike, plus the sign bit."""
    r, neg = _fp8_round(b, v)
    e = _exponent(b, r)
    mag = b(
        "Add", b("Mul", b("Add", e, b.const(6.0)), b.const(8.0)), b("Div", r, _fp8_quantum(b, r))
    )
    code = b("Add", mag, b("Where", neg, b.const(128.0), b.const(0.0)))
    return b("Cast", code, to=2)


def _pow2_up(b: Body, s: str) -> str:
    """The smallest power of two ``>= s`` (an estimate through Log, then corrected both
    ways, so it is exact whatever Log rounds to)."""
    est = b("Ceil", b("Mul", b("Log", s), b.const(1.0 / math.log(2.0))))
    up = b("Pow", b.const(2.0), est)
    up = b("Where", b("Less", up, s), b("Mul", up, b.const(2.0)), up)
    half = b("Mul", up, b.const(0.5))
    return b("Where", b("GreaterOrEqual", half, s), half, up)


def pad_to(b: Body, size: str, block: str) -> str:
    """How much ``size`` needs to become a multiple of ``block`` (1-D int64)."""
    return b("Mod", b("Sub", block, b("Mod", size, block)), block)


def quant_values(b: Body, x: str, fmt: QuantFormat, gs: str) -> tuple[str, str, str]:
    """Quantise batched float32 ``x`` ``[B, R, C]`` in format ``fmt`` with group size
    ``gs`` (1-D int64), as ``core/formats.quantize_tensor`` defines it.

    Returns ``(q, scale, full)``: ``q`` the integer codes as float32 (int formats) or
    ``x / full`` not yet rounded (fp8), ``scale`` ``[B, *scale_shape]`` float32 and
    ``full`` the scale broadcastable to ``[B, R, C]``.
    """
    bb, r, c = b.dim(x, 0), b.dim(x, 1), b.dim(x, 2)
    ax = b("Abs", x)
    if fmt.granularity == "row":
        amax = b("ReduceMax", ax, b.ints(2), keepdims=0)
    elif fmt.granularity == "group":
        pc = pad_to(b, c, gs)
        padded = b("Pad", ax, b("Concat", b.ints(0, 0, 0, 0, 0), pc, axis=0))
        groups = b("Div", b("Add", c, pc), gs)
        amax = b("ReduceMax", b.reshape(padded, bb, r, groups, gs), b.ints(3), keepdims=0)
    else:
        pr, pc = pad_to(b, r, gs), pad_to(b, c, gs)
        padded = b("Pad", ax, b("Concat", b.ints(0, 0, 0, 0), pr, pc, axis=0))
        rb, cb = b("Div", b("Add", r, pr), gs), b("Div", b("Add", c, pc), gs)
        tiles = b.reshape(padded, bb, rb, gs, cb, gs)
        amax = b("ReduceMax", tiles, b.ints(2, 4), keepdims=0)
    fp8 = fmt.storage == FP8_DTYPE
    floor = FP8_AMAX_FLOOR if fp8 else INT_AMAX_FLOOR
    qmax = FP8_MAX if fp8 else (INT8_MAX if fmt.storage == torch.int8 else INT4_QMAX)
    scale = b("Div", b("Max", amax, b.const(floor)), b.const(qmax))
    if fmt.pow2_scales:
        scale = _pow2_up(b, scale)
    if fmt.granularity == "row":
        full = b("Unsqueeze", scale, b.ints(2))
    elif fmt.granularity == "group":
        groups = b.dim(scale, 2)
        wide = b("Expand", b("Unsqueeze", scale, b.ints(3)), b("Concat", bb, r, groups, gs, axis=0))
        full = b("Slice", b.reshape(wide, bb, r, b("Mul", groups, gs)), b.ints(0), c, b.ints(2))
    else:
        rb, cb = b.dim(scale, 1), b.dim(scale, 2)
        tiles = b(
            "Expand",
            b.reshape(scale, bb, rb, b.ints(1), cb, b.ints(1)),
            b("Concat", bb, rb, gs, cb, gs, axis=0),
        )
        wide = b.reshape(tiles, bb, b("Mul", rb, gs), b("Mul", cb, gs))
        full = b("Slice", wide, b.ints(0, 0), b("Concat", r, c, axis=0), b.ints(1, 2))
    scaled = b("Div", x, full)
    if fp8:
        return scaled, scale, full
    return b("Clip", b("Round", scaled), b.const(-qmax), b.const(qmax)), scale, full


def fake_quant(b: Body, x: str, fmt: QuantFormat, gs: str) -> str:
    """Batched float32 ``x`` quantised then dequantised (float32 on the format's grid)."""
    q, _, full = quant_values(b, x, fmt, gs)
    if fmt.storage == FP8_DTYPE:
        q = fp8_value(b, q)
    return b("Mul", q, full)


def pack_int4(b: Body, q: str) -> str:
    """int4 codes as float32 ``[..., C]`` -> uint8 ``[..., C/2]``, even columns low."""
    nib = b("Add", q, b("Mul", b("Cast", b("Less", q, b.const(0.0)), to=1), b.const(16.0)))
    big = b.ints(INT64_MAX)
    lo = b("Slice", nib, b.ints(0), big, b.ints(-1), b.ints(2))
    hi = b("Slice", nib, b.ints(1), big, b.ints(-1), b.ints(2))
    return b("Cast", b("Add", lo, b("Mul", hi, b.const(16.0))), to=2)


def unpack_int4(b: Body, packed: str) -> str:
    """uint8 ``[B, N, K/2]`` -> signed int4 values as float32 ``[B, N, K]``."""
    lo = b("BitwiseAnd", packed, b.const(15, "uint8"))
    hi = b("BitShift", packed, b.const(4, "uint8"), direction="RIGHT")
    pair = b("Concat", b("Unsqueeze", lo, b.ints(-1)), b("Unsqueeze", hi, b.ints(-1)), axis=-1)
    n = b.reshape(
        b.f32(pair), b.dim(packed, 0), b.dim(packed, 1), b("Mul", b.dim(packed, 2), b.ints(2))
    )
    return b(
        "Sub", n, b("Mul", b("Cast", b("GreaterOrEqual", n, b.const(8.0)), to=1), b.const(16.0))
    )


def transpose(b: Body, x: str, *perm: int) -> str:
    """``x`` with its axes permuted by ``perm``."""
    return b("Transpose", x, perm=list(perm))


def gemm(b: Body, x: str, w: str, sw: str | None, scheme: str, gs: str) -> str:
    """Batched ``y[B, R, N] = x[B, R, K] @ W[B, N, K].T`` with ``w`` stored per
    ``scheme`` (``w_scale`` ``sw`` ``[B, ...]``, None for float / fake-quant weights),
    the activation quantised as the scheme says (``core/formats.py``)."""
    if scheme == FLOAT_WEIGHT:
        return b("MatMul", x, transpose(b, b.f32(w), 0, 2, 1))
    s = SCHEMES[scheme]
    k = b.dim(x, 2)
    if sw is None:  # fake-quant (QAT): float GEMM on both operands' grid values
        xq = (
            x
            if s.activation is None
            else fake_quant(
                b, x, s.activation, b.ints(s.fixed_group_size) if s.fixed_group_size else k
            )
        )
        wgs = b.ints(s.fixed_group_size) if s.fixed_group_size else gs
        wq = fake_quant(b, b.f32(w), s.weight, wgs)
        return b("MatMul", xq, transpose(b, wq, 0, 2, 1))
    bb, n = b.dim(w, 0), b.dim(w, 1)
    if s.weight.granularity == "row":  # [B, N]: one scale group spanning K
        sw = b("Unsqueeze", sw, b.ints(2))
    if s.activation is None:  # w4a16: dequantise the weight, float activations
        groups = b.dim(sw, 2)
        g = b("Div", k, groups)
        full = b.reshape(
            b("Expand", b("Unsqueeze", sw, b.ints(3)), b("Concat", bb, n, groups, g, axis=0)),
            bb,
            n,
            k,
        )
        return b("MatMul", x, transpose(b, b("Mul", unpack_int4(b, w), full), 0, 2, 1))
    if s.activation.storage == torch.int8:
        # Exact int32 sums per weight scale group (MatMulInteger), then the scales.
        qx, sx, _ = quant_values(b, x, s.activation, k)
        qw = unpack_int4(b, w) if s.weight.storage == torch.uint8 else w
        groups, r = b.dim(sw, 2), b.dim(x, 1)
        g = b("Div", k, groups)
        a = transpose(b, b.reshape(b("Cast", qx, to=3), bb, r, groups, g), 0, 2, 1, 3)
        wt = transpose(b, b.reshape(b("Cast", qw, to=3), bb, n, groups, g), 0, 2, 3, 1)
        part = b.f32(b("MatMulInteger", a, wt))  # [B, G, R, N]
        y = b(
            "ReduceSum",
            b("Mul", part, b("Unsqueeze", transpose(b, sw, 0, 2, 1), b.ints(2))),
            b.ints(1),
            keepdims=0,
        )
        return b("Mul", y, b("Unsqueeze", sx, b.ints(2)))
    # FP8 blocks: per 128-wide K block, fp8 x fp8 products in float32, then both scales.
    block = b.ints(s.fixed_group_size)
    scaled, sx, _ = quant_values(b, x, s.activation, block)
    xq = fp8_value(b, scaled)
    pk = pad_to(b, k, block)
    kb = b("Div", b("Add", k, pk), block)
    r = b.dim(x, 1)
    xp = b("Pad", xq, b("Concat", b.ints(0, 0, 0, 0, 0), pk, axis=0))
    wp = b("Pad", from_fp8(b, w), b("Concat", b.ints(0, 0, 0, 0, 0), pk, axis=0))
    xa = transpose(b, b.reshape(xp, bb, r, kb, block), 0, 2, 1, 3)  # [B, KB, R, 128]
    wa = transpose(b, b.reshape(wp, bb, n, kb, block), 0, 2, 3, 1)  # [B, KB, 128, N]
    part = b("MatMul", xa, wa)
    nb = b.dim(sw, 1)
    rows = b("Expand", b("Unsqueeze", sw, b.ints(2)), b("Concat", bb, nb, block, kb, axis=0))
    swn = b("Slice", b.reshape(rows, bb, b("Mul", nb, block), kb), b.ints(0), n, b.ints(1))
    scales = b(
        "Mul",
        b("Unsqueeze", transpose(b, sx, 0, 2, 1), b.ints(3)),
        b("Unsqueeze", transpose(b, swn, 0, 2, 1), b.ints(2)),
    )
    return b("ReduceSum", b("Mul", part, scales), b.ints(1), keepdims=0)


def arange(b: Body, n: str) -> str:
    """``0 .. n-1`` int64 for a 1-D one-element ``n``."""
    return b("Range", b.const(0, "int64"), b("Squeeze", n), b.const(1, "int64"))
