"""Benchmarks of the tiny GLM-5 on this CPU (generic backend), side by side in one run.

1. Decode tokens/s at contexts 1K / 8K / 32K with DSA (index_topk 256) against dense
   attention (the same weights with index_topk >= the context), and prefill throughput
   (chunked prefill of 2048 tokens per step; dense prefill at 32K is skipped: O(T^2)).
2. MTP speculative decoding against plain greedy: tokens/s and mean acceptance length,
   with the random tiny weights and with an MTP layer made to agree with the model.
3. Quantised (W4A8 experts + W8A8 projections, and FP8-block) against fp32 weight memory
   for the tiny model (measured) and GLM-5 (from the parameter shapes on meta).

Run: ``python bench/model.py`` (a few minutes on 2 cores); ``--quick`` for a smoke run.
Writes ``bench/results/model.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import table, write

import glmport
from glmport.core.formats import SCHEMES
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.generation import generate
from glmport.model.quantize import quantize_model

DSA_TOPK = 256
PREFILL_CHUNK, DECODE_STEPS, BLOCK = 2048, 32, 64


def tiny_model() -> GlmMoeDsaForCausalLM:
    cfg = GlmMoeDsaConfig.tiny(index_topk=DSA_TOPK, max_position_embeddings=1 << 16)
    return GlmMoeDsaForCausalLM.from_config(cfg, seed=0).eval()


def prefill(model, cache, seq, ids: list[int]) -> float:
    """Chunked prefill; returns seconds."""
    start = time.perf_counter()
    for i in range(0, len(ids), PREFILL_CHUNK):
        forward_cached(model, cache, [seq], [ids[i : i + PREFILL_CHUNK]], last_only=True)
    return time.perf_counter() - start


def decode_rate(model, cache, seq, steps: int) -> float:
    """Greedy decode steps per second on a filled cache."""
    token = 1
    start = time.perf_counter()
    for _ in range(steps):
        out = forward_cached(model, cache, [seq], [[token]], last_only=True)
        token = int(out.logits.argmax(-1)[0])
    return steps / (time.perf_counter() - start)


def context_bench(model, contexts, steps, dense_prefill_max) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in contexts:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        blocks = -(-(n + steps + 1) // BLOCK)
        row = {"context": n}
        # Dense: a top-k as wide as every visible key (wider would only add -1 slots).
        for mode, topk in (("dsa", DSA_TOPK), ("dense", n + steps + 1)):
            model.config.index_topk = topk
            cache = PagedKVCache.for_config(
                model.config, model.config.num_hidden_layers, blocks, BLOCK
            )
            seq = cache.add_sequence()
            if mode == "dense" and n > dense_prefill_max:
                # Decode cost depends on the context length, not on how the cache was
                # filled: fill it the DSA way, decode densely.
                model.config.index_topk = DSA_TOPK
                prefill(model, cache, seq, ids)
                model.config.index_topk = topk
            else:
                row[f"{mode}_prefill_tok_per_s"] = n / prefill(model, cache, seq, ids)
            row[f"{mode}_decode_tok_per_s"] = decode_rate(model, cache, seq, steps)
        model.config.index_topk = DSA_TOPK
        rows.append(row)
    return rows


def agreeing_mtp(model: GlmMoeDsaForCausalLM) -> GlmMoeDsaForCausalLM:
    """A copy whose MTP layer predicts what the main model will (its attention and MLP
    outputs zeroed, ``eh_proj`` passing the embedding, embeddings dominant)."""
    m = copy.deepcopy(model)
    mtp, h = m.model.mtp_layers[0], m.config.hidden_size
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(3.0)
        mtp.embed_tokens.weight.copy_(m.model.embed_tokens.weight)
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, :h] = torch.eye(h)
        mtp.self_attn.o_proj.weight.zero_()
        mtp.mlp.experts.down_proj.zero_()
        mtp.mlp.shared_experts.down_proj.weight.zero_()
    return m


def speculative_bench(model, new_tokens: int) -> list[dict]:
    prompts = [[3, 17, 42, 5, 9, 11, 64, 2]]
    rows = []
    for name, m in (("random weights", model), ("agreeing MTP", agreeing_mtp(model))):
        plain = generate(m, prompts, new_tokens)
        spec = generate(m, prompts, new_tokens, speculative=True)
        assert spec.output_ids == plain.output_ids  # the same text, faster or not
        rows.append({
            "model": name,
            "plain_tok_per_s": plain.tokens_per_s,
            "speculative_tok_per_s": spec.tokens_per_s,
            "speedup": spec.tokens_per_s / plain.tokens_per_s,
            "acceptance_length": spec.acceptance_length,
        })  # fmt: skip
    return rows


def _scheme_bytes(numel_rows: int, cols: int, scheme: str, group: int = 128) -> float:
    """Bytes of a packed ``[rows, cols]`` weight and its fp32 scales."""
    s = SCHEMES[scheme]
    per_value = 0.5 if s.weight.storage == torch.uint8 else 1.0
    if s.weight.granularity == "row":
        scales = numel_rows
    elif s.weight.granularity == "group":
        scales = numel_rows * cols / group
    else:
        scales = (numel_rows / 128) * (cols / 128)
    return numel_rows * cols * per_value + 4 * scales


def glm5_memory(experts: str, dense: str) -> dict:
    """GLM-5 weight bytes in bf16 against the scheme, from the meta model's shapes.

    What stays float follows glmport.model.quantize: embeddings, norms, heads, the
    router, the indexer's weights_proj and kv_b_proj."""
    model = GlmMoeDsaForCausalLM.from_config("glm5", device="meta")
    before = after = 0.0
    for name, p in model.named_parameters():
        before += 2 * p.numel()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, cols = p.shape
            after += e * _scheme_bytes(rows, cols, experts)
        elif p.dim() == 2 and name.endswith(".weight") and not any(
            k in name for k in ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.",
                                "weights_proj", "kv_b_proj", "norm")
        ):  # fmt: skip
            after += _scheme_bytes(p.shape[0], p.shape[1], dense)
        else:
            after += 2 * p.numel()
    return {"bf16_gib": before / 2**30, "quantised_gib": after / 2**30, "saving": before / after}


