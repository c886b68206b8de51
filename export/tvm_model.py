"""The GLM-5 model to TVM (Relax), compiled for the CPU, and the compiled model run in
the Relax VM.

Two roads in: ``torch.export`` of :mod:`.graph`'s static forward into
``from_exported_program``, with :mod:`.tvm_ops` lowering every glmport op to Relax ops
(``source="torch"``), or the ONNX export with its ``ai.glmport`` nodes inlined into
``from_onnx`` (``source="onnx"``, fixed shapes). Importing this module needs the ``export``
extra.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import onnx
import torch
import tvm
from tvm import relax

from glmport.core.errors import ConfigError, UnsupportedError
from glmport.core.formats import FP8_DTYPE
from glmport.model.causal_lm import GlmMoeDsaForCausalLM

from .graph import GraphKind, check_graph_inputs, traced_graph, unwrapped_errors
from .tvm_graph import FP8_REASON
from .tvm_ops import convert_map
from .tvm_runtime import compile_relax, from_tvm, save_library, to_tvm

Source = Literal["torch", "onnx"]
SOURCES: tuple[Source, ...] = ("torch", "onnx")
_LIBRARY = "model.so"
_META = "glmport_export.json"
_LEAF_SPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def relax_module(
    model: GlmMoeDsaForCausalLM,
    kind: GraphKind = "prefill",
    source: Source = "torch",
    *,
    fixed: Mapping[str, int] | None = None,
) -> tvm.IRModule:
    """``model``'s graph of ``kind`` as a Relax module, weights bound as constants.

    From torch (the default), batch, sequence and cache axes stay symbolic. From ONNX,
    ``fixed`` sets them (``batch`` and ``seq``; ``batch`` and ``past`` for decode): TVM
    0.27's ONNX importer cannot take the shape arithmetic of a dynamic export (it reads
    ``Squeeze(Shape(x))`` as a scalar its ``Reshape`` refuses), so the axes are fixed and
    that arithmetic folded to constants (onnxscript's optimiser) first. Raises
    :class:`~glmport.core.errors.UnsupportedError` naming an op TVM cannot take."""
    if source not in SOURCES:
        raise ConfigError(f"source must be one of {SOURCES}, got {source!r}")
    if model.lm_head.weight.dtype == torch.bfloat16:
        raise UnsupportedError(
            "TVM export: TVM 0.27's layer_norm (the indexer's key norm) takes float32 and "
            "float16 only, not bfloat16; export the model in float32 or float16"
        )
    if source == "onnx":
        sizes = _fixed_sizes(model, kind, fixed)
    with unwrapped_errors():
        if source == "torch":
            from tvm.relax.frontend.torch import from_exported_program

            graph, args, dynamic = traced_graph(model, kind)
            program = torch.export.export(graph, args, dynamic_shapes=dynamic)
            _refuse_fp8_inputs(program)
            converters = {**convert_map(), **_matmuls_in_input_dtype()}
            with warnings.catch_warnings():
                # torch's run_decompositions, which the importer calls, deep-copies a
                # LeafSpec of its own call graph: torch's deprecation, nothing to act on.
                warnings.filterwarnings("ignore", _LEAF_SPEC, FutureWarning)
                mod = from_exported_program(program, custom_convert_map=converters)
        else:
            import onnxscript
            from tvm.relax.frontend.onnx import from_onnx

            from .onnx_model import export_onnx

            # The ONNX guards gate input_ids through a Reshape of a data-dependent shape,
            # which TVM's importer cannot take: the asserts below take their place.
            proto = export_onnx(model, kind, inline=True, guards=False)
            for value, shape in zip(proto.graph.input, sizes, strict=True):
                for dim, size in zip(value.type.tensor_type.shape.dim, shape, strict=True):
                    dim.dim_value = size
            mod = from_onnx(_constants_as_value(onnxscript.optimizer.optimize(proto)))
    return _guarded(mod, model.config.vocab_size)


def _guarded(mod: tvm.IRModule, vocab: int) -> tvm.IRModule:
    """``mod`` whose ``main`` asserts, before it runs the graph, that ``input_ids``
    holds at least one sequence of one position and only ids in ``[0, vocab)``: TVM's
    gather (``take``) does not check its indices, so a bad id read memory outside the
    embedding. A failed assert raises ``AssertionError`` naming the condition. The VM
    checks dtypes, ranks and every size the signature ties together (both caches of one
    batch and length) itself."""
    op = relax.op
    graph = mod["main"]
    others = {gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"}
    bb = relax.BlockBuilder(tvm.IRModule(others))
    unchecked = bb.add_func(graph.without_attr("global_symbol"), "main_unchecked")
    params = [relax.Var(p.name, p.ty) for p in graph.params]
    ids = params[0]

    def check(condition: relax.Expr, text: str) -> None:
        bb.emit(op.assert_op(bb.emit(condition), [], f"glmport guard: {text}"))

    def int64(value: int) -> relax.Expr:
        return relax.const(value, "int64")

    with bb.function("main", params):
        size = op.shape_to_tensor(relax.ShapeExpr([ids.ty.shape[0] * ids.ty.shape[1]]))
        check(
            op.greater(op.reshape(size, []), int64(0)),
            "input_ids [batch, seq] with batch and seq >= 1",
        )
        # After the check above: TVM's sum over no element returns uninitialised memory.
        inside = op.logical_and(op.greater_equal(ids, int64(0)), op.less(ids, int64(vocab)))
        outside = op.sum(op.astype(op.logical_not(inside), "int64"))
        check(op.equal(outside, int64(0)), f"input_ids in [0, {vocab})")
        bb.emit_func_output(bb.emit(relax.Call(unchecked, params)))
    return bb.get()


def _fixed_sizes(
    model: GlmMoeDsaForCausalLM, kind: GraphKind, fixed: Mapping[str, int] | None
) -> list[tuple[int, ...]]:
    """The graph inputs' static shapes from ``fixed`` (see :func:`relax_module`)."""
    c = model.config
    want = ("batch", "seq") if kind == "prefill" else ("batch", "past")
    fixed = dict(fixed or {})
    if set(fixed) != set(want) or not all(isinstance(fixed[k], int) and fixed[k] > 0 for k in want):
        raise ConfigError(
            f"the ONNX road into TVM compiles fixed shapes: give {' and '.join(want)} as "
            f"positive integers (got {fixed or 'none'})"
        )
    if kind == "prefill":
        return [(fixed["batch"], fixed["seq"])]
    b, p, layers = fixed["batch"], fixed["past"], c.num_hidden_layers
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    return [(b, 1), (layers, b, p, latent), (layers, b, p, c.index_head_dim)]


def _matmuls_in_input_dtype() -> dict[str, Callable]:
    """``custom_convert_map`` entries for torch's matmul family that keep the input's
    dtype. TVM 0.27's importer makes every ``matmul`` / ``mm`` / ``bmm`` / ``addmm`` /
    ``linear`` output float32, which breaks a bf16 model wherever that output meets a
    bf16 tensor (the cache concatenation)."""

    def emit(importer, expr: relax.Expr) -> relax.Expr:
        return importer.block_builder.emit(expr)

    def matmul(node: torch.fx.Node, importer) -> relax.Expr:
        a, b = importer.retrieve_args(node)[:2]
        return emit(importer, relax.op.matmul(a, b, out_dtype=str(a.ty.dtype)))

    def linear(node: torch.fx.Node, importer) -> relax.Expr:
        x, weight, *bias = importer.retrieve_args(node)
        b = bias[0] if bias else None
        return emit(importer, relax.op.linear(x, weight, b, str(x.ty.dtype)))

    def addmm(node: torch.fx.Node, importer) -> relax.Expr:
        x, a, b = importer.retrieve_args(node)[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        dtype = str(a.ty.dtype)
        product = emit(importer, relax.op.matmul(a, b, out_dtype=dtype))
        if alpha != 1:
            product = emit(importer, relax.op.multiply(product, relax.const(alpha, dtype)))
        if beta != 1:
            x = emit(importer, relax.op.multiply(x, relax.const(beta, dtype)))
        return emit(importer, relax.op.add(x, product)) if beta != 0 else product

    return {"matmul.default": matmul, "mm.default": matmul, "bmm.default": matmul,
            "addmm.default": addmm, "linear.default": linear}  # fmt: skip


def _refuse_fp8_inputs(program: torch.export.ExportedProgram) -> None:
    """A float8 weight (FP8-block GEMMs) cannot enter TVM: name the op that reads it."""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and getattr(value, "dtype", None) == FP8_DTYPE:
            readers = sorted({str(user.target).split(".")[-2] for user in node.users})
            raise UnsupportedError(
                f"TVM export: {', '.join(readers)} reads the float8 tensor {node.name}: "
                f"{FP8_REASON}; export such a model to ONNX, or quantise it without fp8"
            )


def _constants_as_value(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``from_onnx`` reads a Constant node's ``value`` only: rewrite ``value_int`` /
    ``value_ints`` / ``value_float(s)`` into an equal ``value`` tensor."""
    kinds = {
        "value_int": onnx.TensorProto.INT64,
        "value_ints": onnx.TensorProto.INT64,
        "value_float": onnx.TensorProto.FLOAT,
        "value_floats": onnx.TensorProto.FLOAT,
    }
    for node in proto.graph.node:
        if node.op_type != "Constant" or node.attribute[0].name not in kinds:
            continue
        attr = node.attribute[0]
        value = onnx.helper.get_attribute_value(attr)
        dims = [len(value)] if isinstance(value, list) else []
        values = value if isinstance(value, list) else [value]
        tensor = onnx.helper.make_tensor("value", kinds[attr.name], dims, values)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", tensor))
    return proto


@dataclass
class TvmModel:
    """A compiled graph in the Relax VM: ``run`` takes the graph's inputs as torch tensors
    and returns its outputs (logits, present latent, present index keys). It refuses
    inputs the graph cannot compute correctly with a
    :class:`~glmport.export.graph.GraphInputError` naming the input, before the VM sees
    them (:func:`~glmport.export.graph.check_graph_inputs`)."""

    executable: relax.VMExecutable
    kind: GraphKind
    config: dict
    dtype: torch.dtype  # the model's, which the caches carry
    fixed: dict[str, int] = field(default_factory=dict)  # static axes (the ONNX road)

    @classmethod
    def build(
        cls,
        model: GlmMoeDsaForCausalLM,
        kind: GraphKind = "prefill",
        source: Source = "torch",
        *,
        fixed: Mapping[str, int] | None = None,
    ) -> TvmModel:
        """Compile ``model``'s graph of ``kind`` (see :func:`relax_module`)."""
        mod = relax_module(model, kind, source, fixed=fixed)
        dtype = model.lm_head.weight.dtype
        return cls(compile_relax(mod), kind, model.config.to_dict(), dtype, dict(fixed or {}))

    def save(self, folder: str | Path) -> Path:
        """Write ``model.so`` and ``glmport_export.json`` (graph kind, config, dtype,
        fixed axes)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_library(self.executable, folder / _LIBRARY)
        meta = {
            "graph": self.kind,
            "config": self.config,
            "dtype": str(self.dtype).removeprefix("torch."),
            "fixed": self.fixed,
            "library": _LIBRARY,
        }
        (folder / _META).write_text(json.dumps(meta, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> TvmModel:
        folder = Path(folder)
        meta = json.loads((folder / _META).read_text())
        lacking = [k for k in ("graph", "config", "dtype", "fixed", "library") if k not in meta]
        if lacking:
            raise ConfigError(
                f"{folder / _META} lacks {', '.join(lacking)}: written by an older glmport? "
                "Export the model again"
            )
        library = tvm.runtime.load_module(str(folder / meta["library"]))
        dtype = getattr(torch, meta["dtype"])
        return cls(library, meta["graph"], meta["config"], dtype, meta["fixed"])

    def __post_init__(self) -> None:
        # One VM for every run: building one costs ~1.6 ms, a third of a tiny decode step.
        self._main = relax.VirtualMachine(self.executable, tvm.cpu())["main"]

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_graph_inputs(self.kind, self.config, self.dtype, inputs, self.fixed)
        out = self._main(*(to_tvm(t) for t in inputs))
        return tuple(from_tvm(o) for o in out)
