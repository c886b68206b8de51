"""Bad environment and bad command lines: one ``glmport: error:`` line, exit 2, never a
traceback; every GLMPORT_* variable parsed in one place; where a backend selection
follows work handed to other threads."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys

import pytest
import torch
from hang_guard import guard_s

import glmport
from glmport.backends.generic.tiling import budget_bytes
from glmport.cli import main
from glmport.core import environment
from glmport.core.selection import current_settings, selected_device, settings_from_env

# A device index torch never has here, whether or not this machine has a GPU.
_ABSENT_CUDA = f"cuda:{torch.cuda.device_count()}"

# (variable, bad value, text the error must contain besides the variable and the value)
ENV_CASES = [
    ("GLMPORT_TILE_MB", "inf", "finite number of MiB"),
    ("GLMPORT_TILE_MB", "abc", "finite number of MiB"),
    ("GLMPORT_TILE_MB", "-1", "finite number of MiB"),
    ("GLMPORT_TILE_MB", "0", "less than one byte"),
    ("GLMPORT_TILE_MB", "1e-300", "less than one byte"),
    ("GLMPORT_TILE_MB", "nan", "finite number of MiB"),
    ("GLMPORT_TILE_MB", "1e999", "too large"),
    ("GLMPORT_SHADOW_CALLS", "١٢", "ASCII digits"),
    ("GLMPORT_SHADOW_CALLS", "²", "ASCII digits"),
    ("GLMPORT_SHADOW_CALLS", "9" * 5000, "ASCII digits"),
    ("GLMPORT_SHADOW", "xyz", "valid backends"),
    ("GLMPORT_DEVICE", _ABSENT_CUDA, "cuda device(s) here"),
    ("GLMPORT_DEVICE", "not-a-device", "torch device"),
    ("GLMPORT_OPS", "rope=cpu,rope=generic", "given twice"),
    ("GLMPORT_EMULATE", "maybe", "1 or 0"),
    ("GLMPORT_VALIDATE", "some", "full or meta"),
    ("GLMPORT_BACKEND", "xyz", "valid backends"),
]


def _shown(value: str) -> str:
    """How an error message shows ``value`` (its repr, as the messages write it)."""
    return repr(value)[1:-1][:40]


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("glmport: error: "), stderr
    return lines[0]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    env.update(extra)
    return env


def _run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.Popen]:
    """Start every command at once (each is mostly interpreter start-up) and wait."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "glmport", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv, env in commands
    ]
    for p in procs:
        p.out, p.err = p.communicate(timeout=guard_s(60))  # all at once: ~20 interpreters
    return procs


def test_bad_environment_is_one_line_from_the_real_command():
    """Each bad variable, in its own ``python -m glmport info`` process: a traceback
    anywhere (import, settings, the generic backend) would show on its stderr."""
    procs = _run_all([(["info"], _clean_env(**{var: raw})) for var, raw, _ in ENV_CASES])
    for (var, raw, needle), p in zip(ENV_CASES, procs, strict=True):
        line = _one_error_line(p.err)
        assert p.returncode == 2, (var, raw, p.returncode)
        assert var in line and needle in line, line
        assert _shown(raw) in line or raw in line, line


