"""``glmport conformance`` end to end: the example plug-in installs and passes, a broken
plug-in fails with a non-zero exit and a report naming the op, an unavailable backend
never passes silently, and the pytest plugin works on its own in a vendor's CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glmport.cli import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "glmport-example-backend"
GLMPORT = Path(sys.executable).with_name("glmport")


def _run(args, cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """The example plug-in, installed with pip into a folder of its own."""
    target = tmp_path_factory.mktemp("example_site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(EXAMPLE)],
        capture_output=True, text=True, timeout=600,
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
    assert "backend 'example' CONFORMS" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert data["backend"] == "example" and data["manifest"]["ops"] == ["rms_norm"]
    assert data["summary"]["pass"] == data["summary"]["total"] > 0
    ran_on = {(c["op"], c["ran_on"]) for c in data["cases"]}
    assert ran_on == {("rms_norm", "example"), ("rope", "generic")}  # rope fell back
    assert {c["kind"] for c in data["cases"]} == {
        "value", "determinism", "gradient", "bad_input", "opcheck",
    }  # fmt: skip
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    assert "CONFORMS" in (report / "conformance.md").read_text()


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


@pytest.fixture
def broken_site(tmp_path):
    """A plug-in made by hand: a module and the dist-info that declares its entry point."""
    site = tmp_path / "broken_site"
    (site / "broken_glmport-0.0.dist-info").mkdir(parents=True)
    (site / "broken_glmport.py").write_text(BROKEN_PLUGIN)
    info = site / "broken_glmport-0.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-glmport\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[glmport.backends]\nbroken = broken_glmport:BACKEND\n")
    return site


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
    assert "## Not passed" in md and "rms_norm" in md


def test_an_unavailable_backend_never_passes_silently(tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [str(GLMPORT), "conformance", "--backend", "cuda", "--ops", "rope", "-n", "0",
         "--report-dir", str(report)],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    data = json.loads((report / "conformance.json").read_text())
    assert data["summary"]["skipped"] == data["summary"]["total"] > 0
    assert all("no Triton kernels" in c["reason"] for c in data["cases"])


def test_the_pytest_plugin_runs_the_suite_in_a_vendor_ci(tmp_path):
    report = tmp_path / "report"
    proc = _run(
        [sys.executable, "-m", "pytest", "--pyargs", "glmport.conformance.suite", "-q",
         "-p", "no:cacheprovider", "--glmport-backend", "cpu", "--glmport-ops", "moe_dispatch",
         "--glmport-report-dir", str(report)],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "glmport conformance" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert {c["op"] for c in data["cases"]} == {"moe_dispatch"}


def test_conformance_rejects_an_unknown_backend_listing_valid_ones(capsys):
    assert main(["conformance", "--backend", "bogus"]) == 2
    assert "valid backends" in capsys.readouterr().err


def test_conformance_rejects_an_unknown_op(capsys):
    assert main(["conformance", "--ops", "rms_norm,matmul"]) == 2
    assert "unknown op 'matmul'" in capsys.readouterr().err
