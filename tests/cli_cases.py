"""Driving ``glmport`` in this process for tests of its refusals: each command's first
heavy step stubbed (a refusal must come before it), and the outcome of one command line
classified."""

from __future__ import annotations

import contextlib
import io
import sys
import types

import pytest

from glmport.cli import main

# What a command line ended in.
REFUSED = "refused"  # exit 2, one "glmport: error:" line, nothing else on stderr
WORK_STARTED = "work started"  # got past every check
TRACEBACK = "traceback"  # an exception left main()
UNCLEAR = "unclear"  # exit 2 but not one error line, or another exit status


class WorkStarted(AssertionError):
    """Raised by a stub of a command's first heavy step."""


def _started(*args, **kwargs):
    raise WorkStarted(args)


# Each command's first heavy step, after every check it makes (loading the model is
# not one: some sizes are checked against the loaded model's context).
HEAVY_STEPS = [
    "glmport.conformance.diff.diff_backends",
    "glmport.conformance.matrix.mismatch_matrix",
    "glmport.model.generation.Sampler",  # generate(), once it has checked its arguments
    "glmport.model.indexcache.search",
    "glmport.rl.run.train",
    "glmport.rl.gateway.start_local_pool",
    "glmport.rl.gateway.start_ray_pool",
    "glmport.rl.agent.run_episodes",
    "glmport.rl.agent.local_gateway",
    "pytest.main",
]
# The exporters, replaced whole: importing onnx and TVM costs seconds.
_EXPORTERS = {
    "glmport.export.onnx_model": ("OnnxRuntimeModel", "export_onnx", "save_onnx"),
    "glmport.export.tvm_model": ("TvmModel",),
}


def stub_heavy_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every command's first heavy step raise :class:`WorkStarted`."""
    for target in HEAVY_STEPS:
        monkeypatch.setattr(target, _started)
    stub = types.SimpleNamespace(build=_started, load=_started)
    for module, names in _EXPORTERS.items():
        fake = types.ModuleType(module)
        for name in names:
            setattr(fake, name, stub if name[0].isupper() else _started)
        monkeypatch.setitem(sys.modules, module, fake)


def outcome(argv: list[str]) -> tuple[str, str]:
    """Run ``glmport argv`` here: (one of the outcomes above, stderr or the exception)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exit_:  # argparse's own errors exit, as argparse does
                status = exit_.code
    except WorkStarted:
        return WORK_STARTED, err.getvalue()
    except Exception as exc:
        return TRACEBACK, f"{type(exc).__name__}: {exc}"
    text = err.getvalue()
    lines = text.strip().splitlines()
    one_line = len(lines) == 1 and lines[0].startswith("glmport: error: ")
    if status == 2 and one_line and "Traceback" not in text:
        return REFUSED, lines[0]
    if status == 0:
        return WORK_STARTED, text
    return UNCLEAR, f"exit {status}: {text}"
