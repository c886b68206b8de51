"""The GLM-5 model to ONNX, and the exported model run in onnxruntime.

``torch.onnx.export(dynamo=True)`` traces :mod:`.graph`'s static forward; every glmport
op becomes one ``ai.glmport`` node that carries its ONNX function body
(:mod:`.onnx_ops`), so onnxruntime runs it and a vendor runtime may put its fused
kernel in the node's place. ``inline=True`` expands those nodes into standard ops. Importing
this module needs the ``export`` extra (onnx, onnxruntime, onnxscript).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy
import onnx
import onnx.inliner
import torch

from glmport.core.errors import ConfigError, UnsupportedError
from glmport.model.causal_lm import GlmMoeDsaForCausalLM

from .graph import (
    GRAPH_INPUTS,
    GRAPH_OUTPUTS,
    GraphKind,
    check_graph_inputs,
    traced_graph,
    unwrapped_errors,
)
from .onnx_ops import DOMAIN, OPSET, attach_functions, translation_table
from .ort_runtime import from_ort, to_ort

# Above this size the weights go to a side file (a protobuf holds at most 2 GiB).
_EXTERNAL_DATA_BYTES = 1 << 30


def export_onnx(
    model: GlmMoeDsaForCausalLM,
    kind: GraphKind = "prefill",
    *,
    inline: bool = False,
    guards: bool = True,
) -> onnx.ModelProto:
    """``model`` as an ONNX model of :mod:`.graph`'s ``kind`` ("prefill": ``input_ids
    [batch, seq]`` -> logits and caches; "decode": one step on the caches), dynamic batch,
    sequence and cache axes. With ``guards`` (the default) the graph fails on inputs it
    cannot compute correctly (:func:`_guard_inputs`); ``guards=False`` leaves them out
    for the ONNX road into TVM, which adds its own. Checked with ``onnx.checker`` (full)
    and strict shape inference. Raises :class:`~glmport.core.errors.UnsupportedError`
    naming the op a translation cannot take."""
    graph, args, dynamic = traced_graph(model, kind)
    with _quiet_exporter(), unwrapped_errors():
        program = torch.onnx.export(
            graph,
            args,
            dynamo=True,
            custom_translation_table=translation_table(),
            dynamic_shapes=dynamic,
            input_names=list(GRAPH_INPUTS[kind]),
            output_names=list(GRAPH_OUTPUTS),
            opset_version=OPSET,
            optimize=False,  # the optimiser would inline the ai.glmport nodes
            verbose=False,
        )
    proto = attach_functions(_fp8_as_bits(program.model_proto))
    if guards:
        _guard_inputs(proto, kind, model.config.vocab_size)
    if inline:
        proto = onnx.inliner.inline_local_functions(proto)
        del proto.functions[:]
        kept = [o for o in proto.opset_import if o.domain != DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)
    onnx.helper.set_model_props(
        proto, {"glmport.graph": kind, "glmport.config": json.dumps(model.config.to_dict())}
    )
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    return proto


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx's notices about optional packages (torchvision), deprecations and axis
    renames say nothing about this export: keep them off the user's terminal."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*axis name", category=UserWarning)
            yield
    finally:
        registration.setLevel(level)


def _fp8_as_bits(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Opset 18 has no float8 type: a float8 e4m3 weight (FP8-block GEMMs) becomes its
    uint8 bit pattern, which is what the ``ai.glmport`` function bodies decode. Only
    those nodes may read it."""
    fp8 = onnx.TensorProto.FLOAT8E4M3FN
    names = {t.name for t in proto.graph.initializer if t.data_type == fp8}
    for node in proto.graph.node:
        if node.domain != DOMAIN and names.intersection(node.input):
            raise UnsupportedError(
                f"ONNX export: the standard op {node.op_type} ({node.name}) reads a float8 "
                "tensor, which opset 18 cannot type; only glmport ops take float8 here"
            )
    for t in proto.graph.initializer:
        if t.data_type == fp8:
            t.data_type = onnx.TensorProto.UINT8
    for v in (*proto.graph.input, *proto.graph.value_info):
        if v.name in names:
            v.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    return proto


