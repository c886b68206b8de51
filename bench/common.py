"""Shared helpers for the benchmarks: timing, peak-memory probes, result files."""

from __future__ import annotations

import ctypes
import gc
import json
import platform
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


def interleaved_samples(
    fns: dict[str, Callable[[], object]], repeats: int = 5
) -> dict[str, list[float]]:
    """Wall seconds of every run of each function, after one warm-up run each; the
    functions run in turns (round ``i`` of each is sample ``i``) so that machine noise
    hits all alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def timed_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5) -> dict[str, float]:
    """Median seconds of each function, run in turns so that machine noise hits all alike."""
    samples = interleaved_samples(fns, repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> float:
    """Return freed memory to the OS, reset the kernel's peak-RSS mark (Linux), and
    return the resident MiB now: the baseline for :func:`peak_since_reset_mib`."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def peak_since_reset_mib() -> float:
    return _status_mib("VmHWM")


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


def markdown_table(rows: list[tuple]) -> str:
    """``rows`` (the first one the header) as a Markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells[1:]])
