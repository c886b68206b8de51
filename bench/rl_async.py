"""Asynchronous RL's rollout throughput on this CPU: pools of 1, 2 and 4 Ray rollout
workers against the in-process batched ``generate`` a synchronous run makes, side by
side in one run; then the synchronous and the asynchronous trainer end to end.

The policy is ``policy_config(make_task("reverse"), {})`` (seed 0, 3-digit prompts of 4
tokens, 3 new tokens) on the generic backend with the default (full) validation; the
rollout is a fixed set of 32 prompts x 8 samples (GRPO groups of 8), sampled at
temperature 1 with the same weights throughout.

1. Pools: W = 1, 2, 4 Ray actors (``rollout_actor``), each with torch threads
   ``max(1, cores // W)``, holding policy version 0 from the object store. The groups
   go out in calls of ``--groups-per-call`` groups (dealt round-robin to the workers),
   all submitted, then gathered: tokens / wall seconds of submit-to-last-result. The
   pools are started once (not timed) and all stay up; they take turns, so their
   actors reserve no Ray CPUs.
2. Baseline: the same 256 sequences in one batched
   ``generate(..., return_logprobs=True)`` call in this process (what
   ``Trainer.step()`` does), at torch 1 and 2 threads. Each row's ``vs_baseline`` is
   its median tokens/s over each baseline's median. The same in process in the pools'
   calls (``generate_calls``) shows what the splitting alone costs, without Ray.

   Every case of 1 and 2 runs once untimed (the pools' first call loads the weights),
   then all run in turns (round ``i`` of each is sample ``i``).
3. End to end, with ``RLConfig`` defaults otherwise (32 x 8, 2 minibatches, generic
   rollout and training, no evaluation), the trainers at ``--trainer-threads`` torch
   threads (default: every core):
   ``Trainer.step()`` and ``AsyncTrainer.step()`` (2 workers, max staleness 4), one
   warm-up step (Ray and the workers start in it) then ``--steps`` timed steps each,
   synchronous first: seconds per step (median, spread), train steps/s (timed steps
   over their total seconds), and the asynchronous run's staleness (mean and max over
   the trained groups) and interrupted / stale / failed rollouts. The JSON also keeps
   each step's ``rollout_tokens_per_s`` metric, which the two trainers define apart
   (synchronous: over the rollout phase; asynchronous: tokens sampled between two
   step ends over that time), so the table leaves it out.

Run: ``python bench/rl_async.py`` (a few minutes on 2 cores); writes
``bench/results/rl_async.json`` (``--out PATH`` elsewhere) and prints the tables.
``--smoke --out PATH``: 4 prompts x 2, one group per call, W = 1, 2, one repeat, two
timed steps of 4 x 2 at one trainer thread (timings mean nothing; never written to
``bench/results``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, interleaved_samples, save, spread, table

import glmport
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.generation import generate
from glmport.rl.async_trainer import AsyncTrainer
from glmport.rl.ray_runtime import ray_session, rollout_actor
from glmport.rl.tasks import Problem, make_task
from glmport.rl.trainer import RLConfig, Trainer, policy_config
from glmport.rl.workers import GroupSampling, GroupSpec, Interrupted

BACKEND = "generic"
TASK = "reverse"
TEMPERATURE = 1.0
VERSION = 0  # the policy version every pool samples with
ROLLOUT_SEED = 1


class Pool:
    """``workers`` rollout actors holding the policy; :meth:`rollout` samples the
    groups ``specs`` in calls of ``per_call`` groups and returns the tokens sampled."""

    def __init__(
        self, workers: int, model_config: dict, sampling: GroupSampling, cores: int
    ) -> None:
        self.threads = max(1, cores // workers)
        actor = rollout_actor(num_cpus=0)  # pools take turns: none reserves a CPU
        self.actors = [
            actor.remote(
                model_config, backend=BACKEND, threads=self.threads, index=i, sampling=sampling
            )
            for i in range(workers)
        ]

    def rollout(self, specs: list[GroupSpec], per_call: int, weights: ray.ObjectRef) -> int:
        calls = [specs[i : i + per_call] for i in range(0, len(specs), per_call)]
        refs = [
            self.actors[i % len(self.actors)].rollout.remote(call, VERSION, [weights])
            for i, call in enumerate(calls)
        ]
        tokens, groups = 0, 0
        for result in ray.get(refs):
            if isinstance(result, Interrupted):  # nothing publishes: cannot happen
                raise RuntimeError(f"a rollout of worker {result.worker} was interrupted")
            tokens += sum(g.tokens for g in result)
            groups += len(result)
        if groups != len(specs):
            raise RuntimeError(f"{groups} groups came back of {len(specs)} sent")
        return tokens

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


def baseline_rollout(
    policy: GlmMoeDsaForCausalLM, prompts: list[list[int]], new: int, per_call: int
) -> int:
    """The synchronous trainer's rollout in this process: batched generation with
    log-probs, ``per_call`` prompts per call (all of them: one call); returns the tokens
    sampled."""
    tokens = 0
    with glmport.use_backend(BACKEND), torch.no_grad():
        for i in range(0, len(prompts), per_call):
            result = generate(
                policy,
                prompts[i : i + per_call],
                new,
                greedy=False,
                temperature=TEMPERATURE,
                seed=ROLLOUT_SEED + i,
                return_logprobs=True,
            )
            tokens += sum(len(o) for o in result.output_ids)
    return tokens


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def rate_row(name: str, kind: str, workers: int, threads: int, tokens: int, seconds) -> dict:
    rates = [tokens / t for t in seconds]
    return {
        "name": name,
        "kind": kind,
        "workers": workers,
        "threads": threads,
        "tokens": tokens,
        "samples_s": seconds,
        "tokens_per_s": rates,
        **{f"{k}_tokens_per_s": v for k, v in spread(rates).items()},
    }


def bench_rollout(args: argparse.Namespace, task, policy, problems: list[Problem]) -> list[dict]:
    """Sections 1 and 2: every pool and baseline, interleaved ``args.repeats`` times."""
    cores = os.cpu_count() or 1
    specs = [GroupSpec(i, 0, p, ROLLOUT_SEED + i) for i, p in enumerate(problems)]
    prompts = [list(p.prompt) for p in problems for _ in range(args.samples)]
    sampling = GroupSampling(args.samples, task.response_len, TEMPERATURE)
    weights = ray.put({k: v.detach().clone() for k, v in policy.state_dict().items()})
    pools = {w: Pool(w, policy.config.to_dict(), sampling, cores) for w in args.workers}
    tokens: dict[str, int] = {}

    def run_pool(w: int):
        def fn() -> None:
            tokens[f"pool/{w}"] = pools[w].rollout(specs, args.groups_per_call, weights)

        return fn

    # The baseline, and the same in the pools' calls: what splitting alone costs.
    splits = {"generate": len(prompts), "generate_calls": args.groups_per_call * args.samples}

    def run_baseline(kind: str, t: int):
        def fn() -> None:
            torch.set_num_threads(t)
            tokens[f"{kind}/{t}"] = baseline_rollout(
                policy, prompts, task.response_len, splits[kind]
            )

        return fn

    fns = {f"{k}/{t}": run_baseline(k, t) for k in splits for t in args.baseline_threads}
    fns.update({f"pool/{w}": run_pool(w) for w in args.workers})
    default_threads = torch.get_num_threads()
    try:
        samples = interleaved_samples(fns, args.repeats)
    finally:
        torch.set_num_threads(default_threads)
        for pool in pools.values():
            pool.close()
    calls = -(-len(prompts) // splits["generate_calls"])
    names = {"generate": "", "generate_calls": f", {plural(calls, 'call')}"}
    rows = [
        rate_row(
            f"generate + logprobs, in process, {plural(t, 'thread')}{names[k]}",
            k,
            0,
            t,
            tokens[f"{k}/{t}"],
            samples[f"{k}/{t}"],
        )
        for k in splits
        for t in args.baseline_threads
    ]
    rows += [
        rate_row(
            f"{plural(w, 'Ray worker')} x {plural(pools[w].threads, 'thread')}",
            "pool",
            w,
            pools[w].threads,
            tokens[f"pool/{w}"],
            samples[f"pool/{w}"],
        )
        for w in args.workers
    ]
    base = {r["threads"]: r["median_tokens_per_s"] for r in rows if r["kind"] == "generate"}
    for r in rows:
        r["vs_baseline"] = {str(t): r["median_tokens_per_s"] / b for t, b in base.items()}
    return rows


def run_steps(trainer: Trainer, steps: int) -> tuple[dict, list[float], list[dict]]:
    """One warm-up step, then ``steps`` timed ones: the warm-up's metrics, the timed
    steps' seconds and metrics."""
    warmup = trainer.step()
    seconds, metrics = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics.append(trainer.step())
        seconds.append(time.perf_counter() - t0)
    return warmup, seconds, metrics


