"""The cuda backend: Triton kernels for NVIDIA GPUs (and ROCm through torch.cuda).

Its kernels are not written yet: it implements no op and reports itself unavailable,
so that nobody mistakes the fallback path for GPU kernels. Once it has kernels it runs
on a CUDA device, or on the CPU through the Triton interpreter with
``GLMPORT_EMULATE=1``.
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import Availability, Backend, BackendManifest, Kernel


class CudaBackend(Backend):
    manifest = BackendManifest(
        name="cuda",
        device_type="cuda",
        description="Triton kernels for NVIDIA (and ROCm) GPUs",
        ops=(),
        priority=30,
        emulation="Triton interpreter (TRITON_INTERPRET=1) on CPU tensors",
        verified="not verified on real hardware",
        stack=("triton",),
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(False, "no Triton kernels in this glmport version yet")

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {}


BACKEND = CudaBackend()