def _guard_inputs(proto: onnx.ModelProto, kind: GraphKind, vocab: int) -> None:
    """Make the graph fail, in any runtime that follows the ONNX spec, on the inputs it
    cannot compute correctly (:func:`~glmport.export.graph.check_graph_inputs` refuses
    the same ones with a typed error before a glmport runner feeds them).

    Opset 18 has no assertion, and a check beside the data path would be pruned, so
    each condition gates ``input_ids`` on its way into the graph: a ``Reshape`` to its
    own shape while the condition holds, else to one element more, which the spec makes
    an error. The ``Reshape`` is named after the condition, so the runtime's error says
    which one failed (onnxruntime: "... running Reshape node. Name:'glmport guard:
    input_ids in [0, 128)' ..."). The conditions: at least one sequence of one position;
    every id in ``[0, vocab)`` (Gather would take a negative id from the end of the
    embedding); for decode, both caches of ``input_ids``' batch and of one length. The
    runtime itself checks dtypes, ranks and fixed sizes against the graph's inputs."""
    from onnx import TensorProto, helper, numpy_helper

    nodes: list[onnx.NodeProto] = []

    def node(op_type: str, *inputs: str, name: str = "", **attrs: object) -> str:
        out = f"glmport_guard_{len(nodes)}"
        nodes.append(helper.make_node(op_type, list(inputs), [out], name=name or out, **attrs))
        return out

    def ints(*values: int) -> str:
        return node("Constant", value=numpy_helper.from_array(numpy.array(values, "int64")))

    def dim(value: str, axis: int) -> str:
        return node("Gather", node("Shape", value), ints(axis), axis=0)

    ids = "input_ids"
    shape, size = node("Shape", ids), node("Size", ids)
    one_more = node("Concat", node("Add", node("Reshape", size, ints(1)), ints(1)), ints(1), axis=0)
    gated = ids

    def gate(ok: str, condition: str) -> None:
        nonlocal gated
        target = node("Where", ok, shape, one_more)
        gated = node("Reshape", gated, target, name=f"glmport guard: {condition}")

    gate(node("Greater", size, ints(0)), "input_ids [batch, seq] with batch and seq >= 1")
    outside = node(
        "Not", node("And", node("GreaterOrEqual", ids, ints(0)), node("Less", ids, ints(vocab)))
    )
    count = node("ReduceSum", node("Cast", outside, to=TensorProto.INT64), keepdims=0)
    gate(node("Equal", count, ints(0)), f"input_ids in [0, {vocab})")
    if kind == "decode":
        batch = dim(ids, 0)
        same_batch = node(
            "And",
            node("Equal", dim("past_latent", 1), batch),
            node("Equal", dim("past_index_keys", 1), batch),
        )
        gate(same_batch, "past_latent and past_index_keys of input_ids' batch (axis 1)")
        same_past = node("Equal", dim("past_latent", 2), dim("past_index_keys", 2))
        gate(same_past, "past_index_keys as many cached positions as past_latent (axis 2)")
    for n in proto.graph.node:
        n.input[:] = [gated if i == ids else i for i in n.input]
    graph_nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes + graph_nodes)
    declared = next(v for v in proto.graph.input if v.name == ids)
    checked = proto.graph.value_info.add()
    checked.CopyFrom(declared)
    checked.name = gated


def save_onnx(proto: onnx.ModelProto, path: str | Path) -> Path:
    """Write ``proto`` to ``path``; weights past 1 GiB go to ``<name>.data`` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    large = proto.ByteSize() > _EXTERNAL_DATA_BYTES
    onnx.save_model(
        proto, path, save_as_external_data=large, location=path.name + ".data" if large else None
    )
    return path


# The ONNX element types a cache input may have (the model's dtype).
_CACHE_DTYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
}


@dataclass
class OnnxRuntimeModel:
    """An exported graph in an onnxruntime session: ``run`` takes the graph's inputs as
    torch tensors (``input_ids`` int64, caches in the model's dtype) and returns its
    outputs (logits, present latent, present index keys) as torch tensors. It refuses
    inputs the graph cannot compute correctly with a
    :class:`~glmport.export.graph.GraphInputError` naming the input, before the runtime
    sees them (:func:`~glmport.export.graph.check_graph_inputs`)."""

    session: object

    def __post_init__(self) -> None:
        props = self.session.get_modelmeta().custom_metadata_map
        if "glmport.graph" not in props or "glmport.config" not in props:
            raise ConfigError(
                "this ONNX model is not a glmport export: its metadata lacks glmport.graph "
                "and glmport.config (export it with glmport export onnx)"
            )
        self.kind: GraphKind = props["glmport.graph"]
        self.config: dict = json.loads(props["glmport.config"])
        caches = self.session.get_inputs()[1:]  # decode: the model's dtype
        self.dtype = _CACHE_DTYPES[caches[0].type] if caches else None

    @classmethod
    def load(cls, model: str | Path | onnx.ModelProto, threads: int = 0) -> OnnxRuntimeModel:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3  # errors only: not its constant-folding notices
        # Idle pool threads would spin and take the cores from torch in the same process.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
        try:
            return cls(ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"]))
        except ort.capi.onnxruntime_pybind11_state.NotImplemented as err:
            raise UnsupportedError(f"onnxruntime's CPU execution provider: {err}") from err

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_graph_inputs(self.kind, self.config, self.dtype, inputs)
        names = [i.name for i in self.session.get_inputs()]
        feed = {n: to_ort(t.cpu()) for n, t in zip(names, inputs, strict=True)}
        return tuple(from_ort(o) for o in self.session.run_with_ort_values(None, feed))
