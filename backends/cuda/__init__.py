"""The cuda backend: Triton kernels for NVIDIA GPUs (and ROCm GPUs through torch.cuda).

Every op is a ``@triton.jit`` kernel written for the hardware (one file per op family:
``attention``, ``indexer``, ``gemm`` with ``quant``, ``moe``, ``norm_rope``,
``logprobs``; ``mla``'s prolog is cuBLAS GEMMs around one kernel); ``runtime`` holds
what they share. On a GPU the kernels autotune over a small config space; with
``GLMPORT_EMULATE=1`` exactly the same kernels run on CPU tensors through Triton's
interpreter, with fixed large blocks, so the backend can be developed and judged
without a GPU.

Backward passes: ``sparse_attention`` and ``token_logprobs`` use the generic
backend's closed-form chunked backward (the dispatcher's fallback for a missing
``"<op>:backward"``), ``indexer_logits``, ``rms_norm``, ``rope``, ``moe_gate`` and
the MoE permutations the vector-Jacobian product of the generic composites, and the
GEMMs glmport's straight-through closed form. Only the forward passes are Triton.

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted,
its own helpers (``tl.sum``) included, when triton is first imported: a process
chooses once. Probing the emulated backend before anything imports triton sets
``TRITON_INTERPRET=1``; the other mode is then reported unavailable with the reason.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from glmport.core.extras import pip_command
from glmport.core.registry import Availability, Backend, BackendManifest, Capability, Kernel

from .mode import INTERPRET_VAR, interpreting, triton_mode


class CudaBackend(Backend):
    manifest = BackendManifest(
        name="cuda",
        device_type="cuda",
        description="Triton kernels for NVIDIA (and ROCm) GPUs",
        ops=(
            "lightning_indexer",
            "indexer_logits",
            "sparse_attention",
            "moe_gate",
            "moe_dispatch",
            "moe_combine",
            "grouped_gemm",
            "quantize",
            "quant_gemm",
            "rms_norm",
            "rope",
            "token_logprobs",
            "mla_prolog",
        ),
        # Limits where a kernel's on-chip tiles stop fitting a GPU (shared memory,
        # registers, compile time of the unrolled sort network); calls beyond them fall
        # back to the generic backend on the same device.
        capabilities={
            "lightning_indexer": Capability(
                q_heads=range(1, 129), head_dim=range(1, 257), topk=range(1, 8193)
            ),
            "indexer_logits": Capability(q_heads=range(1, 129), head_dim=range(1, 257)),
            "sparse_attention": Capability(v_head_dim=range(0, 1025)),
            "moe_gate": Capability(experts=range(1, 262145)),
            # The prolog kernel holds a token's latent rows whole.
            "mla_prolog": Capability(q_lora=range(0, 8193), kv_lora=range(0, 8193)),
        },
        priority=30,
        emulation="Triton interpreter (TRITON_INTERPRET=1) on CPU tensors",
        verified=(
            "Triton interpreter on x86_64 CPUs (CI), the GPU's autotune configs and host "
            "plans included (runtime.gpu_plan); compiled for sm_90a and sm_100a without a "
            "GPU (bench/cuda_compile.py); not verified on a GPU"
        ),
        stack=("triton",),
    )

    def probe(self, emulate: bool) -> Availability:
        if importlib.util.find_spec("triton") is None:
            return Availability(False, f"triton not installed: {pip_command(['cuda'], ['triton'])}")
        mode = triton_mode()
        if emulate:
            if mode is False:
                return Availability(
                    False,
                    "triton was imported compiled in this process before emulation was "
                    f"selected: set {INTERPRET_VAR}=1 (or GLMPORT_EMULATE=1) before it is imported",
                )
            os.environ[INTERPRET_VAR] = "1"  # before triton defines its own helpers
            import triton

            return Availability(True, f"Triton {triton.__version__} interpreter", emulated=True)
        import torch

        if not torch.cuda.is_available():  # checked first: importing triton fixes its mode
            return Availability(
                False,
                "no CUDA or ROCm device visible to torch "
                "(GLMPORT_EMULATE=1 runs the kernels on the CPU through Triton's interpreter)",
            )
        if mode or interpreting():
            return Availability(False, f"{INTERPRET_VAR} is set: Triton would only interpret")
        import triton

        return Availability(True, f"Triton {triton.__version__} on {torch.cuda.get_device_name()}")

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        # probe() ran first: under emulation TRITON_INTERPRET is set and triton imported
        # interpreted, so the kernels below are defined interpreted too.
        from . import attention, gemm, indexer, logprobs, mla, moe, norm_rope, quant

        return {
            "lightning_indexer": indexer.lightning_indexer,
            "indexer_logits": indexer.indexer_logits,
            "sparse_attention": attention.sparse_attention,
            "moe_gate": moe.moe_gate,
            "moe_dispatch": moe.moe_dispatch,
            "moe_combine": moe.moe_combine,
            "grouped_gemm": gemm.grouped_gemm,
            "quantize": quant.quantize,
            "quant_gemm": gemm.quant_gemm,
            "rms_norm": norm_rope.rms_norm,
            "rope": norm_rope.rope,
            "mla_prolog": mla.mla_prolog,
            "token_logprobs": logprobs.token_logprobs,
        }


BACKEND = CudaBackend()
