"""Shared helpers for the benchmarks: timing, peak-memory probes, result files; and
for the backend benchmarks (``bench/cuda_backend.py``, ``bench/ascend_backend.py``)
GLM-5's op shapes, their seeded inputs, agreement with the generic backend and the
command line."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import glmport
from glmport.core.environment import versions
from glmport.core.formats import quantize_tensor
from glmport.core.tolerance import Comparison, Tolerance, compare

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


_FLUSH = None  # a buffer larger than this CPU's last-level cache, made on first use
FLUSH_BYTES = 64 << 20


def flush_caches() -> None:
    """Evict the CPU caches by writing 64 MiB (twice the L3 of the machine these
    figures come from): a timed call then starts from memory, as it would in a model where other
    work runs between calls, not from the cache its previous run warmed."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32)
    _FLUSH.fill_(1.0)


def interleaved_samples(
    fns: dict[str, Callable[[], object]], repeats: int = 5, *, flush: bool = False
) -> dict[str, list[float]]:
    """Wall seconds of every run of each function, after one warm-up run each; the
    functions run in turns (round ``i`` of each is sample ``i``) so that machine noise
    hits all alike. ``flush``: :func:`flush_caches` before every timed run (untimed)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if flush:
                flush_caches()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def timed_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5) -> dict[str, float]:
    """Median seconds of each function, run in turns so that machine noise hits all alike."""
    samples = interleaved_samples(fns, repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def spread(values: list[float]) -> dict[str, float | list[float]]:
    """Median, min, max and interquartile range (the range itself for one value)."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "iqr": [q[0], q[2]],
    }


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


# -- The backend benchmarks: one backend against generic on the same device and inputs.


