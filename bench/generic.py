"""Benchmarks of the generic backend's DSA ops on this CPU, measured side by side in one
run, each case at 1 and then 2 torch threads (median and interquartile range of
interleaved samples; a 64 MiB buffer is written between timed calls so that no path
finds the previous call's working set in cache).

1. DSA decode: one query, 64 heads, absorbed MLA (Dk 576 / Dv 512), indexer 32 x 128,
   topk 2048, contexts N. Paths: glmport (``lightning_indexer`` + ``sparse_attention``
   on generic, default validation); a naive torch DSA (indexer scores by matmul /
   relu / weights, ``torch.topk``, ``index_select`` of the latent rows, softmax
   attention); dense attention by ``F.scaled_dot_product_attention`` (absorbed MQA:
   the 64 heads are 64 query rows of the one latent K/V head, FlashMLA's layout).
2. Validation cost at the decode shapes (N = 65536): each op validated (``full``, the
   default) against the same call under ``GLMPORT_VALIDATE=meta``, interleaved; and
   the checks alone (the spec's value checks, timed apart), as a share of the call.
3. Sparse prefill, 64 heads (absorbed 576 / 512), topk 2048, at T = N = 8192 and
   32768: a fixed subset of query rows (blocks spread evenly over all positions; the
   same rows for every path), each block attending causally over its prefix. glmport
   (indexer + sparse attention) against SDPA with the causal mask of those rows
   (heads as query rows, as in 1); the ratio of the sums estimates full prefill.
4. Peak memory of 1 and 3 against SDPA, each in a fresh process.

Run: ``python bench/generic.py`` (about 15 minutes on 2 cores); ``--quick`` for a
smoke run (small shapes; written only with ``--out``). Writes
``bench/results/generic.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import (
    RESULTS,
    environment,
    extra_peak_mib,
    interleaved_samples,
    peak_since_reset_mib,
    reset_peak,
    save,
    spread,
    table,
)

import glmport
from glmport.core.specs import SPECS
from glmport.core.validate import Level

H, DK, DV, HI, DI, TOPK = 64, 576, 512, 32, 128, 2048
SCALE = DK**-0.5
DECODE_N = (1024, 2048, 4096, 8192, 16384, 65536)
PREFILL = {8192: (8, 64), 32768: (8, 16)}  # N: (blocks, rows per block)
THREADS = (1, 2)


def samples(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each run of each function, in turns, a cache flush before each."""
    return interleaved_samples(fns, repeats, flush=True)


def cell(s: dict) -> str:
    """Median ms and its interquartile range."""
    lo, hi = s["iqr"]
    return f"{s['median'] * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f})"


# -- inputs and paths ----------------------------------------------------------------


def decode_inputs(n: int, t: int = 1, positions: torch.Tensor | None = None) -> dict:
    """Queries at ``positions`` (default: the last ``t``) over a cache of ``n`` slots."""
    gen = torch.Generator().manual_seed(n)
    pos = torch.arange(n - t, n) if positions is None else positions
    return {
        "q": torch.randn(t, H, DK, generator=gen),
        "kv": torch.randn(n, 1, DK, generator=gen),
        "qi": torch.randn(t, HI, DI, generator=gen),
        "ki": torch.randn(n, DI, generator=gen),
        "w": torch.randn(t, HI, generator=gen) * (HI * DI) ** -0.5,
        "k_start": torch.zeros(t, dtype=torch.int32),
        "k_end": (pos + 1).to(torch.int32),
    }


def glmport_dsa(a: dict) -> torch.Tensor:
    """DSA as the model runs it: the indexer's top-k, then sparse attention."""
    with glmport.use_backend("generic"):
        idx, _ = glmport.ops.lightning_indexer(
            a["qi"], a["ki"], a["w"], a["k_start"], a["k_end"], TOPK
        )
        return glmport.ops.sparse_attention(a["q"], a["kv"], a["kv"][..., :DV], idx, SCALE)[0]


def naive_dsa(a: dict) -> torch.Tensor:
    """The ten-line torch DSA a user would write for one decode query."""
    scores = (torch.relu(a["qi"][0] @ a["ki"].T) * a["w"][0][:, None]).sum(0)
    idx = torch.topk(scores, min(TOPK, scores.shape[0])).indices
    kv = a["kv"][:, 0].index_select(0, idx)
    p = torch.softmax((a["q"][0] @ kv.T) * SCALE, dim=-1)
    return p @ kv[:, :DV]


