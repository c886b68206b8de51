"""A backend with one planted bug, to see ``glmport diff`` find it (docs/conformance.md).

``mychip`` runs the reference ``sparse_attention`` but forgets that an index of ``-1``
means "no key": it reads the last key slot instead, a classic kernel bug that lets a
query attend to a key it must not see (in a packed batch, a later token). Every other
op falls back to ``generic``::

    PYTHONPATH=examples glmport diff --plugin planted_bug_backend:BACKEND \\
        --backends cpu,mychip --random 24
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest, Kernel


def _sparse_attention_ignoring_padding(q, k, v, indices, scale, need_lse=True, k_rope=None):
    """The reference kernel with every ``-1`` index turned into the last key slot."""
    reference = REGISTRY.kernels(REGISTRY.reference(), False)["sparse_attention"]
    idx = torch.where(indices < 0, k.shape[0] - 1, indices)
    return reference(q, k, v, idx, scale, need_lse, k_rope)


class PlantedBug(Backend):
    manifest = BackendManifest(
        name="mychip",
        device_type="cpu",
        description="example: sparse_attention that reads slot N-1 where the index is -1",
        ops=("sparse_attention",),
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(True)

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {"sparse_attention": _sparse_attention_ignoring_padding}


BACKEND = PlantedBug()