def memory_bench() -> dict:
    out = {}
    for experts, dense in (("w4a8", "w8a8"), ("fp8_block", "fp8_block")):
        model = tiny_model()
        report = quantize_model(model, experts=experts, dense=dense, group_size=32)
        out[f"{experts}+{dense}"] = {
            "tiny_fp32_mib": report.bytes_before / 2**20,
            "tiny_quantised_mib": report.bytes_after / 2**20,
            "tiny_saving": report.saving,
            "tiny_expert_saving": report.expert_saving,
            "glm5": glm5_memory(experts, dense),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short contexts, few tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    contexts = (256, 1024) if args.quick else (1024, 8192, 32768)
    model = tiny_model()
    results: dict = {"command": "python bench/model.py", "backend": "generic"}
    with glmport.use_backend("generic"):
        context_bench(model, (64,), 2, 64)  # warm-up: first-call costs are not throughput
        results["contexts"] = context_bench(
            model, contexts, 4 if args.quick else DECODE_STEPS, 8192
        )
        results["speculative"] = speculative_bench(model, 16 if args.quick else 64)
    results["memory"] = memory_bench()

    print("1. Tiny GLM-5 decode and prefill, tokens/s (generic; DSA index_topk 256 vs dense)")
    rows = [("context", "DSA decode", "dense decode", "DSA prefill", "dense prefill")]
    for r in results["contexts"]:
        dense_prefill = r.get("dense_prefill_tok_per_s")
        rows.append((
            r["context"],
            f"{r['dsa_decode_tok_per_s']:.1f}",
            f"{r['dense_decode_tok_per_s']:.1f}",
            f"{r['dsa_prefill_tok_per_s']:.0f}",
            "skipped" if dense_prefill is None else f"{dense_prefill:.0f}",
        ))  # fmt: skip
    print(table(rows))
    print("\n2. MTP speculative vs plain greedy (identical output)")
    print(table([("model", "plain tok/s", "speculative tok/s", "speedup", "acceptance")] + [
        (r["model"], f"{r['plain_tok_per_s']:.1f}", f"{r['speculative_tok_per_s']:.1f}",
         f"{r['speedup']:.2f}x", f"{r['acceptance_length']:.2f}") for r in results["speculative"]
    ]))  # fmt: skip
    print("\n3. Weight memory, quantised vs float")
    print(table([("schemes", "tiny fp32 MiB", "quantised", "saving", "GLM-5 bf16 GiB",
                  "quantised", "saving")] + [
        (k, f"{v['tiny_fp32_mib']:.2f}", f"{v['tiny_quantised_mib']:.2f}",
         f"{v['tiny_saving']:.2f}x", f"{v['glm5']['bf16_gib']:.0f}",
         f"{v['glm5']['quantised_gib']:.0f}", f"{v['glm5']['saving']:.2f}x")
        for k, v in results["memory"].items()
    ]))  # fmt: skip
    path = write("model", results)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
