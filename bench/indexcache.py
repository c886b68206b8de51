"""IndexCache on the tiny GLM-5: every layer running its own indexer against a 1-in-4
pattern (F S S S F S S S), same weights, side by side in one run.

The model is ``GlmMoeDsaConfig.tiny`` with 8 decoder layers and ``index_topk`` 64, so
that at contexts of 2048 / 4096 / 8192 tokens the indexer really selects (it scores every
visible key, the attention reads the 64 it keeps). The 1-in-4 model is the same config
with ``index_topk_freq=4, index_skip_topk_offset=1`` (transformers' derivation; the
default offset 2 gives F F S S S F S S) and the full model's weights less its shared
layers' indexers.

Measured at 1 and 2 torch threads, both models in turns (``interleaved_samples``):
prefill tokens/s of one sequence into a fresh paged cache (chunks of 2048 tokens), and
decode tokens/s of greedy single-token steps on the paged cache after that prefill
(only the steps timed; a 64 MiB buffer written between steps). The indexer's share of
each timed call is the wall time inside ``Indexer.keys`` and ``Indexer.select`` (which
includes the indexer's queries and the ``lightning_indexer`` top-k), timed by wrappers
this script installs, over the call's wall time; the calls are counted too. The models'
log-probabilities over a prompt are compared for information (the 1-in-4 model computes
something else). Run: ``python bench/indexcache.py`` (about 6.5 minutes on 2 cores);
``--quick`` for a smoke run (writes only with ``--out``). Writes
``bench/results/indexcache.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, interleaved_samples, save, spread, table

import glmport
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.attention import Indexer
from glmport.model.cache import PagedKVCache, forward_cached

LAYERS = 8
PATTERN = {"index_topk_freq": 4, "index_skip_topk_offset": 1}  # F S S S F S S S
PREFILL_CHUNK, BLOCK = 2048, 64


def build_models(index_topk: int, max_context: int) -> dict[str, GlmMoeDsaForCausalLM]:
    """The all-full tiny model and the 1-in-4 one with the same weights (the shared
    layers' indexer tensors dropped, so the load is strict)."""
    base = dict(
        num_hidden_layers=LAYERS, index_topk=index_topk, max_position_embeddings=max_context
    )
    full = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(**base), seed=0).eval()
    shared = GlmMoeDsaForCausalLM.from_config(
        GlmMoeDsaConfig.tiny(**base, extra=dict(PATTERN)), seed=0
    ).eval()
    kept = shared.state_dict().keys()
    shared.load_state_dict({k: v for k, v in full.state_dict().items() if k in kept})
    return {"full": full, "1-in-4": shared}


@dataclass
class IndexerClock:
    """Wall seconds and calls inside the indexer since the last :meth:`take`."""

    seconds: float = 0.0
    calls: int = 0

    def take(self) -> tuple[float, int]:
        """The seconds and ``select`` calls so far, then zero."""
        out = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return out


