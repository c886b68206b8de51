"""The train / inference mismatch of RL across backends and dtypes, with and without
replaying the rollout's discrete choices.

Rollout on one backend and dtype (default: generic, bf16), training on another (cpu,
fp32); the same seeded run with replay off, routing only, indices only, and both.
Each run's steps report the mean and max ``|log pi_train(theta_old) - log
pi_rollout(theta_old)|`` over its tokens, the IcePop pop fraction at beta 2 and the
1st / 99th percentiles of rho; the table shows their means over the steps. The
indexer's top-k is set below the sequence length so that DSA really selects
(``--index-topk``).

    python bench/rl_mismatch.py                    # writes bench/results/rl_mismatch.json
    python bench/rl_mismatch.py --steps 2 --out /tmp/m.json   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, save

from glmport.rl.trainer import RLConfig, Trainer

REPLAYS = {
    "none": (),
    "routing": ("routing",),
    "indices": ("indices",),
    "both": ("routing", "indices"),
}
KEYS = ("mismatch_mean", "mismatch_max", "pop_fraction", "rho_p01", "rho_p99")


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for label, replay in REPLAYS.items():
        config = RLConfig(
            task="reverse",
            task_args={"digits": args.digits},
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group_size,
            rollout_backend=args.rollout_backend,
            train_backend=args.train_backend,
            rollout_dtype=args.rollout_dtype,
            replay=replay,
            model={"index_topk": args.index_topk},
            seed=args.seed,
        )
        history = Trainer(config).run()
        row = {"replay": label, "steps": len(history)}
        for key in KEYS:
            values = [h[key] for h in history]
            row[key] = statistics.mean(values)
            row[key + "_per_step"] = values
        row["reward_last"] = history[-1]["reward"]
        rows.append(row)
        print(
            f"{label:>8}: mean |dlogp| {row['mismatch_mean']:.2e}  max |dlogp| "
            f"{row['mismatch_max']:.2e}  pop fraction {row['pop_fraction']:.2e}  rho p01 "
            f"{row['rho_p01']:.4f} p99 {row['rho_p99']:.4f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--digits", type=int, default=8)
    parser.add_argument("--index-topk", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rollout-backend", default="generic")
    parser.add_argument("--train-backend", default="cpu")
    parser.add_argument("--rollout-dtype", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "rl_mismatch.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args)
    save(args.out, {"environment": environment(), "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
