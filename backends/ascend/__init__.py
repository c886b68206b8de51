"""The ascend backend: adapters onto torch_npu's fused ops for Huawei Ascend NPUs.

Its adapters are not written yet: it implements no op and reports itself
unavailable. torch_npu must only ever be imported lazily, inside the backend (a
torch_npu without CANN breaks ``import torch``, so it is never a test dependency).
"""

from __future__ import annotations

from collections.abc import Mapping

from glmport.core.registry import Availability, Backend, BackendManifest, Kernel


class AscendBackend(Backend):
    manifest = BackendManifest(
        name="ascend",
        device_type="npu",
        description="adapters onto torch_npu fused ops for Huawei Ascend NPUs",
        ops=(),
        priority=30,
        emulation="CPU emulator of the torch_npu op contracts",
        verified="not verified on real hardware",
        stack=("torch-npu", "$ASCEND_TOOLKIT_HOME"),
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(False, "no torch_npu adapters in this glmport version yet")

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {}


BACKEND = AscendBackend()
