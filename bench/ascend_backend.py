"""The ascend backend's torch_npu adapters on an Ascend NPU, checked and timed side by
side with the generic backend on the same device and inputs, in one run.

Sections (GLM-5 shapes; ``--smoke`` shrinks them):

1. ``attention``: sparse decode attention, B queries x 64 heads, absorbed MLA (Dk 576
   / Dv 512, v a view of k), topk 2048 over each query's own context of N slots; and
   sparse prefill, T queries x 64 heads.
2. ``indexer``: the lightning indexer with its fused top-2048 (32 heads x 128), and
   ``indexer_logits`` over up to 8192 keys (the op's largest ``sparse_count``).
3. ``moe``: the router (256 experts, top-8, sigmoid with bias), dispatch, combine, and
   the grouped GEMM (bf16 over all experts; W8A8 over a slice of them).
4. ``quant``: ``quantize`` in the int8 / int4 / fp8 formats (generic only: the ascend
   backend has no ``quantize``, see docs/ascend.md) and ``quant_gemm`` in every scheme
   (W4A8 / FP8-block on generic only: outside A2 / A3's ops).
5. ``norm_rope``: RMSNorm over hidden 6144; rope on GLM-5's 64 heads x 64 (interleaved),
   its shared key rope ``[T, 64]`` and the indexer's half-split rope.
6. ``mla``: the MLA prolog (MLAPO) of a decode batch, at the widths
   ``npu_mla_prolog_v3`` documents (DeepSeek-V3.2's: served by ascend) and at GLM-5's
   (generic until a torch_npu documents them), with bf16 and W8A8 projections.

Every row names the backend that served the call under ``use_backend("ascend")``: a
call outside the ascend backend's capabilities runs on generic (the row says why and
is only timed on generic). Served rows: median ms with the 20th-80th percentile spread,
generic's median, the speedup, and agreement with generic by
``glmport.core.tolerance.compare`` within the op's tolerance for its dtype (index
outputs by the scores they select, router weights sorted per token, integer outputs
exactly). A call that raises on ascend is reported and fails the run, which goes on.

Run on an Ascend NPU (torch_npu and CANN installed): ``python bench/ascend_backend.py`` (writes
``bench/results/ascend.json``); ``--only attention,moe`` runs some sections;
``--smoke`` runs everything on tiny shapes on the CPU against the emulated torch_npu
ops (``GLMPORT_EMULATE=1`` semantics; CI runs it): the script is known to work before
an NPU sees it, its timings mean nothing.
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
from common import Glm5Sizes, environment, markdown_table, randn, table

import glmport
from glmport.core.formats import quantize_tensor
from glmport.core.selection import resolve
from glmport.core.specs import SPECS
from glmport.core.tolerance import Comparison, tolerance

SECTIONS = ("attention", "indexer", "moe", "quant", "norm_rope", "mla")


@dataclass(frozen=True)
class Sizes(Glm5Sizes):
    """GLM-5's shapes, the experts of the W8A8 grouped GEMM and the rope width."""

    quant_experts: int = 32
    rope_dim: int = 64


NPU_SIZES = Sizes()
SMOKE_SIZES = Sizes.smoke(quant_experts=4)


def agreement(out, ref, op: str, dtype: torch.dtype) -> Comparison:
    """``compare`` of every floating output within ``op``'s tolerance for ``dtype``
    (the worst of them; NaN is worst); an integer output must equal generic's exactly."""
    return common.agreement_within(out, ref, tolerance(op, dtype))


