"""Per-call dispatch overhead of every glmport op on this CPU: the public call against
the bare kernel it resolves to, side by side in one run.

For every op of ``OP_NAMES`` the inputs are its first tiny float32 conformance case
(tiny tensors, so that the kernel is short and the overhead shows), without
requires_grad. Each round times ``inner`` back-to-back calls of (a) the public call
``glmport.ops.<op>(*args)``, then of (b) the kernel of the backend the op resolves to,
``resolve(op, device_type=...).kernel(*args)`` (arguments in schema order). The
overhead per call is (a) - (b) within a round. Reported per op: the median overhead
over the rounds, its interquartile range, and the ratio (a) / (b) of the medians; per
setting, the median overhead across the ops. Settings: ``GLMPORT_VALIDATE`` full and
meta, 1 and 2 torch threads.

That overhead also holds what the dispatch code costs the kernel: on a small CPU the
kernel runs measurably slower between dispatch steps than back to back (caches). The
*path* column isolates glmport's own work: the same public call on a probe backend
whose kernels return outputs computed beforehand, against calling those kernels
directly. The <= 5 us target is about the path.

Run: ``python bench/dispatch.py`` (about 1.5 minutes on 2 cores); ``--quick`` for a
smoke run; ``--markdown`` prints the tables for docs/benchmarks.md instead of the
plain ones. Writes ``bench/results/dispatch.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import interleaved_samples, markdown_table, table, timed, write

import glmport
from glmport.conformance.cases import all_cases
from glmport.conformance.cases.base import Case
from glmport.core.registry import Backend, BackendManifest
from glmport.core.selection import clear_cache, current_settings, resolve
from glmport.core.specs import OP_NAMES

MODES = ("full", "meta")
THREADS = (1, 2)
TARGET_META_US = 5.0


def tiny_cases() -> dict[str, Case]:
    """Each op's first tiny float32 conformance case."""
    cases = all_cases()
    return {
        op: next(
            c
            for c in cases
            if c.op == op and c.name.startswith("tiny") and c.dtype == torch.float32
        )
        for op in OP_NAMES
    }


class _ProbeBackend(Backend):
    """Every op returns outputs computed once beforehand: a call on it times glmport's
    path alone, without the kernel's work or its cache footprint."""

    manifest = BackendManifest(
        name="dispatch-probe",
        device_type="cpu",
        description="bench/dispatch.py: kernels that return precomputed outputs",
        ops=OP_NAMES,
        priority=-100,
    )

    def __init__(self, outputs: dict[str, object]) -> None:
        self.outputs = outputs

    def load_kernels(self, emulate: bool) -> dict:
        return {op: (lambda *args, _out=out: _out) for op, out in self.outputs.items()}


def select(mode: str, threads: int) -> None:
    """Switch ``GLMPORT_VALIDATE`` and the torch thread count, forgetting cached settings."""
    os.environ["GLMPORT_VALIDATE"] = mode
    clear_cache()
    if current_settings().validate_values != (mode == "full"):
        raise RuntimeError(f"GLMPORT_VALIDATE={mode} did not take effect")
    torch.set_num_threads(threads)


def _overhead(call, kernel, args: tuple, rounds: int, sample_s: float) -> dict:
    """Per-call times of ``call(*args)`` and ``kernel(*args)``, interleaved rounds."""
    inner = max(1, round(sample_s / timed(lambda: call(*args), repeats=3)))

    def public() -> None:
        for _ in range(inner):
            call(*args)

    def bare() -> None:
        for _ in range(inner):
            kernel(*args)

    samples = interleaved_samples({"call": public, "kernel": bare}, rounds)
    us = 1e6 / inner
    overhead = [(a - b) * us for a, b in zip(samples["call"], samples["kernel"], strict=True)]
    q1, _, q3 = statistics.quantiles(overhead, n=4)
    return {
        "inner": inner,
        "call_us": statistics.median(samples["call"]) * us,
        "kernel_us": statistics.median(samples["kernel"]) * us,
        "overhead_us": statistics.median(overhead),
        "iqr_us": [q1, q3],
    }


def measure(case: Case, rounds: int, sample_s: float) -> dict:
    """Overhead of the public call of ``case.op`` over its bare kernel, per call, and
    of the same call on the probe backend over its kernel (the path alone)."""
    args = case.args()
    call = getattr(glmport.ops, case.op)
    res = resolve(case.op, device_type=args[0].device.type)  # as a call on these inputs
    real = _overhead(call, res.kernel, args, rounds, sample_s)
    with glmport.use_backend("dispatch-probe"):
        probe = resolve(case.op, device_type=args[0].device.type)
        path = _overhead(call, probe.kernel, args, rounds, sample_s)
    inner, call_us, kernel_us = real["inner"], real["call_us"], real["kernel_us"]
    q1, q3 = real["iqr_us"]
    return {
        "op": case.op,
        "case": case.id,
        "backend": res.backend,
        "inner": inner,
        "rounds": rounds,
        "call_us": call_us,
        "kernel_us": kernel_us,
        "overhead_us": real["overhead_us"],
        "overhead_iqr_us": [q1, q3],
        "ratio": call_us / kernel_us,
        "path_us": path["overhead_us"],
        "path_iqr_us": path["iqr_us"],
    }