def randn(*shape, dtype=torch.bfloat16, device, scale=1.0, seed=0) -> torch.Tensor:
    """Seeded standard normal values times ``scale``, in ``dtype`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


@dataclass(frozen=True)
class Glm5Sizes:
    """GLM-5's op shapes, as the backend benchmarks run them, and the seeded inputs of
    each op at them; a script adds the fields only it uses in a subclass, and
    :meth:`smoke` gives the tiny shapes of a CPU run."""

    heads: int = 64
    dk: int = 576
    dv: int = 512
    topk: int = 2048
    decode_batches: tuple[int, ...] = (64, 128)
    contexts: tuple[int, ...] = (8192, 32768, 65536)
    prefill_tokens: int = 4096
    prefill_keys: int = 8192
    index_heads: int = 32
    index_dim: int = 128
    index_queries: tuple[tuple[int, int], ...] = ((128, 65536), (2048, 16384))
    page: int = 128  # paged-cache block size (vllm-ascend's)
    experts: int = 256
    top_k: int = 8
    tokens: int = 4096
    hidden: int = 6144
    expert_width: int = 2048
    dense_out: int = 12288

    @classmethod
    def smoke(cls, **overrides):
        """Tiny shapes for a smoke run on the CPU (absorbed MLA's 576 / 512 and the
        indexer's 128 kept); ``overrides`` sets the fields a script shrinks otherwise."""
        return cls(**{**SMOKE, **overrides})

    def attention_flops(self, queries: int) -> float:
        """Sparse attention's FLOPs: ``queries`` x heads over topk keys (q k and p v)."""
        return 2.0 * queries * self.heads * self.topk * (self.dk + self.dv)

    def decode_inputs(self, batch: int, n: int, device) -> tuple:
        """``sparse_attention``'s arguments for decode: ``batch`` queries x heads in
        absorbed MLA (v a view of k), query ``i`` picking topk of its own ``n`` slots
        ``[i n, (i + 1) n)``."""
        kv = randn(batch * n, 1, self.dk, device=device, seed=n)
        q = randn(batch, self.heads, self.dk, device=device, seed=batch)
        gen = torch.Generator(device=device).manual_seed(1)
        slots = torch.randint(0, n, (batch, self.topk), generator=gen, device=device)
        idx = (slots + torch.arange(batch, device=device)[:, None] * n).to(torch.int32)
        return q, kv, kv[..., : self.dv], idx, self.dk**-0.5

    def paged_decode_inputs(self, batch: int, n: int, device) -> tuple:
        """``sparse_attention``'s arguments for decode on the model's paged cache: the
        pools kept apart (latent ``[batch n, 1, dv]`` as ``k`` and ``v``, rope key
        ``[batch n, 1, dk - dv]`` as ``k_rope``), in inference (no lse); the same slots
        as :meth:`decode_inputs`."""
        q, kv, _, idx, scale = self.decode_inputs(batch, n, device)
        latent = kv[..., : self.dv].contiguous()
        return q, latent, latent[..., : self.dv], idx, scale, False, kv[..., self.dv :].contiguous()

    def paged_indexer_inputs(self, batch: int, n: int, device) -> tuple:
        """The lightning indexer's paged decode call: ``batch`` sequences of ``n``
        cached keys in one pool of ``page``-slot blocks, their blocks interleaved
        (sequence ``b``'s ``j``-th block is ``j * batch + b``), one query each over
        all its keys; scores asked for (what the benchmark compares)."""
        blocks = n // self.page
        q = randn(batch, self.index_heads, self.index_dim, device=device, seed=6)
        k = randn(batch * blocks, self.page, self.index_dim, device=device, seed=7)
        w = randn(batch, self.index_heads, device=device, dtype=torch.float32, seed=8)
        w = w * (self.index_heads * self.index_dim) ** -0.5
        table = torch.arange(blocks, device=device)[None, :] * batch
        table = (table + torch.arange(batch, device=device)[:, None]).to(torch.int32)
        start = torch.zeros(batch, device=device, dtype=torch.int32)
        end = torch.full((batch,), n, device=device, dtype=torch.int32)
        return q, k, w, start, end, self.topk, None, None, table, True

    def prefill_inputs(self, device) -> tuple:
        """``sparse_attention``'s arguments for prefill: the last ``prefill_tokens`` of
        ``prefill_keys`` slots, each drawing topk of the slots up to its own at random
        (causal; repeats possible)."""
        t, n = self.prefill_tokens, self.prefill_keys
        kv = randn(n, 1, self.dk, device=device, seed=3)
        q = randn(t, self.heads, self.dk, device=device, seed=4)
        ends = torch.arange(n - t + 1, n + 1, device=device)
        gen = torch.Generator(device=device).manual_seed(5)
        idx = torch.rand(t, self.topk, generator=gen, device=device) * ends[:, None]
        return q, kv, kv[..., : self.dv], idx.long().to(torch.int32), self.dk**-0.5

    def indexer_inputs(self, t: int, n: int, device) -> tuple:
        """The lightning indexer's ``(q, k, weights, k_start, k_end)``: the last ``t``
        of ``n`` tokens, each over its earlier keys."""
        q = randn(t, self.index_heads, self.index_dim, device=device, seed=6)
        k = randn(n, self.index_dim, device=device, seed=7)
        w = randn(t, self.index_heads, device=device, dtype=torch.float32, seed=8)
        w = w * (self.index_heads * self.index_dim) ** -0.5
        start = torch.zeros(t, device=device, dtype=torch.int32)
        end = torch.arange(n - t + 1, n + 1, device=device, dtype=torch.int32)
        return q, k, w, start, end

    def indexer_flops(self, end: torch.Tensor) -> float:
        """The indexer's FLOPs over keys ``[0, end)`` of each query."""
        return 2.0 * float(end.double().sum()) * self.index_heads * self.index_dim

    def gate_args(self, device) -> tuple:
        """``moe_gate``'s arguments: GLM-5's router (sigmoid scores with a bias, top-k
        in one group, renormalised, scaled by 2.5)."""
        logits = randn(self.tokens, self.experts, device=device, dtype=torch.float32, seed=18)
        bias = randn(self.experts, device=device, dtype=torch.float32, seed=19, scale=0.1)
        return logits, bias, self.top_k, 1, 1, 2.5, True, "sigmoid"

    def routing(self, device, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Balanced-ish routing over ``experts`` (default all): ``[T, k]`` distinct int32
        experts per token and the int32 group offsets."""
        experts = self.experts if experts is None else experts
        gen = torch.Generator(device=device).manual_seed(9)
        scores = torch.rand(self.tokens, experts, generator=gen, device=device)
        ids = scores.topk(self.top_k).indices
        counts = torch.bincount(ids.flatten(), minlength=experts)
        offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)
        return ids.to(torch.int32), offsets

    def hidden_states(self, device) -> torch.Tensor:
        """``[tokens, hidden]`` bf16 activations (norm, dispatch, quantize, GEMMs)."""
        return randn(self.tokens, self.hidden, device=device, seed=15)

    def norm_weight(self, device) -> torch.Tensor:
        """An RMSNorm weight near 1, ``[hidden]`` bf16."""
        return randn(self.hidden, device=device, seed=16, scale=0.1) + 1

    def combine_inputs(self, x: torch.Tensor, ids: torch.Tensor, device) -> tuple:
        """``moe_combine``'s ``(expert outputs, source rows, weights)`` for the dispatch
        of ``x`` by ``ids`` (its source rows from the generic backend)."""
        with glmport.use_backend("generic"):
            _, _, src_row = glmport.ops.moe_dispatch(x, ids, self.experts)
        y = randn(self.tokens * self.top_k, self.hidden, device=device, seed=20)
        return y, src_row, torch.rand(self.tokens, self.top_k, device=device)

    def grouped_gemm_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' gate-up GEMM in bf16: ``x [T k, hidden]`` (rows grouped by
        :meth:`routing`'s offsets) and ``w [experts, 2 width, hidden]``."""
        k = self.hidden
        x = randn(self.tokens * self.top_k, k, device=device, seed=10)
        w = randn(self.experts, 2 * self.expert_width, k, device=device, seed=11, scale=k**-0.5)
        return x, w

    def dense_weight(self, device, seed: int) -> torch.Tensor:
        """A float32 ``[dense_out, hidden]`` weight, to quantise."""
        d = self.hidden
        return randn(
            self.dense_out, d, device=device, dtype=torch.float32, seed=seed, scale=d**-0.5
        )


SMOKE = {
    "heads": 16,
    "topk": 64,
    "decode_batches": (2,),
    "contexts": (256,),
    "prefill_tokens": 8,
    "prefill_keys": 256,
    "index_heads": 8,
    "index_queries": ((2, 512),),
    "page": 16,
    "experts": 8,
    "top_k": 2,
    "tokens": 32,
    "hidden": 256,
    "expert_width": 128,
    "dense_out": 256,
}


def quantized(w: torch.Tensor, fmt: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (or ``[E, N, K]``) in ``fmt``'s canonical layout, on ``device``."""
    if w.dim() == 2:
        return tuple(a.to(device) for a in quantize_tensor(w.cpu(), fmt, 128))
    parts = [quantize_tensor(we.cpu(), fmt, 128) for we in w]
    return (
        torch.stack([q for q, _ in parts]).to(device),
        torch.stack([sc for _, sc in parts]).to(device),
    )


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def agreement_within(out, ref, tol: Tolerance) -> Comparison:
    """``compare`` of every floating output (of a tensor or a tuple) within ``tol``: the
    worst of them (NaN is worst); an integer output must equal ``ref``'s exactly (inf,
    not ok, when it does not)."""
    found = []
    for o, r in zip(_tensors(out), _tensors(ref), strict=True):
        if o.is_floating_point():
            found.append(compare(o, r, tol))
        elif not torch.equal(o, r):
            return Comparison(math.inf, math.inf, False)

    def worst(values):
        return max(values, key=lambda v: (math.isnan(v), v), default=0.0)

    return Comparison(
        worst(c.max_rel for c in found),
        worst(c.mean_rel for c in found),
        all(c.ok for c in found),
    )


def whole(out):
    """An op's outputs as they are: what agreement compares unless told otherwise."""
    return out


def index_scores(out):
    """Top-k outputs differ legitimately at near-ties: compare the selected scores."""
    return out[1]


def router_weights(out):
    """Router weights, sorted per token (ties may swap equal experts)."""
    return out[0].sort(dim=1).values


def bench_args(
    doc: str, sections: tuple[str, ...], name: str, smoke_help: str, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """A backend benchmark's command line (``--smoke``, ``--only``, ``--out``,
    ``--markdown``): the parser (for the script's own errors) and the arguments, with
    ``only`` the list of sections to run and ``out`` the JSON path (default
    ``bench/results/NAME.json``, smoke ``NAME-smoke.json``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--only", default=",".join(sections), help="comma-separated sections")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON path (default bench/results/{name}.json; smoke: {name}-smoke.json)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(args.only) - set(sections))
    if unknown:
        parser.error(f"unknown sections {unknown}; sections are {', '.join(sections)}")
    args.out = args.out or RESULTS / (f"{name}-smoke.json" if args.smoke else f"{name}.json")
    return parser, args


def run_sections(bench, runners: dict[str, Callable], sections: list[str], sizes) -> None:
    """Each section's runner on ``bench`` at ``sizes``, without autograd, under
    production validation (no value checks, no host syncs) for both backends alike."""
    os.environ["GLMPORT_VALIDATE"] = "meta"
    with torch.no_grad():
        for name in sections:
            print(f"[{name}]", flush=True)
            runners[name](bench, sizes)


def save(out: Path, payload: dict) -> None:
    """Write a backend benchmark's JSON (non-JSON values as strings) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {out}")