def step_row(name: str, seconds: list[float], metrics: list[dict]) -> dict:
    rates = [m["rollout_tokens_per_s"] for m in metrics]
    return {
        "name": name,
        "steps": len(seconds),
        "step_s": seconds,
        **{f"{k}_s": v for k, v in spread(seconds).items()},
        "steps_per_s": len(seconds) / sum(seconds),
        "reward": [m["reward"] for m in metrics],
        "rollout_tokens_per_s": rates,
        "median_rollout_tokens_per_s": statistics.median(rates),
    }


COUNTS = ("interrupted", "stale", "failed")


def bench_end_to_end(args: argparse.Namespace) -> dict:
    """Section 3: the synchronous trainer, then the asynchronous one (2 workers)."""
    sync_config = RLConfig(
        task=TASK,
        prompts_per_step=args.prompts,
        group_size=args.samples,
        steps=args.steps + 1,
        eval_every=0,
        rollout_backend=BACKEND,
        train_backend=BACKEND,
    )
    async_config = replace(sync_config, mode="async", rollout_workers=2)
    torch.set_num_threads(args.trainer_threads)
    _, seconds, metrics = run_steps(Trainer(sync_config), args.steps)
    sync = step_row("Trainer.step()", seconds, metrics)
    with AsyncTrainer(async_config) as trainer:
        warmup, seconds, metrics = run_steps(trainer, args.steps)
    asyn = step_row("AsyncTrainer.step(), 2 workers", seconds, metrics)
    asyn.update(
        worker_threads=trainer.worker_threads,
        groups_per_call=trainer.groups_per_call,
        staleness_mean=statistics.fmean(m["staleness_mean"] for m in metrics),
        staleness_max=max(m["staleness_max"] for m in metrics),
        wait_s=[m["wait_seconds"] for m in metrics],
        **{f"{k}_total": int(metrics[-1][f"{k}_total"]) for k in COUNTS},
        **{f"{k}_timed": int(metrics[-1][f"{k}_total"] - warmup[f"{k}_total"]) for k in COUNTS},
    )
    return {
        "trainer_threads": args.trainer_threads,
        "warmup_steps": 1,
        "config": sync_config.to_json(),
        "async_config": {k: getattr(async_config, k) for k in ASYNC_FIELDS},
        "sync": sync,
        "async": asyn,
        "async_vs_sync_steps_per_s": asyn["steps_per_s"] / sync["steps_per_s"],
    }


