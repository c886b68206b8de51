"""Numerical guarantees every backend keeps at the edges of float32.

* A log-probability is never above 0 and an entropy never below 0, at any accepted
  temperature (the conformance suite's temperature cases, 1e-6 to 1e6, judged with the
  sign rule of :func:`glmport.conformance.judges.logprobs`).
"""

from __future__ import annotations

import pytest

from glmport.conformance.cases import LOGPROB_TEMPERATURES
from glmport.conformance.runner import run_check, suite_checks

pytestmark = pytest.mark.usefixtures("one_thread")

EMULATED = ("cuda", "ascend")
TEMPERATURE_CHECKS = [
    c for c in suite_checks(ops=("token_logprobs",)) if c.kind == "value" and "temperature" in c.id
]
# TVM compiles a module per temperature (a scalar of the graph): its extremes only.
TVM_TEMPERATURES = (min(LOGPROB_TEMPERATURES), max(LOGPROB_TEMPERATURES))


def _temperature_checks(backend: str) -> list:
    if backend != "tvm":
        return TEMPERATURE_CHECKS
    return [
        c
        for c in TEMPERATURE_CHECKS
        if dict(c.case.params)["temperature"] in TVM_TEMPERATURES and "float32" in c.id
    ]


@pytest.mark.parametrize("backend", ["cpu", "generic", "cuda", "ascend", "onnxruntime", "tvm"])
def test_log_probabilities_are_never_positive_at_extreme_temperatures(backend):
    checks = _temperature_checks(backend)
    assert checks
    for check in checks:
        rec = run_check(check, backend, emulate=backend in EMULATED)
        assert rec.outcome == "pass", f"{check.id} on {rec.ran_on}: {rec.reason}"
