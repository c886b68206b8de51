"""The cost-cutting in one op call must change no meaning: cached settings follow the
environment and registrations by themselves, the meta-mode signature cache never
lets a bad call through, and the eager path equals the torch.library path."""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.core.registry import Availability, Backend, BackendManifest
from glmport.core.selection import current_settings, resolve


class _Marker(Backend):
    manifest = BackendManifest(
        name="marker", device_type="cpu", description="test double", ops=("rms_norm",)
    )

    def __init__(self):
        self.calls = 0

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        def rms_norm(x, weight, eps=1e-6):
            self.calls += 1
            return torch.full_like(x, 7.0)

        return {"rms_norm": rms_norm}


def _norm():
    return glmport.ops.rms_norm(torch.randn(2, 8), torch.ones(8))


def test_an_environment_change_takes_effect_on_the_next_call_without_clearing(monkeypatch):
    assert current_settings().validate_values
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    assert not current_settings().validate_values
    monkeypatch.setenv("GLMPORT_BACKEND", "generic")
    assert resolve("rope", device_type="cpu").backend == "generic"
    monkeypatch.setenv("GLMPORT_BACKEND", "cpu")
    assert resolve("rope", device_type="cpu").backend == "cpu"


def test_registering_a_backend_invalidates_cached_resolutions(monkeypatch):
    monkeypatch.setenv("GLMPORT_BACKEND", "marker")
    with pytest.raises(glmport.UnknownBackendError):
        _norm()
    marker = _Marker()
    glmport.register_backend(marker)
    try:
        assert torch.all(_norm() == 7.0) and marker.calls == 1
    finally:
        glmport.unregister_backend("marker")
    with pytest.raises(glmport.UnknownBackendError):
        _norm()


def test_meta_mode_caches_passed_signatures_but_still_rejects_new_bad_calls(monkeypatch):
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    x, w = torch.randn(2, 8), torch.ones(8)
    for _ in range(2):
        glmport.ops.rms_norm(x, w)
    with pytest.raises(glmport.OpInputError, match="'weight'"):
        glmport.ops.rms_norm(x, torch.ones(9))
    with pytest.raises(glmport.OpInputError, match="'weight'"):
        glmport.ops.rms_norm(x, torch.ones(8, dtype=torch.float64))
    with pytest.raises(glmport.OpInputError, match="'eps'"):
        glmport.ops.rms_norm(x, w, True)  # a bool is not a float, though True == 1.0


def test_the_eager_path_and_the_dispatcher_path_run_the_same_kernel():
    marker = _Marker()
    glmport.register_backend(marker)
    try:
        with glmport.use_backend("marker"):
            x, w = torch.randn(2, 8), torch.ones(8)
            eager = glmport.ops.rms_norm(x, w, 1e-6)
            through_library = torch.ops.glmport.rms_norm(x, w, 1e-6)
            traced = torch.compile(glmport.ops.rms_norm, backend="eager", fullgraph=True)(x, w)
    finally:
        glmport.unregister_backend("marker")
    assert marker.calls == 3
    assert torch.equal(eager, through_library) and torch.equal(eager, traced)


def test_calls_needing_autograd_take_the_dispatcher_and_get_gradients():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    glmport.ops.rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        y = glmport.ops.rms_norm(x, w)
    assert not y.requires_grad
