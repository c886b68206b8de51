"""GLMPORT_SHADOW: live calls are re-run on the reference and mismatches are logged."""

from __future__ import annotations

import logging

import pytest
import torch

import glmport
from glmport.core import shadow
from glmport.core.registry import Availability, Backend, BackendManifest
from glmport.core.selection import composite_kernel


class _NormBackend(Backend):
    """rms_norm = the reference plus ``bias`` (0: right, else wrong by that much)."""

    def __init__(self, name, bias):
        self.manifest = BackendManifest(
            name=name, device_type="cpu", description="test", ops=("rms_norm",)
        )
        self.bias = bias

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        ref = composite_kernel("rms_norm")
        return {"rms_norm": lambda x, w, eps=1e-6: ref(x, w, eps) + self.bias}


@pytest.fixture
def backends():
    glmport.register_backend(_NormBackend("right", 0.0))
    glmport.register_backend(_NormBackend("wrong", 0.5))
    yield
    glmport.unregister_backend("right")
    glmport.unregister_backend("wrong")


def _calls(n):
    for _ in range(n):
        glmport.ops.rms_norm(torch.randn(4, 16), torch.ones(16))


def test_shadow_logs_a_mismatch_with_op_and_error_size(monkeypatch, backends, caplog):
    monkeypatch.setenv("GLMPORT_SHADOW", "cpu")
    with caplog.at_level(logging.WARNING, logger="glmport.shadow"), glmport.use_backend("wrong"):
        _calls(1)
    (rep,) = shadow.reports()
    assert (rep.op, rep.backend, rep.shadow, rep.ok) == ("rms_norm", "wrong", "cpu", False)
    assert rep.max_rel > 0.05
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "rms_norm" in msg and "'wrong'" in msg and "max|err|/max|ref|" in msg


def test_shadow_passes_a_correct_backend_silently(monkeypatch, backends, caplog):
    monkeypatch.setenv("GLMPORT_SHADOW", "cpu")
    with caplog.at_level(logging.WARNING, logger="glmport.shadow"), glmport.use_backend("right"):
        _calls(2)
    assert [r.ok for r in shadow.reports()] == [True, True]
    assert not caplog.records


def test_shadow_checks_only_the_first_n_calls_per_op(monkeypatch, backends):
    monkeypatch.setenv("GLMPORT_SHADOW", "cpu")
    monkeypatch.setenv("GLMPORT_SHADOW_CALLS", "3")
    with glmport.use_backend("wrong"):
        _calls(5)
    assert len(shadow.reports()) == 3


def test_shadow_is_off_by_default_and_skips_the_reference_itself(monkeypatch, backends):
    with glmport.use_backend("wrong"):
        _calls(2)
    monkeypatch.setenv("GLMPORT_SHADOW", "cpu")
    with glmport.use_backend("cpu"):
        _calls(2)  # the active backend is cpu itself: nothing to compare
    assert shadow.reports() == []


def test_use_backend_can_turn_shadowing_on(backends):
    with glmport.use_backend("wrong", shadow="cpu"):
        _calls(1)
    assert [r.ok for r in shadow.reports()] == [False]
