"""The conformance suite's quick mode on the ascend backend, emulated: its adapters
against the CPU emulator of the torch_npu op contracts, the same cases and tolerances
as every backend. One test per check so that pytest-xdist spreads them; the verdict
over all of them is what ``glmport conformance --backend ascend --emulate`` prints.

Cases outside the chip limits the manifest declares (fp32, head dims other than
GLM-5's, W4A8 / FP8 schemes ...) are *unsupported*: they run on the generic backend,
and the suite says so. A second test makes sure the limits leave every declared op
real cases of its own to be judged on."""

from __future__ import annotations

import pytest

from glmport.backends.ascend import BACKEND
from glmport.conformance.cases import all_cases
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.specs import SPECS

CHECKS = suite_checks()
# Whose backward runs when it is not ascend's (docs/backends.md): the gradient check is
# skipped saying so; grad_consistency ties ascend's forward to that backward, except for
# glmport's straight-through closed forms (skipped: by design not a derivative).
BORROWED_BACKWARD = ("generic", "glmport closed form")


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_ascend_conforms_under_the_emulator(check):
    rec = run_check(check, "ascend", emulate=True)
    if rec.outcome == "unsupported":  # outside the chip limits: generic ran it, said so
        assert rec.ran_on == "generic" and not rec.own, rec.reason
        assert "ascend" in rec.reason, rec.reason
        return
    if rec.outcome == "skipped":
        closed_form = rec.metrics.get("backward") == "glmport closed form"
        if rec.kind == "grad_consistency":  # a straight-through GEMM is not a derivative
            assert closed_form, rec.reason
        else:
            assert rec.kind == "gradient" and rec.ran_on in BORROWED_BACKWARD, rec.reason
        return
    assert rec.outcome == "pass", f"{rec.outcome} on {rec.ran_on}: {rec.reason}"


@pytest.mark.parametrize("op", [op for op in BACKEND.manifest.ops if op in SPECS])
def test_every_declared_op_has_quick_cases_inside_the_chip_limits(op):
    """The capabilities must not turn an op's whole quick suite into fallbacks: at least
    one value case of each declared op (and for the GEMMs each declared scheme) is
    inside the limits, so the adapter itself is judged."""
    cap = BACKEND.manifest.capabilities.get(op)
    spec = SPECS[op]
    inside = [
        c
        for c in all_cases(ops=(op,))
        if cap is None or cap.refusal(spec.features(*c.args())) is None
    ]
    assert inside, f"no quick {op} case is inside ascend's limits {cap.limits}"
    if cap is not None and "scheme" in cap.limits:
        schemes = {c.scheme for c in inside}
        assert set(cap.limits["scheme"]) - {"none"} <= schemes, schemes


def test_a_call_an_adapter_hands_to_generic_is_credited_to_generic():
    """int4 with K 2 (group 2) is inside the manifest's limits but not the ops': the
    adapter runs the generic composite, so generic ran the check, not ascend."""
    (check,) = [c for c in CHECKS if c.id == "quant_gemm-k1-bfloat16-w4a16"]
    rec = run_check(check, "ascend", emulate=True)
    assert rec.outcome == "pass" and rec.ran_on == "generic" and not rec.own, rec
    assert "ascend's kernel handed it to generic" in rec.reason
    # An adapter that ran its own op keeps the credit.
    (own,) = [c for c in CHECKS if c.id == "quant_gemm-tiny-bfloat16-w4a16"]
    rec = run_check(own, "ascend", emulate=True)
    assert rec.outcome == "pass" and rec.ran_on == "ascend" and rec.own, rec


def test_at_least_30_quick_sparse_attention_value_checks_reach_the_adapter():
    ran = [
        run_check(c, "ascend", emulate=True)
        for c in CHECKS
        if c.op == "sparse_attention" and c.kind == "value"
    ]
    own = [r.id for r in ran if r.own and r.outcome == "pass"]
    assert len(own) >= 30, own
