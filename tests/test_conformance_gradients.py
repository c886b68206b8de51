"""Gradient checks judge the backend under test: a gradient check counts only when
the backward that ran is the backend's own code, and ``grad_consistency`` compares the
backend's forward (central differences) with whichever backward runs."""

from __future__ import annotations

import pytest

import glmport
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest
from glmport.core.specs import SPECS

GRADIENT_KINDS = ("gradient", "grad_consistency")
NOT_OWN = "not from {}'s code; see the forward/backward consistency check"


def _kernel(backend, key):
    return REGISTRY.kernels(backend, False)[key]


def _wrong_scale(q, k, v, indices, scale, need_lse=True, k_rope=None):
    return _kernel("cpu", "sparse_attention")(
        q, k, v, indices, v.shape[-1] ** -0.5, need_lse, k_rope
    )


def _combine_without_weights(y_sorted, src_row, weights):
    return _kernel("cpu", "moe_combine")(y_sorted, src_row, weights * 0 + 1)


def _dq_without_scale(inputs, grads):
    # A fused backward that forgets the softmax scale on dq (dk and dv are right).
    dq, dk, dv, *rest = _kernel("generic", "sparse_attention:backward")(inputs, grads)
    return (dq / inputs[4], dk, dv, *rest)


class _Plugin(Backend):
    """A cpu backend of the given kernels (``"<op>:backward"`` keys included)."""

    def __init__(self, name, kernels, fallback=()):
        ops = tuple(k for k in kernels if ":" not in k)
        self.manifest = BackendManifest(
            name=name, device_type="cpu", description="test", ops=ops, fallback=fallback
        )
        self.kernels = kernels

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        return self.kernels


def _records(backend, ops):
    return [run_check(c, backend) for c in suite_checks(ops=ops) if c.kind in GRADIENT_KINDS]


@pytest.fixture
def plugins():
    """Register test backends; unregistered (last first) after the test."""
    names = []

    def register(name, kernels, fallback=()):
        glmport.register_backend(_Plugin(name, kernels, fallback))
        names.append(name)

    yield register
    for name in reversed(names):
        glmport.unregister_backend(name)


@pytest.mark.parametrize(
    ("op", "kernel", "backward"),
    [
        ("sparse_attention", _wrong_scale, "generic:backward"),
        ("moe_combine", _combine_without_weights, "composite vjp (generic)"),
    ],
)
def test_a_wrong_forward_without_a_backward_fails_consistency_and_never_passes_gradients(
    plugins, op, kernel, backward
):
    plugins("wrong_fwd", {op: kernel})
    records = _records("wrong_fwd", (op,))
    grads = [r for r in records if r.kind == "gradient"]
    assert grads and all(r.outcome == "skipped" for r in grads)
    for r in grads:
        assert r.ran_on == "generic" and not r.own and r.metrics["backward"] == backward
        assert r.reason == f"gradients come from {backward}, {NOT_OWN.format('wrong_fwd')}"
    failed = [r for r in records if r.kind == "grad_consistency" and r.outcome == "fail"]
    assert failed and all(r.ran_on == "wrong_fwd" and backward in r.reason for r in failed)
    assert not [r for r in records if r.outcome == "error"]


def test_a_right_forward_without_a_backward_passes_consistency(plugins):
    ops = ("sparse_attention", "moe_combine", "rms_norm", "token_logprobs")
    plugins("right_fwd", {op: _kernel("cpu", op) for op in ops})
    records = _records("right_fwd", ops)
    consistency = [r for r in records if r.kind == "grad_consistency"]
    assert consistency and all(r.outcome == "pass" for r in consistency), [
        (r.id, r.reason) for r in consistency if r.outcome != "pass"
    ]
    assert all(r.outcome == "skipped" for r in records if r.kind == "gradient")


def test_a_wrong_fused_backward_fails_its_gradient_and_consistency_checks(plugins):
    kernels = {
        "sparse_attention": _kernel("cpu", "sparse_attention"),
        "sparse_attention:backward": _dq_without_scale,
    }
    plugins("wrong_bwd", kernels)
    records = _records("wrong_bwd", ("sparse_attention",))
    assert records and all(r.outcome == "fail" for r in records), [
        (r.id, r.outcome, r.reason) for r in records
    ]
    assert all(r.ran_on == "wrong_bwd" and r.own for r in records)
    assert all(r.metrics["backward"] == "wrong_bwd:backward" for r in records)
    assert all("'q'" in r.reason for r in records)  # the input whose gradient is wrong


def test_a_fallbacks_fused_backward_is_named_and_not_credited(plugins):
    plugins(
        "fused",
        {
            "sparse_attention": _kernel("cpu", "sparse_attention"),
            "sparse_attention:backward": _kernel("generic", "sparse_attention:backward"),
        },
    )
    plugins("norm_only", {"rms_norm": _kernel("cpu", "rms_norm")}, fallback=("fused",))
    records = _records("norm_only", ("sparse_attention",))
    assert records and all(r.metrics["backward"] == "fused:backward" for r in records)
    assert {(r.kind, r.outcome, r.ran_on) for r in records} == {
        ("gradient", "skipped", "fused"),
        ("grad_consistency", "pass", "fused"),
    }


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_the_reference_and_generic_have_no_false_failures(backend):
    records = _records(backend, None)
    assert records and not [r for r in records if r.outcome not in ("pass", "skipped")], [
        (r.id, r.outcome, r.reason) for r in records if r.outcome not in ("pass", "skipped")
    ]
    for r in records:
        if SPECS[r.op].backward is not None:  # straight-through: no backend's code
            assert (r.outcome, r.metrics["backward"]) == ("skipped", "glmport closed form")
            assert r.kind == "grad_consistency" or r.ran_on == "glmport closed form"
        elif r.kind == "grad_consistency":
            assert r.outcome == "pass" and r.metrics["consistency_rel"] < 1e-2
        else:  # each differentiates its own code: generic and the reference alike
            assert (r.ran_on, r.outcome) == (backend, "pass"), (r.id, r.reason)
