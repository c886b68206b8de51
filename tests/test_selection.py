"""Backend selection: environment variables, use_backend, per-op overrides, auto, the
fallback chain, plug-in loading through entry points, and the errors on bad settings."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest
import torch

import glmport
from glmport.core import registry
from glmport.core.registry import Availability, Backend, BackendManifest, Capability
from glmport.core.selection import current_settings, resolve, settings_from_env
from glmport.core.specs import OP_NAMES


class _ToyBackend(Backend):
    """A backend whose rms_norm adds a marker, so tests can see where a call ran."""

    def __init__(self, name="toy", ops=("rms_norm",), available=True, caps=None, device="cpu"):
        self.manifest = BackendManifest(
            name=name,
            device_type=device,
            description="test double",
            ops=ops,
            capabilities=caps or {},
            priority=5,
        )
        self.available = available
        self.calls = 0

    def probe(self, emulate):
        return Availability(self.available, "" if self.available else "toy hardware absent")

    def load_kernels(self):
        def rms_norm(x, weight, eps=1e-6):
            self.calls += 1
            return torch.full_like(x, 42.0)

        return {"rms_norm": rms_norm}


@pytest.fixture
def toy():
    backend = _ToyBackend()
    glmport.register_backend(backend)
    yield backend
    glmport.unregister_backend("toy")


def _norm():
    x = torch.randn(3, 8)
    return glmport.ops.rms_norm(x, torch.ones(8))


def test_default_selection_is_auto_and_resolves_to_cpu_without_accelerators():
    assert current_settings().backend == "auto"
    for op in OP_NAMES:
        assert resolve(op).backend == "cpu"


def test_env_backend_selects_a_registered_backend(monkeypatch, toy):
    monkeypatch.setenv("GLMPORT_BACKEND", "toy")
    assert torch.all(_norm() == 42.0)
    assert toy.calls == 1


def test_ops_a_backend_lacks_fall_back_along_its_chain(monkeypatch, toy):
    monkeypatch.setenv("GLMPORT_BACKEND", "toy")
    res = resolve("rope")
    assert (res.requested, res.backend, res.chain) == ("toy", "generic", ("toy", "generic"))
    assert res.fell_back


def test_a_fallback_is_logged_once_per_backend_and_op(caplog):
    glmport.register_backend(_ToyBackend(name="logonce"))
    try:
        with caplog.at_level(logging.WARNING, logger="glmport"), glmport.use_backend("logonce"):
            for _ in range(3):
                glmport.core.selection.clear_cache()
                resolve("token_logprobs")
    finally:
        glmport.unregister_backend("logonce")
    lines = [r.getMessage() for r in caplog.records if "'logonce'" in r.getMessage()]
    assert lines == ["glmport: backend 'logonce' lacks 'token_logprobs'; falling back to 'generic'"]


def test_generic_implements_every_op_itself(monkeypatch):
    monkeypatch.setenv("GLMPORT_BACKEND", "generic")
    for op in OP_NAMES:
        assert resolve(op).chain == ("generic",)


def test_unknown_backend_name_lists_the_valid_names(monkeypatch):
    monkeypatch.setenv("GLMPORT_BACKEND", "bogus")
    with pytest.raises(glmport.UnknownBackendError) as err:
        _norm()
    msg = str(err.value)
    assert "'bogus'" in msg
    for name in ("cpu", "generic", "cuda", "ascend", "auto"):
        assert name in msg


def test_unavailable_backend_says_why_and_lists_available_ones(monkeypatch):
    monkeypatch.setenv("GLMPORT_BACKEND", "cuda")
    with pytest.raises(glmport.BackendUnavailableError) as err:
        _norm()
    assert "no Triton kernels" in str(err.value)
    assert "Available now: cpu, generic" in str(err.value)


def test_unavailable_registered_backend_reports_its_probe_reason(monkeypatch):
    glmport.register_backend(_ToyBackend(name="absent", available=False))
    try:
        monkeypatch.setenv("GLMPORT_BACKEND", "absent")
        with pytest.raises(glmport.BackendUnavailableError, match="toy hardware absent"):
            _norm()
    finally:
        glmport.unregister_backend("absent")


def test_per_op_override_routes_one_op(monkeypatch, toy):
    monkeypatch.setenv("GLMPORT_OPS", "rms_norm=toy")
    assert torch.all(_norm() == 42.0)
    assert resolve("rope").backend == "cpu"


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("rms_norm", "malformed entry"),
        ("rms_norm=", "malformed entry"),
        ("not_an_op=cpu", "unknown op 'not_an_op'"),
    ],
)
def test_malformed_op_overrides_are_config_errors(monkeypatch, raw, needle):
    monkeypatch.setenv("GLMPORT_OPS", raw)
    with pytest.raises(glmport.ConfigError, match=needle):
        _norm()


def test_op_override_to_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("GLMPORT_OPS", "rms_norm=nope")
    with pytest.raises(glmport.UnknownBackendError, match="valid backends"):
        _norm()


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("GLMPORT_EMULATE", "maybe"),
        ("GLMPORT_DEVICE", "not-a-device:x"),
        ("GLMPORT_SHADOW_CALLS", "-3"),
        ("GLMPORT_VALIDATE", "some"),
    ],
)
def test_malformed_environment_values_name_the_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    with pytest.raises(glmport.ConfigError, match=var):
        settings_from_env()


def test_emulate_accepts_common_spellings():
    assert settings_from_env({"GLMPORT_EMULATE": "yes"}).emulate is True
    assert settings_from_env({"GLMPORT_EMULATE": "0"}).emulate is False


def test_use_backend_overrides_env_and_restores_on_exit(monkeypatch, toy):
    monkeypatch.setenv("GLMPORT_BACKEND", "cpu")
    with glmport.use_backend("toy"):
        assert torch.all(_norm() == 42.0)
        with glmport.use_backend("cpu"):
            assert not torch.all(_norm() == 42.0)
        assert torch.all(_norm() == 42.0)
    assert not torch.all(_norm() == 42.0)


def test_use_backend_checks_the_name_on_entry():
    with pytest.raises(glmport.UnknownBackendError), glmport.use_backend("bogus"):
        pass
    with pytest.raises(glmport.BackendUnavailableError), glmport.use_backend("ascend"):
        pass


def test_use_backend_per_op_overrides_stack(toy):
    with glmport.use_backend("generic", ops={"rms_norm": "toy"}):
        assert resolve("rms_norm").backend == "toy"
        assert resolve("rope").chain == ("generic",)


def test_two_backends_in_one_process_in_threads(toy):
    import threading

    results = {}

    def work(name):
        with glmport.use_backend(name):
            results[name] = bool(torch.all(_norm() == 42.0))

    threads = [threading.Thread(target=work, args=(n,)) for n in ("toy", "cpu")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"toy": True, "cpu": False}


def test_capability_refusal_is_an_unsupported_error_naming_op_and_backend():
    caps = {"rms_norm": Capability(dtypes=(torch.float32,))}
    glmport.register_backend(_ToyBackend(name="fp32only", caps=caps))
    try:
        with glmport.use_backend("fp32only"):
            assert torch.all(_norm() == 42.0)
            x = torch.randn(2, 8, dtype=torch.bfloat16)
            with pytest.raises(glmport.UnsupportedError, match=r"rms_norm.*fp32only.*bfloat16"):
                glmport.ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
    finally:
        glmport.unregister_backend("fp32only")


def test_backend_for_another_device_refuses_cpu_tensors_clearly():
    glmport.register_backend(_ToyBackend(name="xpuish", device="xpu"))
    try:
        with glmport.use_backend("xpuish"), pytest.raises(glmport.UnsupportedError, match="xpu"):
            _norm()
    finally:
        glmport.unregister_backend("xpuish")


def test_auto_prefers_an_available_accelerator_backend():
    glmport.register_backend(_ToyBackend(name="accel", device="xpu"))
    try:
        assert resolve("rms_norm").requested == "accel"
        with glmport.use_backend(device="cpu"):
            assert resolve("rms_norm").requested == "accel"
    finally:
        glmport.unregister_backend("accel")
    assert resolve("rms_norm").requested == "cpu"


def test_auto_with_a_device_of_no_vendor_backend_picks_generic(monkeypatch):
    monkeypatch.setenv("GLMPORT_DEVICE", "xpu:0")
    assert resolve("rms_norm").requested == "generic"


def test_registering_a_builtin_name_needs_replace():
    with pytest.raises(ValueError, match="exists already"):
        glmport.register_backend(_ToyBackend(name="cpu"))


def test_manifest_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown ops"):
        BackendManifest(name="x", device_type="cpu", description="", ops=("matmul",))


class _FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"fake_pkg:{name}", target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


@pytest.fixture
def entry_points(monkeypatch):
    """Install fake entry points for the glmport.backends group."""
    found = []

    def fake_entry_points(group=None):
        return list(found) if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry.REGISTRY, "_entry_points", None)
    yield found
    registry.REGISTRY._entry_points = None
    for ep in found:
        registry.REGISTRY._loaded.pop(ep.name, None)
        registry.REGISTRY._forget(ep.name)
    glmport.core.selection.clear_cache()


def test_plugin_backend_arrives_through_the_entry_point_group(entry_points):
    entry_points.append(_FakeEntryPoint("plug", lambda: _ToyBackend(name="plug")))
    assert "plug" in glmport.backend_names()
    with glmport.use_backend("plug"):
        assert torch.all(_norm() == 42.0)


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (ImportError("no module named vendor_sdk"), "failed to load"),
        (object(), "expected a glmport.core.registry.Backend"),
        (_ToyBackend(name="other"), "must agree"),
    ],
)
def test_broken_plugins_are_unavailable_with_a_reason_not_a_crash(entry_points, target, needle):
    entry_points.append(_FakeEntryPoint("broken", target))
    with (
        pytest.raises(glmport.BackendUnavailableError, match=needle),
        glmport.use_backend("broken"),
    ):
        pass
    avail = registry.REGISTRY.availability("broken", False)
    assert not avail.ok
    assert needle in avail.reason
