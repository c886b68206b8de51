"""Kill a rollout worker in the middle of an asynchronous RL run and show, from the run's
ledger of group ids, that no group was lost, none was trained twice, and training went on.

Run: ``python examples/async_rl_worker_kill.py [--steps 30] [--kill-at 10] [--out DIR]``
(about a minute on 2 cores). It trains the reversal task with 2 Ray rollout workers,
kills worker 0 with ``ray.kill`` (Ray restarts it) after ``--kill-at`` steps while it
has groups in flight, trains on to ``--steps``, audits ``DIR/ledger.jsonl`` and prints
what happened to the killed worker's groups.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import ray

from glmport.rl.async_trainer import AsyncTrainer
from glmport.rl.staleness import GroupLedger, audit
from glmport.rl.trainer import RLConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temp one)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="glmport-kill-"))
    config = RLConfig(
        task="reverse",
        steps=args.steps,
        prompts_per_step=8,
        group_size=8,
        mode="async",
        max_staleness=4,
        rollout_workers=2,
        eval_every=0,
        seed=1,
    )
    rewards = []
    with AsyncTrainer(config, out) as trainer:
        while trainer.step_index < args.kill_at:
            rewards.append(trainer.step()["reward"])
        victim = sorted(
            g.group_id for specs, i in trainer._in_flight.values() if i == 0 for g in specs
        )
        mark = len(trainer.ledger.records)
        killed = time.perf_counter()
        ray.kill(trainer.workers[0], no_restart=False)
        back = None
        while trainer.step_index < config.steps:
            rewards.append(trainer.step()["reward"])
            later = trainer.ledger.records[mark:]
            if back is None and any(r["event"] == "returned" and r["worker"] == 0 for r in later):
                back = time.perf_counter() - killed
    records = GroupLedger.read(out / "ledger.jsonl")
    counts = audit(records)  # raises if a group was trained twice or lost
    after = records[mark:]
    fate = {
        g: [r["event"] for r in after if r["group"] == g and r["event"] != "dispatched"]
        for g in victim
    }
    report = {
        "steps": config.steps,
        "killed_after_step": args.kill_at,
        "groups_in_flight_on_killed_worker": victim,
        "their_events_after_the_kill": fate,
        "ledger_counts": counts,
        "groups_trained": counts["trained"],
        "expected_trained": config.steps * config.prompts_per_step,
        "worker_sampling_again_after_s": back,
        "reward_first_5_steps": sum(rewards[:5]) / 5,
        "reward_last_5_steps": sum(rewards[-5:]) / 5,
        "ledger": str(out / "ledger.jsonl"),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