def sdpa_decode(a: dict) -> torch.Tensor:
    """Dense attention over every slot: 64 heads as query rows of one K/V head."""
    kv = a["kv"][None, :, 0][None]  # [1, 1, N, Dk]
    return F.scaled_dot_product_attention(a["q"][None], kv, kv[..., :DV], scale=SCALE)[0, 0]


def sdpa_causal_rows(a: dict) -> torch.Tensor:
    """Dense causal attention of a block of query rows over its prefix (SDPA with the
    causal mask of those rows; heads as query rows of the one K/V head)."""
    t = a["q"].shape[0]
    end = int(a["k_end"][-1])
    kv = a["kv"][None, :end, 0][None]
    mask = torch.arange(end)[None, :] < a["k_end"][:, None]
    q = a["q"].reshape(1, 1, t * H, DK)
    out = F.scaled_dot_product_attention(
        q, kv, kv[..., :DV], attn_mask=mask.repeat_interleave(H, 0)[None, None], scale=SCALE
    )
    return out.view(t, H, DV)


def validated(op: str, a: dict, idx: torch.Tensor) -> Callable[[], object]:
    """One op call on generic at the decode shapes (indices from the indexer)."""
    ops = glmport.ops
    if op == "lightning_indexer":
        args = (a["qi"], a["ki"], a["w"], a["k_start"], a["k_end"], TOPK)
        return lambda: ops.lightning_indexer(*args)
    return lambda: ops.sparse_attention(a["q"], a["kv"], a["kv"][..., :DV], idx, SCALE)