ASYNC_FIELDS = ("mode", "rollout_workers", "max_staleness", "async_loss", "publish_every")


def int_list(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``text``: comma-separated ints >= 1 (``flag`` names it in the error)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag} takes comma-separated ints, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} takes ints >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="4 prompts x 2, W = 1,2, 1 repeat, 2 steps"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default rl_async.json)")
    parser.add_argument("--workers", default="1,2,4", help="comma-separated pool sizes")
    parser.add_argument("--baseline-threads", default="1,2", help="the baseline's torch threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds of the rollouts")
    parser.add_argument("--groups-per-call", type=int, default=4, help="groups per worker call")
    parser.add_argument("--steps", type=int, default=8, help="timed trainer steps (+1 warm-up)")
    parser.add_argument(
        "--trainer-threads", type=int, default=None, help="torch threads of the trainers (cores)"
    )
    args = parser.parse_args(argv)
    args.workers = int_list(parser, "--workers", args.workers)
    args.baseline_threads = int_list(parser, "--baseline-threads", args.baseline_threads)
    args.trainer_threads = args.trainer_threads or os.cpu_count() or 1
    for flag in ("repeats", "groups_per_call", "steps", "trainer_threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    args.prompts, args.samples = 32, 8
    if args.smoke:
        if args.out is None or args.out.resolve().is_relative_to(RESULTS):
            parser.error(
                "--smoke needs --out PATH outside bench/results (smoke timings mean nothing)"
            )
        args.workers, args.repeats, args.groups_per_call, args.steps = [1, 2], 1, 1, 2
        args.trainer_threads = 1
        args.prompts, args.samples = 4, 2
    args.out = args.out or RESULTS / "rl_async.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = make_task(TASK)
    policy = GlmMoeDsaForCausalLM.from_config(policy_config(task, {}), seed=0)
    problems = task.sample(args.prompts, torch.Generator().manual_seed(0))
    default_threads = torch.get_num_threads()
    with ray_session():
        print("[rollout]", flush=True)
        rollout = bench_rollout(args, task, policy, problems)
        print("[end to end]", flush=True)
        end_to_end = bench_end_to_end(args)
    torch.set_num_threads(default_threads)  # the environment records the process default
    payload = {
        "command": "python bench/rl_async.py" + (" --smoke" if args.smoke else ""),
        "smoke": args.smoke,
        "backend": BACKEND,
        "task": TASK,
        "cores": os.cpu_count(),
        "prompt_tokens": task.prompt_len,
        "new_tokens": task.response_len,
        "groups": {
            "prompts": args.prompts,
            "samples_per_prompt": args.samples,
            "sequences": args.prompts * args.samples,
            "groups_per_call": args.groups_per_call,
            "calls": -(-args.prompts // args.groups_per_call),
        },
        "repeats": args.repeats,
        "workers": args.workers,
        "baseline_threads": args.baseline_threads,
        "ray": ray.__version__,
        "rollout": rollout,
        "end_to_end": end_to_end,
    }
    save(args.out, {"environment": environment(), **payload})
    print_tables(payload)
    return 0


def print_tables(p: dict) -> None:
    g = p["groups"]
    print(
        f"\nRollout: reverse-task policy, {g['prompts']} prompts x {g['samples_per_prompt']} "
        f"({g['sequences']} sequences of {p['prompt_tokens']} + {p['new_tokens']} tokens), "
        f"{BACKEND} backend, pools in calls of {plural(g['groups_per_call'], 'group')}; medians of "
        f"{p['repeats']} interleaved rounds (min-max) on {p['cores']} cores"
    )
    threads = p["baseline_threads"]
    rows = [("rollout", "tokens/s", "min-max", *(f"vs generate {t}T" for t in threads))]
    for r in p["rollout"]:
        rows.append((
            r["name"], f"{r['median_tokens_per_s']:.0f}",
            f"{r['min_tokens_per_s']:.0f}-{r['max_tokens_per_s']:.0f}",
            *(f"{r['vs_baseline'][str(t)]:.2f}x" for t in threads),
        ))  # fmt: skip
    print(table(rows))
    e = p["end_to_end"]
    s, a = e["sync"], e["async"]
    print(
        f"\nEnd to end: {e['config']['prompts_per_step']} x {e['config']['group_size']} per step, "
        f"trainers at {plural(e['trainer_threads'], 'thread')}, {s['steps']} steps after 1 "
        "warm-up"
    )
    rows = [("trainer", "s/step", "min-max", "steps/s")]
    for r in (s, a):
        rows.append((
            r["name"], f"{r['median_s']:.2f}", f"{r['min_s']:.2f}-{r['max_s']:.2f}",
            f"{r['steps_per_s']:.2f}",
        ))  # fmt: skip
    print(table(rows))
    print(
        f"async/sync steps/s {e['async_vs_sync_steps_per_s']:.2f}x; async staleness mean "
        f"{a['staleness_mean']:.2f}, max {a['staleness_max']:.0f} (bound "
        f"{e['async_config']['max_staleness']}); rollouts interrupted {a['interrupted_timed']}, "
        f"stale {a['stale_timed']}, failed {a['failed_timed']} in the timed steps "
        f"({a['interrupted_total']}, {a['stale_total']}, {a['failed_total']} in all)"
    )


if __name__ == "__main__":
    sys.exit(main())
