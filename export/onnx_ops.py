"""Every glmport op as an ONNX custom-domain node with a function body of standard ops.

A glmport op is exported as one node of domain ``ai.glmport`` (version 1) named after
the op, with the torch schema's arguments: tensors as inputs (an absent optional
tensor is an empty input name), every scalar as an attribute of the same name and
default. Vendor runtimes may map the node to a fused kernel; everyone else runs its
``FunctionProto`` body, built from standard ONNX ops at opset 18 (``TopK``,
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

This module holds the ops' signatures, variants, function protos, schemas and
translations; the bodies are in :mod:`.onnx_bodies`, built with :mod:`.onnx_body`.

onnx / onnxscript are imported inside functions only: importing glmport must not
import them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmport.core.formats import FP8_DTYPE
from glmport.core.specs import OP_NAMES, SPECS

from .onnx_bodies import BODIES
from .onnx_body import Body

if TYPE_CHECKING:
    import onnx

DOMAIN = "ai.glmport"
DOMAIN_VERSION = 1
OPSET = 18
IR_VERSION = 10  # function overloads: one body per structural variant

_NO_DEFAULT = object()


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

    if op not in BODIES:
        raise ValueError(f"{op!r} is not a glmport op; ops: {', '.join(OP_NAMES)}")
    attrs, present = _parse_variant(op, overload)
    b = Body()
    tensors = {
        p.name: p.name if p.kind == "tensor" or p.name in present else None
        for p in params(op)
        if p.is_tensor
    }
    results = BODIES[op](b, tensors, attrs)
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
        if node.op_type not in BODIES:
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
