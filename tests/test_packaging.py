"""The install: folders map into the glmport namespace only, import glmport is cheap,
the console script and ``python -m glmport`` work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


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
    assert json.loads(proc.stdout)["selected_backend"] == "cpu"
