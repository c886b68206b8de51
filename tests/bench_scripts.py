"""Running a script of ``bench/`` as a user would: a fresh Python process under the
default selection (no ``GLMPORT_*`` variable set), its output captured, waited for as
long as :func:`hang_guard.guard_s` gives for its idle time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from hang_guard import guard_s

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(
    script: str, *args: str, idle_s: float = 75, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python bench/<script> *args``, with ``env`` added to the environment; ``idle_s``:
    how long it takes on an idle 2-core machine (the hang guard is sized from it)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=guard_s(idle_s),
    )


def run_bench_json(
    script: str, out: Path, *args: str, idle_s: float = 75, env: Mapping[str, str] | None = None
) -> dict:
    """Run ``script`` with ``*args --out out``; it must succeed. Returns what it wrote."""
    proc = run_bench(script, *args, "--out", str(out), idle_s=idle_s, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
