"""glmport against transformers on the same saved checkpoint, side by side in one run:
prefill time, greedy decode tokens/s and prefill peak memory, at 1 and 2 threads.

What a user comparing glmport with what they already run would measure. One random
GLM-5-shaped model (``CONFIG``: hidden 256, 3 layers (the first dense), 8 experts
top-2, 8 heads, indexer 8 x 64, index top-k 256, vocab 4096) is saved once as a
transformers checkpoint; glmport's ``GlmMoeDsaForCausalLM.from_pretrained`` and
transformers' ``GlmMoeDsaForCausalLM.from_pretrained(attn_implementation="sdpa",
dtype=float32)`` load it. glmport runs on the default backend (``auto``).

1. Prefill: one forward over a prompt of ``L`` tokens, batch 1, no grad: glmport
   ``model(ids)``; transformers ``model(ids, use_cache=False)`` (no cache to build:
   its fastest prefill). Interleaved rounds, the CPU caches flushed before each timed
   call; median and spread.
2. Greedy decode: after a cached prefill of the prompt, rounds of ``--new-tokens``
   greedy steps, each side continuing its own sequence (glmport ``forward_cached`` on
   a paged cache; transformers forward steps on its ``DynamicCache``: the loop inside
   ``generate`` without its per-step processors), interleaved; tokens/s.
3. Peak memory of one prefill over the loaded model, in a fresh process per case
   (Linux peak RSS), 1 thread.
4. Agreement, once per length: max |logit difference|, and the same with glmport
   replaying transformers' discrete choices (its indexer's top-k and its experts,
   through glmport's choice tape): exact or near ties in the indexer scores or the
   router let the two pick different keys or experts, which the report counts (rows
   whose selection differs, per layer: the first layer's inputs are identical on both
   sides, so its differences are rounding-level near ties; later layers add their
   consequences) instead of hiding; the greedy tokens of the first decode round are
   compared too.

Run: ``python bench/vs_transformers.py`` (about 20 minutes on 2 cores; transformers'
prefill at 8192 dominates); ``--quick`` for a smoke run (lengths 300, one round, one
thread; its timings mean nothing and go to ``--out``, never to bench/results).
Writes ``bench/results/vs_transformers.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import (
    RESULTS,
    environment,
    interleaved_samples,
    markdown_table,
    peak_since_reset_mib,
    reset_peak,
    save,
    spread,
)

from glmport.core.selection import primary_backend
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.choices import Choices, choice_tape

CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=8,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=256,
    max_position_embeddings=16384,
)
BLOCK = 64  # paged-cache block size for glmport's decode


def save_checkpoint(folder: Path) -> None:
    """The random model (seed 0) as a transformers checkpoint in ``folder``."""
    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(**CONFIG), seed=0)
    model.save_pretrained(folder)


def load(folder: Path) -> tuple[GlmMoeDsaForCausalLM, torch.nn.Module]:
    """glmport's and transformers' models from the same checkpoint, eval mode, fp32."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    ours = GlmMoeDsaForCausalLM.from_pretrained(folder).eval()
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    return ours, hf


def prompt(length: int) -> torch.Tensor:
    """``[1, length]`` int64 seeded random token ids."""
    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, CONFIG["vocab_size"], (1, length), generator=gen)


