"""Load test of the token-in-token-out gateway (``glmport rl serve``) on loopback.

The gateway runs as it is served: uvicorn on 127.0.0.1 (a free port) in front of
``--workers`` rollout-worker Ray actors (a local Ray instance) holding the tiny GLM-5
(seed 0). ``C`` concurrent httpx clients (each ``--clients`` value) send ``--requests``
requests in all, as multi-turn agent sessions: a session starts from a prompt of
``--prompt-tokens`` (256) and each of its ``--turns`` (4) turns appends the previous
output and 4 "tool" tokens, then asks for ``--max-new-tokens`` (8) sampled tokens
(temperature 1, a seed per request).

Two cases side by side, in interleaved rounds (round ``i`` of each is sample ``i``):

- ``sessions``: a turn continues its session, so the worker reuses its KV cache;
- ``fresh``: the same requests with a new ``session_id`` each (no reuse: every request
  prefills its whole context).

Each round checks that every request was answered exactly once (the echoed
``request_id`` set equals the sent one, no duplicates, all HTTP 200) and that each
session stayed on one worker. Reported per case: requests/s and tokens/s (median and
spread over rounds), p50 / p99 latency over every request, the share of input tokens
served from the cache.

Run: ``python bench/gateway_load.py`` (about a minute on 2 cores); writes
``bench/results/gateway_load.json`` (``--out PATH`` elsewhere) and prints the table.
``--smoke --out PATH``: 2 clients, 8 requests, one round (timings mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, save, spread, table

from glmport.model import GlmMoeDsaForCausalLM
from glmport.rl.gateway import running_server, start_ray_pool
from glmport.rl.gateway_app import create_app
from glmport.rl.ray_runtime import ray_session

TOOL_TOKENS = 4
CASES = ("sessions", "fresh")


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def one_round(
    url: str,
    case: str,
    clients: int,
    requests: int,
    turns: int,
    prompt_tokens: int,
    new_tokens: int,
    tag: str,
) -> dict:
    """``requests`` requests from ``clients`` concurrent clients; returns what came back."""
    import httpx

    async def client(c: int, http: httpx.AsyncClient) -> list[dict]:
        mine = list(range(c, requests, clients))
        done, context, session = [], [], ""
        for k, r in enumerate(mine):
            if k % turns == 0:  # a new session
                session = f"{tag}-c{c}-s{k // turns}"
                rng = random.Random(1000 * c + k)  # the same prompts in every case and round
                context = [rng.randrange(128) for _ in range(prompt_tokens)]
            body = {
                "input_ids": context,
                "session_id": session if case == "sessions" else f"{tag}-r{r}",
                "request_id": f"{tag}-r{r}",
                "max_new_tokens": new_tokens,
                "temperature": 1.0,
                "seed": r,
            }
            start = time.perf_counter()
            reply = await http.post("/generate", json=body)
            latency = time.perf_counter() - start
            data = reply.json() if reply.status_code == 200 else {}
            done.append({"body": body, "status": reply.status_code, "data": data, "s": latency})
            if data:
                context = [*context, *data["output_ids"], *range(1, TOOL_TOKENS + 1)]
        return done

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(client(c, http) for c in range(clients)))
        seconds = time.perf_counter() - start
    done = [x for xs in per_client for x in xs]
    sent = [x["body"]["request_id"] for x in done]
    echoed = Counter(x["data"].get("request_id") for x in done if x["data"])
    workers: dict[str, set[int]] = {}
    for x in done:
        if x["data"]:
            workers.setdefault(x["body"]["session_id"], set()).add(x["data"]["worker"])
    return {
        "seconds": seconds,
        "latencies": [x["s"] for x in done],
        "statuses": dict(Counter(x["status"] for x in done)),
        "exactly_once": set(echoed) == set(sent) and set(echoed.values()) == {1},
        "pinned": all(len(w) == 1 for w in workers.values()),
        "new_tokens": sum(len(x["data"].get("output_ids", [])) for x in done),
        "input_tokens": sum(len(x["body"]["input_ids"]) for x in done),
        "cached_tokens": sum(x["data"].get("cached_tokens", 0) for x in done),
    }


def summarize(case: str, clients: int, rounds: list[dict]) -> dict:
    latencies = [s for r in rounds for s in r["latencies"]]
    n = len(rounds[0]["latencies"])
    return {
        "case": case,
        "clients": clients,
        "requests_per_round": n,
        "requests_per_s": spread([n / r["seconds"] for r in rounds]),
        "tokens_per_s": spread([r["new_tokens"] / r["seconds"] for r in rounds]),
        "latency_p50_ms": 1000 * percentile(latencies, 0.5),
        "latency_p99_ms": 1000 * percentile(latencies, 0.99),
        "cache_reuse": sum(r["cached_tokens"] for r in rounds)
        / sum(r["input_tokens"] for r in rounds),
        "exactly_once": all(r["exactly_once"] for r in rounds),
        "sessions_pinned": all(r["pinned"] for r in rounds),
        "statuses": dict(sum((Counter(r["statuses"]) for r in rounds), Counter())),
        "round_seconds": [r["seconds"] for r in rounds],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 clients, 8 requests, 1 round")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default gateway_load.json)")
    parser.add_argument("--workers", type=int, default=2, help="rollout-worker Ray actors")
    parser.add_argument("--clients", default="1,8", help="comma-separated concurrent clients")
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--turns", type=int, default=4, help="requests per session")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="a session's prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case")
    args = parser.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--clients takes comma-separated ints, got {args.clients!r}")
    for name in ("workers", "requests", "turns", "prompt_tokens", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.clients or min(args.clients) < 1:
        parser.error(f"--clients takes counts >= 1, got {args.clients}")
    if args.smoke:
        if args.out is None or args.out.resolve().is_relative_to(RESULTS):
            parser.error("--smoke needs --out PATH outside bench/results (timings mean nothing)")
        args.clients, args.requests, args.repeats = [2], 8, 1
    args.out = args.out or RESULTS / "gateway_load.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the driver only serves HTTP; the workers compute
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    results: dict[tuple[str, int], list[dict]] = {}
    load_before = os.getloadavg()
    with ray_session(num_cpus=os.cpu_count() or 1):
        pool = start_ray_pool(model, 0, workers=args.workers)
        try:
            with running_server(create_app(pool)) as url:
                run = args.requests, args.turns, args.prompt_tokens, args.max_new_tokens
                asyncio.run(one_round(url, "sessions", max(args.clients), *run, "warmup"))
                for i in range(args.repeats):
                    for clients in args.clients:
                        for case in CASES:
                            tag = f"{case}-{clients}-{i}"
                            print(f"round {i + 1}/{args.repeats}: {tag}", flush=True)
                            result = asyncio.run(one_round(url, case, clients, *run, tag))
                            results.setdefault((case, clients), []).append(result)
        finally:
            pool.close()
    rows = [summarize(case, clients, r) for (case, clients), r in results.items()]
    payload = {
        "command": "python bench/gateway_load.py" + (" --smoke" if args.smoke else ""),
        "smoke": args.smoke,
        "model": "tiny GLM-5 (seed 0), fp32, generic backend",
        "workers": args.workers,
        "requests_per_round": args.requests,
        "turns_per_session": args.turns,
        "prompt_tokens": args.prompt_tokens,
        "tool_tokens_per_turn": TOOL_TOKENS,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        # Other work on the machine shows in the spread: its 1/5/15-minute load averages.
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cases": rows,
    }
    import fastapi
    import httpx
    import ray
    import uvicorn

    stack = {m.__name__: m.__version__ for m in (ray, fastapi, uvicorn, httpx)}
    save(args.out, {"environment": {**environment(), **stack}, **payload})
    print_table(payload)
    ok = all(r["exactly_once"] and r["sessions_pinned"] for r in rows)
    return 0 if ok else 1


def print_table(p: dict) -> None:
    print(
        f"\nGateway on loopback, {p['workers']} Ray workers, {p['requests_per_round']} requests "
        f"per round ({p['turns_per_session']}-turn sessions, {p['prompt_tokens']}-token prompts, "
        f"{p['max_new_tokens']} new tokens); "
        f"medians of {p['repeats']} interleaved rounds (min-max); load average "
        f"{p['load_average_before'][0]:.1f} before, {p['load_average_after'][0]:.1f} after"
    )
    rows = [
        ("case", "clients", "req/s", "min-max", "tokens/s", "p50 ms", "p99 ms", "reuse", "once")
    ]
    for r in p["cases"]:
        rps, tps = r["requests_per_s"], r["tokens_per_s"]
        once = "yes" if r["exactly_once"] and r["sessions_pinned"] else "NO"
        rows.append((
            r["case"], r["clients"], f"{rps['median']:.1f}", f"{rps['min']:.1f}-{rps['max']:.1f}",
            f"{tps['median']:.0f}", f"{r['latency_p50_ms']:.0f}", f"{r['latency_p99_ms']:.0f}",
            f"{r['cache_reuse']:.2f}", once,
        ))  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    raise SystemExit(main())
