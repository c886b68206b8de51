"""The install: folders map into the glmport namespace only (in the editable install
and in the wheel), import glmport is cheap, the console script and ``python -m glmport``
work, and the pytest plug-in costs other projects' test runs no torch import."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hang_guard import guard_s
from source_tree import OWN_NAME, REPO, installed_name, package_folders


def _run(code_or_args, cwd, env=None, module=False):
    args = [sys.executable, *code_or_args] if module else [sys.executable, "-c", code_or_args]
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("bare", ["core", "model", "rl", "backends", "conformance", "export"])
def test_folders_are_not_importable_as_bare_top_level_modules(tmp_path, bare):
    proc = _run(f"import {bare}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize(
    "module",
    [
        "glmport.core",
        "glmport.backends.cpu",
        "glmport.backends.generic",
        "glmport.backends.cuda",
        "glmport.backends.ascend",
        "glmport.model",
        "glmport.rl",
        "glmport.conformance",
        "glmport.export",
    ],
)
def test_every_layout_folder_is_a_glmport_subpackage(tmp_path, module):
    proc = _run(f"import {module}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_import_glmport_pulls_in_no_heavy_or_vendor_module(tmp_path):
    code = (
        "import sys, json, glmport; "
        "print(json.dumps(sorted(m for m in ('triton', 'torch_npu', 'onnx', 'onnxruntime', "
        "'onnxscript', 'tvm', 'transformers') if m in sys.modules)))"
    )
    proc = _run(code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_python_dash_m_glmport_runs_the_cli(tmp_path):
    proc = _run(["-m", "glmport", "info", "--json"], cwd=tmp_path, module=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["selected_backend"] == "generic"


def _wheel_paths_of_source_tree() -> set[str]:
    """Where each .py file of the source tree must land in the wheel, from a walk of the
    tree (so a folder that packaging forgets shows up as missing)."""
    paths = set()
    for top in package_folders():
        prefix = installed_name(top).replace(".", "/")
        paths |= {f"{prefix}/{py.relative_to(top).as_posix()}" for py in top.rglob("*.py")}
    return paths


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # Built from a copy: an in-tree build leaves build/ and *.egg-info in the checkout,
    # and files left in build/ by an earlier build would reach the wheel.
    src = tmp_path_factory.mktemp("src")
    for item in REPO.iterdir():
        if item.is_file():
            shutil.copy2(item, src)
    for top in package_folders():
        shutil.copytree(top, src / top.name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=guard_s(60),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("glmport-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_holds_every_source_module_under_its_glmport_name(wheel):
    expected = _wheel_paths_of_source_tree()
    assert {"glmport/core/specs/__init__.py", "pytest_glmport/__init__.py"} <= expected
    in_wheel = {n for n in wheel.namelist() if n.endswith(".py")}
    assert sorted(expected - in_wheel) == [], "modules missing from the wheel"
    assert sorted(in_wheel - expected) == [], "modules in the wheel but not in the tree"


def test_the_wheel_installs_no_bare_top_level_module(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" not in n}
    assert tops == OWN_NAME


def test_the_wheel_registers_the_builtin_backends_and_the_pytest_plugin(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    eps = configparser.ConfigParser()
    eps.read_string(wheel.read(name).decode())
    assert dict(eps["glmport.backends"]) == {
        **{b: f"glmport.backends.{b}:BACKEND" for b in ("cpu", "generic", "cuda", "ascend")},
        "onnxruntime": "glmport.export.ort_backend:BACKEND",
        "tvm": "glmport.export.tvm_backend:BACKEND",
    }
    assert dict(eps["pytest11"]) == {"glmport": "pytest_glmport"}


def _run_pytest_project(tmp_path: Path, files: dict[str, str], *args: str):
    """A project of its own in tmp_path, under pytest in a fresh interpreter."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GLMPORT_"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=guard_s(60),
    )  # fmt: skip


UNRELATED_PROJECT_TEST = """
import sys

def test_the_plugin_is_loaded_but_imported_neither_glmport_nor_torch(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("glmport")
    assert [m for m in sys.modules if m.split(".")[0] in ("glmport", "torch")] == []
"""


def test_the_pytest_plugin_costs_an_unrelated_project_no_torch_import(tmp_path):
    proc = _run_pytest_project(tmp_path, {"test_unrelated.py": UNRELATED_PROJECT_TEST})
    assert proc.returncode == 0, proc.stdout + proc.stderr


SUITE_PROJECT_TEST = """
from glmport.conformance.suite import test_conformance  # the suite, in a vendor's project

def test_the_options_reach_the_settings(glmport_settings):
    assert (glmport_settings.backend, glmport_settings.ops) == ("cpu", ("rms_norm",))
"""


def test_the_pytest_plugin_runs_the_suite_when_a_project_asks_for_it(tmp_path):
    proc = _run_pytest_project(
        tmp_path, {"test_vendor.py": SUITE_PROJECT_TEST},
        "--glmport-backend", "cpu", "--glmport-ops", "rms_norm",
        "--glmport-report-dir", str(tmp_path / "report"),
        "-k", "settings or rms_norm-tiny-float32]",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout and "glmport conformance" in proc.stdout
    data = json.loads((tmp_path / "report" / "conformance.json").read_text())
    assert [(c["op"], c["outcome"]) for c in data["cases"]] == [("rms_norm", "pass")]


def test_the_wheel_holds_every_mustpass_list(wheel):
    shipped = sorted(p.name for p in (REPO / "conformance" / "mustpass").glob("*.json"))
    assert shipped, "no mustpass list in the tree"
    in_wheel = sorted(
        Path(n).name for n in wheel.namelist() if n.startswith("glmport/conformance/mustpass/")
    )
    assert in_wheel == shipped
