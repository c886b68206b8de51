"""The backend contract around the kernel table: a table that breaks the manifest
makes the backend unavailable at probe time; a kernel that does not take the op's
arguments is an error naming the backend and the op; ``glmport info --backend``
shows where every op runs; a backend registered in code is judged by
``glmport conformance --plugin`` with pytest-xdist workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang_guard import guard_s

import glmport
from glmport import KernelSignatureError
from glmport.cli import collect_info, main
from glmport.core.errors import BackendUnavailableError, ConfigError
from glmport.core.registry import (
    REGISTRY,
    Availability,
    Backend,
    BackendManifest,
    register_backend_target,
)
from glmport.core.specs import INTERFACE_NAMES

TESTS = Path(__file__).resolve().parent
GLMPORT = Path(sys.executable).with_name("glmport")


def _ref(op):
    return REGISTRY.kernels(REGISTRY.reference(), False)[op]


class _Table(Backend):
    """A cpu backend declaring ``ops`` whose load_kernels returns ``table``."""

    def __init__(self, name, ops, table):
        self.manifest = BackendManifest(name=name, device_type="cpu", description="t", ops=ops)
        self.table = table

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        return self.table


@pytest.fixture
def registered():
    names = []

    def register(backend):
        glmport.register_backend(backend)
        names.append(backend.manifest.name)
        return backend.manifest.name

    yield register
    for name in names:
        glmport.unregister_backend(name)


@pytest.mark.parametrize(
    "table, why",
    [
        ({}, "declares ops ['rms_norm'] but its load_kernels() lacks them"),
        ({"rms_norm": None, "rms_nrom": None}, "load_kernels() returned unknown keys ['rms_nrom']"),
        (None, "load_kernels failed: TypeError"),
    ],
)
def test_a_kernel_table_that_breaks_the_manifest_is_unavailable_at_probe(registered, table, why):
    name = registered(_Table("badtable", ("rms_norm",), table))
    avail = REGISTRY.availability(name, False)
    assert not avail.ok and why in avail.reason
    info = collect_info()
    (entry,) = [b for b in info["backends"] if b["name"] == name]
    assert not entry["available"] and why in entry["reason"]
    with pytest.raises(BackendUnavailableError, match="not available here") as err:
        glmport.use_backend(name).__enter__()
    assert why in str(err.value)


def test_a_kernel_with_the_wrong_signature_names_the_backend_and_the_op(registered):
    def no_eps(x, weight):  # forgets that eps is passed too, positionally
        return _ref("rms_norm")(x, weight)

    name = registered(_Table("noeps", ("rms_norm",), {"rms_norm": no_eps}))
    with glmport.use_backend(name), pytest.raises(KernelSignatureError) as err:
        glmport.ops.rms_norm(torch.randn(3, 8), torch.ones(8))
    msg = str(err.value)
    assert "backend 'noeps' kernel for 'rms_norm' does not take the op's arguments" in msg
    assert "float eps=1e-06" in msg and "takes 2 positional arguments but 3 were given" in msg
    assert isinstance(err.value, TypeError)


def test_a_type_error_raised_inside_a_kernel_stands_as_raised(registered):
    def inner_bug(x, weight, eps=1e-6):
        return x + "one"

    name = registered(_Table("innerbug", ("rms_norm",), {"rms_norm": inner_bug}))
    with glmport.use_backend(name), pytest.raises(TypeError) as err:
        glmport.ops.rms_norm(torch.randn(3, 8), torch.ones(8))
    assert not isinstance(err.value, KernelSignatureError)


def test_the_conformance_suite_reports_a_wrong_signature_as_an_error(registered):
    from glmport.conformance.runner import run_check, suite_checks

    name = registered(_Table("noeps2", ("rms_norm",), {"rms_norm": lambda x, w: x}))
    (check,) = [c for c in suite_checks(ops=("rms_norm",)) if c.kind == "value"][:1]
    rec = run_check(check, name)
    assert rec.outcome == "error" and "kernel for 'rms_norm'" in rec.reason


@pytest.fixture
def code_backends(monkeypatch):
    """``tests/code_backends.py`` importable; ``codeplug`` unregistered afterwards."""
    monkeypatch.syspath_prepend(str(TESTS))
    yield
    glmport.unregister_backend("codeplug")


def test_info_backend_shows_where_every_op_runs(code_backends, capsys):
    name = register_backend_target("code_backends:BACKEND")
    info = collect_info("codeplug")
    assert info["selected_backend"] == name == "codeplug"
    assert set(info["ops"]) == set(INTERFACE_NAMES)
    norm = info["ops"]["rms_norm"]
    assert (norm["backend"], norm["chain"]) == ("codeplug", ["codeplug"])
    assert norm["limits"] == {"dtype": "float32"} and norm["beyond_limits"][0] == "generic"
    assert info["ops"]["rope"]["chain"] == ["codeplug", "generic"]
    assert info["ops"]["expert_parallel"]["backend"] == "generic"
    assert main(["info", "--backend", "codeplug"]) == 0
    out = capsys.readouterr().out
    assert "ops (where each runs under backend 'codeplug')" in out
    assert "codeplug -> generic" in out and "dtype float32 (else generic -> cpu)" in out
    assert main(["info", "--backend", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in data["ops"].values()} == {"cpu"}


def test_info_backend_emulated_and_unavailable(capsys, registered):
    info = collect_info("generic", emulate=True)
    assert info["emulate"] and info["ops"]["sparse_attention"]["backend"] == "generic"
    from code_backends import Absent

    registered(Absent())
    assert main(["info", "--backend", "absent", "--emulate"]) == 2
    err = capsys.readouterr().err  # unavailable: the reason, not a traceback
    assert "'absent'" in err and "no such chip in this machine" in err


def test_plugin_targets_register_once_and_report_bad_targets(code_backends):
    assert register_backend_target("code_backends:make_codeplug") == "codeplug"
    assert register_backend_target("code_backends:make_codeplug") == "codeplug"
    with pytest.raises(ConfigError, match="exists already"):
        register_backend_target("code_backends:BACKEND")  # another object, same name
    with pytest.raises(ConfigError, match="expected module:attr"):
        register_backend_target("code_backends")
    with pytest.raises(ConfigError, match="failed to load: ModuleNotFoundError"):
        register_backend_target("no_such_module_here:X")
    with pytest.raises(ConfigError, match="gave int"):
        register_backend_target("code_backends:__name__.__len__")


def test_conformance_plugin_with_xdist_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    env["PYTHONPATH"] = str(TESTS)
    report = tmp_path / "report"
    proc = subprocess.run(
        [str(GLMPORT), "conformance", "--plugin", "code_backends:BACKEND", "--ops", "rms_norm",
         "-n", "2", "--report-dir", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=guard_s(150),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bringing up nodes" in proc.stdout  # pytest-xdist workers judged it
    data = json.loads((report / "conformance.json").read_text())
    assert data["backend"] == "codeplug" and data["summary"]["pass"] > 0
    own = {(c["op"], c["ran_on"], c["outcome"]) for c in data["cases"] if c["own"]}
    assert ("rms_norm", "codeplug", "pass") in own
    assert not {o for *_, o in own} - {"pass", "unsupported"}
