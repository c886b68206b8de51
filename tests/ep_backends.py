"""Backends for the expert-parallel tests, in an importable module so that worker
processes started by spawn can unpickle them (their manifests are class attributes).

``ep_vendor`` provides only ``expert_parallel`` (an honest all-to-all of its own);
``ep_bf16_only`` declines float32 like a bfloat16-only fused kernel;
``ep_drops_last_rank`` and ``ep_uniform_weights`` are deliberately broken.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from glmport.backends.generic.ep import AllToAllExpertParallel
from glmport.core.errors import UnsupportedError
from glmport.core.registry import Backend, BackendManifest, Kernel


class VendorEP(AllToAllExpertParallel):
    """Stands in for a vendor's fused dispatch / combine (numerically the generic one)."""


class Bf16OnlyEP(AllToAllExpertParallel):
    """Takes bfloat16 tokens only, as DeepEP's normal-mode kernels do."""

    def _dispatch(self, x, ids):
        if x.dtype != torch.bfloat16:
            raise UnsupportedError(f"ep_bf16_only dispatches bfloat16 tokens, got {x.dtype}")
        return super()._dispatch(x, ids)


class DropsLastRankEP(AllToAllExpertParallel):
    """Bug: the rows computed on the last rank never reach their tokens."""

    def _combine(self, y_local, state, weights):
        keep = 0.0 if self.rank == self.world - 1 else 1.0
        return super()._combine(y_local * keep, state, weights)


class UniformWeightsEP(AllToAllExpertParallel):
    """Bug: combines with ``1 / k`` instead of the routing weights."""

    def _combine(self, y_local, state, weights):
        return super()._combine(y_local, state, torch.full_like(weights, 1 / weights.shape[1]))


class _EPOnly(Backend):
    """A CPU backend whose only entry is its ``expert_parallel`` factory."""

    factory: type[AllToAllExpertParallel]

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {"expert_parallel": self.factory}


def _manifest(name: str, description: str) -> BackendManifest:
    return BackendManifest(
        name=name, device_type="cpu", description=description, ops=("expert_parallel",)
    )


class VendorBackend(_EPOnly):
    manifest = _manifest("ep_vendor", "a vendor's own expert parallelism")
    factory = VendorEP


class Bf16OnlyBackend(_EPOnly):
    manifest = _manifest("ep_bf16_only", "expert parallelism for bfloat16 tokens only")
    factory = Bf16OnlyEP


class DropsLastRankBackend(_EPOnly):
    manifest = _manifest("ep_drops_last_rank", "combine drops the last rank's rows")
    factory = DropsLastRankEP


class UniformWeightsBackend(_EPOnly):
    manifest = _manifest("ep_uniform_weights", "combine ignores the routing weights")
    factory = UniformWeightsEP


class NoEPBackend(Backend):
    """A vendor backend without expert parallelism: it falls back like any op."""

    manifest = BackendManifest(
        name="ep_lacking", device_type="cpu", description="rms_norm only", ops=("rms_norm",)
    )

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        from glmport.backends.cpu.norm_rope import rms_norm

        return {"rms_norm": rms_norm}