def under_meta(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        os.environ["GLMPORT_VALIDATE"] = "meta"
        try:
            return fn()
        finally:
            del os.environ["GLMPORT_VALIDATE"]

    return run


def prefill_blocks(n: int, blocks: int, rows: int) -> list[dict]:
    """``blocks`` blocks of ``rows`` consecutive queries ending at evenly spread
    positions; every block shares one cache (same seed)."""
    out = []
    for b in range(blocks):
        end = (b + 1) * n // blocks
        a = decode_inputs(n, rows, torch.arange(end - rows, end))
        out.append(a)
    return out


# -- sections ------------------------------------------------------------------------


def bench_decode(ns, repeats: int) -> list[dict]:
    rows = []
    for n in ns:
        a = decode_inputs(n)
        s = samples(
            {
                "glmport": lambda a=a: glmport_dsa(a),
                "naive": lambda a=a: naive_dsa(a),
                "sdpa": lambda a=a: sdpa_decode(a),
            },
            repeats,
        )
        stats = {k: spread(v) for k, v in s.items()}
        g = stats["glmport"]["median"]
        rows.append({
            "N": n,
            **stats,
            "speedup_vs_sdpa": stats["sdpa"]["median"] / g,
            "speedup_vs_naive": stats["naive"]["median"] / g,
        })  # fmt: skip
    return rows


def bench_validation(n: int, repeats: int) -> list[dict]:
    a = decode_inputs(n)
    with glmport.use_backend("generic"):
        idx, _ = glmport.ops.lightning_indexer(
            a["qi"], a["ki"], a["w"], a["k_start"], a["k_end"], TOPK
        )
    args = {
        "lightning_indexer": (
            a["qi"],
            a["ki"],
            a["w"],
            a["k_start"],
            a["k_end"],
            TOPK,
            None,
            None,
            None,
            True,
        ),
        "sparse_attention": (a["q"], a["kv"], a["kv"][..., :DV], idx, SCALE, False, None),
    }
    rows = []
    for op in ("lightning_indexer", "sparse_attention"):
        with glmport.use_backend("generic"):
            call = validated(op, a, idx)
            s = samples({"full": call, "meta": under_meta(call)}, repeats)
        stats = {k: spread(v) for k, v in s.items()}
        # The checks alone, timed apart: a figure the noise of the whole call hides.
        check = SPECS[op].validate
        checks = samples({"checks": lambda f=check, x=args[op]: f(x, values=Level.FULL)}, 50)
        check_s = spread(checks["checks"])
        rows.append({
            "op": op, "N": n, **stats, "checks_only": check_s,
            "call_ratio_full_over_meta": stats["full"]["median"] / stats["meta"]["median"],
            "check_cost": check_s["median"] / stats["meta"]["median"],
        })  # fmt: skip
    return rows


def bench_prefill(cases: dict, repeats: int) -> list[dict]:
    rows = []
    for n, (blocks, block_rows) in cases.items():
        parts = prefill_blocks(n, blocks, block_rows)
        s = samples(
            {
                "glmport": lambda parts=parts: [glmport_dsa(a) for a in parts],
                "sdpa": lambda parts=parts: [sdpa_causal_rows(a) for a in parts],
            },
            repeats,
        )
        stats = {k: spread(v) for k, v in s.items()}
        rows.append({
            "T": n, "N": n, "heads": H, "topk": TOPK, "query_rows": blocks * block_rows,
            "blocks": blocks, "rows_per_block": block_rows, **stats,
            "speedup_vs_sdpa": stats["sdpa"]["median"] / stats["glmport"]["median"],
        })  # fmt: skip
    return rows


# -- memory probes -------------------------------------------------------------------

MEMORY_CASES = {
    "decode_glmport": (glmport_dsa, lambda n: decode_inputs(n)),
    "decode_sdpa": (sdpa_decode, lambda n: decode_inputs(n)),
    "prefill_glmport": (glmport_dsa, lambda n: decode_inputs(n, 64)),
    "prefill_sdpa": (sdpa_causal_rows, lambda n: decode_inputs(n, 64)),
}
MEMORY_RUNS = ("decode_glmport_65536", "decode_sdpa_65536", "prefill_glmport_8192",
               "prefill_sdpa_8192")  # fmt: skip


def measure_memory(case: str) -> None:
    """Print the MiB a case's computation adds to resident memory over its inputs."""
    path, n = case.rsplit("_", 1)
    fn, build = MEMORY_CASES[path]
    fn(build(2 * TOPK))  # imports, registrations, caches: not the case's cost
    inputs = build(int(n))
    baseline = reset_peak()
    fn(inputs)
    print(f"{peak_since_reset_mib() - baseline:.1f}")


# -- main ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and repeats")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/generic.json)")
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        measure_memory(args.memory)
        return
    repeats = 3 if args.quick else 9
    ns = (1024, 4096) if args.quick else DECODE_N
    prefill = {2048: (2, 8)} if args.quick else PREFILL
    check_n = 8192 if args.quick else 65536
    results: dict = {
        "command": "python bench/generic.py" + (" --quick" if args.quick else ""),
        "units": "seconds; median, min, max, iqr [p25, p75] of interleaved samples",
    }
    for threads in THREADS:
        torch.set_num_threads(threads)
        key = f"threads_{threads}"
        dec = bench_decode(ns, repeats)
        val = bench_validation(check_n, repeats)
        pre = bench_prefill(prefill, max(1, repeats // 3))
        results[key] = {"decode": dec, "validation": val, "prefill": pre}
        print(f"== {threads} thread(s): ms, median (p25-p75) ==")
        print("1. DSA decode (1 query, 64 heads, Dk 576 / Dv 512, indexer 32x128, topk 2048)")
        print(table([("N", "glmport", "naive torch DSA", "SDPA dense", "vs SDPA", "vs naive")]
                    + [(r["N"], cell(r["glmport"]), cell(r["naive"]), cell(r["sdpa"]),
                        f"{r['speedup_vs_sdpa']:.2f}x", f"{r['speedup_vs_naive']:.2f}x")
                       for r in dec]))  # fmt: skip
        print(f"2. Validation cost at N = {check_n} (default checks vs meta)")
        print(table([("op", "full", "meta", "full / meta", "checks alone", "cost")]
                    + [(r["op"], cell(r["full"]), cell(r["meta"]),
                        f"{r['call_ratio_full_over_meta']:.3f}", cell(r["checks_only"]),
                        f"{r['check_cost']:.2%}") for r in val]))  # fmt: skip
        print("3. Sparse prefill, a subset of query rows (64 heads, topk 2048)")
        print(table([("T = N", "rows", "glmport", "SDPA causal", "speedup")]
                    + [(r["N"], r["query_rows"], cell(r["glmport"]), cell(r["sdpa"]),
                        f"{r['speedup_vs_sdpa']:.2f}x") for r in pre]))  # fmt: skip
        print()
    if not args.quick:
        mem = {case: extra_peak_mib(__file__, case) for case in MEMORY_RUNS}
        results["peak_memory_mib"] = mem
        print("4. Peak memory added over the inputs (fresh process each)")
        print(table([("case", "MiB")] + [(c, f"{v:.0f}") for c, v in mem.items()]))
    results["decode_min_speedup_vs_naive"] = min(
        r["speedup_vs_naive"] for k in results if k.startswith("threads_")
        for r in results[k]["decode"]
    )  # fmt: skip
    # Smoke timings never overwrite the committed figures.
    out = args.out or (None if args.quick else RESULTS / "generic.json")
    if out is not None:
        save(out, {"environment": environment(), **results})


if __name__ == "__main__":
    main()
