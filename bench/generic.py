"""Benchmarks of the generic backend on this CPU, measured side by side in one run.

1. DSA decode against dense attention: one query, 64 heads, absorbed Dk 576 / Dv 512,
   indexer 32 x 128, topk 2048, over contexts N; the crossover N.
2. Sparse prefill: T = N = 8192, topk 2048 (16 heads, absorbed 576 / 512), against
   dense causal attention (query-chunked, the fast dense formulation on a CPU).
3. MoE layer: T 1024, 64 experts top-8, hidden 1024, expert width 512 (SwiGLU): the
   grouped path against a per-expert masked loop and dense compute of all experts,
   and its GFLOP/s against torch.matmul's on the same FLOPs (the roofline here).
4. Peak memory of 1 and 2 against the dense formulations, each in a fresh process.

Run: ``python bench/generic.py`` (about 5 minutes on 2 cores); ``--quick`` for a
smoke run. Writes ``bench/results/generic.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import (
    extra_peak_mib,
    peak_since_reset_mib,
    reset_peak,
    table,
    timed,
    timed_interleaved,
    write,
)

import glmport

H, DK, DV, HI, DI, TOPK = 64, 576, 512, 32, 128, 2048
PREFILL_H = 16


def decode_inputs(n: int, heads: int = H, t: int = 1):
    gen = torch.Generator().manual_seed(n)
    return {
        "q": torch.randn(t, heads, DK, generator=gen),
        "kv": torch.randn(n, 1, DK, generator=gen),
        "qi": torch.randn(t, HI, DI, generator=gen),
        "ki": torch.randn(n, DI, generator=gen),
        "w": torch.randn(t, HI, generator=gen) * (HI * DI) ** -0.5,
        "k_start": torch.zeros(t, dtype=torch.int32),
        "k_end": torch.arange(n - t + 1, n + 1, dtype=torch.int32),
    }


def sparse_path(a):
    """Indexer + top-k + sparse attention, as DSA runs them."""
    with glmport.use_backend("generic"):
        idx, _ = glmport.ops.lightning_indexer(
            a["qi"], a["ki"], a["w"], a["k_start"], a["k_end"], TOPK
        )
        return glmport.ops.sparse_attention(a["q"], a["kv"], a["kv"][..., :DV], idx, DK**-0.5)


def dense_decode(a):
    """One query over every slot: q K^T, softmax, P V."""
    kv = a["kv"][:, 0]
    p = torch.softmax((a["q"][0] @ kv.T) * DK**-0.5, dim=-1)
    return p @ kv[:, :DV]


def dense_causal(a, chunk: int = 256):
    """Causal attention over every earlier slot, in query chunks ([chunk, H, N] scores)."""
    kv = a["kv"][:, 0]
    t, n = a["q"].shape[0], kv.shape[0]
    out = torch.empty(t, a["q"].shape[1], DV)
    for t0 in range(0, t, chunk):
        q = a["q"][t0 : t0 + chunk]
        s = torch.einsum("thd,nd->thn", q, kv) * DK**-0.5
        limit = a["k_end"][t0 : t0 + chunk, None, None]
        s = s.masked_fill(torch.arange(n)[None, None, :] >= limit, float("-inf"))
        out[t0 : t0 + chunk] = torch.softmax(s, dim=-1) @ kv[:, :DV]
    return out


def dense_causal_materialised(a):
    """The dense formulation: the whole [H, T, N] score matrix at once."""
    return dense_causal(a, chunk=a["q"].shape[0])


# -- MoE ---------------------------------------------------------------------------

MOE_T, MOE_E, MOE_K, MOE_D, MOE_F = 1024, 64, 8, 1024, 512


def moe_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MOE_T, MOE_D, generator=gen)
    router = torch.randn(MOE_E, MOE_D, generator=gen) * MOE_D**-0.5
    weights, ids = glmport.ops.moe_gate(x @ router.T, None, MOE_K)
    return {
        "x": x,
        "weights": weights,
        "ids": ids,
        "w_gate_up": torch.randn(MOE_E, 2 * MOE_F, MOE_D, generator=gen) * MOE_D**-0.5,
        "w_down": torch.randn(MOE_E, MOE_D, MOE_F, generator=gen) * MOE_F**-0.5,
    }


def _swiglu(h):
    return torch.nn.functional.silu(h[..., :MOE_F]) * h[..., MOE_F:]


def moe_grouped(m):
    with glmport.use_backend("generic"):
        xs, off, src = glmport.ops.moe_dispatch(m["x"], m["ids"], MOE_E)
        h = _swiglu(glmport.ops.grouped_gemm(xs, m["w_gate_up"], off))
        y = glmport.ops.grouped_gemm(h, m["w_down"], off)
        return glmport.ops.moe_combine(y, src, m["weights"])


def moe_masked_loop(m):
    """The naive layer: for every expert, find its tokens by mask, run it, scatter back."""
    out = torch.zeros_like(m["x"])
    for e in range(MOE_E):
        rows, slot = (m["ids"] == e).nonzero(as_tuple=True)
        if rows.numel():
            y = _swiglu(m["x"][rows] @ m["w_gate_up"][e].T) @ m["w_down"][e].T
            out.index_add_(0, rows, y * m["weights"][rows, slot, None])
    return out


def moe_dense_all(m):
    """Every token through every expert, weighted by a dense [T, E] routing matrix."""
    dense_w = torch.zeros(MOE_T, MOE_E).scatter(1, m["ids"].long(), m["weights"])
    out = torch.zeros_like(m["x"])
    for e in range(MOE_E):
        out += (_swiglu(m["x"] @ m["w_gate_up"][e].T) @ m["w_down"][e].T) * dense_w[:, e : e + 1]
    return out


def moe_flops() -> float:
    rows = MOE_T * MOE_K
    return 2.0 * rows * (MOE_D * 2 * MOE_F + MOE_F * MOE_D)


def matmul_roofline():
    """torch.matmul on the same FLOPs as the grouped GEMMs, in two large GEMMs."""
    gen = torch.Generator().manual_seed(1)
    rows = MOE_T * MOE_K
    a, b = torch.randn(rows, MOE_D, generator=gen), torch.randn(MOE_D, 2 * MOE_F, generator=gen)
    c, d = torch.randn(rows, MOE_F, generator=gen), torch.randn(MOE_F, MOE_D, generator=gen)
    return lambda: (a @ b, c @ d)


# -- memory probes -------------------------------------------------------------------

MEMORY_CASES = {
    "decode_sparse": sparse_path,
    "decode_dense": dense_decode,
    "prefill_sparse": sparse_path,
    "prefill_dense_chunked": dense_causal,
    "prefill_dense_materialised": dense_causal_materialised,
}
MEMORY_RUNS = (
    "decode_sparse_65536",
    "decode_dense_65536",
    "prefill_sparse_8192",
    "prefill_dense_chunked_8192",
    "prefill_dense_materialised_8192",
)


def measure_memory(case: str) -> None:
    """Print the MiB a case's computation adds to resident memory over its inputs."""
    kind, path, n = case.split("_", 1)[0], case.rsplit("_", 1)[0], int(case.rsplit("_", 1)[1])
    build = decode_inputs if kind == "decode" else lambda n: decode_inputs(n, PREFILL_H, n)
    MEMORY_CASES[path](build(64))  # imports, registrations, caches: not the case's cost
    inputs = build(n)
    baseline = reset_peak()
    MEMORY_CASES[path](inputs)
    print(f"{peak_since_reset_mib() - baseline:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small repeats, no prefill / memory")
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        measure_memory(args.memory)
        return
    repeats = 2 if args.quick else 5
    results: dict = {"decode": [], "command": "python bench/generic.py"}

    rows = [("N", "sparse ms", "dense ms", "speedup")]
    for n in (1024, 2048, 4096, 8192, 16384, 65536):
        a = decode_inputs(n)
        t = timed_interleaved(
            {"sparse": lambda a=a: sparse_path(a), "dense": lambda a=a: dense_decode(a)}, repeats
        )
        ts, td = t["sparse"], t["dense"]
        results["decode"].append({"N": n, "sparse_s": ts, "dense_s": td, "speedup": td / ts})
        rows.append((n, f"{ts * 1e3:.2f}", f"{td * 1e3:.2f}", f"{td / ts:.2f}x"))
    faster = [r["N"] for r in results["decode"] if r["speedup"] > 1]
    results["decode_crossover_N"] = min(faster) if faster else None
    print("1. DSA decode (1 query, 64 heads, Dk 576 / Dv 512, indexer 32x128, topk 2048)")
    print(table(rows))
    print(f"   sparse beats dense from N = {results['decode_crossover_N']} (of the Ns measured)\n")

    m = moe_inputs()
    flops = moe_flops()
    roofline = matmul_roofline()
    t = timed_interleaved(
        {"grouped": lambda: moe_grouped(m), "loop": lambda: moe_masked_loop(m), "roof": roofline},
        repeats,
    )
    t_grouped, t_loop, t_roof = t["grouped"], t["loop"], t["roof"]
    t_dense = timed(lambda: moe_dense_all(m), max(1, repeats // 2))
    results["moe"] = {
        "shape": {"T": MOE_T, "E": MOE_E, "top_k": MOE_K, "hidden": MOE_D, "width": MOE_F},
        "grouped_s": t_grouped,
        "masked_loop_s": t_loop,
        "dense_all_experts_s": t_dense,
        "matmul_same_flops_s": t_roof,
        "gflops": flops / 1e9,
        "grouped_gflop_per_s": flops / t_grouped / 1e9,
        "matmul_gflop_per_s": flops / t_roof / 1e9,
        "fraction_of_matmul": t_roof / t_grouped,
        "speedup_vs_masked_loop": t_loop / t_grouped,
        "speedup_vs_dense": t_dense / t_grouped,
    }
    mo = results["moe"]
    print("3. MoE layer (T 1024, 64 experts top-8, hidden 1024, width 512, SwiGLU)")
    grouped_rate, roof_rate = f"{mo['grouped_gflop_per_s']:.1f}", f"{mo['matmul_gflop_per_s']:.1f}"
    print(table([
        ("path", "ms", "GFLOP/s", "time / grouped"),
        ("grouped (glmport generic)", f"{t_grouped * 1e3:.1f}", grouped_rate, "1.00"),
        ("per-expert masked loop", f"{t_loop * 1e3:.1f}", "", f"{t_loop / t_grouped:.2f}"),
        ("dense, all experts", f"{t_dense * 1e3:.1f}", "", f"{t_dense / t_grouped:.2f}"),
        ("torch.matmul, same FLOPs", f"{t_roof * 1e3:.1f}", roof_rate, "roofline"),
    ]))  # fmt: skip
    print(f"   grouped path reaches {mo['fraction_of_matmul']:.0%} of torch.matmul's GFLOP/s\n")

    if not args.quick:
        a = decode_inputs(8192, PREFILL_H, 8192)
        ts, td = timed(lambda: sparse_path(a), 1, 0), timed(lambda: dense_causal(a), 1, 0)
        results["prefill"] = {"T": 8192, "N": 8192, "heads": PREFILL_H, "topk": TOPK,
                              "sparse_s": ts, "dense_causal_s": td, "speedup": td / ts}  # fmt: skip
        print("2. Sparse prefill (T = N = 8192, 16 heads, absorbed 576/512, topk 2048)")
        print(table([("path", "s"), ("sparse (indexer + attention)", f"{ts:.2f}"),
                     ("dense causal (chunked)", f"{td:.2f}")]))  # fmt: skip
        print(f"   speedup {td / ts:.2f}x\n")
        mem = {case: extra_peak_mib(__file__, case) for case in MEMORY_RUNS}
        results["peak_memory_mib"] = mem
        print("4. Peak memory added over the inputs (fresh process each)")
        print(table([("case", "MiB")] + [(c, f"{v:.0f}") for c, v in mem.items()]))
    path = write("generic", results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
