"""The generic backend: device-neutral torch composites for any torch device.

It is what a chip without fused kernels runs (Intel XPU, Apple MPS, Moore Threads
MUSA, Cambricon MLU, Hygon DCU, Ascend when torch_npu lacks an op), the fallback of
every vendor backend, and the path that exports to ONNX and TVM. Only torch
operations, no device-specific calls; the device comes from the inputs. Heavy ops
are tiled under a memory budget (``GLMPORT_TILE_MB``, see ``tiling.py``): sparse
attention gathers only the selected slots in query chunks, the indexer keeps a
running top-k over key tiles, log-probs use an online log-sum-exp over vocabulary
tiles. Expert parallelism (``"expert_parallel"``): all-to-all over
``torch.distributed``, :mod:`.ep`.
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import ANY_DEVICE, COMPOSITE, Backend, BackendManifest, Kernel
from glmport.core.specs import OP_NAMES


class GenericBackend(Backend):
    manifest = BackendManifest(
        name="generic",
        device_type=ANY_DEVICE,
        description="device-neutral, memory-bounded torch composites (any torch device)",
        ops=(*OP_NAMES, "expert_parallel"),
        role=COMPOSITE,
        priority=0,  # the baseline on every device: a vendor wins auto only above it
        verified="CI on x86_64 CPUs; not verified on an accelerator",
    )

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        from . import attention, ep, indexer, logprobs, mla, moe, norm_rope, quant

        return {
            "lightning_indexer": indexer.lightning_indexer,
            "indexer_logits": indexer.indexer_logits,
            "sparse_attention": attention.sparse_attention,
            "sparse_attention:backward": attention.sparse_attention_backward,
            "moe_gate": moe.moe_gate,
            "moe_dispatch": moe.moe_dispatch,
            "moe_combine": moe.moe_combine,
            "grouped_gemm": moe.grouped_gemm,
            "grouped_gemm:prepared": moe.grouped_gemm_prepared,
            "quantize": quant.quantize,
            "quant_gemm": quant.quant_gemm,
            "quant_gemm:prepared": quant.quant_gemm_prepared,
            "rms_norm": norm_rope.rms_norm,
            "rope": norm_rope.rope,
            "mla_prolog": mla.mla_prolog,
            "token_logprobs": logprobs.token_logprobs,
            "token_logprobs:backward": logprobs.token_logprobs_backward,
            "expert_parallel": ep.AllToAllExpertParallel,
        }

    def prepare_weight(self, op, w, w_scale, scheme, emulate):
        from .quant import prepare_weight

        return prepare_weight(op, w, w_scale, scheme, emulate)


BACKEND = GenericBackend()
