"""The cuda backend's Triton kernels on a GPU, checked and timed side by side with the
generic backend on the same device and inputs, torch's bf16 matmul and
``torch._scaled_mm``, in one run.

Sections (GLM-5 shapes; ``--smoke`` shrinks them):

1. ``decode``: sparse decode attention, B queries x 64 heads, absorbed MLA (Dk 576 /
   Dv 512, v a view of k), topk 2048, each query over its own context of N slots:
   achieved TB/s (the gathered key rows, indices, q, out, lse) against the device's
   HBM peak, and TFLOPS.
2. ``prefill``: sparse prefill attention, T queries x 64 heads, topk 2048: TFLOPS.
3. ``indexer``: the lightning indexer with its fused top-2048 (32 heads x 128).
4. ``gemm``: grouped GEMM (256 experts, 8 per token, bf16) against one
   ``torch.matmul`` of the same FLOPs; FP8-block GEMM (``quant_gemm``, activation
   quantisation included) against bf16 ``torch.matmul`` and ``torch._scaled_mm``
   (fp8 with row-wise scales) on the same shape.
5. ``ops``: every other op (norm, rope, router, dispatch / combine, quantize, W8A8 /
   W4A8 / W4A16 GEMMs, log-probs) against the generic backend.

Every row: median ms with the 20th-80th percentile spread (``triton.testing.do_bench``
on a GPU), the generic backend's median, the speedup, and the kernel's error against
the generic backend's output (max|diff| / max|generic|; index outputs by the scores
they select). The floors of issue 10 are judged at the end: every kernel faster than
generic, decode at 64K context >= 50% of HBM peak, grouped GEMM >= 70% of bf16 matmul,
FP8-block GEMM faster than bf16 matmul.

Run on a GPU: ``python bench/cuda.py`` (writes ``bench/results/cuda.json``);
``--only decode,gemm`` runs some sections; ``--smoke`` runs everything on tiny shapes
on the CPU through the Triton interpreter (minutes, CI runs it): the script is known
to work before a GPU sees it, its timings mean nothing and no floor is judged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script this folder is sys.path[0], where torch.cuda's `import cuda.bindings`
# (cuda-python's package name) would find this file: out of the path until torch loads.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

sys.path.insert(0, str(HERE))  # its helpers

from common import RESULTS, environment, markdown_table, table  # noqa: E402

import glmport  # noqa: E402
from glmport.core.formats import quantize_tensor  # noqa: E402
from glmport.core.tolerance import Tolerance, compare  # noqa: E402

SECTIONS = ("decode", "prefill", "indexer", "gemm", "ops")
# Peak HBM bandwidth (TB/s) and dense bf16 / fp8 tensor TFLOPS, by device name.
PEAKS = {
    "H200": (4.8, 989.0, 1979.0),
    "H100": (3.35, 989.0, 1979.0),
    "H800": (3.35, 989.0, 1979.0),
    "H20": (4.0, 148.0, 296.0),
    "A100": (2.04, 312.0, None),
}
FLOORS = {"decode_hbm_fraction": 0.5, "grouped_vs_matmul": 0.7, "fp8_vs_bf16_matmul": 1.0}


@dataclass(frozen=True)
class Sizes:
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
    experts: int = 256
    top_k: int = 8
    tokens: int = 4096
    hidden: int = 6144
    expert_width: int = 2048
    dense_out: int = 12288
    vocab: int = 154880
    logprob_tokens: int = 2048


GPU_SIZES = Sizes()
SMOKE_SIZES = Sizes(
    heads=16,
    dk=576,
    dv=512,
    topk=64,
    decode_batches=(2,),
    contexts=(256,),
    prefill_tokens=8,
    prefill_keys=256,
    index_heads=8,
    index_dim=64,
    index_queries=((2, 512),),
    experts=8,
    top_k=2,
    tokens=32,
    hidden=256,
    expert_width=128,
    dense_out=256,
    vocab=1000,
    logprob_tokens=8,
)


class Bench:
    """Times functions and collects rows; knows the device and whether it is a smoke run."""

    def __init__(self, device: torch.device, smoke: bool, emulate: bool) -> None:
        self.device, self.smoke, self.emulate = device, smoke, emulate
        self.rows: list[dict] = []
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.device_name = name
        self.peaks = next((p for key, p in PEAKS.items() if key in name), None)

    def time_ms(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        """(median, 20th, 80th percentile) milliseconds of ``fn``."""
        if self.device.type == "cuda":
            from triton.testing import do_bench

            med, lo, hi = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
            return float(med), float(lo), float(hi)
        fn()  # warm-up: the interpreter rewrites each kernel once
        samples = []
        for _ in range(1 if self.smoke else 5):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples), min(samples), max(samples)

    def on(self, backend: str):
        return glmport.use_backend(backend, emulate=self.emulate if backend == "cuda" else None)

    def compare(
        self,
        section: str,
        name: str,
        run: Callable[[], object],
        *,
        flops: float = 0.0,
        bytes_moved: float = 0.0,
        error_of: Callable[[object, object], float] | None = None,
    ) -> dict:
        """One row: ``run`` on cuda and on generic (same inputs), timed, and the
        error of cuda's output against generic's."""
        with self.on("cuda"):
            out = run()
            med, lo, hi = self.time_ms(run)
        with self.on("generic"):
            ref = run()
            base, _, _ = self.time_ms(run)
        row = {
            "section": section,
            "name": name,
            "cuda_ms": med,
            "cuda_p20_ms": lo,
            "cuda_p80_ms": hi,
            "generic_ms": base,
            "speedup_vs_generic": base / med if med else math.inf,
            "error_vs_generic": (error_of or rel_error)(out, ref),
        }
        if flops:
            row["tflops"] = flops / (med * 1e-3) / 1e12
        if bytes_moved:
            row["tb_per_s"] = bytes_moved / (med * 1e-3) / 1e12
            if self.peaks:
                row["hbm_fraction"] = row["tb_per_s"] / self.peaks[0]
        self.rows.append(row)
        print(
            f"  {section:8s} {name:44s} {med:10.3f} ms  x{row['speedup_vs_generic']:.2f} vs "
            f"generic  err {row['error_vs_generic']:.2e}",
            flush=True,
        )
        return row

    def baseline(self, section: str, name: str, fn: Callable[[], object], flops: float) -> dict:
        """A torch baseline (not an op of ours), timed alone."""
        med, lo, hi = self.time_ms(fn)
        row = {
            "section": section,
            "name": name,
            "baseline_ms": med,
            "baseline_p20_ms": lo,
            "baseline_p80_ms": hi,
            "tflops": flops / (med * 1e-3) / 1e12,
        }
        self.rows.append(row)
        print(f"  {section:8s} {name:44s} {med:10.3f} ms  (torch baseline)", flush=True)
        return row


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def rel_error(out, ref) -> float:
    """Worst max|out - ref| / max|ref| over the floating outputs, as the shadow checker
    and the suite measure it (inf / nan entries must agree; NaN gives NaN); integer
    outputs must match exactly (inf when they do not)."""
    worst = 0.0
    for o, r in zip(_tensors(out), _tensors(ref), strict=True):
        if not o.is_floating_point():
            if not torch.equal(o, r):
                return math.inf
            continue
        err = compare(o, r, Tolerance(0.0, 0.0)).max_rel
        if math.isnan(err):
            return err
        worst = max(worst, err)
    return worst


def indexer_error(out, ref) -> float:
    """Top-k outputs differ legitimately at near-ties: compare the selected scores."""
    return rel_error(out[1], ref[1])


def gate_error(out, ref) -> float:
    """Router weights, sorted per token (ties may swap equal experts)."""
    return rel_error(out[0].sort(dim=1).values, ref[0].sort(dim=1).values)


def _randn(*shape, dtype=torch.bfloat16, device, scale=1.0, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)


def _random_slots(rows: int, topk: int, lo, width: int, device, seed=1) -> torch.Tensor:
    """``[rows, topk]`` int32 slot ids, row ``i`` drawn from ``[lo[i], lo[i] + width)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = torch.randint(0, width, (rows, topk), generator=gen, device=device)
    return (r + lo[:, None]).to(torch.int32)


