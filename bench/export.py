"""The tiny GLM-5 exported to onnxruntime and TVM against eager torch, on this CPU.

Graphs: prefill of one sequence of ``S`` tokens, and one decode step on a cache of
``P`` positions (batch 1, fp32, the tiny model's 3 layers). Paths, run in turns
(round i of each is sample i):

- ``eager torch (generic)``: what a torch user runs: the model's own packed forward for
  prefill, and for decode its cached step on the paged KV cache (``forward_cached``,
  the cache cut back to ``P`` after each timed step); the glmport ops on the generic
  backend with the default validation;
- ``onnxruntime``: the ONNX export with its ``ai.glmport`` nodes (function bodies);
- ``onnxruntime, inlined``: the same export with the nodes expanded to standard ops;
- ``tvm``: torch.export -> Relax (glmport ops lowered by ``export/tvm_ops.py``),
  compiled for llvm, run in the Relax VM.

Every path's logits are checked against eager torch in the same run. Median,
interquartile range and min..max at 1 and 2 threads: each thread count runs in a fresh
process with torch's, onnxruntime's intra-op and TVM's pools (``TVM_NUM_THREADS``, read
when its pool starts) set alike, and neither runtime's idle threads spinning (they would
take the cores from the path being timed).

Run: ``python bench/export.py`` (a few minutes on 2 cores); ``--quick`` for a smoke run
(writes only with ``--out``). Writes ``bench/results/export.json``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, interleaved_samples, markdown_table, save, spread, table

import glmport
from glmport.export.check import sample_ids
from glmport.export.graph import PrefillGraph
from glmport.export.onnx_model import OnnxRuntimeModel, export_onnx
from glmport.export.tvm_model import TvmModel
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, forward_cached

FULL = {"prefill": [64, 512], "decode": [64, 512]}
QUICK = {"prefill": [16], "decode": [16]}
BLOCK = 64  # paged-cache block size of the eager decode step
PATHS = ("eager torch (generic)", "onnxruntime", "onnxruntime, inlined", "tvm")


class CachedStep:
    """The model's own decode step on its paged cache, holding ``latent``'s positions:
    called with a graph's decode inputs, it appends the token, then cuts the cache back."""

    def __init__(self, model: GlmMoeDsaForCausalLM, prompt: torch.Tensor) -> None:
        c = model.config
        blocks = -(-(prompt.shape[1] + 1) // BLOCK)
        self.model, self.length = model, prompt.shape[1]
        self.cache = PagedKVCache.for_config(c, c.num_hidden_layers, blocks, BLOCK)
        self.seq = self.cache.add_sequence()
        forward_cached(model, self.cache, [self.seq], [prompt[0]])

    def __call__(self, ids: torch.Tensor, *caches: torch.Tensor) -> tuple[torch.Tensor]:
        out = forward_cached(self.model, self.cache, [self.seq], [ids[0]])
        self.cache.truncate(self.seq, self.length)
        return (out.logits.view(1, 1, -1),)


def build(model: GlmMoeDsaForCausalLM, threads: int) -> dict[str, dict[str, Callable]]:
    """``{graph kind: {path: run(*inputs) -> outputs}}`` for ``threads`` threads, the
    eager decode step filled in per case (it holds its own cache)."""
    runners: dict[str, dict[str, Callable]] = {}
    for kind in ("prefill", "decode"):
        eager = (lambda ids: (model(ids).logits,)) if kind == "prefill" else None
        runners[kind] = {
            "eager torch (generic)": eager,
            "onnxruntime": OnnxRuntimeModel.load(export_onnx(model, kind), threads).run,
            "onnxruntime, inlined": OnnxRuntimeModel.load(
                export_onnx(model, kind, inline=True), threads
            ).run,
            "tvm": TvmModel.build(model, kind).run,
        }
    return runners


def inputs(model: GlmMoeDsaForCausalLM, kind: str, length: int) -> tuple[torch.Tensor, ...]:
    """Prefill: ``input_ids [1, length]``; decode: one token and a ``length``-position cache."""
    ids = sample_ids(model, 1, length + 1)
    if kind == "prefill":
        return (ids[:, :length],)
    _, latent, keys = PrefillGraph(model)(ids[:, :length])
    return ids[:, length:], latent, keys


def prompt_of(model: GlmMoeDsaForCausalLM, length: int) -> torch.Tensor:
    """The ``length`` tokens :func:`inputs` cached for a decode case."""
    return sample_ids(model, 1, length + 1)[:, :length]


def run_threads(model, sizes: dict, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    runners = build(model, threads)
    cases = []
    for kind, lengths in sizes.items():
        for length in lengths:
            args = inputs(model, kind, length)
            paths = dict(runners[kind])
            if kind == "decode":
                paths["eager torch (generic)"] = CachedStep(model, prompt_of(model, length))
            reference = paths["eager torch (generic)"](*args)[0]
            error = {
                name: float((run(*args)[0] - reference).abs().max()) for name, run in paths.items()
            }
            calls = {n: (lambda r=r, a=args: r(*a)) for n, r in paths.items()}
            samples = interleaved_samples(calls, repeats)
            stats = {n: spread(v) for n, v in samples.items()}
            eager = stats["eager torch (generic)"]["median"]
            cases.append({
                "graph": kind,
                "length": length,
                "max_abs_logits_vs_eager": error,
                "paths": {n: {**stats[n], "samples_s": samples[n]} for n in paths},
                "speedup_vs_eager": {n: eager / stats[n]["median"] for n in paths},
            })  # fmt: skip
    return {"threads": threads, "cases": cases}


def print_run(run: dict) -> None:
    print(f"{run['threads']} thread(s)")
    rows = [("graph", "path", "median ms", "IQR ms", "min..max ms", "x eager", "max |dlogits|")]
    for case in run["cases"]:
        for name in PATHS:
            p = case["paths"][name]
            rows.append((
                f"{case['graph']} {case['length']}",
                name,
                f"{p['median'] * 1e3:.2f}",
                f"{p['iqr'][0] * 1e3:.2f}..{p['iqr'][1] * 1e3:.2f}",
                f"{p['min'] * 1e3:.2f}..{p['max'] * 1e3:.2f}",
                f"{case['speedup_vs_eager'][name]:.2f}",
                f"{case['max_abs_logits_vs_eager'][name]:.1e}",
            ))  # fmt: skip
    print(table(rows) + "\n")


def markdown(payload: dict) -> str:
    """The docs table: per graph and length, each path's median ms [IQR] and speedup."""
    runs = payload["runs"]
    rows = [("graph", "path", *(f"{r['threads']} thread(s)" for r in runs))]
    for i, case in enumerate(runs[0]["cases"]):
        for name in PATHS:
            cells = []
            for r in runs:
                c = r["cases"][i]
                p = c["paths"][name]
                cells.append(
                    f"{p['median'] * 1e3:.2f} ms [{p['iqr'][0] * 1e3:.2f}..{p['iqr'][1] * 1e3:.2f}]"
                    f", {c['speedup_vs_eager'][name]:.2f}x"
                )
            rows.append((f"{case['graph']} {case['length']}", name, *cells))
    return markdown_table(rows)


def in_child(threads: int, args: argparse.Namespace) -> dict:
    """One thread count's run in a fresh process (TVM sizes its pool once, at start)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, __file__, "--child", str(threads), "--repeats", str(args.repeats),
               "--out", str(out)] + (["--quick"] if args.quick else [])  # fmt: skip
        env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "TVM_NUM_THREADS")},
               "TVM_THREAD_POOL_SPIN_COUNT": "0"}  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        print(proc.stdout, end="")
        if proc.returncode:
            raise SystemExit(f"the {threads}-thread run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short inputs, 2 rounds, 1 thread")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per case")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/export.json)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    repeats = 2 if args.quick else args.repeats
    if args.child:
        model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()
        with torch.no_grad(), glmport.use_backend("generic"):
            run = run_threads(model, sizes, args.child, repeats)
        print_run(run)
        args.out.write_text(json.dumps(run))
        return
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",") if t.strip()]
    runs = [in_child(n, args) for n in threads]
    payload = {
        "command": "python bench/export.py" + (" --quick" if args.quick else ""),
        "model": "tiny GLM-5 (glmport preset 'tiny'), fp32, batch 1",
        "repeats": repeats,
        "runs": runs,
    }
    print(markdown(payload))
    out = args.out or (None if args.quick else RESULTS / "export.json")
    if out is not None:
        save(out, {"environment": environment(), **payload})


if __name__ == "__main__":
    main()
