"""The command line refuses before any work: absurd sizes, an ``--out`` it cannot or
must not write, a missing extra (with a pip command that works where glmport came
from); and its errors name where a bad value came from (a flag, a variable, a call)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hang_guard import guard_s

import glmport
from glmport.cli import build_parser, main
from glmport.commands import common
from glmport.commands.common import MAX_TOKENS, MAX_WORKERS
from glmport.core import extras
from glmport.core.errors import ConfigError
from glmport.model.indexcache import MAX_CALIBRATION_TOKENS, random_calibration, read_calibration
from glmport.rl.tasks import MAX_BASE, MAX_DIGITS, make_task

REPO = Path(__file__).resolve().parents[1]


class WorkStarted(AssertionError):
    """Raised by a stub of the first heavy step: the command got past its checks."""


@pytest.fixture
def no_work(monkeypatch):
    """Every command's first heavy step raises WorkStarted: a refusal must come first."""

    def started(*args, **kwargs):
        raise WorkStarted(args)

    import pytest as pytest_module

    import glmport.rl.run

    monkeypatch.setattr(common, "load_model", started)
    monkeypatch.setattr(pytest_module, "main", started)
    monkeypatch.setattr(glmport.rl.run, "train", started)


def _refusal(argv: list[str], capsys) -> str:
    """Run ``glmport argv`` in this process: exit status 2 and one error line, returned."""
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors exit, as argparse does
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, (argv, status, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("glmport: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _flags(command: list[str]) -> dict[str, object]:
    """``--flag -> argparse type`` of one command (``["rl", "serve"]``)."""
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
        parser = sub.choices[word]
    return {a.option_strings[-1]: a.type for a in parser._actions if a.option_strings}


# Sampling parameters are checked by generate() and the gateway (their representable
# range is theirs to define); every other number these commands take is bounded here.
_SAMPLING = {
    ("generate", "--temperature"),
    ("generate", "--top-p"),
    ("rl agent", "--temperature"),
    ("rl train", "--temperature"),
}
_COMMANDS = ["info", "conformance", "diff", "generate", "indexcache search", "rl serve", "rl agent"]


@pytest.mark.parametrize("command", _COMMANDS)
def test_no_number_is_taken_without_bounds(command):
    """A bare ``type=int`` / ``type=float`` takes 10**30 as readily as 3."""
    unbounded = [
        flag
        for flag, kind in _flags(command.split()).items()
        if kind in (int, float) and (command, flag) not in _SAMPLING
    ]
    assert not unbounded, f"glmport {command}: {unbounded} take any number"


_GEN = ["generate", "--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "1"]
_SEARCH = ["indexcache", "search", "--model", "tiny", "--keep", "1"]

ABSURD = [
    (["diff", "--backends", "cpu,generic", "--random", "1000000000"], "--random"),
    (["diff", "--backends", "cpu,generic", "--random", "1e9"], "--random"),
    (["diff", "--backends", "cpu,generic", "--random", "1"], "from 2"),
    ([*_GEN[:-1], "10" * 9], "--max-new-tokens"),
    ([*_SEARCH, "--random", "1000000000"], "--random"),
    ([*_SEARCH, "--random", "1e9"], "--random"),
    ([*_SEARCH, "--random", "100000"], f"{MAX_CALIBRATION_TOKENS} calibration tokens"),
    ([*_SEARCH, "--random", "2", "--seq-len", str(MAX_TOKENS + 1)], "--seq-len"),
    ([*_SEARCH, "--random", "2", "--keep", "9" * 50], "--keep"),
    (["rl", "serve", "--workers", "1000000"], "--workers"),
    (["rl", "serve", "--workers", str(MAX_WORKERS + 1)], f"to {MAX_WORKERS}"),
    (["rl", "serve", "--port", "65536"], "--port"),
    (["rl", "serve", "--port", "-1"], "--port"),
    (["rl", "serve", "--max-sessions", "0"], "--max-sessions"),
    (["rl", "serve", "--max-new-tokens-limit", "10000000000"], "--max-new-tokens-limit"),
    (["rl", "agent", "--episodes", "1000000000000"], "--episodes"),
    (["rl", "agent", "--episodes", "1e12"], "--episodes"),
    (["rl", "agent", "--max-turns", "10" * 10], "--max-turns"),
    (["rl", "agent", "--max-context", "1" + "0" * 30], "--max-context"),
    (["rl", "train", "--digits", "100000", "--out", "run"], "--digits"),
    (["rl", "train", "--digits", str(MAX_DIGITS + 1), "--out", "run"], f"to {MAX_DIGITS}"),
    (["conformance", "-n", "100000"], "argument -n"),
    (["conformance", "-n", "١٢"], "argument -n"),
    ([*_GEN, "--seed", "9" * 5000], "--seed"),
]


@pytest.mark.parametrize(("argv", "needle"), ABSURD)
def test_absurd_sizes_are_refused_before_any_work(argv, needle, no_work, capsys, tmp_path):
    os.chdir(tmp_path)
    line = _refusal(argv, capsys)
    assert needle in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["diff", "--backends", "cpu,generic", "--random", "5000"], "--random"),
        (["diff", "--backends", "cpu,generic", "--input-ids", ",".join(["1"] * 5000)], "--input-"),
        ([*_SEARCH, "--random", "1", "--seq-len", "5000"], "--seq-len"),
        (["rl", "agent", "--max-context", "5000"], "--max-context"),
        (
            ["rl", "serve", "--model", "tiny", "--local", "--max-new-tokens-limit", "5000"],
            "--max-new-tokens-limit",
        ),
    ],
)
def test_sizes_the_model_bounds_are_checked_once_it_is_loaded(argv, flag, capsys, tmp_path):
    """The tiny model's context is 4096 positions: refused after loading it, before use."""
    os.chdir(tmp_path)
    line = _refusal([*argv, *(["--out", "o"] if argv[0] != "rl" else [])], capsys)
    assert flag in line and "max_position_embeddings 4096" in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "kwargs", [{"digits": MAX_DIGITS + 1}, {"digits": 10**9}, {"base": MAX_BASE + 1}]
)
@pytest.mark.parametrize("task", ["reverse", "add"])
def test_a_task_too_large_for_a_cpu_is_refused(task, kwargs):
    with pytest.raises(ConfigError, match=f"argument '{next(iter(kwargs))}' must be at most"):
        make_task(task, **kwargs)
    assert make_task(task, digits=MAX_DIGITS).prompt_len > MAX_DIGITS  # the bound is taken


