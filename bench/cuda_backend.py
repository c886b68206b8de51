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
6. ``model``: the byte / FLOP / occupancy model of decode and prefill attention and
   the indexer at GLM-5's shapes (``cuda_cost.py``: bytes per query against one
   gather, programs from the backend's own plan for an H200, the roofline, MMA kinds
   from the compile table) beside the anchors' records; no timing, the same on a CPU.

Every row: median ms with the 20th-80th percentile spread (``triton.testing.do_bench``
on a GPU), the generic backend's median, the speedup, and the kernel's error against
the generic backend's output (max|diff| / max|generic|; index outputs by the scores
they select). The floors of issue 10 are judged at the end: every kernel faster than
generic, decode at 64K context >= 50% of HBM peak, grouped GEMM >= 70% of bf16 matmul,
FP8-block GEMM faster than bf16 matmul.

The rows with a rate name their conformance scorecard cell (``op``, ``dtype``) and, on a
device in ``PEAKS``, carry ``peak_fraction`` and ``peak`` (:meth:`Bench.peak_fraction`):
``glmport conformance --scorecard RUN... --bench bench/results/cuda.json`` shows them.

Run on a GPU: ``python bench/cuda_backend.py`` (writes ``bench/results/cuda.json``);
``--only decode,gemm`` runs some sections; ``--smoke`` runs everything on tiny shapes
on the CPU through the Triton interpreter (minutes, CI runs it): the script is known
to work before a GPU sees it, its timings mean nothing and no floor is judged.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

import common
import cuda_cost
from common import Glm5Sizes, environment, markdown_table, randn, table

import glmport
from glmport.conformance.runner import dtype_key
from glmport.core.tolerance import Tolerance

SECTIONS = ("decode", "prefill", "indexer", "gemm", "ops", "model")
# Peak HBM bandwidth (TB/s) and dense bf16 / fp8 tensor TFLOPS, by device name.
PEAKS = {
    "H200": (4.8, 989.0, 1979.0),
    "H100": (3.35, 989.0, 1979.0),
    "H800": (3.35, 989.0, 1979.0),
    "H20": (4.0, 148.0, 296.0),
    "A100": (2.04, 312.0, None),
}
# Schemes whose GEMMs run on the 8-bit tensor cores (the fp8 / int8 peak, PEAKS[2]).
EIGHT_BIT_SCHEMES = ("fp8_block", "w8a8", "w4a8")
FLOORS = {"decode_hbm_fraction": 0.5, "grouped_vs_matmul": 0.7, "fp8_vs_bf16_matmul": 1.0}


@dataclass(frozen=True)
class Sizes(Glm5Sizes):
    """GLM-5's shapes, and ``token_logprobs``' vocabulary and token count."""

    vocab: int = 154880
    logprob_tokens: int = 2048


GPU_SIZES = Sizes()
SMOKE_SIZES = Sizes.smoke(index_dim=64, vocab=1000, logprob_tokens=8)


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
        view: Callable[[object], object] = common.whole,
        op: str | None = None,
        like: torch.Tensor | None = None,
        scheme: str | None = None,
    ) -> dict:
        """One row: ``run`` on cuda and on generic (same inputs), timed, and the
        error of cuda's output against generic's (of ``view`` of each). With ``op``
        (and ``like``, the tensor whose dtype the conformance reports' dtype column
        names, and the ``scheme``): the row names its scorecard cell and, on a device
        with known peaks, its fraction of the peak (:meth:`peak_fraction`)."""
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
            "error_vs_generic": rel_error(view(out), view(ref)),
        }
        if flops:
            row["tflops"] = flops / (med * 1e-3) / 1e12
        if bytes_moved:
            row["tb_per_s"] = bytes_moved / (med * 1e-3) / 1e12
            if self.peaks:
                row["hbm_fraction"] = row["tb_per_s"] / self.peaks[0]
        if op is not None and like is not None:
            row["op"] = op
            row["dtype"] = dtype_key(str(like.dtype).removeprefix("torch."), scheme)
            row |= self.peak_fraction(row, scheme)
        self.rows.append(row)
        print(
            f"  {section:8s} {name:44s} {med:10.3f} ms  x{row['speedup_vs_generic']:.2f} vs "
            f"generic  err {row['error_vs_generic']:.2e}",
            flush=True,
        )
        return row

    def peak_fraction(self, row: dict, scheme: str | None) -> dict:
        """``{peak_fraction, peak}``: the row's achieved rate over the device's peak
        for the resource it is closest to exhausting (HBM bandwidth, or the tensor
        FLOPS of its precision), the roofline's bound; {} on a device without known
        peaks or a row that measured neither rate."""
        if not self.peaks:
            return {}
        hbm, bf16, eight_bit = self.peaks
        flops_peak, flops_name = (eight_bit, "fp8/int8") if scheme in EIGHT_BIT_SCHEMES else (
            bf16, "bf16"
        )  # fmt: skip
        rates = []
        if "tb_per_s" in row:
            rates.append((row["tb_per_s"] / hbm, f"HBM {hbm} TB/s"))
        if "tflops" in row and flops_peak:
            rates.append((row["tflops"] / flops_peak, f"{flops_name} {flops_peak} TFLOPS"))
        if not rates:
            return {}
        fraction, peak = max(rates)
        return {"peak_fraction": fraction, "peak": peak}

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


