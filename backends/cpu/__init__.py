"""The cpu backend: glmport's golden reference.

Every op, written for clarity in plain torch: whole-matrix formulas, stable sorts for
deterministic tie-breaking, exact integer accumulation for int8 / int4 GEMMs, float8
operands through torch's float8 dtypes. Computes in float32 by default and in float64
inside :func:`float64_reference` (the conformance suite's reference mode).
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import Backend, BackendManifest, Kernel
from glmport.core.specs import OP_NAMES

from .precision import float64_reference


class CpuBackend(Backend):
    manifest = BackendManifest(
        name="cpu",
        device_type="cpu",
        description="reference: readable torch, float64-capable, exact quant emulation",
        ops=OP_NAMES,
        fallback=(),
        priority=0,
        verified="CI on x86_64 CPUs (the reference every other backend is judged by)",
    )

    def load_kernels(self) -> Mapping[str, Kernel]:
        from . import attention, indexer, logprobs, moe, norm_rope, quant

        modules = (attention, indexer, logprobs, moe, norm_rope, quant)
        return {op: getattr(m, op) for m in modules for op in OP_NAMES if hasattr(m, op)}


BACKEND = CpuBackend()

__all__ = ["BACKEND", "CpuBackend", "float64_reference"]