def test_bad_sampling_arguments_are_one_line_from_the_real_command():
    gen = ["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "2"]
    cases = [
        ([*gen, "--seed", str(1 << 64)], "--seed"),
        ([*gen, "--seed", str(-(1 << 63) - 1)], "--seed"),
        ([*gen, "--temperature", "1e-45"], None),
        ([*gen, "--greedy"], None),
    ]
    procs = _run_all([(argv, _clean_env()) for argv, _ in cases])
    *errors, tiny_temperature, greedy = procs
    for (_, needle), p in zip(cases, errors, strict=False):
        assert needle in _one_error_line(p.err) and p.returncode == 2
    # A temperature near 0 is a valid input: the answer is the greedy one (the limit of
    # sampling as the temperature falls), else a one-line refusal; never a traceback.
    assert greedy.returncode == 0, greedy.err
    if tiny_temperature.returncode == 0:
        assert tiny_temperature.out.splitlines()[0] == greedy.out.splitlines()[0]
    else:
        assert tiny_temperature.returncode == 2
        assert "temperature" in _one_error_line(tiny_temperature.err)


_GEN = ["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "1"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*_GEN, "--seed", str(1 << 64)], "2**64-1"),
        ([*_GEN, "--seed", "x"], "expected an integer"),
        ([*_GEN, "--temperature", "abc"], "--temperature"),
        ([*_GEN, "--temperature", "nan"], "temperature"),
        ([*_GEN, "--temperature", "-1"], "temperature"),
        ([*_GEN, "--top-p", "1.5"], "--top-p"),
        ([*_GEN, "--top-k", "-3"], "--top-k"),
        ([*_GEN, "--greedy", "--seed", "1"], "--greedy"),
        (
            ["generate", "--model", "tiny", "--input-ids", "1", "--max-new-tokens", "-1"],
            "--max-new",
        ),
        (["generate", "--model", "tiny", "--input-ids", "", "--max-new-tokens", "1"], "input-ids"),
        (["generate", "--model", "tiny", "--input-ids", "-5", "--max-new-tokens", "1"], "outside"),
        (["generate", "--model", "/no/such/dir", "--input-ids", "1", "--max-new-tokens", "1"], ""),
        ([*_GEN, "--stop-tokens", "x"], "--stop-tokens"),
        ([*_GEN, "--backend", "xyz"], "valid backends"),
        (["generate", "--model", "tiny"], "required"),
        (["info", "--backend", "xyz"], "valid backends"),
        (["conformance", "--backend", "xyz"], "valid backends"),
        (["conformance", "--ops", "nope"], "unknown op"),
        (["conformance", "--plugin", "no_such_module:x"], "no_such_module"),
        (["conformance", "-n", "abc"], "argument -n"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_command_lines_are_one_line(argv, needle, capsys, monkeypatch):
    for var in environment.VARIABLES:
        monkeypatch.delenv(var, raising=False)
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors exit, as argparse does
        rc = exc.code
    assert rc == 2
    assert needle in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(("var", "raw", "needle"), ENV_CASES)
def test_every_variable_is_checked_at_its_first_use(monkeypatch, var, raw, needle):
    """One ConfigError (or UnknownBackendError for a backend name) naming the variable
    at its first read: the selection's at the first resolution (or, for the device,
    where tensors go), the tile budget when the generic backend first tiles."""
    monkeypatch.setenv(var, raw)
    with pytest.raises(glmport.GlmportError, match=var) as err:
        if var == "GLMPORT_TILE_MB":
            budget_bytes()
        selected_device(current_settings())
        glmport.core.selection.resolve("rms_norm")
    assert needle in str(err.value)


def test_valid_values_parse_to_typed_settings():
    s = settings_from_env(
        {
            "GLMPORT_BACKEND": " generic ",
            "GLMPORT_DEVICE": "cpu",
            "GLMPORT_EMULATE": "On",
            "GLMPORT_OPS": "rope=cpu, rms_norm=generic",
            "GLMPORT_SHADOW": "cpu",
            "GLMPORT_SHADOW_CALLS": "+12",
            "GLMPORT_VALIDATE": "META",
            "GLMPORT_TILE_MB": "0.5",
        }
    )
    assert (s.backend, s.device, s.emulate, s.shadow, s.shadow_calls) == (
        "generic",
        "cpu",
        True,
        "cpu",
        12,
    )
    assert s.ops == (("rope", "cpu"), ("rms_norm", "generic"))
    assert s.validate_values is False
    blank = settings_from_env({v: " " for v in environment.VARIABLES})
    assert blank == settings_from_env({})


def test_tile_budget_is_read_through_the_one_parser(monkeypatch):
    monkeypatch.setenv("GLMPORT_TILE_MB", "0.5")
    assert budget_bytes() == 1 << 19
    monkeypatch.setenv("GLMPORT_TILE_MB", "١٢")  # float() would take it: 12 MiB
    with pytest.raises(glmport.ConfigError, match="GLMPORT_TILE_MB='١٢'"):
        budget_bytes()
    monkeypatch.delenv("GLMPORT_TILE_MB")
    assert budget_bytes() == 256 << 20


def test_use_backend_names_a_misspelt_shadow():
    with (
        pytest.raises(glmport.UnknownBackendError, match="use_backend"),
        glmport.use_backend(shadow="cpux"),
    ):
        pass


def test_device_is_checked_to_exist_where_tensors_go(monkeypatch):
    monkeypatch.setenv("GLMPORT_DEVICE", _ABSENT_CUDA)
    # Auto-selection needs only the device's type: it still resolves.
    assert glmport.core.selection.resolve("rms_norm").backend
    with pytest.raises(glmport.ConfigError, match="GLMPORT_DEVICE"):
        selected_device()
    monkeypatch.setenv("GLMPORT_DEVICE", "meta")
    assert selected_device() == torch.device("meta")


def test_an_internal_bug_keeps_its_traceback(monkeypatch):
    """Only glmport's own errors and OSErrors on a named path are bad input; anything
    else is a bug and must propagate so it can be reported."""
    import glmport.commands.info as info

    def bug(*_):
        raise RuntimeError("internal")

    monkeypatch.setattr(info, "_collect_info", bug)
    with pytest.raises(RuntimeError, match="internal"):
        main(["info"])


def test_an_unreadable_path_is_one_line(monkeypatch, capsys):
    import glmport.commands.info as info

    def unreadable(*_):
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(info, "_collect_info", unreadable)
    assert main(["info"]) == 2
    assert "/some/file" in _one_error_line(capsys.readouterr().err)


def _selected() -> str:
    return current_settings().backend


def test_to_thread_inherits_use_backend_and_run_in_executor_does_not(monkeypatch):
    """The claim in docs/backends.md ("Selecting")."""
    monkeypatch.delenv("GLMPORT_BACKEND", raising=False)

    async def scenario() -> tuple[str, str, str]:
        loop = asyncio.get_running_loop()
        with glmport.use_backend("generic"):
            in_to_thread = await asyncio.to_thread(_selected)
            in_executor = await loop.run_in_executor(None, _selected)
            carried = await loop.run_in_executor(None, contextvars.copy_context().run, _selected)
        return in_to_thread, in_executor, carried

    assert asyncio.run(scenario()) == ("generic", "auto", "generic")