@torch.no_grad()
def ours_prefill(model: GlmMoeDsaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


@torch.no_grad()
def hf_prefill(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids, use_cache=False).logits


class OursDecoder:
    """Greedy decoding on a paged cache, continued round after round."""

    def __init__(self, model: GlmMoeDsaForCausalLM, ids: torch.Tensor, capacity: int) -> None:
        self.model = model
        c = model.config
        self.cache = PagedKVCache.for_config(c, c.num_hidden_layers, -(-capacity // BLOCK), BLOCK)
        self.seq = self.cache.add_sequence()
        with torch.no_grad():
            out = forward_cached(model, self.cache, [self.seq], [ids[0]], last_only=True)
        self.token = int(out.logits[0].argmax())

    @torch.no_grad()
    def steps(self, n: int) -> list[int]:
        tokens = []
        for _ in range(n):
            tokens.append(self.token)
            out = forward_cached(self.model, self.cache, [self.seq], [[self.token]], last_only=True)
            self.token = int(out.logits[0].argmax())
        return tokens


class HfDecoder:
    """Greedy decoding with transformers' ``DynamicCache``, continued round after round."""

    def __init__(self, hf: torch.nn.Module, ids: torch.Tensor) -> None:
        self.hf = hf
        with torch.no_grad():
            out = hf(ids, use_cache=True)
        self.past = out.cache
        self.token = int(out.logits[0, -1].argmax())

    @torch.no_grad()
    def steps(self, n: int) -> list[int]:
        tokens = []
        for _ in range(n):
            tokens.append(self.token)
            ids = torch.tensor([[self.token]])
            out = self.hf(ids, cache=self.past, use_cache=True)
            self.past = out.cache
            self.token = int(out.logits[0, -1].argmax())
        return tokens


def hf_choices(hf: torch.nn.Module, ids: torch.Tensor, config: GlmMoeDsaConfig) -> Choices:
    """transformers' indexer selections (as key positions, ``-1`` for a masked future
    key or padding) and routed experts of one prefill over ``ids [1, L]``."""
    picked: dict[int, list[torch.Tensor]] = {"indices": [], "experts": []}
    hooks = []
    for layer in hf.model.layers[: config.num_hidden_layers]:
        hooks.append(
            layer.self_attn.indexer.register_forward_hook(
                lambda _m, _a, out: picked["indices"].append(out[0])
            )
        )
        if hasattr(layer.mlp, "gate"):
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda _m, _a, out: picked["experts"].append(out[2])
                )
            )
    try:
        hf_prefill(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    length = ids.shape[1]
    rows = []
    for indices in picked["indices"]:  # [L, min(topk, L)] positions, futures included
        visible = indices <= torch.arange(length)[:, None]
        positions = torch.where(visible, indices, -1).to(torch.int32)
        pad = config.index_topk - positions.shape[1]
        rows.append(torch.nn.functional.pad(positions, (0, pad), value=-1))
    experts = torch.stack([e.to(torch.int16) for e in picked["experts"]])
    return Choices(experts, torch.stack(rows))


def differing_rows(ours: torch.Tensor, theirs: torch.Tensor) -> list[int]:
    """Per layer, the rows whose chosen sets differ: ``[layers, L, K]`` each, order
    within a row ignored."""
    a, b = ours.sort(dim=-1).values, theirs.sort(dim=-1).values
    return (a != b).any(dim=-1).sum(dim=1).tolist()


def agreement(ours: GlmMoeDsaForCausalLM, hf: torch.nn.Module, length: int) -> dict:
    """Logit agreement at ``length``: free-running and with transformers' choices."""
    ids = prompt(length)
    with choice_tape(ours) as tape:
        free = ours_prefill(ours, ids)
    recorded = tape.recorded()[0]
    reference = hf_prefill(hf, ids)
    theirs = hf_choices(hf, ids, ours.config)
    with choice_tape(ours, replay=[theirs]):
        replayed = ours_prefill(ours, ids)
    return {
        "length": length,
        "max_abs_logit_diff": float((free - reference).abs().max()),
        "max_abs_logit_diff_replaying_hf_choices": float((replayed - reference).abs().max()),
        "indexer_rows_differing": differing_rows(recorded.indices, theirs.indices),
        "indexer_rows": int(recorded.indices.shape[0] * recorded.indices.shape[1]),
        "routing_rows_differing": differing_rows(recorded.experts, theirs.experts),
        "routing_rows": int(recorded.experts.shape[0] * recorded.experts.shape[1]),
    }


def timing_row(case: str, length: int, threads: int, samples: dict[str, list[float]]) -> dict:
    ours, hf = spread(samples["glmport"]), spread(samples["transformers"])
    return {
        "case": case,
        "length": length,
        "threads": threads,
        "glmport_s": samples["glmport"],
        "transformers_s": samples["transformers"],
        **{f"glmport_{k}_s": v for k, v in ours.items()},
        **{f"transformers_{k}_s": v for k, v in hf.items()},
        "speedup": hf["median"] / ours["median"],
    }


def bench_length(ours, hf, length: int, threads: int, args) -> tuple[dict, dict]:
    """Prefill and decode rows for one prompt length at ``threads`` threads."""
    torch.set_num_threads(threads)
    ids = prompt(length)
    prefill = interleaved_samples(
        {"glmport": lambda: ours_prefill(ours, ids), "transformers": lambda: hf_prefill(hf, ids)},
        args.repeats,
        flush=True,
    )
    capacity = length + args.new_tokens * (args.repeats + 2)
    decoders = {"glmport": OursDecoder(ours, ids, capacity), "transformers": HfDecoder(hf, ids)}
    first = {name: d.steps(args.new_tokens) for name, d in decoders.items()}  # the warm-up
    decode = interleaved_samples(
        {name: (lambda d=d: d.steps(args.new_tokens)) for name, d in decoders.items()},
        args.repeats,
        flush=True,
    )
    decode_row = timing_row("decode", length, threads, decode)
    decode_row["new_tokens_per_round"] = args.new_tokens
    decode_row["first_round_tokens_agree"] = sum(
        a == b for a, b in zip(first["glmport"], first["transformers"], strict=True)
    )
    return timing_row("prefill", length, threads, prefill), decode_row


def memory_case(folder: Path, impl: str, length: int) -> float:
    """Peak MiB one prefill adds over the loaded model (run in a fresh process)."""
    torch.set_num_threads(1)
    ours, hf = load(folder)
    ids = prompt(length)
    base = reset_peak()
    if impl == "glmport":
        ours_prefill(ours, ids)
    else:
        hf_prefill(hf, ids)
    return peak_since_reset_mib() - base


def measure_memory(folder: Path, impl: str, length: int) -> float:
    proc = subprocess.run(
        [sys.executable, __file__, "--memory", impl, str(length), str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.strip().splitlines()[-1])


def report(payload: dict) -> str:
    lines = []
    for case, unit in (("prefill", "s"), ("decode", "tokens/s")):
        rows = [("L", "threads", f"glmport {unit}", f"transformers {unit}", "glmport speedup")]
        for r in payload[case]:
            # Decode rounds are timed: report tokens/s (min and max swap).
            per = r.get("new_tokens_per_round")
            cells = []
            for impl in ("glmport", "transformers"):
                med, lo, hi = (r[f"{impl}_{k}_s"] for k in ("median", "min", "max"))
                if per:
                    med, lo, hi = per / med, per / hi, per / lo
                digits = 1 if per else 3
                cells.append(f"{med:.{digits}f} [{lo:.{digits}f}..{hi:.{digits}f}]")
            rows.append((r["length"], r["threads"], *cells, f"{r['speedup']:.2f}x"))
        lines += [f"**{case}** (median [min..max])", "", markdown_table(rows), ""]
    rows = [("L", "glmport MiB", "transformers MiB", "glmport / transformers")]
    for r in payload["memory"]:
        rows.append((
            r["length"],
            f"{r['glmport_mib']:.0f}",
            f"{r['transformers_mib']:.0f}",
            f"{r['glmport_mib'] / r['transformers_mib']:.2f}x",
        ))  # fmt: skip
    lines += ["**prefill peak memory** (added over the loaded model)", "", markdown_table(rows), ""]
    rows = [("L", "max abs diff", "replaying HF's choices", "indexer rows differing (per layer)",
             "routing rows differing (per MoE layer)")]  # fmt: skip
    for r in payload["agreement"]:
        rows.append((
            r["length"],
            f"{r['max_abs_logit_diff']:.2e}",
            f"{r['max_abs_logit_diff_replaying_hf_choices']:.2e}",
            f"{' + '.join(map(str, r['indexer_rows_differing']))} / {r['indexer_rows']}",
            f"{' + '.join(map(str, r['routing_rows_differing']))} / {r['routing_rows']}",
        ))  # fmt: skip
    lines += ["**logits against transformers**", "", markdown_table(rows)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192", help="comma-separated prompt lengths")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps per round")
    parser.add_argument("--quick", action="store_true", help="a smoke run (needs --out)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument(
        "--memory", nargs=3, metavar=("IMPL", "LENGTH", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.memory:
        return args
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        args.threads = [int(x) for x in args.threads.split(",") if x.strip()]
    except ValueError:
        parser.error("--lengths and --threads take comma-separated ints")
    if (
        not args.lengths
        or min(args.lengths) < 2
        or max(args.lengths) > CONFIG["max_position_embeddings"] - 512
    ):
        parser.error(f"--lengths must lie in [2, {CONFIG['max_position_embeddings'] - 512}]")
    if not args.threads or min(args.threads) < 1:
        parser.error("--threads takes thread counts >= 1")
    if args.repeats < 1 or args.new_tokens < 1:
        parser.error("--repeats and --new-tokens must be >= 1")
    if args.quick:
        if args.out is None:
            parser.error("--quick needs --out (smoke timings never go to bench/results)")
        args.lengths, args.threads, args.repeats, args.new_tokens = [300], [1], 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory:
        impl, length, folder = args.memory
        print(memory_case(Path(folder), impl, int(length)))
        return 0
    out = args.out or RESULTS / "vs_transformers.json"
    payload: dict = {
        "environment": environment(),
        "backend": primary_backend(),
        "config": CONFIG,
        "repeats": args.repeats,
        "prefill": [],
        "decode": [],
        "memory": [],
        "agreement": [],
    }
    default_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(Path(folder))
        ours, hf = load(Path(folder))
        for length in args.lengths:
            torch.set_num_threads(1)
            payload["agreement"].append(agreement(ours, hf, length))
            for threads in args.threads:
                print(f"[L={length}, {threads} thread{'s' if threads > 1 else ''}]", flush=True)
                prefill, decode = bench_length(ours, hf, length, threads, args)
                payload["prefill"].append(prefill)
                payload["decode"].append(decode)
            mib = {
                impl: measure_memory(Path(folder), impl, length)
                for impl in ("glmport", "transformers")
            }
            payload["memory"].append({"length": length, **{f"{k}_mib": v for k, v in mib.items()}})
    torch.set_num_threads(default_threads)
    save(out, payload)
    print(report(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
