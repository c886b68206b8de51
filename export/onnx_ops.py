"""Every glmport op as an ONNX custom-domain node with a function body of standard ops.

A glmport op is exported as one node of domain ``ai.glmport`` (version 1) named after
the op, with the torch schema's arguments: tensors as inputs (an absent optional
tensor is an empty input name), every scalar as an attribute of the same name and
default. Vendor runtimes may map the node to a fused kernel; everyone else runs its
``FunctionProto`` body, built here from standard ONNX ops at opset 18 (``TopK``,
``Gather``, ``MatMul``, ``MatMulInteger``, ``ScatterND``...). Bodies compute in
float32 and return the outputs in the reference's dtypes.

Variants. An ONNX function cannot branch on a string attribute or on whether an
optional input is there, so each op has one body per *structural variant*: the
values of its ``str`` / ``bool`` attributes and which optional inputs are present.
The variant is the node's function ``overload`` (IR 10), so the op keeps one name
(``ai.glmport::quant_gemm``) and every variant its own body; numeric attributes
(``eps``, ``topk``, ``scale``...) stay attributes the body reads by reference.

Dtype conventions at opset 18 (it has no float8 type): float8_e4m3fn tensors travel
as their uint8 bit patterns (decoded by a 256-entry table, encoded by exact
round-half-even arithmetic); bfloat16 / float16 are plain ONNX types.

Translation. ``torch.onnx.export(dynamo=True)`` inlines model-local functions it
records, so :func:`translation_table` emits *opaque* nodes (an ``OpSchema`` derived
from the torch schema) and :func:`attach_functions` adds the bodies afterwards.

onnx / onnxscript are imported inside functions only: importing glmport must not
import them.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from glmport.core.formats import (
    FLOAT_WEIGHT,
    FORMATS,
    FP8_AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    INT4_QMAX,
    INT8_MAX,
    INT_AMAX_FLOOR,
    SCHEMES,
    QuantFormat,
)
from glmport.core.specs import OP_NAMES, SPECS

if TYPE_CHECKING:
    import onnx

DOMAIN = "ai.glmport"
DOMAIN_VERSION = 1
OPSET = 18
IR_VERSION = 10  # function overloads: one body per structural variant

_NO_DEFAULT = object()
_INF = float("inf")
_INT64_MAX = 2**63 - 1


# -- the ops' signatures, read from their torch schemas --------------------------------


@dataclass(frozen=True)
class Param:
    """One argument of a glmport op: ``kind`` is ``tensor``, ``optional`` (``Tensor?``),
    ``int``, ``float``, ``bool`` or ``str``; ``default`` is ``_NO_DEFAULT`` if none."""

    name: str
    kind: str
    default: object = _NO_DEFAULT

    @property
    def is_tensor(self) -> bool:
        return self.kind in ("tensor", "optional")

    @property
    def structural(self) -> bool:
        """Whether its value selects a function-body variant (not a runtime number)."""
        return self.kind in ("bool", "str")


_KINDS = {
    "TensorType": "tensor",
    "IntType": "int",
    "FloatType": "float",
    "BoolType": "bool",
    "StringType": "str",
}


@functools.cache
def params(op: str) -> tuple[Param, ...]:
    """The arguments of ``op`` in schema order, from ``torch.ops.glmport.<op>``."""
    import glmport.core.library  # noqa: F401  (registers torch.ops.glmport)

    out = []
    for a in getattr(torch.ops.glmport, op).default._schema.arguments:
        type_name = type(a.type).__name__
        kind = "optional" if type_name == "OptionalType" else _KINDS[type_name]
        default = a.default_value if a.has_default_value() else _NO_DEFAULT
        out.append(Param(a.name, kind, default))
    return tuple(out)


@functools.cache
def output_names(op: str) -> tuple[str, ...]:
    """The output names of ``op`` (``out`` for an unnamed single output)."""
    import glmport.core.library  # noqa: F401

    returns = getattr(torch.ops.glmport, op).default._schema.returns
    return tuple(
        r.name or ("out" if len(returns) == 1 else f"out{i}") for i, r in enumerate(returns)
    )


def _variant(op: str, attrs: dict[str, object], present: set[str]) -> str:
    """The overload name of one structural variant: its str/bool attribute values and
    its absent optional inputs, e.g. ``scheme=w8a8``, ``score_func=sigmoid,no_bias``."""
    parts = []
    for p in params(op):
        if p.structural:
            value = attrs.get(p.name, p.default)
            if value is _NO_DEFAULT:
                raise ValueError(f"{op}: the node lacks the required attribute {p.name!r}")
            parts.append(f"{p.name}={str(bool(value)).lower() if p.kind == 'bool' else value}")
        elif p.kind == "optional" and p.name not in present:
            parts.append(f"no_{p.name}")
    return ",".join(parts)


def _parse_variant(op: str, overload: str) -> tuple[dict[str, object], set[str]]:
    """Inverse of :func:`_variant`: the structural attributes and present optionals."""
    items = [s for s in overload.split(",") if s]
    attrs: dict[str, object] = {}
    absent = {s.removeprefix("no_") for s in items if s.startswith("no_")}
    for s in items:
        if "=" in s:
            name, value = s.split("=", 1)
            attrs[name] = value == "true" if value in ("true", "false") else value
    present = {p.name for p in params(op) if p.kind == "optional" and p.name not in absent}
    return attrs, present


# -- a small builder for function bodies ---------------------------------------------


class _Body:
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


def _from_fp8(b: _Body, bits: str) -> str:
    """float8_e4m3fn bit patterns (uint8) -> float32 values, by table lookup."""
    return b("Gather", b.const(_fp8_table()), b("Cast", bits, to=6), axis=0)


def _exponent(b: _Body, a: str) -> str:
    """``max(floor(log2 a), -6)`` for ``0 <= a < 512``, exactly, by comparisons with
    powers of two (float32): the e4m3 binade of ``a`` (subnormals share -6's)."""
    pows = b.const([2.0**k for k in range(-5, 9)])
    above = b("Cast", b("GreaterOrEqual", b("Unsqueeze", a, b.ints(-1)), pows), to=1)
    return b("Add", b("ReduceSum", above, b.ints(-1), keepdims=0), b.const(-6.0))


def _fp8_quantum(b: _Body, a: str) -> str:
    """The e4m3 spacing at ``a``: ``2 ** (binade - 3)``."""
    return b("Pow", b.const(2.0), b("Sub", _exponent(b, a), b.const(3.0)))


def _fp8_round(b: _Body, v: str) -> tuple[str, str]:
    """``v`` clamped to +-448 and rounded half to even onto the e4m3 grid: (magnitude,
    sign mask with -0.0 negative, as torch's conversion keeps it)."""
    a = b("Abs", b("Clip", v, b.const(-FP8_MAX), b.const(FP8_MAX)))
    q = _fp8_quantum(b, a)
    r = b("Mul", b("Round", b("Div", a, q)), q)
    zero = b.const(0.0)
    neg_zero = b("And", b("Equal", v, zero), b("Less", b("Reciprocal", v), zero))
    return r, b("Or", b("Less", v, zero), neg_zero)


def _fp8_value(b: _Body, v: str) -> str:
    r, neg = _fp8_round(b, v)
    return b("Where", neg, b("Neg", r), r)


def _fp8_codes(b: _Body, v: str) -> str:
    """float32 ``v`` -> float8_e4m3fn bit patterns (uint8): code = 8 * (binade + 6) +
    magnitude / spacing, which covers normals and subnormals alike, plus the sign bit."""
    r, neg = _fp8_round(b, v)
    e = _exponent(b, r)
    mag = b(
        "Add", b("Mul", b("Add", e, b.const(6.0)), b.const(8.0)), b("Div", r, _fp8_quantum(b, r))
    )
    code = b("Add", mag, b("Where", neg, b.const(128.0), b.const(0.0)))
    return b("Cast", code, to=2)


def _pow2_up(b: _Body, s: str) -> str:
    """The smallest power of two ``>= s`` (an estimate through Log, then corrected both
    ways, so it is exact whatever Log rounds to)."""
    est = b("Ceil", b("Mul", b("Log", s), b.const(1.0 / math.log(2.0))))
    up = b("Pow", b.const(2.0), est)
    up = b("Where", b("Less", up, s), b("Mul", up, b.const(2.0)), up)
    half = b("Mul", up, b.const(0.5))
    return b("Where", b("GreaterOrEqual", half, s), half, up)


def _pad_to(b: _Body, size: str, block: str) -> str:
    """How much ``size`` needs to become a multiple of ``block`` (1-D int64)."""
    return b("Mod", b("Sub", block, b("Mod", size, block)), block)


def _quant_values(b: _Body, x: str, fmt: QuantFormat, gs: str) -> tuple[str, str, str]:
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
        pc = _pad_to(b, c, gs)
        padded = b("Pad", ax, b("Concat", b.ints(0, 0, 0, 0, 0), pc, axis=0))
        groups = b("Div", b("Add", c, pc), gs)
        amax = b("ReduceMax", b.reshape(padded, bb, r, groups, gs), b.ints(3), keepdims=0)
    else:
        pr, pc = _pad_to(b, r, gs), _pad_to(b, c, gs)
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


def _fake_quant(b: _Body, x: str, fmt: QuantFormat, gs: str) -> str:
    """Batched float32 ``x`` quantised then dequantised (float32 on the format's grid)."""
    q, _, full = _quant_values(b, x, fmt, gs)
    if fmt.storage == FP8_DTYPE:
        q = _fp8_value(b, q)
    return b("Mul", q, full)


def _pack_int4(b: _Body, q: str) -> str:
    """int4 codes as float32 ``[..., C]`` -> uint8 ``[..., C/2]``, even columns low."""
    nib = b("Add", q, b("Mul", b("Cast", b("Less", q, b.const(0.0)), to=1), b.const(16.0)))
    big = b.ints(_INT64_MAX)
    lo = b("Slice", nib, b.ints(0), big, b.ints(-1), b.ints(2))
    hi = b("Slice", nib, b.ints(1), big, b.ints(-1), b.ints(2))
    return b("Cast", b("Add", lo, b("Mul", hi, b.const(16.0))), to=2)


def _unpack_int4(b: _Body, packed: str) -> str:
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


def _t(b: _Body, x: str, *perm: int) -> str:
    return b("Transpose", x, perm=list(perm))


def _gemm(b: _Body, x: str, w: str, sw: str | None, scheme: str, gs: str) -> str:
    """Batched ``y[B, R, N] = x[B, R, K] @ W[B, N, K].T`` with ``w`` stored per
    ``scheme`` (``w_scale`` ``sw`` ``[B, ...]``, None for float / fake-quant weights),
    the activation quantised as the scheme says (``core/formats.py``)."""
    if scheme == FLOAT_WEIGHT:
        return b("MatMul", x, _t(b, b.f32(w), 0, 2, 1))
    s = SCHEMES[scheme]
    k = b.dim(x, 2)
    if sw is None:  # fake-quant (QAT): float GEMM on both operands' grid values
        xq = (
            x
            if s.activation is None
            else _fake_quant(
                b, x, s.activation, b.ints(s.fixed_group_size) if s.fixed_group_size else k
            )
        )
        wgs = b.ints(s.fixed_group_size) if s.fixed_group_size else gs
        wq = _fake_quant(b, b.f32(w), s.weight, wgs)
        return b("MatMul", xq, _t(b, wq, 0, 2, 1))
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
        return b("MatMul", x, _t(b, b("Mul", _unpack_int4(b, w), full), 0, 2, 1))
    if s.activation.storage == torch.int8:
        # Exact int32 sums per weight scale group (MatMulInteger), then the scales.
        qx, sx, _ = _quant_values(b, x, s.activation, k)
        qw = _unpack_int4(b, w) if s.weight.storage == torch.uint8 else w
        groups, r = b.dim(sw, 2), b.dim(x, 1)
        g = b("Div", k, groups)
        a = _t(b, b.reshape(b("Cast", qx, to=3), bb, r, groups, g), 0, 2, 1, 3)
        wt = _t(b, b.reshape(b("Cast", qw, to=3), bb, n, groups, g), 0, 2, 3, 1)
        part = b.f32(b("MatMulInteger", a, wt))  # [B, G, R, N]
        y = b(
            "ReduceSum",
            b("Mul", part, b("Unsqueeze", _t(b, sw, 0, 2, 1), b.ints(2))),
            b.ints(1),
            keepdims=0,
        )
        return b("Mul", y, b("Unsqueeze", sx, b.ints(2)))
    # FP8 blocks: per 128-wide K block, fp8 x fp8 products in float32, then both scales.
    block = b.ints(s.fixed_group_size)
    scaled, sx, _ = _quant_values(b, x, s.activation, block)
    xq = _fp8_value(b, scaled)
    pk = _pad_to(b, k, block)
    kb = b("Div", b("Add", k, pk), block)
    r = b.dim(x, 1)
    xp = b("Pad", xq, b("Concat", b.ints(0, 0, 0, 0, 0), pk, axis=0))
    wp = b("Pad", _from_fp8(b, w), b("Concat", b.ints(0, 0, 0, 0, 0), pk, axis=0))
    xa = _t(b, b.reshape(xp, bb, r, kb, block), 0, 2, 1, 3)  # [B, KB, R, 128]
    wa = _t(b, b.reshape(wp, bb, n, kb, block), 0, 2, 3, 1)  # [B, KB, 128, N]
    part = b("MatMul", xa, wa)
    nb = b.dim(sw, 1)
    rows = b("Expand", b("Unsqueeze", sw, b.ints(2)), b("Concat", bb, nb, block, kb, axis=0))
    swn = b("Slice", b.reshape(rows, bb, b("Mul", nb, block), kb), b.ints(0), n, b.ints(1))
    scales = b(
        "Mul",
        b("Unsqueeze", _t(b, sx, 0, 2, 1), b.ints(3)),
        b("Unsqueeze", _t(b, swn, 0, 2, 1), b.ints(2)),
    )
    return b("ReduceSum", b("Mul", part, scales), b.ints(1), keepdims=0)


def _scores(b: _Body, t: dict[str, str | None]) -> str:
    """Indexer scores ``[T, N]`` float32, ``-inf`` outside ``[k_start, k_end)``."""
    fp8 = t["q_scale"] is not None
    q = _from_fp8(b, t["q"]) if fp8 else b.f32(t["q"])
    k = _from_fp8(b, t["k"]) if fp8 else b.f32(t["k"])
    dots = b("MatMul", q, _t(b, k, 1, 0))  # [T, Hi, N]
    if fp8:
        dots = b(
            "Mul",
            b("Mul", dots, b("Unsqueeze", t["q_scale"], b.ints(2))),
            b("Unsqueeze", t["k_scale"], b.ints(0, 1)),
        )
    w = b("Unsqueeze", t["weights"], b.ints(1))
    scores = b("Squeeze", b("MatMul", w, b("Relu", dots)), b.ints(1))  # [T, N]
    slots = b("Unsqueeze", _arange(b, b.dim(k, 0)), b.ints(0))
    start = b("Unsqueeze", b("Cast", t["k_start"], to=7), b.ints(1))
    end = b("Unsqueeze", b("Cast", t["k_end"], to=7), b.ints(1))
    valid = b("And", b("GreaterOrEqual", slots, start), b("Less", slots, end))
    return b("Where", valid, scores, b.const(-_INF))


def _arange(b: _Body, n: str) -> str:
    """``0 .. n-1`` int64 for a 1-D one-element ``n``."""
    return b("Range", b.const(0, "int64"), b("Squeeze", n), b.const(1, "int64"))


# -- the op bodies: (body, tensors by name, structural attributes) -> outputs ----------


def _lightning_indexer(b, t, a):
    scores = _scores(b, t)
    n, rows = b.dim(t["k"], 0), b.dim(t["q"], 0)
    zero = b.ints(0)
    start = b("Min", b("Max", b("Cast", t["k_start"], to=7), zero), n)
    end = b("Max", b("Min", b("Max", b("Cast", t["k_end"], to=7), zero), n), start)
    count = b("Unsqueeze", b("Sub", end, start), b.ints(1))
    topk = b.attr_1d("topk")
    # -inf columns so TopK always has topk entries (N < topk): the tail is masked below.
    padded = b("Concat", scores, b.full(-_INF, rows, topk), axis=1)
    values, slots = b("TopK", padded, topk, axis=1, largest=1, sorted=1, outputs=2)
    keep = b("Less", b("Unsqueeze", _arange(b, topk), b.ints(0)), count)
    indices = b("Cast", b("Where", keep, slots, b.const(-1, "int64")), to=6)
    return [indices, b("Where", keep, values, b.const(-_INF))]


def _indexer_logits(b, t, a):
    return [_scores(b, t)]


def _sparse_attention(b, t, a):
    q, k, v = b.f32(t["q"]), b.f32(t["k"]), b.f32(t["v"])
    rows, h, dk = b.dim(q, 0), b.dim(q, 1), b.dim(q, 2)
    n, hkv, dv = b.dim(k, 0), b.dim(k, 1), b.dim(v, 2)
    kk = b.dim(t["indices"], 1)
    # One zero slot after the N real ones: invalid entries gather it (also when N = 0).
    kp = b("Concat", k, b.full(0.0, b.ints(1), hkv, dk), axis=0)
    vp = b("Concat", v, b.full(0.0, b.ints(1), hkv, dv), axis=0)
    idx = b("Cast", t["indices"], to=7)
    valid = b("And", b("GreaterOrEqual", idx, b.const(0, "int64")), b("Less", idx, n))
    slots = b("Where", valid, idx, n)
    kg, vg = b("Gather", kp, slots, axis=0), b("Gather", vp, slots, axis=0)  # [T, K, Hkv, D]
    groups = b("Div", h, hkv)
    qg = b.reshape(q, rows, hkv, groups, dk)
    s = b("MatMul", qg, _t(b, kg, 0, 2, 3, 1))  # [T, Hkv, G, K]
    s = b("Mul", b.reshape(s, rows, h, kk), b.attr("scale", "float"))
    s = b("Where", b("Unsqueeze", valid, b.ints(1)), s, b.const(-_INF))
    m = b("ReduceMax", s, b.ints(-1), keepdims=1)
    m = b("Where", b("IsInf", m), b.const(0.0), m)  # all -inf: subtract 0, p = 0 not NaN
    e = b("Exp", b("Sub", s, m))
    total = b("ReduceSum", e, b.ints(-1), keepdims=1)
    p = b("Div", e, b("Where", b("Greater", total, b.const(0.0)), total, b.const(1.0)))
    lse = b("Squeeze", b("Add", m, b("Log", total)), b.ints(-1))
    out = b("MatMul", b.reshape(p, rows, hkv, groups, kk), _t(b, vg, 0, 2, 1, 3))
    return [b("CastLike", b.reshape(out, rows, h, dv), t["q"]), lse]


def _moe_gate(b, t, a):
    lf = b.f32(t["logits"])
    scores = b("Sigmoid", lf) if a["score_func"] == "sigmoid" else b("Softmax", lf, axis=-1)
    bias = t["bias"]
    choice = scores if bias is None else b("Add", scores, bias)
    rows, e = b.dim(lf, 0), b.dim(lf, 1)
    ng = b.attr_1d("n_group")
    per = b("Div", e, ng)
    grouped = b.reshape(choice, rows, ng, per)
    # A group's best score without a bias, the sum of its best two with one (noaux_tc).
    if bias is None:
        group_score = b("ReduceMax", grouped, b.ints(2), keepdims=0)
    else:
        best2 = b("TopK", grouped, b("Min", per, b.ints(2)), axis=2, outputs=2)[0]
        group_score = b("ReduceSum", best2, b.ints(2), keepdims=0)
    # TopK breaks ties to the lower index, as the reference's stable sorts do.
    kept = b("TopK", group_score, b.attr_1d("topk_group"), axis=1, outputs=2)[1]
    hit = b("Equal", b("Unsqueeze", kept, b.ints(2)), b.reshape(_arange(b, ng), b.ints(1, 1), ng))
    keep = b("ReduceMax", b("Cast", hit, to=1), b.ints(1), keepdims=0)  # [T, n_group]
    mask = b.reshape(
        b("Expand", b("Unsqueeze", keep, b.ints(2)), b("Concat", rows, ng, per, axis=0)), rows, e
    )
    choice = b("Where", b("Greater", mask, b.const(0.0)), choice, b.const(-_INF))
    ids = b("TopK", choice, b.attr_1d("top_k"), axis=1, outputs=2)[1]
    weights = b("GatherElements", scores, ids, axis=1)
    if a["norm_topk_prob"]:
        total = b("Add", b("ReduceSum", weights, b.ints(1), keepdims=1), b.const(1e-20))
        weights = b("Div", weights, total)
    weights = b("Mul", weights, b.attr("routed_scaling_factor", "float"))
    return [weights, b("Cast", ids, to=6)]


def _moe_dispatch(b, t, a):
    ids = t["ids"]
    e = b.attr_1d("num_experts")
    flat = b("Cast", b.reshape(ids, b("Reshape", b("Size", ids), b.ints(1))), to=7)
    key = b(
        "Where",
        b("And", b("GreaterOrEqual", flat, b.const(0, "int64")), b("Less", flat, e)),
        flat,
        e,
    )
    # An ascending TopK over every row is a stable sort: ties keep the lower row first.
    src = b("TopK", b.f32(key), b.dim(key, 0), axis=0, largest=0, sorted=1, outputs=2)[1]
    below = b(
        "Less",
        b("Unsqueeze", key, b.ints(0)),
        b("Unsqueeze", _arange(b, b("Add", e, b.ints(1))), b.ints(1)),
    )
    offsets = b("ReduceSum", b("Cast", below, to=7), b.ints(1), keepdims=0)
    x_sorted = b("Gather", t["x"], b("Div", src, b.dim(ids, 1)), axis=0)
    return [x_sorted, b("Cast", offsets, to=6), b("Cast", src, to=6)]


def _moe_combine(b, t, a):
    y = b.f32(t["y_sorted"])
    w = t["weights"]
    rows, k, d = b.dim(w, 0), b.dim(w, 1), b.dim(y, 1)
    total = b("Mul", rows, k)
    src = b("Cast", t["src_row"], to=7)
    valid = b("And", b("GreaterOrEqual", src, b.const(0, "int64")), b("Less", src, total))
    src = b("Where", valid, src, b.const(0, "int64"))
    # A src_row naming no token adds into a spare row T, dropped below.
    target = b("Where", valid, b("Div", src, k), rows)
    flat_w = b("Gather", b.reshape(w, total), src, axis=0)
    contrib = b("Mul", y, b("Unsqueeze", flat_w, b.ints(1)))
    acc = b.full(0.0, b("Add", rows, b.ints(1)), d)
    out = b("ScatterND", acc, b("Unsqueeze", target, b.ints(1)), contrib, reduction="add")
    return [b("CastLike", b("Slice", out, b.ints(0), rows, b.ints(0)), t["y_sorted"])]


def _grouped_gemm(b, t, a):
    x, w, sw = t["x"], t["w"], t["w_scale"]
    m = b.dim(x, 0)
    # Offsets made a partition of [0, M]: clamped, then a running maximum.
    off = b("Min", b("Max", b("Cast", t["expert_offsets"], to=7), b.ints(0)), m)
    e1 = b.dim(off, 0)
    pos = _arange(b, e1)
    upto = b("LessOrEqual", b("Unsqueeze", pos, b.ints(0)), b("Unsqueeze", pos, b.ints(1)))
    spread = b("Where", upto, b("Unsqueeze", off, b.ints(0)), b.const(-1, "int64"))
    bounds = b("ReduceMax", spread, b.ints(1), keepdims=0)
    rows = _arange(b, m)
    upper = b("Slice", bounds, b.ints(1), e1, b.ints(0))
    expert = b(
        "ReduceSum",
        b(
            "Cast",
            b("LessOrEqual", b("Unsqueeze", upper, b.ints(0)), b("Unsqueeze", rows, b.ints(1))),
            to=7,
        ),
        b.ints(1),
        keepdims=0,
    )
    first = b("Slice", bounds, b.ints(0), b.ints(1), b.ints(0))
    owned = b("And", b("GreaterOrEqual", rows, first), b("Less", expert, b("Sub", e1, b.ints(1))))
    expert = b("Where", owned, expert, b.const(0, "int64"))
    # Each row with its expert's weight: one batched GEMM of row-sized batches.
    wr = b("Gather", w, expert, axis=0)
    swr = None if sw is None else b("Gather", sw, expert, axis=0)
    x3 = b("Unsqueeze", b.f32(x), b.ints(1))
    gs = b.attr_1d("group_size")
    y = b("Squeeze", _gemm(b, x3, wr, swr, a["scheme"], gs), b.ints(1))
    y = b("Where", b("Unsqueeze", owned, b.ints(1)), y, b.const(0.0))
    return [b("CastLike", y, x)]


def _quantize(b, t, a):
    fmt = FORMATS[a["fmt"]]
    x3 = b("Unsqueeze", b.f32(t["x"]), b.ints(0))
    q, scale, _ = _quant_values(b, x3, fmt, b.attr_1d("group_size"))
    q = b("Squeeze", q, b.ints(0))
    if fmt.storage == FP8_DTYPE:
        codes = _fp8_codes(b, q)
    elif fmt.storage == torch.uint8:
        codes = _pack_int4(b, q)
    else:
        codes = b("Cast", q, to=3)
    return [codes, b("Squeeze", scale, b.ints(0))]


def _quant_gemm(b, t, a):
    x3 = b("Unsqueeze", b.f32(t["x"]), b.ints(0))
    w3 = b("Unsqueeze", t["w"], b.ints(0))
    sw = t["w_scale"]
    sw3 = None if sw is None else b("Unsqueeze", sw, b.ints(0))
    y = _gemm(b, x3, w3, sw3, a["scheme"], b.attr_1d("group_size"))
    return [b("CastLike", b("Squeeze", y, b.ints(0)), t["x"])]


def _rms_norm(b, t, a):
    x = b.f32(t["x"])
    # Rows beyond 1 are divided by their max |x| first (no overflow), as the reference.
    s = b("Max", b("ReduceMax", b("Abs", x), b.ints(-1), keepdims=1), b.const(1.0))
    xs = b("Div", x, s)
    ms = b("ReduceMean", b("Mul", xs, xs), b.ints(-1), keepdims=1)
    eps = b("Div", b.attr("eps", "float"), b("Mul", s, s))
    inv = b("Reciprocal", b("Sqrt", b("Add", ms, eps)))
    return [b("CastLike", b("Mul", b("Mul", xs, inv), b.f32(t["weight"])), t["x"])]


def _rope(b, t, a):
    x = b.f32(t["x"])
    shape = b("Shape", x)
    # cos / sin [T, D/2] viewed as [T, 1, ..., 1, D/2] to broadcast over head dims.
    middle = b("Reshape", b("Sub", b("Size", shape), b.const(2, "int64")), b.ints(1))
    ones = b("ConstantOfShape", middle, value=_int64_one())
    c = b.reshape(b.f32(t["cos"]), b.dim(t["cos"], 0), ones, b.dim(t["cos"], 1))
    s = b.reshape(b.f32(t["sin"]), b.dim(t["sin"], 0), ones, b.dim(t["sin"], 1))
    if a["interleaved"]:
        big = b.ints(_INT64_MAX)
        x1 = b("Slice", x, b.ints(0), big, b.ints(-1), b.ints(2))
        x2 = b("Slice", x, b.ints(1), big, b.ints(-1), b.ints(2))
    else:
        x1, x2 = b("Split", x, axis=-1, num_outputs=2, outputs=2)
    y1 = b("Sub", b("Mul", x1, c), b("Mul", x2, s))
    y2 = b("Add", b("Mul", x1, s), b("Mul", x2, c))
    if a["interleaved"]:
        pair = b("Concat", b("Unsqueeze", y1, b.ints(-1)), b("Unsqueeze", y2, b.ints(-1)), axis=-1)
        y = b("Reshape", pair, shape, allowzero=1)
    else:
        y = b("Concat", y1, y2, axis=-1)
    return [b("CastLike", y, t["x"])]


def _int64_one():
    from onnx import helper

    return helper.make_tensor("one", 7, [1], [1])


def _token_logprobs(b, t, a):
    h, w = b.f32(t["hidden"]), b.f32(t["lm_head"])
    logits = b("Div", b("MatMul", h, _t(b, w, 1, 0)), b.attr("temperature", "float"))
    lp = b("LogSoftmax", logits, axis=-1)
    targets = t["targets"]
    v = b.dim(w, 0)
    tg = b("Cast", targets, to=7)
    valid = b("And", b("GreaterOrEqual", tg, b.const(0, "int64")), b("Less", tg, v))
    # A NaN column V: a target outside [0, V) picks it (also when V = 0).
    nan = float("nan")
    lp_nan = b("Concat", lp, b.full(nan, b.dim(lp, 0), b.ints(1)), axis=1)
    pick = b("Unsqueeze", b("Where", valid, tg, v), b.ints(1))
    logp = b("Squeeze", b("GatherElements", lp_nan, pick, axis=1), b.ints(1))
    entropy = b("Neg", b("ReduceSum", b("Mul", b("Exp", lp), lp), b.ints(-1), keepdims=0))
    no_vocab = b("Equal", v, b.const(0, "int64"))  # nothing to normalise: NaN, as the reference
    return [logp, b("Where", no_vocab, b.const(nan), entropy)]


_BODIES: dict[str, Callable] = {
    "lightning_indexer": _lightning_indexer,
    "indexer_logits": _indexer_logits,
    "sparse_attention": _sparse_attention,
    "moe_gate": _moe_gate,
    "moe_dispatch": _moe_dispatch,
    "moe_combine": _moe_combine,
    "grouped_gemm": _grouped_gemm,
    "quantize": _quantize,
    "quant_gemm": _quant_gemm,
    "rms_norm": _rms_norm,
    "rope": _rope,
    "token_logprobs": _token_logprobs,
}


# -- function protos, the opaque node's schema, and models -----------------------------

_ONNX_DTYPES = {
    torch.float32: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 9,
    torch.float16: 10,
    torch.float64: 11,
    torch.bfloat16: 16,
    FP8_DTYPE: 2,  # opset 18 has no float8: its bit patterns as uint8
}


def onnx_dtype(dtype: torch.dtype) -> int:
    """The ONNX element type a torch tensor of ``dtype`` travels as (fp8 as uint8)."""
    if dtype not in _ONNX_DTYPES:
        raise TypeError(f"no ONNX element type for {dtype}")
    return _ONNX_DTYPES[dtype]


def _attribute_default(p: Param):
    from onnx import helper

    return helper.make_attribute(p.name, p.default)


def function_proto(op: str, overload: str) -> onnx.FunctionProto:
    """The body of ``op``'s variant ``overload`` (see :func:`_variant`): inputs and
    attributes named as in the torch schema, opset 18 standard ops only."""
    from onnx import helper

    if op not in _BODIES:
        raise ValueError(f"{op!r} is not a glmport op; ops: {', '.join(OP_NAMES)}")
    attrs, present = _parse_variant(op, overload)
    b = _Body()
    tensors = {
        p.name: p.name if p.kind == "tensor" or p.name in present else None
        for p in params(op)
        if p.is_tensor
    }
    results = _BODIES[op](b, tensors, attrs)
    outs = output_names(op)
    for result, name in zip(results, outs, strict=True):
        b.nodes.append(helper.make_node("Identity", [result], [name]))
    fn = helper.make_function(
        DOMAIN,
        op,
        [p.name for p in params(op) if p.is_tensor],
        list(outs),
        b.nodes,
        [helper.make_opsetid("", OPSET)],
        attributes=[p.name for p in params(op) if not p.is_tensor and p.default is _NO_DEFAULT],
    )
    fn.attribute_proto.extend(
        _attribute_default(p)
        for p in params(op)
        if not p.is_tensor and p.default is not _NO_DEFAULT
    )
    fn.overload = overload
    fn.doc_string = f"glmport.ops.{op} ({overload or 'default'}): {SPECS[op].schema}"
    return fn


def _node_attrs(node) -> dict[str, object]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value: object) -> object:
    return value.decode() if isinstance(value, bytes) else value


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every ``ai.glmport`` node of ``model``'s graph its function body.

    Each node gets the overload of its structural variant (its str/bool attributes,
    which optional inputs it has), and the model one ``FunctionProto`` per variant
    used; opset imports (``""`` 18, ``ai.glmport`` 1) and IR version 10 are set. The
    model is changed in place and returned; attaching twice changes nothing more.
    """
    from onnx import helper

    wanted: dict[tuple[str, str], None] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type not in _BODIES:
            raise ValueError(
                f"node {node.name or node.op_type!r}: {DOMAIN}::{node.op_type} is not a "
                f"glmport op; ops: {', '.join(OP_NAMES)}"
            )
        attrs = {k: _decode(v) for k, v in _node_attrs(node).items()}
        tensor_params = [p for p in params(node.op_type) if p.is_tensor]
        present = {p.name for p, name in zip(tensor_params, node.input, strict=False) if name}
        node.overload = _variant(node.op_type, attrs, present)
        wanted[(node.op_type, node.overload)] = None
    have = {(f.domain, f.name, f.overload) for f in model.functions}
    for op, overload in wanted:
        if (DOMAIN, op, overload) not in have:
            model.functions.append(function_proto(op, overload))
    imports = {o.domain: o for o in model.opset_import}
    if "" in imports and imports[""].version != OPSET:
        raise ValueError(
            f"the model imports opset {imports[''].version}; glmport bodies are opset {OPSET} "
            "(a function body's opset must equal the model's)"
        )
    for domain, version in (("", OPSET), (DOMAIN, DOMAIN_VERSION)):
        if domain not in imports:
            model.opset_import.append(helper.make_opsetid(domain, version))
    model.ir_version = max(model.ir_version, IR_VERSION)
    return model


_ALL_TYPES = [
    "tensor(float)",
    "tensor(float16)",
    "tensor(bfloat16)",
    "tensor(double)",
    "tensor(int8)",
    "tensor(uint8)",
    "tensor(int32)",
    "tensor(int64)",
    "tensor(bool)",
]


@functools.cache
def op_schema(op: str):
    """The ``onnx.defs.OpSchema`` of the opaque ``ai.glmport`` node of ``op``, derived
    from its torch schema: each tensor an input with its own type variable (optional
    for ``Tensor?``), each scalar an attribute with the schema's default."""
    from onnx import defs

    fp = defs.OpSchema.FormalParameter
    single, optional = (
        defs.OpSchema.FormalParameterOption.Single,
        defs.OpSchema.FormalParameterOption.Optional,
    )
    inputs = [
        fp(p.name, f"T_{p.name}", param_option=optional if p.kind == "optional" else single)
        for p in params(op)
        if p.is_tensor
    ]
    outputs = [fp(name, f"T_out_{name}") for name in output_names(op)]
    constraints = [(f"T_{p.name}", _ALL_TYPES, "") for p in params(op) if p.is_tensor]
    constraints += [(f"T_out_{name}", _ALL_TYPES, "") for name in output_names(op)]
    attr_types = {
        "int": defs.OpSchema.AttrType.INT,
        "float": defs.OpSchema.AttrType.FLOAT,
        "bool": defs.OpSchema.AttrType.INT,
        "str": defs.OpSchema.AttrType.STRING,
    }
    attributes = [
        defs.OpSchema.Attribute(p.name, _attribute_default(p), "")
        if p.default is not _NO_DEFAULT
        else defs.OpSchema.Attribute(p.name, attr_types[p.kind], "", required=True)
        for p in params(op)
        if not p.is_tensor
    ]
    return defs.OpSchema(
        op,
        DOMAIN,
        DOMAIN_VERSION,
        SPECS[op].schema,
        inputs=inputs,
        outputs=outputs,
        type_constraints=constraints,
        attributes=attributes,
    )


