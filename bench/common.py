"""Shared helpers for the benchmarks: timing, peak-memory probes, result files."""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from glmport.core.environment import versions

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def extra_peak_mib(script: str, case: str) -> float:
    """Peak memory a case adds on top of its inputs, measured in a fresh process.

    ``script`` must accept ``--memory CASE`` and print the added MiB as its last line.
    """
    proc = subprocess.run(
        [sys.executable, script, "--memory", case], capture_output=True, text=True, check=True
    )
    return float(proc.stdout.strip().splitlines()[-1])


def environment() -> dict:
    return {
        **versions(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path


def table(rows: list[tuple]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