def test_a_calibration_set_beyond_its_budget_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="calibration tokens"):
        random_calibration(MAX_CALIBRATION_TOKENS, 2, 128, 0)  # refused before drawing
    per_line = 1000
    lines = "\n".join([",".join(["1"] * per_line)] * (MAX_CALIBRATION_TOKENS // per_line + 1))
    (tmp_path / "c.txt").write_text(lines)
    with pytest.raises(ConfigError, match=r"more than \d+ calibration tokens"):
        read_calibration(tmp_path / "c.txt", 128)
    with (tmp_path / "big.txt").open("wb") as f:  # sparse: no disk used
        f.truncate(65 * MAX_CALIBRATION_TOKENS)
    with pytest.raises(ConfigError, match="bytes"):
        read_calibration(tmp_path / "big.txt", 128)


# --out: (command, flag, a folder or a file)
WRITERS = [
    (["conformance"], "--report-dir", "folder"),
    (["conformance", "--matrix"], "--report-dir", "folder"),
    (["diff", "--backends", "cpu,generic"], "--out", "folder"),
    ([*_SEARCH, "--random", "2"], "--out", "folder"),
    (["export", "onnx", "--model", "tiny"], "--out", "file"),
    (["export", "tvm", "--model", "tiny"], "--out", "folder"),
    (["rl", "train", "--steps", "1", "--quiet"], "--out", "folder"),
]


def _bad_outs(tmp: Path, kind: str) -> list[tuple[str, str]]:
    """(path, what the error must say) that no command may write, made under ``tmp``."""
    (tmp / "a-file").write_text("x")
    (tmp / "a-folder").mkdir()
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    cases = [
        (str(tmp / "a-file" / "sub"), "is a file"),
        (str(tmp / "dangling"), "link to nothing"),
        ("/proc/glmport-test/out", "cannot write in /proc"),  # unwritable even for root
        ("", "must name a path"),
    ]
    if kind == "folder":
        cases.append((str(tmp / "a-file"), "is not a folder"))
    else:
        cases.append((str(tmp / "a-folder"), "is a folder"))
    return cases


@pytest.mark.parametrize(("command", "flag", "kind"), WRITERS)
def test_out_is_checked_before_any_work(command, flag, kind, no_work, capsys, tmp_path):
    for path, needle in _bad_outs(tmp_path, kind):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        line = _refusal([*command, flag, path], capsys)
        assert flag in line and needle in line, (path, line)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_run_or_copy_is_never_written_over(no_work, capsys, tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    line = _refusal([*_SEARCH, "--random", "2", "--out", str(tmp_path / "old")], capsys)
    assert "already holds files" in line
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["config.json"]


def test_a_writable_out_passes_and_nothing_is_made(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    assert common.check_out(str(deep), "--out") == deep
    assert common.check_out(str(tmp_path / "x.onnx"), "--out", folder=False)
    assert not list(tmp_path.iterdir())  # the probe file is gone, nothing made


@pytest.mark.parametrize(
    ("argv", "source"),
    [
        ([*_GEN, "--backend", "xyz"], "(from --backend)"),
        ([*_GEN, "--backend", "ascend"], "'ascend' (--backend) is not available"),
        (["info", "--backend", "ascend"], "'ascend' (--backend) is not available"),
        ([*_SEARCH, "--random", "2", "--backend", "xyz"], "(from --backend)"),
        (["export", "onnx", "--model", "tiny", "--backend", "xyz"], "(from --backend)"),
        (["rl", "train", "--rollout-backend", "xyz"], "(from --rollout-backend)"),
        (["rl", "train", "--train-backend", "ascend"], "(--train-backend) is not available"),
        (["rl", "serve", "--model", "tiny", "--local", "--backend", "xyz"], "(from --backend)"),
    ],
)
def test_a_bad_backend_is_named_by_its_flag(argv, source, capsys, tmp_path):
    os.chdir(tmp_path)
    if argv[0] in ("export", "rl") and "--out" not in argv and argv[1] != "serve":
        argv = [*argv, "--out", str(tmp_path / "o")]
    line = _refusal(argv, capsys)
    assert source in line and "GLMPORT_BACKEND" not in line and "use_backend" not in line, line


def test_a_bad_backend_from_the_environment_or_code_is_named_so(monkeypatch, capsys):
    monkeypatch.setenv("GLMPORT_BACKEND", "ascend")
    assert "'ascend' (GLMPORT_BACKEND) is not available" in _refusal(["info"], capsys)
    monkeypatch.delenv("GLMPORT_BACKEND")
    unavailable = pytest.raises(glmport.BackendUnavailableError, match=r"use_backend\('ascend'\)")
    with unavailable, glmport.use_backend("ascend"):
        pass


def test_an_op_typo_echoes_what_was_typed(capsys):
    line = _refusal(["conformance", "--ops", "rms_norm,nope"], capsys)
    assert "--ops='rms_norm,nope': unknown op 'nope'" in line and "=cpu" not in line
    assert "given twice" in _refusal(["conformance", "--ops", "rope,rope"], capsys)


def test_the_temperature_error_speaks_in_flags(capsys):
    line = _refusal([*_GEN, "--temperature", "0"], capsys)
    assert "--temperature" in line and "--greedy" in line and "greedy=True" not in line


# --- install hints -------------------------------------------------------------------


def _installed_from(monkeypatch, direct_url: dict | None) -> None:
    """Pretend glmport was installed as ``direct_url`` says (None: no such record)."""
    real = metadata.distribution("glmport")

    class Installed:
        def read_text(self, name):
            if name == "direct_url.json":
                return None if direct_url is None else json.dumps(direct_url)
            return real.read_text(name)

        @property
        def requires(self):
            return real.requires

    monkeypatch.setattr(extras.metadata, "distribution", lambda name: Installed())


def _extra(name: str) -> list[str]:
    """The requirements pyproject.toml lists for extra ``name`` (one line each there)."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf"^{name} = (\[.*\])$", text, re.MULTILINE)
    assert found, name
    return json.loads(found.group(1))


def _check_clone_command(command: str, cwd: Path, extra: str, constraints: bool) -> None:
    """``command`` is pip installing the clone REPO with ``extra``, its paths right from
    ``cwd``, and the CPU constraints file exactly when asked."""
    words = shlex.split(command)
    assert words[:2] == ["pip", "install"] and words[-2] == "-e", command
    target, _, rest = words[-1].partition("[")
    assert (cwd / target).resolve() == REPO and rest == f"{extra}]", command
    assert _extra(extra)
    if constraints:
        assert words[2] == "-c" and (cwd / words[3]).resolve() == REPO / "constraints-cpu.txt"
    else:
        assert "-c" not in words


def test_a_clone_gets_the_readme_command_from_where_the_user_is(monkeypatch, tmp_path):
    _installed_from(monkeypatch, {"url": REPO.as_uri(), "dir_info": {"editable": True}})
    monkeypatch.setattr(extras, "_cpu_torch", lambda: True)
    monkeypatch.chdir(REPO)
    assert extras.install_command(["rich"]) == "pip install -c constraints-cpu.txt -e '.[rl]'"
    for cwd in (REPO, REPO / "tests", tmp_path):
        monkeypatch.chdir(cwd)
        _check_clone_command(extras.install_command(["tvm", "onnx"]), cwd, "export", True)
    monkeypatch.setattr(extras, "_cpu_torch", lambda: False)  # GPU users: no CPU pin
    _check_clone_command(extras.install_command(["ray"]), tmp_path, "rl", False)


@pytest.mark.parametrize(
    "direct_url",
    [
        None,  # from an index
        {"url": "file:///somewhere/glmport-0.1.0-py3-none-any.whl", "archive_info": {}},
        {"url": "file:///no/such/clone", "dir_info": {}},  # the clone is gone
    ],
)
def test_elsewhere_the_hint_names_the_packages_with_their_bounds(monkeypatch, direct_url):
    _installed_from(monkeypatch, direct_url)
    words = shlex.split(extras.install_command(["rich", "matplotlib"]))
    declared = _extra("rl")
    assert words[:2] == ["pip", "install"] and "glmport" not in " ".join(words)
    assert words[2:] == [r for r in declared if r.split(">")[0] in ("rich", "matplotlib")]


def test_every_hint_site_uses_the_one_command(monkeypatch):
    """Backends, report writers and commands: no hint of their own."""
    _installed_from(monkeypatch, None)
    from glmport.backends.cuda import BACKEND as CUDA

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert CUDA.probe(emulate=True).reason.endswith("pip install 'triton>=3.6'")
    with pytest.raises(ConfigError, match=r"pip install 'rich>=13'$"):
        extras.require("x", "rich")


# --- no extras installed ---------------------------------------------------------------

# The README's first install (no extras): none of these can be imported.
EXTRA_MODULES = [
    "rich",
    "matplotlib",
    "ray",
    "fastapi",
    "uvicorn",
    "httpx",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "tvm",
    "triton",
]
_WITHOUT_EXTRAS = (
    "import sys\n"
    f"for name in {EXTRA_MODULES!r}:\n"
    "    sys.modules[name] = None  # import fails, find_spec says absent\n"
    "from glmport.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_without_extras_every_command_fails_fast_in_one_line_or_runs(tmp_path):
    """Each command in its own process with the extras unimportable: one error line
    naming the extra, before any file is written; or, needing none, it runs."""
    refused = {
        "rl train": (["rl", "train", "--steps", "1", "--out", "run"], "rl extra"),
        "rl train --quiet": (["rl", "train", "--quiet", "--out", "run"], "matplotlib"),
        "rl serve": (["rl", "serve", "--model", "tiny", "--local"], "rl extra"),
        "rl agent": (["rl", "agent", "--episodes", "1"], "rl extra"),
        "export onnx": (["export", "onnx", "--model", "tiny", "--out", "m.onnx"], "export"),
        "export tvm": (["export", "tvm", "--model", "tiny", "--out", "m"], "export extra"),
        "generate --backend cuda": ([*_GEN, "--backend", "cuda"], "triton not installed"),
    }
    runs = {
        "generate": _GEN,
        "info": ["info", "--json"],
    }
    procs = {}
    for name, argv in [*((n, a) for n, (a, _) in refused.items()), *runs.items()]:
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _WITHOUT_EXTRAS, *argv],
            cwd=folder,
            env={**os.environ, "GLMPORT_EMULATE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outputs = {}
    for name, proc in procs.items():
        outputs[name], err = proc.communicate(timeout=guard_s(30))  # 9 interpreters at once
        assert "Traceback" not in err, (name, err)
        folder = tmp_path / name.replace(" ", "_")
        if name in refused:
            lines = err.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (name, err)
            assert lines[0].startswith("glmport: error: ") and refused[name][1] in lines[0]
            assert "pip install" in lines[0], lines[0]
            assert not list(folder.iterdir()), (name, list(folder.iterdir()))
        else:
            assert proc.returncode == 0, (name, err)
    cuda = next(b for b in json.loads(outputs["info"])["backends"] if b["name"] == "cuda")
    assert not cuda["available"] and "triton not installed: pip install" in cuda["reason"]