_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _translation(op: str) -> Callable:
    """The torch.onnx translation of ``op``: one opaque ``ai.glmport`` node whose
    Python signature mirrors the torch schema (annotated scalars are attributes)."""
    from onnxscript import values

    node_op = values.Op(values.Opset(DOMAIN, DOMAIN_VERSION), op, op_schema=op_schema(op))
    ps = params(op)

    def translate(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = [bound.arguments[p.name] for p in ps if p.is_tensor]
        attrs = {p.name: bound.arguments[p.name] for p in ps if not p.is_tensor}
        return node_op(*tensors, **attrs)

    sig = inspect.Signature(
        [
            inspect.Parameter(
                p.name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=inspect.Parameter.empty if p.default is _NO_DEFAULT else p.default,
            )
            for p in ps
        ]
    )
    translate.__signature__ = sig
    translate.__annotations__ = {p.name: _PY_TYPES[p.kind] for p in ps if not p.is_tensor}
    translate.__name__ = translate.__qualname__ = op
    return translate


def translation_table() -> dict[torch._ops.OpOverload, Callable]:
    """``{torch.ops.glmport.<op>.default: translation}`` for every op, for
    ``torch.onnx.export(..., dynamo=True, custom_translation_table=...,
    opset_version=OPSET)``; call :func:`attach_functions` on the exported model."""
    import glmport.core.library  # noqa: F401

    return {getattr(torch.ops.glmport, op).default: _translation(op) for op in OP_NAMES}


def op_model(op: str, args: Sequence[object]) -> onnx.ModelProto:
    """A one-node model of ``op`` called with ``args`` (schema order): tensors become
    graph inputs of their dtype and rank with symbolic dims (float8 as uint8), scalars
    attributes, ``None`` an absent optional input; functions attached. Any call with
    the same dtypes, ranks, scalars and ``None`` pattern fits the same model."""
    from onnx import helper

    ps = params(op)
    if len(args) != len(ps):
        raise TypeError(f"{op}: expected {len(ps)} arguments ({', '.join(p.name for p in ps)})")
    inputs, names, attrs = [], [], {}
    for p, value in zip(ps, args, strict=True):
        if p.is_tensor:
            if value is None:
                names.append("")
                continue
            dims = [f"{p.name}_{i}" for i in range(value.dim())]
            inputs.append(helper.make_tensor_value_info(p.name, onnx_dtype(value.dtype), dims))
            names.append(p.name)
        else:
            attrs[p.name] = value
    while names and not names[-1]:
        names.pop()
    fakes = SPECS[op].fake(*args)
    fakes = fakes if isinstance(fakes, tuple) else (fakes,)
    outs = [
        helper.make_tensor_value_info(
            name, onnx_dtype(f.dtype), [f"{name}_{i}" for i in range(f.dim())]
        )
        for name, f in zip(output_names(op), fakes, strict=True)
    ]
    node = helper.make_node(op, names, list(output_names(op)), domain=DOMAIN, **attrs)
    graph = helper.make_graph([node], f"glmport_{op}", inputs, outs)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        ir_version=IR_VERSION,
        producer_name="glmport",
    )
    return attach_functions(model)
