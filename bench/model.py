"""Benchmarks of the tiny GLM-5 on this CPU (generic backend), side by side in one run.

1. Decode and prefill at contexts 1K / 8K / 32K: DSA (index_topk 256: the indexer
   scores every visible key, the attention reads the 256 it keeps) against real dense
   attention on the same weights and paged cache: each layer's absorbed MLA attention
   over every visible latent row by ``F.scaled_dot_product_attention`` (torch's fused
   CPU attention; the heads folded into query rows, as multi-query attention), no
   indexer scoring. That is the dense model a user would run: it is
   what ``transformers``' own sdpa path computes when no key is masked, without
   glmport's gather of every slot. The two are checked to give the same logits when
   DSA's top-k covers every key. Decode: greedy steps on one cache filled by a DSA
   prefill, DSA and dense in turns (a 64 MiB buffer written between steps, so neither
   finds the other's cache rows cached). Prefill: chunks of 2048 tokens into fresh
   caches, DSA and dense in turns.
2. MTP speculative decoding against plain greedy: tokens/s and mean acceptance length,
   with the random tiny weights and with an MTP layer made to agree with the model.
3. Quantised (W4A8 experts + W8A8 projections, and FP8-block) against fp32 weight memory
   for the tiny model (measured) and GLM-5 (from the parameter shapes on meta).

Sections 1 and 2 report median, interquartile range and min..max at 1 and 2 torch
threads. Run: ``python bench/model.py`` (about 15 minutes on 2 cores); ``--quick`` for a
smoke run (short contexts, 1 thread; writes only with ``--out``). Writes
``bench/results/model.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, flush_caches, save, spread, table

import glmport
from glmport.core.formats import SCHEMES
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.attention import Attention
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.generation import generate
from glmport.model.quantize import quantize_model

DSA_TOPK = 256
PREFILL_CHUNK, BLOCK = 2048, 64


def tiny_model() -> GlmMoeDsaForCausalLM:
    cfg = GlmMoeDsaConfig.tiny(index_topk=DSA_TOPK, max_position_embeddings=1 << 16)
    return GlmMoeDsaForCausalLM.from_config(cfg, seed=0).eval()


# -- Dense attention: the same weights, every visible key, torch's fused SDPA ---------


# Query rows per SDPA call in a prefill chunk, so that the causal mask stays ~16M entries.
MASK_ENTRIES = 1 << 24


def _dense_attend_latent(
    self: Attention,
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    slots: torch.Tensor,
    rope_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Attention.attend_latent`` as dense attention: query ``i`` attends the first
    ``count_i`` visible slots (slots ``[T, K]`` list each query's causal keys in order,
    ``-1`` past them; one sequence per step, as this benchmark runs). The absorbed form
    has one key / value row per token shared by every head (multi-query attention), so
    the heads are folded into query rows of one SDPA call: a single shared key stream,
    which SDPA's ``enable_gqa`` runs several times slower here. Prefill chunks go in
    query blocks with a causal mask of at most ``MASK_ENTRIES``."""
    c = self.config
    counts = (slots >= 0).sum(dim=1)
    widest = int(counts.argmax())
    n = int(counts[widest])
    keys = slots[widest, :n].long()
    first = int(keys[0])
    if int(keys[-1]) - first == n - 1:  # one run of physical slots: a view, no gather
        kv = latent_cache[first : first + n]
        rope = None if rope_cache is None else rope_cache[first : first + n]
    else:
        kv = latent_cache.index_select(0, keys)
        rope = None if rope_cache is None else rope_cache.index_select(0, keys)
    if rope is not None:  # SDPA takes one key tensor: the cache's pools side by side
        kv = torch.cat((kv, rope), dim=-1)
    _, w_uv = self._kv_up()
    t, h = q.shape[0], q.shape[1]
    k, v = kv[None, None], kv[None, None, :, : c.kv_lora_rank]
    if bool((counts == n).all()):  # decode: every query sees every key
        out = F.scaled_dot_product_attention(q.reshape(1, 1, t * h, -1), k, v, scale=self.scale)
        out = out.view(t, h, -1)
    else:
        out = q.new_empty(t, h, c.kv_lora_rank)
        block = max(1, MASK_ENTRIES // (h * n))
        for t0 in range(0, t, block):
            t1 = min(t, t0 + block)
            seen = int(counts[t0:t1].max())
            rows = counts[t0:t1].repeat_interleave(h)
            mask = torch.arange(seen, device=slots.device)[None, :] < rows[:, None]
            out[t0:t1] = F.scaled_dot_product_attention(
                q[t0:t1].reshape(1, 1, (t1 - t0) * h, -1),
                k[:, :, :seen],
                v[:, :, :seen],
                attn_mask=mask,
                scale=self.scale,
            ).view(t1 - t0, h, -1)
    out = torch.einsum("thc,hvc->thv", out, w_uv)
    return self.o_proj(out.reshape(t, -1))


@contextlib.contextmanager
def attention(model: GlmMoeDsaForCausalLM, mode: str, context: int) -> Iterator[None]:
    """Run ``model`` as DSA (``"dsa"``) or dense (``"dense"``: top-k wider than every
    context, so the indexer does not score, and SDPA attention) inside the block."""
    saved = model.config.index_topk
    if mode == "dense":
        model.config.index_topk = context  # >= every visible key: no scoring
        Attention.attend_latent = _dense_attend_latent
    try:
        yield
    finally:
        model.config.index_topk = saved
        Attention.attend_latent = _ATTEND_LATENT


_ATTEND_LATENT = Attention.attend_latent


def new_cache(model, tokens: int) -> tuple[PagedKVCache, int]:
    cache = PagedKVCache.for_config(
        model.config, model.config.num_hidden_layers, -(-tokens // BLOCK), BLOCK
    )
    return cache, cache.add_sequence()


def prefill(model, cache, seq, ids: list[int]) -> float:
    """Chunked prefill; returns seconds."""
    start = time.perf_counter()
    for i in range(0, len(ids), PREFILL_CHUNK):
        forward_cached(model, cache, [seq], [ids[i : i + PREFILL_CHUNK]], last_only=True)
    return time.perf_counter() - start


def decode_step(model, cache, seq, token: int) -> tuple[float, int]:
    """One greedy decode step on a filled cache: its seconds and the next token."""
    flush_caches()
    start = time.perf_counter()
    out = forward_cached(model, cache, [seq], [[token]], last_only=True)
    seconds = time.perf_counter() - start
    return seconds, int(out.logits.argmax(-1)[0])


def dense_agreement(model, n: int) -> float:
    """max |dense SDPA - DSA with a top-k covering every key| / max |logit| for one
    decode step after a prefill of ``n`` tokens: the baseline computes the same model."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
    cache, seq = new_cache(model, n + 2)
    with attention(model, "dense", n + 2):
        prefill(model, cache, seq, ids)
        twin = copy.deepcopy(cache)
        dense = forward_cached(model, cache, [seq], [[1]], last_only=True).logits
    saved = model.config.index_topk
    model.config.index_topk = n + 2
    try:
        gathered = forward_cached(model, twin, [seq], [[1]], last_only=True).logits
    finally:
        model.config.index_topk = saved
    return float((dense - gathered).abs().max() / gathered.abs().max())


def context_bench(model, n: int, decode_steps: int, prefill_repeats: int) -> dict:
    """DSA against dense at context ``n``: prefill rates (tokens/s) over
    ``prefill_repeats`` rounds in turns, and decode rates over ``decode_steps`` steps
    in turns on one cache filled by a DSA prefill."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
    total = n + 2 * decode_steps + 2
    prefill_s: dict[str, list[float]] = {"dsa": [], "dense": []}
    for _ in range(prefill_repeats):
        for mode in ("dsa", "dense"):
            cache, seq = new_cache(model, total)
            with attention(model, mode, total):
                prefill_s[mode].append(prefill(model, cache, seq, ids))
            if mode == "dsa":
                filled = cache, seq
    if not prefill_repeats:
        filled = new_cache(model, total)
        with attention(model, "dsa", total):
            prefill(model, *filled, ids)
    cache, seq = filled
    decode_s: dict[str, list[float]] = {"dsa": [], "dense": []}
    token = 1
    for _ in range(decode_steps):
        for mode in ("dsa", "dense"):
            with attention(model, mode, total):
                seconds, token = decode_step(model, cache, seq, token)
            decode_s[mode].append(seconds)
    row: dict = {"context": n, "decode_steps": decode_steps, "prefill_rounds": prefill_repeats}
    for mode in ("dsa", "dense"):
        row[f"{mode}_decode_tok_per_s"] = spread([1 / s for s in decode_s[mode]])
        if prefill_s[mode]:
            row[f"{mode}_prefill_tok_per_s"] = spread([n / s for s in prefill_s[mode]])
    row["dsa_over_dense_decode"] = (
        row["dsa_decode_tok_per_s"]["median"] / row["dense_decode_tok_per_s"]["median"]
    )
    if prefill_s["dsa"]:
        row["dsa_over_dense_prefill"] = (
            row["dsa_prefill_tok_per_s"]["median"] / row["dense_prefill_tok_per_s"]["median"]
        )
    return row


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


def speculative_bench(models: dict[str, GlmMoeDsaForCausalLM], new_tokens: int, repeats: int):
    """Plain greedy and MTP speculative generation in turns, ``repeats`` times per model."""
    prompts = [[3, 17, 42, 5, 9, 11, 64, 2]]
    rows = []
    for name, m in models.items():
        rates: dict[str, list[float]] = {"plain": [], "speculative": []}
        acceptance = None
        for _ in range(repeats):
            plain = generate(m, prompts, new_tokens)
            spec = generate(m, prompts, new_tokens, speculative=True)
            assert spec.output_ids == plain.output_ids  # the same text, faster or not
            rates["plain"].append(plain.tokens_per_s)
            rates["speculative"].append(spec.tokens_per_s)
            acceptance = spec.acceptance_length
        plain_s, spec_s = spread(rates["plain"]), spread(rates["speculative"])
        rows.append({
            "model": name,
            "plain_tok_per_s": plain_s,
            "speculative_tok_per_s": spec_s,
            "speedup": spec_s["median"] / plain_s["median"],
            "acceptance_length": acceptance,
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


def _rate(d: dict, digits: int = 1) -> str:
    lo, hi = d["iqr"]
    return f"{d['median']:.{digits}f} [{lo:.{digits}f}..{hi:.{digits}f}]"


def print_contexts(run: dict) -> None:
    print(f"1. Tiny GLM-5, {run['threads']} thread(s): tokens/s, median [IQR] "
          "(generic; DSA index_topk 256 vs dense SDPA attention)")  # fmt: skip
    rows = [("context", "DSA decode", "dense decode", "DSA / dense", "DSA prefill",
             "dense prefill", "DSA / dense")]  # fmt: skip
    for r in run["contexts"]:
        pre = "dsa_prefill_tok_per_s" in r
        rows.append((
            r["context"],
            _rate(r["dsa_decode_tok_per_s"]),
            _rate(r["dense_decode_tok_per_s"]),
            f"{r['dsa_over_dense_decode']:.2f}x",
            _rate(r["dsa_prefill_tok_per_s"], 0) if pre else "not run",
            _rate(r["dense_prefill_tok_per_s"], 0) if pre else "not run",
            f"{r['dsa_over_dense_prefill']:.2f}x" if pre else "",
        ))  # fmt: skip
    print(table(rows))


def print_speculative(run: dict) -> None:
    print(f"\n2. MTP speculative vs plain greedy, {run['threads']} thread(s) (identical output)")
    print(table([("model", "plain tok/s", "speculative tok/s", "speedup", "acceptance")] + [
        (r["model"], _rate(r["plain_tok_per_s"]), _rate(r["speculative_tok_per_s"]),
         f"{r['speedup']:.2f}x", f"{r['acceptance_length']:.2f}") for r in run["speculative"]
    ]))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short contexts, few tokens")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--out", type=Path, help="result file (default bench/results/model.json)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.quick:
        plan = {256: 1, 1024: 1}  # context: prefill rounds
        threads, steps, new_tokens, spec_repeats = [1], 4, 16, 1
    else:
        plan = {1024: 5, 8192: 3, 32768: 1}
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
        steps, new_tokens, spec_repeats = 32, 64, 5
    model = tiny_model()
    models = {"random weights": model, "agreeing MTP": agreeing_mtp(model)}
    results: dict = {
        "command": "python bench/model.py" + (" --quick" if args.quick else ""),
        "backend": "generic",
        "dense_baseline": "absorbed MLA over every visible latent row by "
        "F.scaled_dot_product_attention; no indexer scoring",
        "decode_steps": steps,
        "prefill_rounds": {str(n): r for n, r in plan.items()},
        "runs": [],
    }
    with glmport.use_backend("generic"):
        results["dense_vs_dsa_all_keys_max_rel_error"] = err = dense_agreement(model, 300)
        print(f"dense SDPA vs DSA with every key: logits max rel error {err:.1e}")
        if not err < 1e-4:
            raise SystemExit(f"the dense baseline computes another model: {err:.1e}")
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            context_bench(model, 64, 2, 1)  # warm-up: first-call costs are not throughput
            run = {
                "threads": n_threads,
                "contexts": [context_bench(model, n, steps, r) for n, r in plan.items()],
                "speculative": speculative_bench(models, new_tokens, spec_repeats),
            }
            results["runs"].append(run)
            print_contexts(run)
            print_speculative(run)
    results["memory"] = memory_bench()
    print("\n3. Weight memory, quantised vs float")
    print(table([("schemes", "tiny fp32 MiB", "quantised", "saving", "GLM-5 bf16 GiB",
                  "quantised", "saving")] + [
        (k, f"{v['tiny_fp32_mib']:.2f}", f"{v['tiny_quantised_mib']:.2f}",
         f"{v['tiny_saving']:.2f}x", f"{v['glm5']['bf16_gib']:.0f}",
         f"{v['glm5']['quantised_gib']:.0f}", f"{v['glm5']['saving']:.2f}x")
        for k, v in results["memory"].items()
    ]))  # fmt: skip
    out = args.out or (None if args.quick else RESULTS / "model.json")
    if out is not None:
        save(out, {"environment": environment(), **results})


if __name__ == "__main__":
    main()