def summarise(run: dict) -> None:
    ops = run["ops"]
    run["median_overhead_us"] = statistics.median(r["overhead_us"] for r in ops)
    run["median_path_us"] = statistics.median(r["path_us"] for r in ops)
    worst = max(ops, key=lambda r: r["overhead_us"])
    run["worst"] = {"op": worst["op"], "overhead_us": worst["overhead_us"]}
    worst_path = max(ops, key=lambda r: r["path_us"])
    run["worst_path"] = {"op": worst_path["op"], "path_us": worst_path["path_us"]}


def mode_rows(runs: list[dict], mode: str) -> list[tuple]:
    """One row per op: kernel time, overhead [IQR] and ratio at each thread count."""
    by_threads = {r["threads"]: r["ops"] for r in runs if r["validate"] == mode}
    header: tuple = ("op", "backend")
    for t in by_threads:
        header += (
            f"kernel us ({t}t)",
            f"overhead us [IQR] ({t}t)",
            f"call/kernel ({t}t)",
            f"path us [IQR] ({t}t)",
        )
    rows = [header]
    for i, op in enumerate(OP_NAMES):
        row: tuple = (op, by_threads[THREADS[0]][i]["backend"])
        for ops in by_threads.values():
            r = ops[i]
            lo, hi = r["overhead_iqr_us"]
            plo, phi = r["path_iqr_us"]
            row += (
                f"{r['kernel_us']:.1f}",
                f"{r['overhead_us']:.1f} [{lo:.1f}..{hi:.1f}]",
                f"{r['ratio']:.2f}x",
                f"{r['path_us']:.1f} [{plo:.1f}..{phi:.1f}]",
            )
        rows.append(row)
    return rows


def summary_line(run: dict) -> str:
    line = (
        f"GLMPORT_VALIDATE={run['validate']}, {run['threads']} thread(s): median overhead "
        f"{run['median_overhead_us']:.1f} us per call across {len(run['ops'])} ops; worst "
        f"{run['worst']['op']} {run['worst']['overhead_us']:.1f} us; the path alone: median "
        f"{run['median_path_us']:.1f} us, worst {run['worst_path']['op']} "
        f"{run['worst_path']['path_us']:.1f} us"
    )
    if run["validate"] == "meta":
        met = run["median_path_us"] <= TARGET_META_US
        line += f" (target <= {TARGET_META_US:g} us for the path: {'met' if met else 'not met'})"
    return line


def report(results: dict, markdown: bool) -> str:
    render = markdown_table if markdown else table
    runs = results["runs"]
    parts = []
    for mode in MODES:
        title = f"GLMPORT_VALIDATE={mode}"
        parts += [f"**{title}**" if markdown else title, "", render(mode_rows(runs, mode)), ""]
    lines = [summary_line(r) for r in runs]
    lines.append(
        f"load average (1 min) before / after: {results['load_average_before'][0]:.1f} / "
        f"{results['load_average_after'][0]:.1f} on {results['cores']} cores"
    )
    parts += [f"- {line}" if markdown else line for line in lines]
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few short rounds: a smoke run")
    parser.add_argument(
        "--markdown", action="store_true", help="print Markdown tables for docs/benchmarks.md"
    )
    args = parser.parse_args()
    rounds, sample_s = (21, 0.0005) if args.quick else (201, 0.001)
    cases = tiny_cases()
    outputs = {}
    for op, case in cases.items():
        outputs[op] = getattr(glmport.ops, op)(*case.args())
    glmport.register_backend(_ProbeBackend(outputs))
    load_before = os.getloadavg()
    runs = []
    for threads in THREADS:
        for mode in MODES:
            select(mode, threads)
            print(f"measuring GLMPORT_VALIDATE={mode}, {threads} thread(s)...", file=sys.stderr)
            run = {
                "validate": mode,
                "threads": threads,
                "ops": [measure(cases[op], rounds, sample_s) for op in OP_NAMES],
            }
            summarise(run)
            runs.append(run)
    results = {
        "command": "python bench/dispatch.py" + (" --quick" if args.quick else ""),
        "target_meta_overhead_us": TARGET_META_US,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cores": os.cpu_count(),
        "runs": runs,
    }
    print(report(results, args.markdown))
    if not args.quick:  # smoke timings never overwrite the committed figures
        print(f"\nwrote {write('dispatch', results)}")


if __name__ == "__main__":
    main()
