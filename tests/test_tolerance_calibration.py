"""The bf16 / fp16 tolerances stay calibrated: correct implementations (the cpu backend
computing in the low dtype, ``generic``) err well inside them, against the float64
reference. ``python tests/test_tolerance_calibration.py`` prints the worst error per op,
dtype and kind over every quick-mode value and gradient check: the table in
:mod:`glmport.core.tolerance`'s docstring."""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from glmport.conformance import gradients, runner
from glmport.core.tolerance import tolerance

LOW = (torch.bfloat16, torch.float16)
MARGIN = 2.0  # the bounds must be at least this many times the worst measured error


def measure(families=None, kinds=("value", "gradient")) -> Iterator[tuple]:
    """``(backend, check, max_rel, mean_rel)`` of every passing-or-failing check in a
    low dtype (gradient metrics are the worst over the differentiable arguments)."""
    for backend in ("cpu", "generic"):
        for check in runner.suite_checks():
            c = check.case
            if check.kind not in kinds or c.dtype not in LOW:
                continue
            if families is not None and c.family not in families:
                continue
            seen: list[dict] = []

            def recording(*args, _close=gradients.close, _seen=seen):
                verdict = _close(*args)
                _seen.append(verdict.metrics)
                return verdict

            with mock.patch.object(gradients, "close", recording):
                rec = runner.run_check(check, backend)
            if rec.outcome == "skipped":  # gradients another backend computes
                continue
            metrics = [rec.metrics] if check.kind == "value" else seen
            worst = [
                max((m.get(k, 0.0) for m in metrics), default=0.0) for k in ("max_rel", "mean_rel")
            ]
            yield backend, check, *worst


@pytest.mark.usefixtures("one_thread")
def test_correct_implementations_err_well_inside_the_low_precision_tolerances():
    measured = list(measure(families=("tiny", "edge"), kinds=("value",)))
    assert measured
    for backend, check, max_rel, mean_rel in measured:
        tol = tolerance(check.op, check.case.dtype)
        assert max_rel * MARGIN <= tol.max_rel, (backend, check.id, max_rel)
        assert mean_rel * MARGIN <= tol.mean_rel, (backend, check.id, mean_rel)


if __name__ == "__main__":
    worst: dict[tuple, list] = {}
    for backend, check, max_rel, mean_rel in measure():
        key = (check.op, str(check.case.dtype).removeprefix("torch."), check.kind)
        entry = worst.setdefault(key, [0.0, "", 0.0])
        if max_rel >= entry[0]:
            entry[:2] = max_rel, f"{backend}:{check.id}"
        entry[2] = max(entry[2], mean_rel)
    for (op, dtype, kind), (max_rel, where, mean_rel) in sorted(worst.items()):
        tol = tolerance(op, getattr(torch, dtype))
        print(
            f"{op:17} {dtype:8} {kind:8} max_rel {max_rel:.2e} (limit {tol.max_rel:.0e}) "
            f"mean_rel {mean_rel:.2e} (limit {tol.mean_rel:.0e})  worst {where}"
        )
