"""``glmport conformance`` end to end: the example plug-in installs and conforms on its
own kernel with the fallback checks reported apart, a broken plug-in fails with a
non-zero exit and a report naming the op, a plug-in implementing nothing or an
unavailable backend never passes on its fallbacks, and the pytest plugin works on its
own in a vendor's CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import guard_s

from glmport.cli import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "glmport-example-backend"
GLMPORT = Path(sys.executable).with_name("glmport")
TESTS = Path(__file__).resolve().parent


def _run(args, cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(  # a conformance run (quick, a few ops) or an install
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=guard_s(150)
    )


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """The example plug-in, installed with pip into a folder of its own."""
    target = tmp_path_factory.mktemp("example_site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True, timeout=guard_s(60),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return target


def test_example_plugin_installs_and_passes_the_suite(example_site, tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [str(GLMPORT), "conformance", "--backend", "example", "--ops", "rms_norm,rope",
         "-n", "2", "--report-dir", str(report)],
        cwd=tmp_path, pythonpath=example_site,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend 'example' CONFORMS on its own kernels (rms_norm), quick mode" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert data["backend"] == "example" and data["manifest"]["ops"] == ["rms_norm"]
    assert data["verdict"] == {"conforms": True, "run_ok": True, "why": ""}
    own = [c for c in data["cases"] if c["own"]]
    assert data["summary"]["total"] == len(own) and data["summary"]["ops"] == ["rms_norm"]
    assert data["summary"]["pass"] > 0 and data["summary"]["fail"] == 0
    assert {(c["op"], c["ran_on"]) for c in own} == {("rms_norm", "example")}
    fallback = data["fallback_summary"]
    assert fallback["total"] == len(data["cases"]) - len(own) > 0
    assert fallback["backends"] == ["generic"] and fallback["fail"] == fallback["error"] == 0
    assert {c["op"] for c in data["cases"] if c["ran_on"] == "generic"} >= {"rope"}
    assert f"{fallback['total']} checks ran on fallbacks (generic), listed apart" in proc.stdout
    assert {"value", "determinism", "gradient", "bad_input", "opcheck"} <= {
        c["kind"] for c in data["cases"]
    }
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    md = (report / "conformance.md").read_text()
    assert "CONFORMS on its own kernels" in md and "## On fallbacks:" in md


BROKEN_PLUGIN = """
import torch
from glmport import Availability, Backend, BackendManifest

class Broken(Backend):
    manifest = BackendManifest(name="broken", device_type="cpu", description="forgets to normalise",
                               ops=("rms_norm",))
    def probe(self, emulate):
        return Availability(True)
    def load_kernels(self, emulate):
        return {"rms_norm": lambda x, weight, eps=1e-6: (x.float() * weight.float()).to(x.dtype)}

BACKEND = Broken()
"""


EMPTY_PLUGIN = """
from glmport import Availability, Backend, BackendManifest

class Empty(Backend):
    manifest = BackendManifest(name="empty", device_type="cpu", description="no kernels yet",
                               ops=())
    def probe(self, emulate):
        return Availability(True)
    def load_kernels(self, emulate):
        return {}

BACKEND = Empty()
"""


def _plugin_site(tmp_path, name: str, source: str):
    """A plug-in made by hand: a module and the dist-info that declares its entry point."""
    site = tmp_path / f"{name}_site"
    info = site / f"{name}_glmport-0.0.dist-info"
    info.mkdir(parents=True)
    (site / f"{name}_glmport.py").write_text(source)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-glmport\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[glmport.backends]\n{name} = {name}_glmport:BACKEND\n")
    return site


@pytest.fixture
def broken_site(tmp_path):
    return _plugin_site(tmp_path, "broken", BROKEN_PLUGIN)


def test_a_broken_plugin_fails_with_a_report_naming_the_op(broken_site, tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [str(GLMPORT), "conformance", "--backend", "broken", "--ops", "rms_norm", "-n", "0",
         "--report-dir", str(report)],
        cwd=tmp_path, pythonpath=broken_site,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DOES NOT CONFORM" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    failed = [c for c in data["cases"] if c["outcome"] == "fail"]
    assert failed and all(c["op"] == "rms_norm" and c["reason"] for c in failed)
    md = (report / "conformance.md").read_text()
    assert "## Not passed: its own kernels" in md and "rms_norm" in md


def test_a_plugin_implementing_nothing_does_not_conform_on_its_fallbacks(tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [str(GLMPORT), "conformance", "--backend", "empty", "--ops", "rms_norm", "-n", "0",
         "--report-dir", str(report)],
        cwd=tmp_path, pythonpath=_plugin_site(tmp_path, "empty", EMPTY_PLUGIN),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "backend 'empty' DOES NOT CONFORM (quick mode): it implements no op" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert data["verdict"]["conforms"] is False and data["summary"]["total"] == 0
    fallback = data["fallback_summary"]
    assert fallback["pass"] > 0 and fallback["backends"] == ["generic"]  # passing, not its own


def test_an_unavailable_backend_never_passes_silently(tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [str(GLMPORT), "conformance", "--plugin", "code_backends:ABSENT", "--ops", "rope",
         "-n", "0", "--report-dir", str(report)],
        cwd=tmp_path, pythonpath=TESTS,
    )  # fmt: skip
    assert proc.returncode != 0
    data = json.loads((report / "conformance.json").read_text())
    assert data["verdict"]["conforms"] is False and data["verdict"]["run_ok"] is False
    own = [c for c in data["cases"] if c["own"]]  # its rope checks: skipped, saying why
    assert own and all(c["outcome"] == "skipped" for c in own)
    assert data["summary"]["skipped"] == data["summary"]["total"] == len(own)
    assert all("no such chip in this machine" in c["reason"] for c in data["cases"])


def test_the_pytest_plugin_runs_the_suite_in_a_vendor_ci(tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [sys.executable, "-m", "pytest", "--pyargs", "glmport.conformance.suite", "-q",
         "-p", "no:cacheprovider", "--glmport-backend", "cpu", "--glmport-ops", "moe_dispatch",
         "--glmport-report-dir", str(report)],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend 'cpu' CONFORMS on its own kernels (moe_dispatch)" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert {c["op"] for c in data["cases"]} == {"moe_dispatch"}
    assert data["verdict"]["run_ok"] and data["summary"]["pass"] > 0


def test_conformance_rejects_an_unknown_backend_listing_valid_ones(capsys):
    assert main(["conformance", "--backend", "bogus"]) == 2
    assert "valid backends" in capsys.readouterr().err


def test_conformance_rejects_an_unknown_op(capsys):
    assert main(["conformance", "--ops", "rms_norm,matmul"]) == 2
    assert "unknown op 'matmul'" in capsys.readouterr().err
