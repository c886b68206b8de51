"""``glmport info``: what it reports, and clear non-zero exits on bad configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmport.cli import main
from glmport.core.specs import INTERFACE_NAMES


def test_info_json_reports_backends_versions_and_every_op(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["selected_backend"] == "generic"  # auto on a CPU: the fast composite
    assert set(info["ops"]) == set(INTERFACE_NAMES)
    assert all(r["backend"] == "generic" for r in info["ops"].values())
    names = {b["name"]: b for b in info["backends"]}
    assert names["cpu"]["available"] and len(names["cpu"]["ops"]) == len(INTERFACE_NAMES)
    assert names["cuda"]["available"] == torch.cuda.is_available() and names["cuda"]["reason"]
    assert "not verified on a GPU" in names["cuda"]["verified"]
    assert info["versions"]["torch"]


def test_info_text_shows_the_fallback_path(monkeypatch, capsys):
    monkeypatch.setenv("GLMPORT_BACKEND", "generic")
    monkeypatch.setenv("GLMPORT_OPS", "rope=cpu")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend 'generic'" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["sparse_attention"] == ["generic", "generic"]
    assert rows["rope"] == ["cpu", "cpu"]


def test_info_with_an_unknown_backend_exits_non_zero_naming_valid_ones(monkeypatch, capsys):
    monkeypatch.setenv("GLMPORT_BACKEND", "bogus")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "cpu" in err and "generic" in err


def test_info_with_a_malformed_override_exits_non_zero(monkeypatch, capsys):
    monkeypatch.setenv("GLMPORT_OPS", "rope")
    assert main(["info"]) == 2
    assert "GLMPORT_OPS" in capsys.readouterr().err


def test_unknown_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_console_script_is_installed(tmp_path):
    exe = Path(sys.executable).with_name("glmport")  # installed beside the interpreter
    assert exe.exists()
    proc = subprocess.run(
        [exe, "info"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "", "GLMPORT_BACKEND": "bogus"},
    )
    assert proc.returncode == 2
    assert "valid backends" in proc.stderr
