"""The conformance suite as a pytest module: one test per check.

Run it with ``glmport conformance``, or in a vendor's own CI with
``pytest --pyargs glmport.conformance.suite --glmport-backend mychip``. Checks are
parametrized by the pytest plug-in :mod:`pytest_glmport` from ``--glmport-full`` and
``--glmport-ops``.
"""

from __future__ import annotations

import pytest

from glmport.conformance.runner import Check, run_check


def test_conformance(glmport_check: Check, glmport_settings, record_property) -> None:
    rec = run_check(glmport_check, glmport_settings.backend, emulate=glmport_settings.emulate)
    record_property("glmport", {**rec.to_dict(), "device": glmport_settings.device})
    if rec.outcome == "pass":
        return
    if rec.outcome in ("unsupported", "skipped"):
        pytest.skip(f"{rec.outcome}: {rec.reason}")
    # A failure on a fallback fails the run too, but it is that backend's bug: say so.
    where = rec.op if rec.own else f"{rec.op} on fallback {rec.ran_on!r}"
    pytest.fail(f"{rec.outcome} [{where}]: {rec.reason}", pytrace=False)
