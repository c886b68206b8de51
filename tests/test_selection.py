"""Backend selection: environment variables, use_backend, per-op overrides, auto, the
fallback chain, plug-in loading through entry points, and the errors on bad settings."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference
from glmport.core import registry
from glmport.core.registry import Availability, Backend, BackendManifest, Capability
from glmport.core.selection import (
    current_settings,
    log_fallback_once,
    recording_fallbacks,
    resolve,
    settings_from_env,
)
from glmport.core.specs import OP_NAMES
from glmport.core.validate import Level


class _ToyBackend(Backend):
    """A backend whose rms_norm adds a marker, so tests can see where a call ran."""

    def __init__(
        self, name="toy", ops=("rms_norm",), available=True, caps=None, device="cpu", priority=-1
    ):
        # priority -1: below the composite, so auto never picks it for CPU tensors
        self.manifest = BackendManifest(
            name=name,
            device_type=device,
            description="test double",
            ops=ops,
            capabilities=caps or {},
            priority=priority,
        )
        self.available = available
        self.calls = 0

    def probe(self, emulate):
        return Availability(self.available, "" if self.available else "toy hardware absent")

    def load_kernels(self, emulate):
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


def test_default_selection_is_auto_and_resolves_to_generic_without_accelerators():
    """The fast device-neutral path, not the reference: the reference is the judge."""
    assert current_settings().backend == "auto"
    assert glmport.core.selection.primary_backend() == "generic"
    for op in OP_NAMES:
        res = resolve(op)
        assert (res.requested, res.backend, res.chain) == ("generic", "generic", ("generic",))


def test_auto_runs_cpu_tensors_on_generic_and_the_reference_stays_the_judge():
    # In float64 mode only the reference computes in float64: the dtype shows who ran.
    x, w = torch.randn(3, 8), torch.rand(8)
    with float64_reference():
        fast = glmport.ops.rms_norm(x, w)
        with glmport.use_backend("cpu"):
            judge = glmport.ops.rms_norm(x, w)
    assert (fast.dtype, judge.dtype) == (torch.float32, torch.float64)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(fast.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(judge, want, rtol=1e-12, atol=1e-12)


def test_auto_picks_the_reference_only_where_nothing_else_runs(monkeypatch):
    real = registry.REGISTRY.availability

    def without_generic(name: str, emulate: bool) -> Availability:
        return Availability(False, "off in this test") if name == "generic" else real(name, emulate)

    monkeypatch.setattr(registry.REGISTRY, "availability", without_generic)
    glmport.core.selection.clear_cache()
    assert resolve("rms_norm", device_type="cpu").backend == "cpu"
    with pytest.raises(glmport.BackendUnavailableError, match="no available backend runs on xpu"):
        resolve("rms_norm", device_type="xpu")


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_unavailable_backend_says_why_and_lists_available_ones(monkeypatch):
    monkeypatch.setenv("GLMPORT_BACKEND", "cuda")
    with pytest.raises(glmport.BackendUnavailableError) as err:
        _norm()
    assert "no CUDA or ROCm device visible to torch" in str(err.value)
    assert "GLMPORT_EMULATE=1" in str(err.value)
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
    assert resolve("rope").backend == "generic"


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


def test_use_backend_sets_the_validation_level_for_its_block(monkeypatch):
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    with glmport.use_backend(validate="STRICT"):
        assert current_settings().validate == Level.STRICT
        with glmport.use_backend("cpu"):  # an inner block keeps the outer level
            assert current_settings().validate == Level.STRICT
    assert current_settings().validate == Level.META
    refused = pytest.raises(glmport.ConfigError, match="valid levels: meta, full, strict")
    with refused, glmport.use_backend(validate="loose"):
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


def test_input_outside_capabilities_falls_back_along_the_chain_with_one_log_line(caplog):
    caps = {"rms_norm": Capability(dtype=(torch.float32,), hidden=range(1, 65))}
    glmport.register_backend(_ToyBackend(name="fp32only", caps=caps))
    try:
        with (
            caplog.at_level(logging.WARNING, logger="glmport"),
            glmport.use_backend("fp32only"),
        ):
            assert torch.all(_norm() == 42.0)  # inside its limits: its own kernel
            for _ in range(3):
                x = torch.randn(2, 8, dtype=torch.bfloat16)
                y = glmport.ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
            wide = glmport.ops.rms_norm(torch.randn(2, 96), torch.ones(96))
    finally:
        glmport.unregister_backend("fp32only")
    with glmport.use_backend("generic"):
        assert torch.equal(y, glmport.ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16)))
    assert not torch.all(wide == 42.0)
    lines = [r.getMessage() for r in caplog.records if "'fp32only'" in r.getMessage()]
    assert lines == [
        "glmport: backend 'fp32only' cannot take dtype bfloat16 (it takes float32) in "
        "'rms_norm'; falling back to 'generic'"
    ]


def test_capability_limits_take_values_and_ranges():
    cap = Capability(q_heads=range(1, 65), head_dim=128, topk=(range(1, 2049), 4096))
    assert cap.refusal({"q_heads": 64, "head_dim": 128, "topk": 2048}) is None
    assert cap.refusal({"q_heads": 64, "head_dim": 128, "topk": 4096}) is None
    assert cap.refusal({"q_heads": 64, "head_dim": None, "topk": 1}) is None  # not limited
    assert cap.refusal({"q_heads": 128, "head_dim": 128, "topk": 1}) == (
        "q_heads 128 (it takes 1..64)"
    )
    assert cap.refusal({"q_heads": 1, "topk": 3000}) == "topk 3000 (it takes 1..2048, 4096)"


def test_manifest_rejects_unknown_feature_names_and_capabilities_of_other_ops():
    with pytest.raises(ValueError, match=r"unknown features \['head_dims'\].*q_heads"):
        BackendManifest(
            name="x",
            device_type="cpu",
            description="",
            ops=("lightning_indexer",),
            capabilities={"lightning_indexer": Capability(head_dims=(128,))},
        )
    with pytest.raises(ValueError, match="not one of its ops"):
        BackendManifest(
            name="x",
            device_type="cpu",
            description="",
            ops=("rms_norm",),
            capabilities={"rope": Capability(dtype=torch.float32)},
        )


def test_every_spec_reports_exactly_its_declared_features():
    from glmport.conformance.cases import all_cases
    from glmport.core.specs import SPECS

    seen = set()
    for case in all_cases(full=False):
        spec = SPECS[case.op]
        assert set(spec.features(*case.args())) == set(spec.feature_names), case.id
        seen.add(case.op)
    assert seen == set(OP_NAMES)


def test_backend_for_another_device_refuses_cpu_tensors_clearly():
    glmport.register_backend(_ToyBackend(name="xpuish", device="xpu"))
    try:
        with glmport.use_backend("xpuish"), pytest.raises(glmport.UnsupportedError, match="xpu"):
            _norm()
    finally:
        glmport.unregister_backend("xpuish")


def test_auto_follows_the_inputs_device_when_an_accelerator_backend_is_available():
    accel = _ToyBackend(name="accel", device="xpu", priority=30)
    glmport.register_backend(accel)
    try:
        assert glmport.core.selection.primary_backend() == "accel"  # the headline
        assert resolve("rms_norm", device_type="xpu").backend == "accel"
        # checkpoint loading and quantisation happen on the CPU: CPU tensors run on the
        # CPU's best backend instead of raising
        assert resolve("rms_norm", device_type="cpu").backend == "generic"
        y = _norm()
        assert accel.calls == 0 and not torch.all(y == 42.0)
        with glmport.use_backend(device="cpu"):
            assert glmport.core.selection.primary_backend() == "generic"
    finally:
        glmport.unregister_backend("accel")
    assert resolve("rms_norm").requested == "generic"


def test_auto_picks_a_vendor_backend_only_above_the_composite_priority():
    for device in ("cpu", "xpu"):
        glmport.register_backend(_ToyBackend(name="tie", device=device, priority=0))
        try:  # ties: the composite
            assert resolve("rms_norm", device_type=device).backend == "generic"
        finally:
            glmport.unregister_backend("tie")
    glmport.register_backend(_ToyBackend(name="amx", priority=3))
    try:
        assert resolve("rms_norm", device_type="cpu").backend == "amx"
        assert resolve("rope", device_type="cpu").chain == ("amx", "generic")
    finally:
        glmport.unregister_backend("amx")


def test_auto_with_a_device_of_no_vendor_backend_picks_the_composite(monkeypatch):
    monkeypatch.setenv("GLMPORT_DEVICE", "xpu:0")
    assert resolve("rms_norm").requested == "generic"
    assert resolve("rms_norm", device_type="xpu").requested == "generic"


class _EmulatedVendor(Backend):
    """A fake vendor whose kernels differ between its emulator and its hardware path."""

    manifest = BackendManifest(
        name="fakechip",
        device_type="cpu",
        description="test double",
        ops=("rms_norm",),
        emulation="a stand-in",
        priority=-1,
    )

    def __init__(self):
        self.loads = []

    def probe(self, emulate):
        return Availability(True, "emulated" if emulate else "", emulated=emulate)

    def load_kernels(self, emulate):
        self.loads.append(emulate)
        value = 1.0 if emulate else 2.0
        return {"rms_norm": lambda x, w, eps=1e-6: torch.full_like(x, value)}


def test_kernels_are_loaded_and_cached_per_emulation_setting():
    vendor = _EmulatedVendor()
    glmport.register_backend(vendor)
    try:
        for _ in range(2):
            with glmport.use_backend("fakechip", emulate=True):
                assert torch.all(_norm() == 1.0)
                assert resolve("rms_norm").emulated
            with glmport.use_backend("fakechip", emulate=False):
                assert torch.all(_norm() == 2.0)
                assert not resolve("rms_norm").emulated
    finally:
        glmport.unregister_backend("fakechip")
    assert vendor.loads == [True, False]


class _SecondComposite(Backend):
    manifest = BackendManifest(
        name="composite2",
        device_type="any",
        description="test double: the generic kernels under another name",
        ops=OP_NAMES,
        role="composite",
        priority=-5,
    )

    def load_kernels(self, emulate):
        from glmport.core.registry import REGISTRY

        return REGISTRY.kernels("generic", emulate)


def test_roles_come_from_manifests_not_names():
    from glmport.core.registry import REGISTRY

    assert REGISTRY.reference() == "cpu"
    assert REGISTRY.with_role("composite") == ("generic",)
    glmport.register_backend(_SecondComposite())
    glmport.register_backend(_ToyBackend(name="v"))
    try:
        assert REGISTRY.with_role("composite") == ("generic", "composite2")
        with glmport.use_backend("composite2"):
            assert resolve("rope").chain == ("composite2",)
        with glmport.use_backend("v"):
            assert resolve("rope").chain == ("v", "generic")
    finally:
        glmport.unregister_backend("composite2")
        glmport.unregister_backend("v")


def test_core_and_the_conformance_runner_name_no_backend():
    import ast
    from pathlib import Path

    import glmport.conformance.calls as calls
    import glmport.conformance.gradients as gradients
    import glmport.conformance.runner as runner
    import glmport.core as core

    runners = [Path(m.__file__) for m in (runner, calls, gradients)]
    files = [*Path(core.__file__).parent.rglob("*.py"), *runners]
    for path in files:
        names = {
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        assert not names & {"generic", "cuda", "ascend", "npu"}, path


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
    real = metadata.entry_points

    def fake_entry_points(group=None):
        return [*real(group=group), *found] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry.REGISTRY, "_entry_points", None)
    yield found
    registry.REGISTRY._entry_points = None
    for ep in found:
        registry.REGISTRY._loaded.pop(ep.name, None)
        registry.REGISTRY.forget(ep.name)
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


def test_recording_fallbacks_collects_each_hand_over_inside_the_block_only():
    log_fallback_once("ascend", "rope", "generic", "cannot take this in")
    with recording_fallbacks() as seen:
        log_fallback_once("ascend", "rope", "generic", "cannot take this in")  # logged before
        log_fallback_once("cuda", "rms_norm", "generic", "lacks")
    log_fallback_once("ascend", "rope", "generic", "cannot take this in")
    assert seen == [("ascend", "rope", "generic"), ("cuda", "rms_norm", "generic")]
