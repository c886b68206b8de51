"""An example glmport backend: one op of its own, the rest through the fallback chain."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from glmport import Availability, Backend, BackendManifest, Capability


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """torch's fused RMSNorm, in fp32 like the contract asks, cast back to x's dtype."""
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(x.dtype)


class ExampleBackend(Backend):
    manifest = BackendManifest(
        name="example",
        device_type="cpu",
        description="example plug-in: torch's fused rms_norm, everything else falls back",
        ops=("rms_norm",),
        # Limits on the features rms_norm names (docs/ops.md); other calls fall back.
        capabilities={"rms_norm": Capability(dtype=(torch.float32, torch.bfloat16, torch.float16))},
        # 0 ties with the reference, so GLMPORT_BACKEND=auto keeps CPU calls on it:
        # installing a demo must not reroute anyone's calls. Select it by name.
        priority=0,
        verified="CI on x86_64 CPUs (glmport's example plug-in)",
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(True, "runs wherever torch runs on a CPU")

    def load_kernels(self, emulate: bool) -> Mapping[str, object]:
        # One table per emulation setting; this backend has no emulator of its own.
        return {"rms_norm": rms_norm}


BACKEND = ExampleBackend()