def attention_flops(t: int, s: Sizes) -> float:
    return 2.0 * t * s.heads * s.topk * (s.dk + s.dv)


def decode(b: Bench, s: Sizes) -> None:
    for batch in s.decode_batches:
        for n in s.contexts:
            dev = b.device
            kv = _randn(batch * n, 1, s.dk, device=dev, seed=n)
            q = _randn(batch, s.heads, s.dk, device=dev, seed=batch)
            starts = torch.arange(batch, device=dev) * n
            idx = _random_slots(batch, s.topk, starts, n, dev)
            elem = kv.element_size()
            moved = batch * s.topk * (s.dk * elem + 4) + batch * s.heads * (
                (s.dk + s.dv) * elem + 4
            )

            def run(q=q, kv=kv, idx=idx):
                return glmport.ops.sparse_attention(q, kv, kv[..., : s.dv], idx, s.dk**-0.5)

            b.compare(
                "decode",
                f"B={batch} N={n} H={s.heads} topk={s.topk}",
                run,
                flops=attention_flops(batch, s),
                bytes_moved=moved,
            )
            del kv


def prefill(b: Bench, s: Sizes) -> None:
    dev, t, n = b.device, s.prefill_tokens, s.prefill_keys
    kv = _randn(n, 1, s.dk, device=dev, seed=3)
    q = _randn(t, s.heads, s.dk, device=dev, seed=4)
    # Causal: query i (the last t of n) picks topk of its earlier slots (-1 when fewer).
    ends = torch.arange(n - t + 1, n + 1, device=dev)
    gen = torch.Generator(device=dev).manual_seed(5)
    idx = (torch.rand(t, s.topk, generator=gen, device=dev) * ends[:, None]).long().to(torch.int32)

    def run():
        return glmport.ops.sparse_attention(q, kv, kv[..., : s.dv], idx, s.dk**-0.5)

    b.compare("prefill", f"T={t} N={n} H={s.heads} topk={s.topk}", run, flops=attention_flops(t, s))


