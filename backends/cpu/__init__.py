"""The cpu backend: glmport's golden reference.

Every op, written for clarity in plain torch: whole-matrix formulas, stable sorts for
deterministic tie-breaking, exact integer accumulation for int8 / int4 GEMMs, float8
operands through torch's float8 dtypes. Computes in float32 by default and in float64
inside :func:`float64_reference` (the conformance suite's reference mode). Expert
parallelism by gathering the whole batch on every rank: :mod:`.ep`.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager

from glmport.core.registry import REFERENCE, Backend, BackendManifest, Kernel
from glmport.core.specs import OP_NAMES

from .precision import float64_reference


class CpuBackend(Backend):
    manifest = BackendManifest(
        name="cpu",
        device_type="cpu",
        description="reference: readable torch, float64-capable, exact quant emulation",
        ops=(*OP_NAMES, "expert_parallel"),
        role=REFERENCE,
        priority=0,  # auto picks the reference only where nothing else runs
        verified="CI on x86_64 CPUs (the reference every other backend is judged by)",
    )

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        from . import attention, ep, indexer, logprobs, mla, moe, norm_rope, quant

        return {
            "lightning_indexer": indexer.lightning_indexer,
            "indexer_logits": indexer.indexer_logits,
            "sparse_attention": attention.sparse_attention,
            "moe_gate": moe.moe_gate,
            "moe_dispatch": moe.moe_dispatch,
            "moe_combine": moe.moe_combine,
            "grouped_gemm": moe.grouped_gemm,
            "quantize": quant.quantize,
            "quant_gemm": quant.quant_gemm,
            "rms_norm": norm_rope.rms_norm,
            "rope": norm_rope.rope,
            "mla_prolog": mla.mla_prolog,
            "token_logprobs": logprobs.token_logprobs,
            "expert_parallel": ep.GatherExpertParallel,
        }

    def float64(self) -> AbstractContextManager[None]:
        """The reference role's precise mode: floating outputs computed in float64."""
        return float64_reference()


BACKEND = CpuBackend()

__all__ = ["BACKEND", "CpuBackend", "float64_reference"]
