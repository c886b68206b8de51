"""The MoE layer on the generic backend against what a user would otherwise run, on this CPU.

Shapes: T 1024 tokens, 64 experts top-8, hidden 1024, expert width 512, SwiGLU (25.8
GFLOP). Paths, run in turns (round i of each is sample i), the caches flushed between
calls (a 64 MiB buffer is written, so no path finds another's operands cached):

- ``glmport``: the model's layer, ``glmport.ops`` on the generic backend with the
  default validation: moe_dispatch, grouped_gemm (gate_up), SwiGLU, grouped_gemm
  (down), moe_combine.
- ``per-expert loop``: the plain torch layer a user writes: for each expert, its
  tokens by ``nonzero``, two matmuls, a weighted ``index_add_``.
- ``torch.matmul, same FLOPs``: two large GEMMs ([T*k, 1024] x [1024, 1024] and
  [T*k, 512] x [512, 1024]): the GFLOP/s the issue measures the layer against.
- ``GEMMs alone``: the layer's 128 GEMMs (per expert, its contiguous rows, one
  ``torch.matmul`` each), without routing or activation: what the grouped GEMMs can
  reach here (many M ~ 128 GEMMs run slower than one large one).

Median, interquartile range and min..max of every path at 1 and 2 torch threads;
``glmport``'s output is checked against the loop's in the same run. Everything runs
twice: with glibc's default allocator, which returns every freed block of 32 MiB or
more to the kernel, so each such tensor pays its first-touch page faults again (the
layer's [T*k, D] tensors do, the loop's per-expert ones do not); and in a child process
whose glibc keeps freed memory for reuse (``MALLOC_MMAP_MAX_=0``,
``MALLOC_TRIM_THRESHOLD_`` huge: what jemalloc / tcmalloc also give), the same for
every path.

Run: ``python bench/moe.py`` (about 4 minutes on 2 cores); ``--quick`` for a smoke
run on tiny shapes (writes only with ``--out``). Writes ``bench/results/moe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import (
    FLUSH_BYTES,
    RESULTS,
    environment,
    interleaved_samples,
    markdown_table,
    save,
    spread,
    table,
)

import glmport

FULL = {"T": 1024, "E": 64, "top_k": 8, "hidden": 1024, "width": 512}
QUICK = {"T": 64, "E": 8, "top_k": 2, "hidden": 64, "width": 32}
ALLOCATORS = {
    "glibc default": {},
    "glibc keeping freed memory": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
}


def inputs(s: dict) -> dict:
    """Seeded activations, routing (glmport's gate on a random router) and expert weights."""
    gen = torch.Generator().manual_seed(0)
    t, e, d, f = s["T"], s["E"], s["hidden"], s["width"]
    x = torch.randn(t, d, generator=gen)
    router = torch.randn(e, d, generator=gen) * d**-0.5
    weights, ids = glmport.ops.moe_gate(x @ router.T, None, s["top_k"])
    return {
        "x": x,
        "weights": weights,
        "ids": ids,
        "w_gate_up": torch.randn(e, 2 * f, d, generator=gen) * d**-0.5,
        "w_down": torch.randn(e, d, f, generator=gen) * f**-0.5,
    }


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """The model's activation (``glmport.model.modeling.Experts``): gate rows first."""
    width = h.shape[-1] // 2
    return F.silu(h[..., :width]) * h[..., width:]


def glmport_layer(m: dict) -> torch.Tensor:
    with glmport.use_backend("generic"):
        xs, offsets, src = glmport.ops.moe_dispatch(m["x"], m["ids"], m["w_down"].shape[0])
        h = swiglu(glmport.ops.grouped_gemm(xs, m["w_gate_up"], offsets))
        y = glmport.ops.grouped_gemm(h, m["w_down"], offsets)
        return glmport.ops.moe_combine(y, src, m["weights"])


def expert_loop(m: dict) -> torch.Tensor:
    """The plain torch layer: per expert, its tokens by mask, two matmuls, weighted add."""
    out = torch.zeros_like(m["x"])
    for e in range(m["w_down"].shape[0]):
        rows, slot = (m["ids"] == e).nonzero(as_tuple=True)
        if rows.numel():
            y = swiglu(m["x"][rows] @ m["w_gate_up"][e].T) @ m["w_down"][e].T
            out.index_add_(0, rows, y * m["weights"][rows, slot, None])
    return out


def matmul_same_flops(s: dict) -> Callable[[], object]:
    """torch.matmul on the layer's GEMM FLOPs, in two large GEMMs."""
    gen = torch.Generator().manual_seed(1)
    rows, d, f = s["T"] * s["top_k"], s["hidden"], s["width"]
    a, b = torch.randn(rows, d, generator=gen), torch.randn(d, 2 * f, generator=gen)
    c, w = torch.randn(rows, f, generator=gen), torch.randn(f, d, generator=gen)
    return lambda: (a @ b, c @ w)


def gemms_alone(m: dict) -> Callable[[], object]:
    """The layer's per-expert GEMMs over the dispatched rows, each into a fresh output
    as grouped_gemm writes it; no routing, no activation."""
    xs, offsets, _ = glmport.ops.moe_dispatch(m["x"], m["ids"], m["w_down"].shape[0])
    bounds = offsets.tolist()
    h = torch.randn(xs.shape[0], m["w_down"].shape[2], generator=torch.Generator().manual_seed(2))

    def run() -> None:
        for inp, w in ((xs, m["w_gate_up"]), (h, m["w_down"])):
            out = inp.new_empty(inp.shape[0], w.shape[1])
            for e in range(w.shape[0]):
                r0, r1 = bounds[e], bounds[e + 1]
                torch.matmul(inp[r0:r1], w[e].T, out=out[r0:r1])

    return run


def gflop(s: dict) -> float:
    rows = s["T"] * s["top_k"]
    return 2.0 * rows * (s["hidden"] * 2 * s["width"] + s["width"] * s["hidden"]) / 1e9


def summary(seconds: list[float], flops: float) -> dict:
    s = spread(seconds)
    return {
        "median_s": s["median"],
        "iqr_s": s["iqr"],
        "min_s": s["min"],
        "max_s": s["max"],
        "gflop_per_s": flops / s["median"],
        "samples_s": seconds,
    }


PATHS = ("glmport", "per-expert loop", "torch.matmul, same FLOPs", "GEMMs alone")


def run_threads(s: dict, m: dict, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    fns = {
        "glmport": lambda: glmport_layer(m),
        "per-expert loop": lambda: expert_loop(m),
        "torch.matmul, same FLOPs": matmul_same_flops(s),
        "GEMMs alone": gemms_alone(m),
    }
    flops = gflop(s)
    samples = interleaved_samples(fns, repeats, flush=True)
    paths = {name: summary(v, flops) for name, v in samples.items()}
    ours = paths["glmport"]["median_s"]
    return {
        "threads": threads,
        "paths": paths,
        "loop_over_glmport": paths["per-expert loop"]["median_s"] / ours,
        "fraction_of_matmul_rate": paths["torch.matmul, same FLOPs"]["median_s"] / ours,
        "fraction_of_gemms_alone_rate": paths["GEMMs alone"]["median_s"] / ours,
    }


def agreement(m: dict) -> float:
    """max |glmport - loop| / max |loop| on the benchmark's inputs."""
    ours, ref = glmport_layer(m), expert_loop(m)
    return float((ours - ref).abs().max() / ref.abs().max())


def print_run(run: dict) -> None:
    rows = [("path", "median ms", "IQR ms", "min..max ms", "GFLOP/s", "time / glmport")]
    ours = run["paths"]["glmport"]["median_s"]
    for name in PATHS:
        p = run["paths"][name]
        rows.append((
            name,
            f"{p['median_s'] * 1e3:.1f}",
            f"{p['iqr_s'][0] * 1e3:.1f}..{p['iqr_s'][1] * 1e3:.1f}",
            f"{p['min_s'] * 1e3:.1f}..{p['max_s'] * 1e3:.1f}",
            f"{p['gflop_per_s']:.1f}",
            f"{p['median_s'] / ours:.2f}",
        ))  # fmt: skip
    print(f"{run['threads']} thread(s)")
    print(table(rows))
    print(
        f"   glmport: {run['loop_over_glmport']:.2f}x the loop's speed, "
        f"{run['fraction_of_matmul_rate']:.0%} of torch.matmul's GFLOP/s, "
        f"{run['fraction_of_gemms_alone_rate']:.0%} of its GEMMs' alone\n"
    )


def markdown(payload: dict) -> str:
    """The docs table: one row per path, median ms [IQR] and GFLOP/s per run."""
    runs = payload["runs"]
    head = ["path"] + [f"{r['allocator']}, {r['threads']} thread(s)" for r in runs]
    rows = [tuple(head)]
    for name in PATHS:
        cells = [name]
        for r in runs:
            p = r["paths"][name]
            lo, hi = p["iqr_s"]
            cells.append(
                f"{p['median_s'] * 1e3:.1f} [{lo * 1e3:.1f}..{hi * 1e3:.1f}], "
                f"{p['gflop_per_s']:.0f}"
            )
        rows.append(tuple(cells))
    ratios = ["glmport: loop's time / glmport's, matmul's, GEMMs alone'"]
    for r in runs:
        ratios.append(
            f"{r['loop_over_glmport']:.2f}x, {r['fraction_of_matmul_rate']:.0%}, "
            f"{r['fraction_of_gemms_alone_rate']:.0%}"
        )
    rows.append(tuple(ratios))
    return markdown_table(rows)


def measure(s: dict, threads: list[int], repeats: int, allocator: str) -> list[dict]:
    """Every thread count's run in this process, tagged with its allocator."""
    m = inputs(s)
    runs = []
    for n in threads:
        runs.append({"allocator": allocator, **run_threads(s, m, n, repeats)})
        print(f"[{allocator}] ", end="")
        print_run(runs[-1])
    return runs


def in_child(allocator: str, args: argparse.Namespace) -> list[dict]:
    """The runs of a fresh process under ``allocator``'s environment (glibc reads it
    when it starts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [sys.executable, __file__, "--threads", args.threads, "--repeats", str(args.repeats),
               "--out", str(out), "--child", allocator]  # fmt: skip
        env = {**os.environ, **ALLOCATORS[allocator]}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        print(proc.stdout, end="")
        if proc.returncode:
            raise SystemExit(f"the {allocator!r} run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds, 1 thread")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per thread count")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/moe.json)")
    parser.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",") if t.strip()]
    repeats = 2 if args.quick else args.repeats
    if args.child:
        args.out.write_text(json.dumps({"runs": measure(s, threads, repeats, args.child)}))
        return
    err = agreement(inputs(s))
    print(f"MoE layer {s}, {gflop(s):.1f} GFLOP; glmport vs loop: max rel error {err:.1e}\n")
    if not err < 1e-4:
        raise SystemExit(f"glmport's MoE layer disagrees with the loop: {err:.1e}")
    runs = measure(s, threads, repeats, "glibc default")
    if not args.quick and sys.platform == "linux":
        runs += in_child("glibc keeping freed memory", args)
    payload = {
        "command": "python bench/moe.py" + (" --quick" if args.quick else ""),
        "shape": s,
        "gflop": gflop(s),
        "repeats": repeats,
        "flush_bytes_between_calls": FLUSH_BYTES,
        "allocators": ALLOCATORS,
        "max_rel_error_vs_loop": err,
        "runs": runs,
    }
    print(markdown(payload))
    out = args.out or (None if args.quick else RESULTS / "moe.json")
    if out is not None:
        save(out, {"environment": environment(), **payload})


if __name__ == "__main__":
    main()