def indexer(b: Bench, s: Sizes) -> None:
    dev = b.device
    for t, n in s.index_queries:
        q = _randn(t, s.index_heads, s.index_dim, device=dev, seed=6)
        k = _randn(n, s.index_dim, device=dev, seed=7)
        w = _randn(t, s.index_heads, device=dev, dtype=torch.float32, seed=8)
        w = w * (s.index_heads * s.index_dim) ** -0.5
        end = torch.arange(n - t + 1, n + 1, device=dev, dtype=torch.int32)
        start = torch.zeros(t, device=dev, dtype=torch.int32)
        flops = 2.0 * float(end.double().sum()) * s.index_heads * s.index_dim

        def run(q=q, k=k, w=w, start=start, end=end):
            return glmport.ops.lightning_indexer(q, k, w, start, end, s.topk)

        b.compare(
            "indexer",
            f"T={t} N={n} Hi={s.index_heads} topk={s.topk}",
            run,
            flops=flops,
            error_of=indexer_error,
        )


def _routing(s: Sizes, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced-ish routing: ``[T, k]`` distinct experts per token and the offsets."""
    gen = torch.Generator(device=dev).manual_seed(9)
    ids = torch.rand(s.tokens, s.experts, generator=gen, device=dev).topk(s.top_k).indices
    counts = torch.bincount(ids.flatten(), minlength=s.experts)
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32)
    return ids.to(torch.int32), offsets


def gemm(b: Bench, s: Sizes) -> None:
    dev = b.device
    _, offsets = _routing(s, dev)
    m, n, k = s.tokens * s.top_k, 2 * s.expert_width, s.hidden
    x = _randn(m, k, device=dev, seed=10)
    w = _randn(s.experts, n, k, device=dev, seed=11, scale=k**-0.5)
    flops = 2.0 * m * n * k
    grouped = b.compare(
        "gemm",
        f"grouped bf16 M={m} E={s.experts} N={n} K={k}",
        lambda: glmport.ops.grouped_gemm(x, w, offsets),
        flops=flops,
    )
    wd = _randn(k, n, device=dev, seed=12, scale=k**-0.5)
    matmul = b.baseline("gemm", f"torch.matmul bf16 {m}x{k} @ {k}x{n}", lambda: x @ wd, flops)
    grouped["vs_bf16_matmul"] = matmul["baseline_ms"] / grouped["cuda_ms"]

    m2, n2, k2 = s.tokens, s.dense_out, s.hidden
    x2 = _randn(m2, k2, device=dev, seed=13)
    w2 = _randn(n2, k2, device=dev, dtype=torch.float32, seed=14, scale=k2**-0.5)
    wq, ws = quantize_tensor(w2.cpu(), "fp8_block", 128)
    wq, ws = wq.to(dev), ws.to(dev)
    flops2 = 2.0 * m2 * n2 * k2
    fp8 = b.compare(
        "gemm",
        f"fp8_block quant_gemm M={m2} N={n2} K={k2}",
        lambda: glmport.ops.quant_gemm(x2, wq, ws, "fp8_block"),
        flops=flops2,
    )
    w2t = w2.to(torch.bfloat16).T.contiguous()
    bf16 = b.baseline("gemm", f"torch.matmul bf16 {m2}x{k2} @ {k2}x{n2}", lambda: x2 @ w2t, flops2)
    fp8["vs_bf16_matmul"] = bf16["baseline_ms"] / fp8["cuda_ms"]
    if dev.type == "cuda":
        xq = x2.to(torch.float8_e4m3fn)
        sa = torch.ones(m2, 1, device=dev)
        sb = torch.ones(1, n2, device=dev)
        scaled = b.baseline(
            "gemm",
            "torch._scaled_mm fp8 row-wise scales",
            lambda: torch._scaled_mm(xq, wq.T, sa, sb, out_dtype=torch.bfloat16),
            flops2,
        )
        fp8["vs_scaled_mm"] = scaled["baseline_ms"] / fp8["cuda_ms"]


def ops(b: Bench, s: Sizes) -> None:
    dev, t, d = b.device, s.tokens, s.hidden
    x = _randn(t, d, device=dev, seed=15)
    weight = _randn(d, device=dev, seed=16, scale=0.1) + 1
    b.compare("ops", f"rms_norm [{t}, {d}] bf16", lambda: glmport.ops.rms_norm(x, weight, 1e-6))
    xr = _randn(t, s.heads, 64, device=dev, seed=17)
    ang = torch.arange(t, device=dev)[:, None] * torch.rand(32, device=dev)[None]
    cos, sin = ang.cos(), ang.sin()
    b.compare(
        "ops", f"rope [{t}, {s.heads}, 64] bf16", lambda: glmport.ops.rope(xr, cos, sin, True)
    )
    logits = _randn(t, s.experts, device=dev, dtype=torch.float32, seed=18)
    bias = _randn(s.experts, device=dev, dtype=torch.float32, seed=19, scale=0.1)
    b.compare(
        "ops",
        f"moe_gate [{t}, {s.experts}] top-{s.top_k}",
        lambda: glmport.ops.moe_gate(logits, bias, s.top_k, 1, 1, 2.5, True, "sigmoid"),
        error_of=gate_error,
    )
    ids, _ = _routing(s, dev)
    b.compare(
        "ops",
        f"moe_dispatch [{t}, {d}] k={s.top_k}",
        lambda: glmport.ops.moe_dispatch(x, ids, s.experts),
    )
    with b.on("generic"):
        _, _, src_row = glmport.ops.moe_dispatch(x, ids, s.experts)
    y = _randn(t * s.top_k, d, device=dev, seed=20)
    wts = torch.rand(t, s.top_k, device=dev)
    b.compare(
        "ops", f"moe_combine [{t * s.top_k}, {d}]", lambda: glmport.ops.moe_combine(y, src_row, wts)
    )
    for fmt in ("int8_row", "fp8_group"):
        b.compare(
            "ops", f"quantize {fmt} [{t}, {d}]", lambda fmt=fmt: glmport.ops.quantize(x, fmt, 128)
        )
    w = _randn(s.dense_out, d, device=dev, dtype=torch.float32, seed=21, scale=d**-0.5).cpu()
    for scheme, fmt in (("w8a8", "int8_row"), ("w4a8", "int4_group"), ("w4a16", "int4_group")):
        wq, ws = (a.to(dev) for a in quantize_tensor(w, fmt, 128))
        b.compare(
            "ops",
            f"quant_gemm {scheme} M={t} N={s.dense_out} K={d}",
            lambda wq=wq, ws=ws, scheme=scheme: glmport.ops.quant_gemm(x, wq, ws, scheme),
            flops=2.0 * t * s.dense_out * d,
        )
    tl_ = s.logprob_tokens
    hidden = _randn(tl_, d, device=dev, seed=22)
    head = _randn(s.vocab, d, device=dev, seed=23, scale=d**-0.5)
    targets = torch.randint(0, s.vocab, (tl_,), device=dev)
    b.compare(
        "ops",
        f"token_logprobs T={tl_} D={d} V={s.vocab}",
        lambda: glmport.ops.token_logprobs(hidden, head, targets, 1.0),
        flops=2.0 * tl_ * s.vocab * d,
    )


RUNNERS = {"decode": decode, "prefill": prefill, "indexer": indexer, "gemm": gemm, "ops": ops}


def floors(b: Bench) -> list[dict]:
    """The issue's floors, judged on this run's rows (never on a smoke run)."""
    judged = []

    def judge(name: str, value: float | None, floor: float) -> None:
        ok = value is not None and value >= floor
        judged.append({"floor": name, "value": value, "min": floor, "ok": ok})

    for r in b.rows:
        if "generic_ms" in r:
            judge(f"{r['section']} {r['name']}: speedup vs generic", r["speedup_vs_generic"], 1.0)
    longest = max(
        (r for r in b.rows if r["section"] == "decode"),
        default=None,
        key=lambda r: int(r["name"].split("N=")[1].split()[0]),
    )
    if longest is not None:
        judge(
            f"decode {longest['name']}: fraction of HBM peak",
            longest.get("hbm_fraction"),
            FLOORS["decode_hbm_fraction"],
        )
    for r in b.rows:
        if r.get("name", "").startswith("grouped bf16"):
            judge(
                "grouped GEMM vs bf16 matmul", r.get("vs_bf16_matmul"), FLOORS["grouped_vs_matmul"]
            )
        if r.get("name", "").startswith("fp8_block quant_gemm"):
            judge(
                "FP8-block GEMM vs bf16 matmul",
                r.get("vs_bf16_matmul"),
                FLOORS["fp8_vs_bf16_matmul"],
            )
    return judged


def render(b: Bench, judged: list[dict], markdown: bool) -> str:
    rows = [
        (
            "section",
            "case",
            "cuda ms (p20-p80)",
            "generic ms",
            "speedup",
            "TFLOPS",
            "TB/s (of peak)",
            "err vs generic",
        )
    ]
    for r in b.rows:
        if "cuda_ms" in r:
            tb = f"{r['tb_per_s']:.2f}" if "tb_per_s" in r else ""
            if "hbm_fraction" in r:
                tb += f" ({r['hbm_fraction']:.0%})"
            rows.append(
                (
                    r["section"],
                    r["name"],
                    f"{r['cuda_ms']:.3f} ({r['cuda_p20_ms']:.3f}-{r['cuda_p80_ms']:.3f})",
                    f"{r['generic_ms']:.3f}",
                    f"{r['speedup_vs_generic']:.2f}x",
                    f"{r['tflops']:.1f}" if "tflops" in r else "",
                    tb,
                    f"{r['error_vs_generic']:.1e}",
                )
            )
        else:
            rows.append(
                (
                    r["section"],
                    r["name"],
                    f"{r['baseline_ms']:.3f} (baseline)",
                    "",
                    "",
                    f"{r['tflops']:.1f}",
                    "",
                    "",
                )
            )
    out = (markdown_table if markdown else table)(rows)
    if judged:
        lines = [
            f"{'ok  ' if j['ok'] else 'MISS'} {j['floor']}: "
            f"{'n/a' if j['value'] is None else format(j['value'], '.3g')} "
            f"(floor {j['min']:g})"
            for j in judged
        ]
        out += "\n\nFloors:\n" + "\n".join(lines)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes through the Triton interpreter on the CPU"
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default bench/results/cuda.json; smoke: cuda-smoke.json)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    sections = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; sections are {', '.join(SECTIONS)}")
    if args.smoke:
        device, sizes, emulate = torch.device("cpu"), SMOKE_SIZES, True
    elif torch.cuda.is_available():
        device, sizes, emulate = torch.device("cuda"), GPU_SIZES, False
    else:
        parser.error("no CUDA / ROCm device: run with --smoke for the interpreter run")
    # Production validation (no value checks, no host syncs) for both backends alike.
    os.environ["GLMPORT_VALIDATE"] = "meta"
    bench = Bench(device, args.smoke, emulate)
    print(
        f"cuda backend vs generic on {bench.device_name}"
        f"{' (smoke: Triton interpreter, timings meaningless)' if args.smoke else ''}"
    )
    with torch.no_grad():
        for name in sections:
            print(f"[{name}]", flush=True)
            RUNNERS[name](bench, sizes)
    judged = [] if args.smoke else floors(bench)
    print(render(bench, judged, args.markdown))
    out = args.out or RESULTS / ("cuda-smoke.json" if args.smoke else "cuda.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": {
            **environment(),
            "device": bench.device_name,
            "peaks_tbs_bf16_fp8": bench.peaks,
        },
        "smoke": args.smoke,
        "sizes": sizes.__dict__,
        "rows": bench.rows,
        "floors": judged,
    }
    out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {out}")
    errors = [r for r in bench.rows if not r.get("error_vs_generic", 0.0) <= 5e-2]  # NaN too
    if errors:
        print("kernels disagreeing with generic: " + ", ".join(r["name"] for r in errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
