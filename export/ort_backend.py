"""The ``onnxruntime`` backend: every glmport op exported alone to ONNX and run by
ONNX Runtime's CPU execution provider.

Each call's *signature family* (op, scalar arguments, input dtypes and ranks, which
optional inputs are None) is exported once (:func:`glmport.export.onnx_ops.op_model`,
symbolic dims) into a cached ``InferenceSession`` that serves every size. Tensors
cross as ``OrtValue``\\ s: bfloat16 as its uint16 bits tagged bfloat16, float8 as its
uint8 bits (opset 18 has no float8; the function bodies decode them); outputs come
back through DLPack, float8 outputs re-viewed from their uint8 bits.

Inference only: gradients fall back to the generic composite's vjp. The conformance
suite's model-level check runs the model's whole ONNX export (:meth:`model_runner`).
onnx / onnxruntime are imported when the kernels load, never with glmport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from glmport.core.errors import UnsupportedError
from glmport.core.extras import missing
from glmport.core.registry import Availability, Backend, BackendManifest, Kernel
from glmport.core.specs import OP_NAMES, SPECS

from .empty_sources import result_without_source_rows
from .onnx_ops import op_model, params
from .ort_runtime import from_ort, to_ort


class _Sessions:
    """One ``InferenceSession`` per signature family, built on first use (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[tuple, object] = {}

    def get(self, op: str, args: tuple):
        key = (op, *(_signature(a) for a in args))
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = _build(op, args)
            return session


def _signature(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim())
    return (type(value).__name__, value)


def _build(op: str, args: tuple):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    model = op_model(op, args)
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _kernel(op: str, sessions: _Sessions) -> Kernel:
    names = _tensor_names(op)

    def run(*args):
        for name, a in zip(_arg_names(op), args, strict=True):
            if isinstance(a, torch.Tensor) and a.device.type != "cpu":
                raise UnsupportedError(
                    f"{op}: onnxruntime runs CPU tensors; '{name}' is on {a.device}"
                )
        known = result_without_source_rows(op, args)
        if known is not None:
            return known
        session = sessions.get(op, args)
        feeds = {
            name: to_ort(a)
            for name, a in zip(_arg_names(op), args, strict=True)
            if name in names and a is not None
        }
        outs = session.run_with_ort_values(None, feeds)
        fakes = SPECS[op].fake(*args)
        fakes = fakes if isinstance(fakes, tuple) else (fakes,)
        result = tuple(from_ort(v, f.dtype) for v, f in zip(outs, fakes, strict=True))
        return result if len(result) > 1 else result[0]

    run.__name__ = f"onnxruntime_{op}"
    return run


def _arg_names(op: str) -> list[str]:
    return [p.name for p in params(op)]


def _tensor_names(op: str) -> list[str]:
    return [p.name for p in params(op) if p.is_tensor]


class OnnxRuntimeBackend(Backend):
    manifest = BackendManifest(
        name="onnxruntime",
        device_type="cpu",
        description="ONNX Runtime (CPU execution provider): each op exported alone as its "
        "ai.glmport ONNX function (opset 18) and run in a cached InferenceSession",
        ops=OP_NAMES,
        auto=False,  # a conformance target and export check: selected by name only
        verified="onnxruntime 1.32 CPU execution provider: CPU (x86_64), CI",
        stack=("onnxruntime", "onnx", "onnxscript"),
    )

    def probe(self, emulate: bool) -> Availability:
        why = missing("onnxruntime", "onnx")
        return Availability(not why, why)

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        sessions = _Sessions()
        return {op: _kernel(op, sessions) for op in OP_NAMES}

    def model_runner(self, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model's ONNX prefill export in one session: ``input_ids -> logits``."""
        from .onnx_model import OnnxRuntimeModel, export_onnx

        graph = OnnxRuntimeModel.load(export_onnx(model, "prefill"))
        return lambda input_ids: graph.run(input_ids)[0]


BACKEND = OnnxRuntimeBackend()
