"""The conformance verdict is about the backend under test: records say where each
check ran, reports keep the backend's own checks apart from fallback ones, a backend
whose own kernels never passed does not conform, and the failure table is readable
(shapes, the worst of every criterion)."""

from __future__ import annotations

import math

import pytest
import torch

from glmport import Availability, Backend, BackendManifest, Capability
from glmport.conformance.report import (
    build_report,
    markdown,
    table_lines,
    verdict_line,
    worst_ratio,
)
from glmport.conformance.runner import Record, run_check, suite_checks
from glmport.core.registry import register_backend, unregister_backend


def _rms_norm(x, weight, eps=1e-6):
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(x.dtype)


class OneOp(Backend):
    """rms_norm in float32 only; everything else falls back."""

    manifest = BackendManifest(
        name="one_op",
        device_type="cpu",
        description="test: one op of its own",
        ops=("rms_norm",),
        capabilities={"rms_norm": Capability(dtype=torch.float32)},
    )

    def load_kernels(self, emulate):
        return {"rms_norm": _rms_norm}


class Absent(Backend):
    """Declares rms_norm but cannot run here."""

    manifest = BackendManifest(
        name="absent", device_type="cpu", description="test: not here", ops=("rms_norm",)
    )

    def probe(self, emulate):
        return Availability(False, "no such chip in this machine")

    def load_kernels(self, emulate):
        return {"rms_norm": _rms_norm}


class Empty(Backend):
    """Implements no op: everything falls back."""

    manifest = BackendManifest(name="empty", device_type="cpu", description="test: no op", ops=())

    def load_kernels(self, emulate):
        return {}


@pytest.fixture(autouse=True)
def test_backends():
    for b in (OneOp(), Absent(), Empty()):
        register_backend(b, replace=True)
    yield
    for name in ("one_op", "absent", "empty"):
        unregister_backend(name)


def _checks(*ids: str):
    by_id = {c.id: c for c in suite_checks(ops=("rms_norm", "rope"))}
    return [by_id[i] for i in ids]


def _rec(id, op, outcome, ran_on, own, *, metrics=None, tolerance=None, params=None, reason=""):
    return Record(
        id=id, op=op, kind="value", family="tiny", dtype="float32", scheme=None,
        params=params or {"shape": [5, 32]}, outcome=outcome, reason=reason,
        metrics=metrics or {}, tolerance=tolerance or {}, ran_on=ran_on, own=own,
    ).to_dict()  # fmt: skip


def _report(records, backend="one_op"):
    return build_report(records, backend=backend, full=False, emulate=False, ops=None)


def test_records_say_where_each_check_ran():
    own, declined, lacked = _checks(
        "rms_norm-tiny-float32", "rms_norm-tiny-bfloat16", "rope-tiny_interleaved-float32"
    )
    rec = run_check(own, "one_op")
    assert (rec.outcome, rec.ran_on, rec.own) == ("pass", "one_op", True)
    rec = run_check(declined, "one_op")  # outside its capabilities: the fallback would run it
    assert (rec.outcome, rec.ran_on, rec.own) == ("unsupported", "generic", False)
    assert "fall back to 'generic'" in rec.reason
    rec = run_check(lacked, "one_op")
    assert (rec.outcome, rec.ran_on, rec.own) == ("pass", "generic", False)
    rec = run_check(lacked, "cpu")
    assert (rec.ran_on, rec.own) == ("cpu", True)


def test_an_unavailable_backend_is_skipped_on_its_own_ops_and_does_not_conform():
    (check,) = _checks("rms_norm-tiny-float32")
    rec = run_check(check, "absent")
    assert (rec.outcome, rec.ran_on, rec.own) == ("skipped", "absent", True)
    report = _report([rec.to_dict()], backend="absent")
    assert report["verdict"] == {
        "conforms": False, "run_ok": False, "why": "none of its own checks passed",
    }  # fmt: skip
    assert "'absent' DOES NOT CONFORM on its own kernels (rms_norm)" in verdict_line(report)


def test_own_and_fallback_checks_are_counted_apart():
    records = [
        _rec("rms_norm-a", "rms_norm", "pass", "one_op", True),
        _rec("rms_norm-b", "rms_norm", "pass", "one_op", True),
        _rec("rms_norm-c", "rms_norm", "unsupported", "generic", False),
        _rec("rope-a", "rope", "pass", "generic", False),
        _rec("rope-b", "rope", "pass", "generic", False),
        _rec("rope-c", "rope", "skipped", "generic", False),
    ]
    report = _report(records)
    assert report["schema_version"] == 2
    assert report["verdict"] == {"conforms": True, "run_ok": True, "why": ""}
    assert report["summary"] == {
        "total": 2, "pass": 2, "fail": 0, "unsupported": 0, "skipped": 0, "error": 0,
        "ops": ["rms_norm"],
    }  # fmt: skip
    fb = report["fallback_summary"]
    assert (fb["total"], fb["pass"], fb["unsupported"], fb["skipped"]) == (4, 2, 1, 1)
    assert fb["backends"] == ["generic"] and fb["ops"] == ["rms_norm", "rope"]
    assert [(r["op"], r["ran_on"], r["own"]) for r in report["table"]] == [
        ("rms_norm", "one_op", True), ("rms_norm", "generic", False), ("rope", "generic", False),
    ]  # fmt: skip
    assert verdict_line(report) == (
        "backend 'one_op' CONFORMS on its own kernels (rms_norm), quick mode: 2 pass, 0 fail, "
        "0 unsupported, 0 skipped, 0 error; 4 checks ran on fallbacks (generic), listed apart: "
        "2 pass, 1 unsupported, 1 skipped"
    )
    header, first = table_lines(report)[:2]
    assert header.split()[:4] == ["op", "dtype", "ran", "on"]
    assert first.split()[:3] == ["rms_norm", "float32", "one_op"]
    md = markdown(report)
    assert "## Its own kernels: 2 checks ran on `one_op`" in md
    assert "## On fallbacks: 4 checks ran on generic" in md
    assert md.index("| rms_norm | float32 | one_op |") < md.index("## On fallbacks")
    assert md.index("| rope | float32 | generic |") > md.index("## On fallbacks")


