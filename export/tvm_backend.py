"""The ``tvm`` backend: every glmport op lowered to Relax (:mod:`.tvm_ops`), compiled for
the llvm target and run in the Relax VM on CPU tensors.

A conformance target for the TVM export path rather than a fast backend (``auto=False``:
selected by name only). Each call's signature family -- op, scalar arguments,
input dtypes and ranks, which optional inputs are None -- is compiled once; sizes are
symbolic, so one module serves every shape. Tensors cross by DLPack (bf16 and fp16
included). float8 is outside its capabilities: TVM's llvm target converts
float8_e4m3fn wrongly. ``tvm`` is imported when the kernels load, never with glmport.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from glmport.core.extras import missing
from glmport.core.registry import Availability, Backend, BackendManifest, Capability, Kernel
from glmport.core.specs import OP_NAMES

from .empty_sources import result_without_source_rows
from .tvm_runtime import compile_relax, from_tvm, to_tvm

_NOT_FP8 = (torch.float32, torch.bfloat16, torch.float16)
_INT_SCHEMES = ("w8a8", "w4a8", "w4a16")
# (w_scale, group_size) positions: with a packed weight group_size is not read.
_PACKED_GROUP = {"quant_gemm": (2, 4), "grouped_gemm": (3, 5)}


class _Compiled:
    """Relax VM functions, one per signature family, compiled on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._functions: dict[tuple, Callable[..., Any]] = {}

    @staticmethod
    def family(op: str, args: tuple) -> tuple:
        """What a compiled module depends on: op, scalars, tensor dtypes and ranks."""

        def part(a: object) -> object:
            if isinstance(a, torch.Tensor):
                return ("tensor", a.dtype, a.dim())
            return a  # a scalar attribute, or None for an absent optional input

        parts = list(map(part, args))
        if op in _PACKED_GROUP and args[_PACKED_GROUP[op][0]] is not None:
            parts[_PACKED_GROUP[op][1]] = None  # packed: groups come from w_scale's shape
        return (op, *parts)

    def function(self, op: str, args: tuple) -> Callable[..., Any]:
        """The compiled ``main`` of ``op``'s family for ``args``; calls to one function
        are serialised (a Relax VM is not safe to run from two threads at once)."""
        key = self.family(op, args)
        with self._lock:
            if key not in self._functions:
                import tvm
                from tvm import relax

                from .tvm_ops import op_module

                executable = compile_relax(op_module(op, args))
                main = relax.VirtualMachine(executable, tvm.cpu())["main"]
                self._functions[key] = _serialised(main)
            return self._functions[key]

    def __len__(self) -> int:
        return len(self._functions)


def _serialised(function: Callable[..., Any]) -> Callable[..., Any]:
    lock = threading.Lock()

    def call(*args: Any) -> Any:
        with lock:
            return function(*args)

    return call


COMPILED = _Compiled()


def _kernel(op: str) -> Kernel:
    def run(*args: object) -> object:
        known = result_without_source_rows(op, args)
        if known is not None:
            return known
        function = COMPILED.function(op, args)
        return from_tvm(function(*(to_tvm(a) for a in args if isinstance(a, torch.Tensor))))

    run.__name__ = run.__qualname__ = f"tvm_{op}"
    return run


class TvmBackend(Backend):
    manifest = BackendManifest(
        name="tvm",
        device_type="cpu",
        description="Apache TVM: each op lowered to Relax, compiled for llvm, run in the Relax VM",
        ops=OP_NAMES,
        # float8 operands: TVM's llvm target converts float8_e4m3fn wrongly.
        capabilities={
            "lightning_indexer": Capability(dtype=_NOT_FP8),
            "indexer_logits": Capability(dtype=_NOT_FP8),
            "quantize": Capability(format=("int8_row", "int4_group")),
            "quant_gemm": Capability(scheme=_INT_SCHEMES),
            "grouped_gemm": Capability(scheme=_INT_SCHEMES),
        },
        auto=False,  # a conformance target and export check: selected by name only
        verified="TVM (llvm target): CPU (x86_64), CI",
        stack=("apache-tvm",),
    )

    def probe(self, emulate: bool) -> Availability:
        why = missing("tvm")
        return Availability(not why, why)

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {op: _kernel(op) for op in OP_NAMES}

    def model_runner(self, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model's prefill graph, torch.export -> Relax -> llvm: ``input_ids -> logits``."""
        from .tvm_model import TvmModel

        graph = TvmModel.build(model, "prefill")
        return lambda input_ids: graph.run(input_ids)[0]


BACKEND = TvmBackend()