@contextlib.contextmanager
def clocked_indexer(clock: IndexerClock) -> Iterator[None]:
    """Time ``Indexer.keys`` and ``Indexer.select`` (neither calls the other) into
    ``clock`` inside the block; CPU ops are synchronous, so wall time is their cost."""
    originals = {name: getattr(Indexer, name) for name in ("keys", "select")}

    def timed(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.calls += name == "select"  # one selection per full layer and step

        return wrapper

    for name, fn in originals.items():
        setattr(Indexer, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(Indexer, name, fn)


def new_cache(model: GlmMoeDsaForCausalLM, tokens: int) -> tuple[PagedKVCache, int]:
    """A paged cache for ``tokens`` tokens of one sequence (indexer keys for full layers
    only) and that sequence's id."""
    cache = PagedKVCache.for_config(
        model.config, model.config.num_hidden_layers, -(-tokens // BLOCK), BLOCK
    )
    return cache, cache.add_sequence()


def prefill(model: GlmMoeDsaForCausalLM, cache: PagedKVCache, seq: int, ids: list[int]) -> None:
    """Chunked prefill of ``ids`` into ``cache``."""
    for i in range(0, len(ids), PREFILL_CHUNK):
        forward_cached(model, cache, [seq], [ids[i : i + PREFILL_CHUNK]], last_only=True)


def prompt(n: int, vocab: int) -> list[int]:
    """``n`` random token ids, seeded by ``n`` (both models read the same prompt)."""
    gen = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def measured(
    fns: dict[str, Callable[[], object]], clock: IndexerClock, tokens: int, repeats: int, **kw
) -> dict:
    """Run ``fns`` in turns (``interleaved_samples``) and give per model the tokens/s,
    the indexer's share of each timed call and its ``select`` calls per call; and under
    ``"speedup"`` the 1-in-4 model's tokens/s over the full one's, round by round (the
    two run back to back in a round, so machine noise hits the pair alike)."""
    taken: dict[str, list[tuple[float, int]]] = {name: [] for name in fns}

    def tracked(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            clock.take()
            fn()
            taken[name].append(clock.take())

        return run

    samples = interleaved_samples({k: tracked(k, f) for k, f in fns.items()}, repeats, **kw)
    out = {}
    for name, seconds in samples.items():
        inside = taken[name][1:]  # the first run is interleaved_samples' warm-up
        out[name] = {
            "tok_per_s": spread([tokens / s for s in seconds]),
            "indexer_share": spread([i / s for (i, _), s in zip(inside, seconds, strict=True)]),
            "indexer_calls": statistics.median(c for _, c in inside),
        }
    pairs = zip(samples["full"], samples["1-in-4"], strict=True)
    out["speedup"] = spread([full / shared for full, shared in pairs])
    return out


def context_bench(models: dict, n: int, steps: int, repeats: int, clock: IndexerClock) -> dict:
    """Prefill (``repeats`` rounds) and decode (``steps`` steps) at context ``n``."""
    ids = prompt(n, models["full"].config.vocab_size)
    total = n + steps + 2

    def prefill_fn(model: GlmMoeDsaForCausalLM) -> Callable[[], None]:
        return lambda: prefill(model, *new_cache(model, total), ids)

    pre = measured({k: prefill_fn(m) for k, m in models.items()}, clock, n, repeats)
    caches = {k: new_cache(m, total) for k, m in models.items()}
    tokens = dict.fromkeys(models, 1)
    for k, m in models.items():
        prefill(m, *caches[k], ids)

    def step_fn(name: str) -> Callable[[], None]:
        def step() -> None:
            out = forward_cached(
                models[name], caches[name][0], [caches[name][1]], [[tokens[name]]], last_only=True
            )
            tokens[name] = int(out.logits.argmax(-1)[0])

        return step

    dec = measured({k: step_fn(k) for k in models}, clock, 1, steps, flush=True)
    return {
        "context": n,
        "decode_steps": steps,
        "prefill_rounds": repeats,
        "prefill": pre,
        "decode": dec,
        "prefill_speedup": pre.pop("speedup"),
        "decode_speedup": dec.pop("speedup"),
    }


def logprob_delta(models: dict, n: int) -> dict:
    """Mean and max |log p(full) - log p(1-in-4)| over a prompt of ``n`` tokens (every
    position, whole vocabulary), and how often their argmax agrees."""
    ids = prompt(n, models["full"].config.vocab_size)
    logp = {}
    for k, m in models.items():
        cache, seq = new_cache(m, n)
        logits = forward_cached(m, cache, [seq], [ids]).logits
        logp[k] = torch.log_softmax(logits.float(), dim=-1)
    delta = (logp["full"] - logp["1-in-4"]).abs()
    same = logp["full"].argmax(-1) == logp["1-in-4"].argmax(-1)
    return {
        "tokens": n,
        "mean_abs_delta_logp": float(delta.mean()),
        "max_abs_delta_logp": float(delta.max()),
        "argmax_agreement": float(same.float().mean()),
    }


def _rate(d: dict, digits: int = 0) -> str:
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}..{d['max']:.{digits}f}]"


def _share(d: dict) -> str:
    return f"{100 * d['median']:.0f}% [{100 * d['min']:.0f}..{100 * d['max']:.0f}]"


def _speedup(d: dict) -> str:
    return f"{d['median']:.2f}x [{d['min']:.2f}..{d['max']:.2f}]"


def print_run(run: dict) -> None:
    print(f"\n{run['threads']} thread(s): tokens/s and indexer share, median [min..max]")
    rows = [("context", "phase", "full tok/s", "1-in-4 tok/s", "speedup", "full idx share",
             "1-in-4 idx share", "idx calls full/1-in-4")]  # fmt: skip
    for r in run["contexts"]:
        for phase in ("prefill", "decode"):
            p = r[phase]
            rows.append((
                r["context"], phase, _rate(p["full"]["tok_per_s"], 1 if phase == "decode" else 0),
                _rate(p["1-in-4"]["tok_per_s"], 1 if phase == "decode" else 0),
                _speedup(r[f"{phase}_speedup"]), _share(p["full"]["indexer_share"]),
                _share(p["1-in-4"]["indexer_share"]),
                f"{p['full']['indexer_calls']:g}/{p['1-in-4']['indexer_calls']:g}",
            ))  # fmt: skip
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short contexts, one round")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument(
        "--out", type=Path, help="result file (default bench/results/indexcache.json)"
    )
    parser.add_argument("--note", default="", help="a remark stored with the results")
    args = parser.parse_args()
    if args.quick:
        topk, plan, steps, threads = 16, {256: 1}, 4, [1]
    else:
        topk, plan, steps = 64, {2048: 7, 4096: 5, 8192: 3}, 32
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    models = build_models(topk, 2 * max(plan))
    cfg = models["1-in-4"].config
    results: dict = {
        "command": "python bench/indexcache.py" + (" --quick" if args.quick else ""),
        "backend": "generic",
        "note": args.note,
        "config": {
            "preset": "tiny",
            "num_hidden_layers": LAYERS,
            "index_topk": topk,
            "index_n_heads": cfg.index_n_heads,
            "index_head_dim": cfg.index_head_dim,
            "hidden_size": cfg.hidden_size,
            "pattern_fields": PATTERN,
            "indexer_types": {k: m.config.indexer_types for k, m in models.items()},
            "parameters": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
        },
        "indexer_time": "wall time inside Indexer.keys + Indexer.select (wrappers installed "
        "by the script) over each timed call's wall time",
        "prefill_chunk": PREFILL_CHUNK,
        "runs": [],
    }
    print(f"tiny GLM-5, {LAYERS} layers, index_topk {topk}; indexer_types:")
    for k, m in models.items():
        print(f"  {k:7s} {''.join(t[0].upper() for t in m.config.indexer_types)}")
    clock = IndexerClock()
    with torch.no_grad(), glmport.use_backend("generic"), clocked_indexer(clock):
        results["logprob_delta"] = d = logprob_delta(models, min(plan))
        print(f"full vs 1-in-4 over {d['tokens']} tokens (information, not a check): mean "
              f"|delta log p| {d['mean_abs_delta_logp']:.3g}, max {d['max_abs_delta_logp']:.3g},"
              f" argmax agreement {d['argmax_agreement']:.1%}")  # fmt: skip
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            context_bench(models, 64, 2, 1, clock)  # warm-up: first-call costs
            run = {
                "threads": n_threads,
                "contexts": [context_bench(models, n, steps, r, clock) for n, r in plan.items()],
            }
            results["runs"].append(run)
            print_run(run)
    out = args.out or (None if args.quick else RESULTS / "indexcache.json")
    if out is not None:
        save(out, {"environment": environment(), **results})


if __name__ == "__main__":
    main()
