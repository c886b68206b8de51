"""The conformance suite's quick mode on the cuda backend, emulated: its Triton kernels
through the interpreter on the CPU, the same cases and tolerances as every backend.
One test per check so that pytest-xdist spreads them; the verdict over all of them is
what ``glmport conformance --backend cuda --emulate`` prints."""

from __future__ import annotations

import pytest

from glmport.conformance.runner import run_check, suite_checks

pytestmark = pytest.mark.usefixtures("one_thread")

CHECKS = suite_checks()
# Whose backward runs when it is not cuda's (docs/backends.md): the gradient check is
# skipped saying so; grad_consistency ties cuda's forward to that backward, except for
# glmport's straight-through closed forms (skipped: by design not a derivative).
BORROWED_BACKWARD = ("generic", "glmport closed form")


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_cuda_conforms_under_the_interpreter(check, cuda_module):
    rec = run_check(check, "cuda", emulate=True)
    if rec.outcome == "skipped":
        closed_form = rec.metrics.get("backward") == "glmport closed form"
        if rec.kind == "grad_consistency":  # a straight-through GEMM is not a derivative
            assert closed_form, rec.reason
        else:
            assert rec.kind == "gradient" and rec.ran_on in BORROWED_BACKWARD, rec.reason
        return
    assert rec.outcome == "pass", f"{rec.outcome} on {rec.ran_on}: {rec.reason}"
    # Own kernels everywhere but expert parallelism, which cuda takes from generic.
    assert rec.own == (rec.kind != "expert_parallel"), rec.ran_on
