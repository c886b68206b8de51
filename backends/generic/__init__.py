"""The generic backend: device-neutral torch composites for any torch device.

It is what a chip without fused kernels runs, and the fallback of every vendor
backend. Its memory-bounded composites are not written yet, so it implements no op
itself: every op falls back to the cpu reference (which accepts only CPU tensors;
``glmport info`` shows the resolution). The device comes from the inputs or
``GLMPORT_DEVICE``.
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import ANY_DEVICE, Backend, BackendManifest, Kernel


class GenericBackend(Backend):
    manifest = BackendManifest(
        name="generic",
        device_type=ANY_DEVICE,
        description="device-neutral torch composites (any torch device)",
        ops=(),
        fallback=("cpu",),
        priority=10,
        verified="CI on x86_64 CPUs",
    )

    def load_kernels(self) -> Mapping[str, Kernel]:
        return {}


BACKEND = GenericBackend()
