"""The generic backend: device-neutral torch composites for any torch device.

It is what a chip without fused kernels runs (Intel XPU, Apple MPS, Moore Threads
MUSA, Cambricon MLU, Hygon DCU, Ascend when torch_npu lacks an op), the fallback of
every vendor backend, and the path that exports to ONNX and TVM. Only torch
operations, no device-specific calls; the device comes from the inputs. Heavy ops
are tiled under a memory budget (``GLMPORT_TILE_MB``, see ``tiling.py``): sparse
attention gathers only the selected slots in query chunks, the indexer keeps a
running top-k over key tiles, log-probs use an online log-sum-exp over vocabulary
tiles. Expert parallelism over ``torch.distributed``: :mod:`.ep`.
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import ANY_DEVICE, Backend, BackendManifest, Kernel
from glmport.core.specs import OP_NAMES


class GenericBackend(Backend):
    manifest = BackendManifest(
        name="generic",
        device_type=ANY_DEVICE,
        description="device-neutral, memory-bounded torch composites (any torch device)",
        ops=OP_NAMES,
        fallback=("cpu",),
        priority=10,
        verified="CI on x86_64 CPUs; not verified on an accelerator",
    )

    def load_kernels(self) -> Mapping[str, Kernel]:
        from . import attention, indexer, logprobs, moe, norm_rope, quant

        modules = (attention, indexer, logprobs, moe, norm_rope, quant)
        kernels = {op: getattr(m, op) for m in modules for op in OP_NAMES if hasattr(m, op)}
        kernels["sparse_attention:backward"] = attention.sparse_attention_backward
        kernels["token_logprobs:backward"] = logprobs.token_logprobs_backward
        return kernels


BACKEND = GenericBackend()