def test_a_backend_that_implements_nothing_does_not_conform():
    records = [_rec("rope-a", "rope", "pass", "generic", False)]
    report = build_report(records, backend="empty", full=False, emulate=False, ops=("rope",))
    assert report["verdict"]["conforms"] is False and report["verdict"]["run_ok"] is False
    assert report["summary"]["total"] == 0 and report["fallback_summary"]["pass"] == 1
    assert verdict_line(report).startswith(
        "backend 'empty' DOES NOT CONFORM (quick mode): it implements no op"
    )
    assert "None: it implements no op" in markdown(report)


def test_own_ops_that_never_ran_do_not_conform():
    records = [_rec("rope-a", "rope", "pass", "generic", False)]
    report = _report(records)
    assert report["verdict"]["why"] == "none of its own ops (rms_norm) ran a check"
    assert not report["verdict"]["run_ok"]


def test_the_reference_conforms_on_its_own_kernels():
    records = [_rec("rope-a", "rope", "pass", "cpu", True)]
    report = _report(records, backend="cpu")
    assert report["verdict"] == {"conforms": True, "run_ok": True, "why": ""}
    assert report["fallback_summary"]["total"] == 0
    assert verdict_line(report).startswith("backend 'cpu' CONFORMS on its own kernels (rope)")
    assert "## On fallbacks" not in markdown(report)


def test_a_fallback_failure_fails_the_run_as_the_fallbacks_bug():
    records = [
        _rec("rms_norm-a", "rms_norm", "pass", "one_op", True),
        _rec("rope-a", "rope", "fail", "generic", False, reason="output 0 off"),
    ]
    report = _report(records)
    assert report["verdict"]["conforms"] is True and report["verdict"]["run_ok"] is False
    assert "not of 'one_op'" in report["verdict"]["why"]
    line = verdict_line(report)
    assert "CONFORMS on its own kernels" in line
    assert "1 fail (the fallback's bugs, not 'one_op''s; they fail the run)" in line
    md = markdown(report)
    assert "## Not passed: on fallbacks" in md and "## Not passed: its own kernels" not in md
    assert "| `rope-a` | fail | generic |" in md


def test_the_failure_table_shows_shapes_and_the_worst_criterion():
    records = [
        _rec(
            "rms_norm-a", "rms_norm", "fail", "one_op", True,
            params={"shape": [8, 6144], "eps": 1e-6},
            metrics={"max_rel": 0.001, "mean_rel": 0.003},
            tolerance={"max_rel": 0.01, "mean_rel": 0.001},
            reason="mean off",
        ),
    ]  # fmt: skip
    md = markdown(_report(records))
    assert "| `rms_norm-a` | fail | one_op | shape=8x6144, eps=1e-06 | 3.000 | mean off |" in md
    assert _report(records)["table"][0]["worst"] == pytest.approx(3.0)  # mean, not max_rel


def test_worst_ratio_takes_every_metric_with_a_tolerance_of_its_name():
    assert worst_ratio({"max_rel": 0.5, "mean_rel": 0.2}, {"max_rel": 1.0, "mean_rel": 0.1}) == 2.0
    model = {"max_abs_dlogp": 0.5, "mean_abs_dlogp": 0.05, "icepop_pop_fraction": 0.0, "tokens": 60}
    limits = {"max_abs_dlogp": math.inf, "mean_abs_dlogp": 0.1, "icepop_pop_fraction": 0.0}
    assert worst_ratio(model, limits) == pytest.approx(0.5)  # inf and exact-zero limits met
    assert worst_ratio({"icepop_pop_fraction": 0.02}, {"icepop_pop_fraction": 0.0}) == math.inf
    assert worst_ratio({"max_rel": math.nan}, {"max_rel": 1.0}) == math.inf
    assert worst_ratio({"codes_differ": 0, "scale_rel": 0.0}, {}) is None
    assert worst_ratio({"max_abs": 3.0}, {"abs_k": 1.0}) is None  # names must match


def test_gemm_worst_ratio_is_the_judges_combined_criterion():
    """The GEMM judge passes when max|err| <= rel * max|ref| + a K-scaled absolute term:
    worst err/tol must be that ratio, at most 1 for a pass and above 1 for a fail."""
    from glmport.conformance.judges import gemm

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 256, generator=gen), torch.randn(1, 8, 256, generator=gen)
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    args = (x, w, offsets, None, "none", 128)
    ref = (x.double() @ w[0].double().T).float()
    for nudge, ok in ((1e-6, True), (1e-1, False)):
        out = ref.clone()
        out[0, 0] += nudge * ref.abs().max()
        v = gemm("grouped_gemm", torch.float32, args, out, ref)
        ratio = worst_ratio(v.metrics, v.tolerance)
        assert v.ok is ok and (ratio <= 1.0) is ok
        assert ratio == pytest.approx(v.metrics["max_abs"] / v.tolerance["max_abs"])