class Bench:
    """Runs ops on ascend and generic, times them, and collects rows."""

    def __init__(self, device: torch.device, smoke: bool) -> None:
        self.device, self.smoke, self.emulate = device, smoke, smoke
        self.rows: list[dict] = []
        self.device_name = torch.npu.get_device_name() if device.type == "npu" else "cpu"

    def sync(self) -> None:
        if self.device.type == "npu":
            torch.npu.synchronize()

    def time_ms(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        """(median, 20th, 80th percentile) milliseconds of ``fn`` after a warm-up; on
        an NPU each sample averages enough back-to-back runs to fill about 2 ms."""
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = time.perf_counter() - start
        inner = 1 if self.device.type != "npu" else max(1, min(100, int(2e-3 / max(once, 1e-6))))
        samples = []
        for _ in range(1 if self.smoke else 20):
            self.sync()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            samples.append((time.perf_counter() - start) * 1e3 / inner)
        if len(samples) < 2:
            return samples[0], samples[0], samples[0]
        deciles = statistics.quantiles(samples, n=10)
        return statistics.median(samples), deciles[1], deciles[7]

    def on(self, backend: str):
        return glmport.use_backend(backend, emulate=self.emulate if backend == "ascend" else None)

    def served_by(self, op: str, args: tuple) -> tuple[str, str]:
        """The backend that takes this call under ``use_backend("ascend")``, and why
        the ones before it declined."""
        with self.on("ascend"):
            res = resolve(op, device_type=self.device.type)
            cand, refusals = res.taker(self.device.type, SPECS[op].features(*args))
        why = "; ".join(f"{b}: {r}" for b, r in refusals)
        if res.fell_back:
            why = "; ".join(filter(None, [f"{res.requested} lacks {op}", why]))
        return (cand.backend if cand else "none"), why

    def compare(
        self,
        section: str,
        name: str,
        op: str,
        args: tuple,
        dtype: torch.dtype,
        *,
        flops: float = 0.0,
        view: Callable[[object], object] = common.whole,
    ) -> dict:
        """One row: ``glmport.ops.<op>(*args)`` on ascend and on generic, timed, and
        their agreement (of ``view`` of each)."""
        args = SPECS[op].complete(args, {})
        fn = getattr(glmport.ops, op)

        def run():
            return fn(*args)

        backend, why = self.served_by(op, args)
        with self.on("generic"):
            ref = run()
            base, _, _ = self.time_ms(run)
        row = {"section": section, "name": name, "op": op, "served_by": backend, "generic_ms": base}
        if backend != "ascend":
            row["fallback"] = why
            self.rows.append(row)
            print(f"  {section:9s} {name:44s} not served by ascend ({why})", flush=True)
            return row
        try:
            with self.on("ascend"):
                out = run()
                med, lo, hi = self.time_ms(run)
        except Exception as err:  # one failing adapter must not end the run
            row["error"] = f"{type(err).__name__}: {err}"
            self.rows.append(row)
            print(f"  {section:9s} {name:44s} FAILED on ascend: {row['error']}", flush=True)
            return row
        result = agreement(view(out), view(ref), op, dtype)
        row |= {
            "ascend_ms": med,
            "ascend_p20_ms": lo,
            "ascend_p80_ms": hi,
            "speedup_vs_generic": base / med if med else math.inf,
            "max_rel_vs_generic": result.max_rel,
            "mean_rel_vs_generic": result.mean_rel,
            "agrees": result.ok,
        }
        if flops:
            row["tflops"] = flops / (med * 1e-3) / 1e12
        self.rows.append(row)
        print(
            f"  {section:9s} {name:44s} {med:10.3f} ms  x{row['speedup_vs_generic']:.2f} vs "
            f"generic  err {result.max_rel:.2e}{'' if result.ok else '  DISAGREES'}",
            flush=True,
        )
        return row


def attention(b: Bench, s: Sizes) -> None:
    for batch in s.decode_batches:
        for n in s.contexts:
            b.compare(
                "attention",
                f"decode B={batch} N={n} H={s.heads} topk={s.topk}",
                "sparse_attention",
                s.decode_inputs(batch, n, b.device),
                torch.bfloat16,
                flops=s.attention_flops(batch),
            )
            b.compare(
                "attention",
                f"decode paged B={batch} N={n} H={s.heads} topk={s.topk} (split pools)",
                "sparse_attention",
                s.paged_decode_inputs(batch, n, b.device),
                torch.bfloat16,
                flops=s.attention_flops(batch),
            )
    t, n = s.prefill_tokens, s.prefill_keys
    b.compare(
        "attention",
        f"prefill T={t} N={n} H={s.heads} topk={s.topk}",
        "sparse_attention",
        s.prefill_inputs(b.device),
        torch.bfloat16,
        flops=s.attention_flops(t),
    )


def indexer(b: Bench, s: Sizes) -> None:
    for batch in s.decode_batches:
        for n in s.contexts:
            args = s.paged_indexer_inputs(batch, n, b.device)
            b.compare(
                "indexer",
                f"paged decode B={batch} N={n} Hi={s.index_heads} topk={s.topk} page={s.page}",
                "lightning_indexer",
                args,
                torch.bfloat16,
                flops=s.indexer_flops(args[4]),
                view=common.index_scores,
            )
    for t, n in s.index_queries:
        q, k, w, start, end = s.indexer_inputs(t, n, b.device)
        b.compare(
            "indexer",
            f"T={t} N={n} Hi={s.index_heads} topk={s.topk}",
            "lightning_indexer",
            (q, k, w, start, end, s.topk),
            torch.bfloat16,
            flops=s.indexer_flops(end),
            view=common.index_scores,
        )
        nl = min(n, 8192)  # ascend's indexer_logits takes ranges up to 8192 keys
        end_l = end - (n - nl)
        b.compare(
            "indexer",
            f"indexer_logits T={t} N={nl} Hi={s.index_heads}",
            "indexer_logits",
            (q, k[:nl], w, start, end_l),
            torch.bfloat16,
            flops=s.indexer_flops(end_l),
        )


def moe(b: Bench, s: Sizes) -> None:
    dev, t, d, bf16 = b.device, s.tokens, s.hidden, torch.bfloat16
    b.compare(
        "moe",
        f"moe_gate [{t}, {s.experts}] top-{s.top_k}",
        "moe_gate",
        s.gate_args(dev),
        torch.float32,
        view=common.router_weights,
    )
    x = s.hidden_states(dev)
    ids, offsets = s.routing(dev)
    b.compare(
        "moe", f"moe_dispatch [{t}, {d}] k={s.top_k}", "moe_dispatch", (x, ids, s.experts), bf16
    )
    combine = s.combine_inputs(x, ids, dev)
    b.compare("moe", f"moe_combine [{t * s.top_k}, {d}]", "moe_combine", combine, bf16)
    xs, w = s.grouped_gemm_inputs(dev)
    (m, k), n = xs.shape, w.shape[1]
    b.compare(
        "moe",
        f"grouped_gemm bf16 M={m} E={s.experts} N={n} K={k}",
        "grouped_gemm",
        (xs, w, offsets),
        bf16,
        flops=2.0 * m * n * k,
    )
    del w
    _, q_offsets = s.routing(dev, s.quant_experts)
    wf = randn(s.quant_experts, n, k, device=dev, dtype=torch.float32, seed=12, scale=k**-0.5)
    wq, ws = common.quantized(wf, "int8_row", dev)
    b.compare(
        "moe",
        f"grouped_gemm w8a8 M={m} E={s.quant_experts} N={n} K={k}",
        "grouped_gemm",
        (xs, wq, q_offsets, ws, "w8a8"),
        bf16,
        flops=2.0 * m * n * k,
    )


def quant(b: Bench, s: Sizes) -> None:
    dev, t, d = b.device, s.tokens, s.hidden
    x = s.hidden_states(dev)
    for fmt in ("int8_row", "int4_group", "fp8_group"):
        b.compare("quant", f"quantize {fmt} [{t}, {d}]", "quantize", (x, fmt, 128), torch.bfloat16)
    w = s.dense_weight(dev, seed=21)
    for scheme, fmt in (
        ("w8a8", "int8_row"),
        ("w4a8", "int4_group"),
        ("w4a16", "int4_group"),
        ("fp8_block", "fp8_block"),
    ):
        wq, ws = common.quantized(w, fmt, dev)
        b.compare(
            "quant",
            f"quant_gemm {scheme} M={t} N={s.dense_out} K={d}",
            "quant_gemm",
            (x, wq, ws, scheme, 128),
            torch.bfloat16,
            flops=2.0 * t * s.dense_out * d,
        )


def norm_rope(b: Bench, s: Sizes) -> None:
    dev, t, d, r = b.device, s.tokens, s.hidden, s.rope_dim
    x, weight = s.hidden_states(dev), s.norm_weight(dev)
    b.compare(
        "norm_rope", f"rms_norm [{t}, {d}] bf16", "rms_norm", (x, weight, 1e-6), torch.bfloat16
    )
    pos = torch.arange(t, device=dev, dtype=torch.float32)[:, None]
    ang = pos * 1e6 ** (-torch.arange(0, r, 2, device=dev, dtype=torch.float32) / r)
    cos, sin = ang.cos(), ang.sin()
    for shape, interleaved, what in (
        ((t, s.heads, r), True, "q_pe"),
        ((t, r), True, "k_pe"),
        ((t, s.index_heads, r), False, "indexer q"),
    ):
        xr = randn(*shape, device=dev, seed=17)
        b.compare(
            "norm_rope",
            f"rope {what} {list(shape)} {'interleaved' if interleaved else 'half'} bf16",
            "rope",
            (xr, cos, sin, interleaved),
            torch.bfloat16,
        )


def mla(b: Bench, s: Sizes) -> None:
    dev, t, heads, kv_lora, rope = b.device, s.decode_batches[0], s.heads, 512, 64
    for what, hidden, q_lora, nope in (
        ("DeepSeek-V3.2 widths", 7168, 1536, 128),
        ("GLM-5 widths", s.hidden, 2048, 192),
    ):

        def weight(*shape: int, seed: int) -> torch.Tensor:
            return randn(*shape, device=dev, scale=shape[-1] ** -0.5, seed=seed)

        angle = randn(t, rope // 2, dtype=torch.float32, device=dev, scale=3.0, seed=26)
        args = (
            randn(t, hidden, device=dev, seed=20),
            weight(q_lora, hidden, seed=21),
            1 + randn(q_lora, device=dev, scale=0.1, seed=22),
            weight(heads * (nope + rope), q_lora, seed=23),
            weight(heads, nope, kv_lora, seed=24),
            weight(kv_lora + rope, hidden, seed=25),
            1 + randn(kv_lora, device=dev, scale=0.1, seed=27),
            angle.cos(),
            angle.sin(),
            1e-6,
        )
        gemms = hidden * (q_lora + kv_lora + rope) + q_lora * heads * (nope + rope)
        packed = [quantize_tensor(args[i], "int8_row", 1) for i in (1, 3, 5)]
        w8a8 = (*args[:1], packed[0][0], args[2], packed[1][0], args[4], packed[2][0], *args[6:])
        for scheme, call in (("bf16", args), ("W8A8", (*w8a8, *(s for _, s in packed)))):
            b.compare(
                "mla",
                f"mla_prolog {what} {scheme} T={t} H={heads}",
                "mla_prolog",
                call,
                torch.bfloat16,
                flops=2.0 * t * (gemms + heads * nope * kv_lora),
            )


RUNNERS = {
    "attention": attention,
    "indexer": indexer,
    "moe": moe,
    "quant": quant,
    "norm_rope": norm_rope,
    "mla": mla,
}


def render(b: Bench, markdown: bool) -> str:
    rows = [
        (
            "section",
            "case",
            "served by",
            "ascend ms (p20-p80)",
            "generic ms",
            "speedup",
            "TFLOPS",
            "max rel err",
        )
    ]
    for r in b.rows:
        if "ascend_ms" in r:
            rows.append(
                (
                    r["section"],
                    r["name"],
                    r["served_by"],
                    f"{r['ascend_ms']:.3f} ({r['ascend_p20_ms']:.3f}-{r['ascend_p80_ms']:.3f})",
                    f"{r['generic_ms']:.3f}",
                    f"{r['speedup_vs_generic']:.2f}x",
                    f"{r['tflops']:.1f}" if "tflops" in r else "",
                    f"{r['max_rel_vs_generic']:.1e}" + ("" if r["agrees"] else " DISAGREES"),
                )
            )
        else:
            failed = "FAILED" if "error" in r else ""
            rows.append(
                (
                    r["section"],
                    r["name"],
                    r["served_by"],
                    failed,
                    f"{r['generic_ms']:.3f}",
                    "",
                    "",
                    "",
                )
            )
    out = (markdown_table if markdown else table)(rows)
    fallbacks = [f"{r['name']}: {r['fallback']}" for r in b.rows if "fallback" in r]
    if fallbacks:
        out += "\n\nNot served by ascend:\n" + "\n".join(fallbacks)
    errors = [f"{r['name']}: {r['error']}" for r in b.rows if "error" in r]
    if errors:
        out += "\n\nFailed on ascend:\n" + "\n".join(errors)
    return out


def main(argv: list[str] | None = None) -> int:
    parser, args = common.bench_args(
        __doc__,
        SECTIONS,
        "ascend",
        "tiny shapes on the CPU against the emulated torch_npu ops",
        argv,
    )
    if args.smoke:
        device, sizes = torch.device("cpu"), SMOKE_SIZES
    else:
        try:
            import torch_npu  # noqa: F401  (registers the npu device)
        except ImportError as err:
            parser.error(f"torch_npu is not importable ({err}): run with --smoke for the emulator")
        if not torch.npu.is_available():
            parser.error("torch_npu found no NPU: run with --smoke for the emulator")
        device, sizes = torch.device("npu"), NPU_SIZES
    bench = Bench(device, args.smoke)
    print(
        f"ascend backend vs generic on {bench.device_name}"
        f"{' (smoke: emulated torch_npu ops, timings meaningless)' if args.smoke else ''}"
    )
    common.run_sections(bench, RUNNERS, args.only, sizes)
    print(render(bench, args.markdown))
    payload = {
        "environment": {**environment(), "device": bench.device_name},
        "smoke": args.smoke,
        "sizes": sizes.__dict__,
        "rows": bench.rows,
    }
    common.save(args.out, payload)
    failed = [r["name"] for r in bench.rows if r.get("agrees") is False or "error" in r]
    if failed:
        print("adapters failing or disagreeing with generic: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