def rel_error(out, ref) -> float:
    """Worst max|out - ref| / max|ref| over the floating outputs, as the shadow checker
    and the suite measure it (inf / nan entries must agree; NaN gives NaN); integer
    outputs must match exactly (inf when they do not)."""
    return common.agreement_within(out, ref, Tolerance(0.0, 0.0)).max_rel


def decode(b: Bench, s: Sizes) -> None:
    for batch in s.decode_batches:
        for n in s.contexts:
            args = s.decode_inputs(batch, n, b.device)
            elem = args[1].element_size()
            moved = batch * s.topk * (s.dk * elem + 4) + batch * s.heads * (
                (s.dk + s.dv) * elem + 4
            )
            b.compare(
                "decode",
                f"B={batch} N={n} H={s.heads} topk={s.topk}",
                lambda args=args: glmport.ops.sparse_attention(*args),
                flops=s.attention_flops(batch),
                bytes_moved=moved,
                op="sparse_attention",
                like=args[0],
            )
            del args


def prefill(b: Bench, s: Sizes) -> None:
    t, n, args = s.prefill_tokens, s.prefill_keys, s.prefill_inputs(b.device)
    b.compare(
        "prefill",
        f"T={t} N={n} H={s.heads} topk={s.topk}",
        lambda: glmport.ops.sparse_attention(*args),
        flops=s.attention_flops(t),
        op="sparse_attention",
        like=args[0],
    )


def indexer(b: Bench, s: Sizes) -> None:
    for t, n in s.index_queries:
        args = s.indexer_inputs(t, n, b.device)
        b.compare(
            "indexer",
            f"T={t} N={n} Hi={s.index_heads} topk={s.topk}",
            lambda args=args: glmport.ops.lightning_indexer(*args, s.topk),
            flops=s.indexer_flops(args[4]),
            view=common.index_scores,
            op="lightning_indexer",
            like=args[0],
        )


