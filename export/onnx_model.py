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

import onnx
import onnx.inliner
import torch

from glmport.core.errors import UnsupportedError
from glmport.model.causal_lm import GlmMoeDsaForCausalLM

from .graph import GRAPH_INPUTS, GRAPH_OUTPUTS, GraphKind, traced_graph, unwrapped_errors
from .onnx_ops import DOMAIN, OPSET, attach_functions, translation_table
from .ort_backend import from_ort, to_ort

# Above this size the weights go to a side file (a protobuf holds at most 2 GiB).
_EXTERNAL_DATA_BYTES = 1 << 30


def export_onnx(
    model: GlmMoeDsaForCausalLM, kind: GraphKind = "prefill", *, inline: bool = False
) -> onnx.ModelProto:
    """``model`` as an ONNX model of :mod:`.graph`'s ``kind`` ("prefill": ``input_ids
    [batch, seq]`` -> logits and caches; "decode": one step on the caches), dynamic batch,
    sequence and cache axes. Checked with ``onnx.checker`` (full) and strict shape
    inference. Raises :class:`~glmport.core.errors.UnsupportedError` naming the op a
    translation cannot take."""
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


def save_onnx(proto: onnx.ModelProto, path: str | Path) -> Path:
    """Write ``proto`` to ``path``; weights past 1 GiB go to ``<name>.data`` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    large = proto.ByteSize() > _EXTERNAL_DATA_BYTES
    onnx.save_model(
        proto, path, save_as_external_data=large, location=path.name + ".data" if large else None
    )
    return path


@dataclass
class OnnxRuntimeModel:
    """An exported graph in an onnxruntime session: ``run`` takes the graph's inputs as
    torch tensors (``input_ids`` int64, caches in the model's dtype) and returns its
    outputs (logits, present latent, present index keys) as torch tensors."""

    session: object

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
        names = [i.name for i in self.session.get_inputs()]
        feed = {n: to_ort(t.cpu()) for n, t in zip(names, inputs, strict=True)}
        return tuple(from_ort(o) for o in self.session.run_with_ort_values(None, feed))
