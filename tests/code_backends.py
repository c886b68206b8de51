"""Backends defined in code (no entry point), in an importable module so that
``glmport conformance --plugin code_backends:...`` can register them in every
pytest-xdist worker (``tests/test_backend_contract.py``).

``codeplug`` runs the reference's ``rms_norm`` as its own kernel, float32 only, and
falls back for the rest; ``make_codeplug`` is the same backend from a factory;
``ABSENT`` declares ``rope`` and is never available.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from glmport.core.registry import (
    REGISTRY,
    Availability,
    Backend,
    BackendManifest,
    Capability,
    Kernel,
)


class CodePlug(Backend):
    manifest = BackendManifest(
        name="codeplug",
        device_type="cpu",
        description="test double: the reference rms_norm, registered in code",
        ops=("rms_norm",),
        capabilities={"rms_norm": Capability(dtype=torch.float32)},
    )

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {"rms_norm": REGISTRY.kernels(REGISTRY.reference(), False)["rms_norm"]}


BACKEND = CodePlug()


def make_codeplug() -> CodePlug:
    """The callable form of a ``--plugin`` target."""
    return CodePlug()


class Absent(Backend):
    """An accelerator backend whose chip is not in this machine: unavailable, with the
    reason, wherever the tests run."""

    manifest = BackendManifest(
        name="absent",
        device_type="cpu",
        description="test double: a backend that cannot run here",
        ops=("rope",),
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(False, "no such chip in this machine")

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        return {"rope": REGISTRY.kernels(REGISTRY.reference(), False)["rope"]}


ABSENT = Absent()