def gemm(b: Bench, s: Sizes) -> None:
    dev = b.device
    _, offsets = s.routing(dev)
    x, w = s.grouped_gemm_inputs(dev)
    (m, k), n = x.shape, w.shape[1]
    flops = 2.0 * m * n * k
    grouped = b.compare(
        "gemm",
        f"grouped bf16 M={m} E={s.experts} N={n} K={k}",
        lambda: glmport.ops.grouped_gemm(x, w, offsets),
        flops=flops,
        op="grouped_gemm",
        like=x,
    )
    wd = randn(k, n, device=dev, seed=12, scale=k**-0.5)
    matmul = b.baseline("gemm", f"torch.matmul bf16 {m}x{k} @ {k}x{n}", lambda: x @ wd, flops)
    grouped["vs_bf16_matmul"] = matmul["baseline_ms"] / grouped["cuda_ms"]

    m2, n2, k2 = s.tokens, s.dense_out, s.hidden
    x2 = randn(m2, k2, device=dev, seed=13)
    w2 = s.dense_weight(dev, seed=14)
    wq, ws = common.quantized(w2, "fp8_block", dev)
    flops2 = 2.0 * m2 * n2 * k2
    fp8 = b.compare(
        "gemm",
        f"fp8_block quant_gemm M={m2} N={n2} K={k2}",
        lambda: glmport.ops.quant_gemm(x2, wq, ws, "fp8_block"),
        flops=flops2,
        op="quant_gemm",
        like=x2,
        scheme="fp8_block",
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
    x, weight = s.hidden_states(dev), s.norm_weight(dev)
    b.compare("ops", f"rms_norm [{t}, {d}] bf16", lambda: glmport.ops.rms_norm(x, weight, 1e-6))
    xr = randn(t, s.heads, 64, device=dev, seed=17)
    ang = torch.arange(t, device=dev)[:, None] * torch.rand(32, device=dev)[None]
    cos, sin = ang.cos(), ang.sin()
    b.compare(
        "ops", f"rope [{t}, {s.heads}, 64] bf16", lambda: glmport.ops.rope(xr, cos, sin, True)
    )
    gate = s.gate_args(dev)
    b.compare(
        "ops",
        f"moe_gate [{t}, {s.experts}] top-{s.top_k}",
        lambda: glmport.ops.moe_gate(*gate),
        view=common.router_weights,
    )
    ids, _ = s.routing(dev)
    b.compare(
        "ops",
        f"moe_dispatch [{t}, {d}] k={s.top_k}",
        lambda: glmport.ops.moe_dispatch(x, ids, s.experts),
    )
    combine = s.combine_inputs(x, ids, dev)
    b.compare("ops", f"moe_combine [{t * s.top_k}, {d}]", lambda: glmport.ops.moe_combine(*combine))
    for fmt in ("int8_row", "fp8_group"):
        b.compare(
            "ops", f"quantize {fmt} [{t}, {d}]", lambda fmt=fmt: glmport.ops.quantize(x, fmt, 128)
        )
    w = s.dense_weight(dev, seed=21)
    for scheme, fmt in (("w8a8", "int8_row"), ("w4a8", "int4_group"), ("w4a16", "int4_group")):
        wq, ws = common.quantized(w, fmt, dev)
        b.compare(
            "ops",
            f"quant_gemm {scheme} M={t} N={s.dense_out} K={d}",
            lambda wq=wq, ws=ws, scheme=scheme: glmport.ops.quant_gemm(x, wq, ws, scheme),
            flops=2.0 * t * s.dense_out * d,
            op="quant_gemm",
            like=x,
            scheme=scheme,
        )
    tl_ = s.logprob_tokens
    hidden = randn(tl_, d, device=dev, seed=22)
    head = randn(s.vocab, d, device=dev, seed=23, scale=d**-0.5)
    targets = torch.randint(0, s.vocab, (tl_,), device=dev)
    b.compare(
        "ops",
        f"token_logprobs T={tl_} D={d} V={s.vocab}",
        lambda: glmport.ops.token_logprobs(hidden, head, targets, 1.0),
        flops=2.0 * tl_ * s.vocab * d,
        op="token_logprobs",
        like=hidden,
    )


def model(b: Bench, s: Sizes) -> None:
    """The cost model's rows (GLM-5's shapes whatever ``s``), planned for the device
    the run is on, or for an H200 under the interpreter."""
    rows = _planned(b, lambda: cuda_cost.model_rows(b.device))
    header = ("kernel", "phase", "design", "T", "B/query", "x gather", "programs", "SM fill",
              "HBM us", "tensor us", "bound TFLOPS", "mma")  # fmt: skip
    body = [
        (r["kernel"], r["phase"], r["design"], r["tokens"], f"{r['bytes_per_query']:.3g}",
         f"{r['vs_one_gather']:.2f}" if "vs_one_gather" in r else "-", r["programs"] or "-",
         f"{r['sm_fill']:.2f}" if "sm_fill" in r else "-", f"{r['hbm_us']:.3g}",
         f"{r['tensor_us']:.3g}", f"{r['bound_tflops']:.0f}",
         ", ".join(f"{a} {k}" for a, k in sorted(r.get("mma", {}).items())) or "-")
        for r in rows
    ]  # fmt: skip
    print(table([header, *body]))
    print("anchors: " + "; ".join(f"{k} {v}" for k, v in cuda_cost.ANCHORS.items()))
    b.rows += [{"section": "model", "name": f"{r['kernel']} {r['design']} T={r['tokens']}"} | r
               for r in rows]  # fmt: skip


def _planned(b: Bench, fn: Callable[[], list]) -> list:
    """``fn()`` under the backend's GPU plan for an H200 when the run is interpreted."""
    if b.device.type == "cuda":
        return fn()
    with b.on("cuda"):
        from glmport.backends.cuda import runtime

        with runtime.gpu_plan():
            return fn()


RUNNERS = {
    "decode": decode,
    "prefill": prefill,
    "indexer": indexer,
    "gemm": gemm,
    "ops": ops,
    "model": model,
}


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
        elif "baseline_ms" in r:  # the model's rows are printed by their section
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
    parser, args = common.bench_args(
        __doc__,
        SECTIONS,
        "cuda",
        "tiny shapes through the Triton interpreter on the CPU",
        argv,
    )
    if args.smoke:
        device, sizes, emulate = torch.device("cpu"), SMOKE_SIZES, True
    elif torch.cuda.is_available():
        device, sizes, emulate = torch.device("cuda"), GPU_SIZES, False
    else:
        parser.error("no CUDA / ROCm device: run with --smoke for the interpreter run")
    bench = Bench(device, args.smoke, emulate)
    print(
        f"cuda backend vs generic on {bench.device_name}"
        f"{' (smoke: Triton interpreter, timings meaningless)' if args.smoke else ''}"
    )
    common.run_sections(bench, RUNNERS, args.only, sizes)
    judged = [] if args.smoke else floors(bench)
    print(render(bench, judged, args.markdown))
    payload = {
        "backend": "cuda",
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
    common.save(args.out, payload)
    errors = [r for r in bench.rows if not r.get("error_vs_generic", 0.0) <= 5e-2]  # NaN too
    if errors:
        print("kernels disagreeing with generic: " + ", ".join(r["name"] for r in errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
