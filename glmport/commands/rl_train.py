"""``glmport rl train``: synchronous or asynchronous RL (GRPO + IcePop, or on-policy
distillation) on a tiny GLM-5, fresh or resumed, into a run folder."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from glmport.commands import common
from glmport.core.errors import ConfigError

if TYPE_CHECKING:
    from glmport.rl.config import RLConfig


# rl train's flags that set an RLConfig field (by their dest; the field has the same
# name but for _FIELD_OF's). Each defaults to None, not given: a fresh run takes
# RLConfig's default, a resumed one the run's own value.
_RL_FLAGS = (
    "task", "steps", "prompts", "group_size", "minibatches", "lr", "temperature",
    "icepop_beta", "kl_coef", "kl_decay_steps", "normalize_std", "rollout_backend",
    "train_backend", "rollout_dtype", "replay", "opd_teacher", "shuffle_rewards", "init",
    "model", "seed", "checkpoint_every", "eval_every", "mode", "max_staleness",
    "rollout_workers", "async_loss", "publish_every",
)  # fmt: skip
_FIELD_OF = {"prompts": "prompts_per_step", "digits": "task_args"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport rl train`` and its flags (their defaults are RLConfig's)."""
    from glmport.rl.config import DEFAULT_KL_COEF, DEFAULT_LR, DEFAULT_LR_DISTILL, RLConfig
    from glmport.rl.tasks import MAX_DIGITS

    tr = sub.add_parser(
        "train",
        help="GRPO + IcePop (or on-policy distillation) on a tiny GLM-5",
        description="Synchronous RL: rollout on --rollout-backend in --rollout-dtype, "
        "training on --train-backend in fp32, the mismatch between them reported every "
        "step. Asynchronous RL (--mode async): Ray rollout workers on --rollout-backend, "
        "bounded staleness, double-sided importance sampling. Writes metrics.jsonl, "
        "curves.png and checkpoint/ (and ledger.jsonl when async) into --out.",
    )
    d = RLConfig()
    tr.add_argument("--task", choices=("reverse", "add"), default=None, help=f"default: {d.task}")
    tr.add_argument(
        "--digits",
        type=common.integer(1, MAX_DIGITS, "a CPU-sized toy task"),
        default=None,
        help="digits per number (task default)",
    )
    tr.add_argument("--steps", type=int, default=None, help=f"RL steps (default {d.steps})")
    tr.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    tr.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    tr.add_argument(
        "--minibatches", type=int, default=d.minibatches, help="optimizer steps per rollout"
    )
    tr.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"Adam learning rate ({DEFAULT_LR:g}, {DEFAULT_LR_DISTILL:g} when distilling)",
    )
    tr.add_argument("--temperature", type=float, default=d.temperature, help="rollout temperature")
    tr.add_argument(
        "--icepop-beta", type=float, default=d.icepop_beta, help="IcePop band [1/b, b] (0: off)"
    )
    tr.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help=f"k3 KL to the initial policy ({DEFAULT_KL_COEF:g}, 0 when distilling; GLM-5: 0)",
    )
    tr.add_argument(
        "--kl-decay-steps",
        type=int,
        default=d.kl_decay_steps,
        help=f"steps over which the KL coefficient decays linearly to a fifth ({d.kl_decay_steps}; "
        "0: constant)",
    )
    tr.add_argument(
        "--normalize-std",
        action=argparse.BooleanOptionalAction,
        default=d.normalize_std,
        help="divide GRPO advantages by the group's std (GLM-5: no)",
    )
    tr.add_argument("--rollout-backend", default=None, help="default: the selection")
    tr.add_argument("--train-backend", default=None, help="default: the selection")
    tr.add_argument("--rollout-dtype", choices=("fp32", "bf16", "fp16"), default=d.rollout_dtype)
    tr.add_argument(
        "--replay",
        default="",
        help="rollout choices the training forward replays: routing, indices or both "
        "(comma-separated)",
    )
    tr.add_argument("--opd-teacher", default=None, help="checkpoint folder: distil it")
    tr.add_argument("--init", default=None, help="checkpoint folder to start the policy from")
    tr.add_argument("--shuffle-rewards", action="store_true", help="control: permuted rewards")
    tr.add_argument(
        "--model",
        type=_overrides,
        default={},
        help="tiny GLM-5 overrides, e.g. index_topk=4,hidden_size=96",
    )
    tr.add_argument("--out", required=True, help="run folder")
    tr.add_argument(
        "--seed", type=common.seed, default=d.seed, help=f"-2**63 to 2**64-1 ({d.seed})"
    )
    tr.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints"
    )
    tr.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between greedy evaluations on held-out prompts (0: none)",
    )
    tr.add_argument(
        "--mode",
        choices=("sync", "async"),
        default=d.mode,
        help="sync: rollout then training each step; async: Ray rollout workers sample "
        "continuously, training takes groups up to --max-staleness versions old",
    )
    tr.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help=f"async: policy versions a trained group may lag ({d.max_staleness})",
    )
    tr.add_argument(
        "--rollout-workers",
        type=int,
        default=d.rollout_workers,
        help=f"async: Ray rollout workers ({d.rollout_workers})",
    )
    tr.add_argument(
        "--async-loss",
        choices=("dsis", "pg"),
        default=d.async_loss,
        help="async: dsis, direct double-sided importance sampling (GLM-5), or pg, plain "
        "policy gradient (the control)",
    )
    tr.add_argument(
        "--publish-every",
        type=int,
        default=d.publish_every,
        help="async: policy versions between weight updates of the rollout workers "
        f"({d.publish_every})",
    )
    tr.add_argument(
        "--ray-address",
        default=None,
        help="async: join this Ray cluster (default: start a local instance)",
    )
    tr.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="async: torch threads per rollout worker (default: cores / workers)",
    )
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=run, **dict.fromkeys(_RL_FLAGS))


def _overrides(text: str) -> dict:
    """``key=value,...`` model config overrides; values are ints, floats or words."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value pairs, got {item!r}")
        for kind in (int, float):
            try:
                out[key.strip()] = kind(raw)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


def _async_options(args: argparse.Namespace) -> dict:
    """The asynchronous trainer's runtime options given on the command line."""
    given = {"ray_address": args.ray_address, "worker_threads": args.worker_threads}
    return {k: v for k, v in given.items() if v is not None}


def _rl_settings(args: argparse.Namespace) -> dict:
    """The RLConfig fields the command line gives (flags left out are absent)."""
    given = {
        _FIELD_OF.get(d, d): getattr(args, d) for d in _RL_FLAGS if getattr(args, d) is not None
    }
    if "icepop_beta" in given:
        given["icepop_beta"] = given["icepop_beta"] or None  # 0: IcePop off
    if "replay" in given:
        given["replay"] = tuple(filter(None, given["replay"].split(",")))
    if args.digits is not None:
        given["task_args"] = {"digits": args.digits}
    return given


def _flag(field: str) -> str:
    """The rl train flag that sets RLConfig ``field``."""
    dest = next((d for d, f in _FIELD_OF.items() if f == field), field)
    return "--" + dest.replace("_", "-")


def _resume_changes(given: dict, saved: RLConfig) -> list[str]:
    """The flags in ``given`` whose values differ from the resumed run's ``saved``
    config (``--steps`` aside, which may change), as ``--flag VALUE (the run: V)``."""
    from glmport.rl.tasks import make_task

    changed = []
    for field, value in given.items():
        old = getattr(saved, field)
        if field == "task_args":  # compare the tasks: {"digits": 3} is the default's {}
            same = vars(make_task(saved.task, **value)) == vars(make_task(saved.task, **old))
        else:
            same = value == old or (field == "replay" and tuple(value) == tuple(old))
        if field != "steps" and not same:
            changed.append(f"{_flag(field)} {value!r} (the run: {old!r})")
    return changed


def run(args: argparse.Namespace) -> int:
    """``glmport rl train``: a fresh or resumed run; prints the last step's metrics."""
    from glmport.core.extras import require
    from glmport.rl.checkpoint import read_state
    from glmport.rl.config import ASYNC_FIELDS, RLConfig
    from glmport.rl.run import train
    from glmport.rl.trainer import CHECKPOINT

    common.check_environment()
    common.check_out(args.out, "--out")
    for flag, name in (
        ("--rollout-backend", args.rollout_backend),
        ("--train-backend", args.train_backend),
    ):
        with common.select_backend(name, flag):  # unknown or unavailable: said now, as the flag's
            pass
    given = _rl_settings(args)
    options = _async_options(args)
    if args.resume:
        saved = read_state(os.path.join(args.out, CHECKPOINT)).config
        changed = _resume_changes(given, saved)
        if changed:
            raise ConfigError(
                f"--resume continues the run in {args.out} with its own settings; only "
                f"--steps may change, and {'; '.join(changed)} differ"
            )
        mode = saved.mode
    else:
        mode = given.get("mode", RLConfig.mode)
    if mode != "async":
        extra = [_flag(f) for f in ASYNC_FIELDS if f in given] + [
            "--" + k.replace("_", "-") for k in options
        ]
        if extra:
            raise ConfigError(f"{', '.join(extra)}: options of --mode async (this run: {mode})")
    # curves.png, the progress bar and the asynchronous trainer's workers, before any work.
    needs = ("matplotlib", *(() if args.quiet else ("rich",)))
    require("glmport rl train", *needs, *(("ray",) if mode == "async" else ()))
    if args.resume:
        records = train(
            None,
            args.out,
            resume=True,
            steps=given.get("steps"),
            progress=not args.quiet,
            options=options,
        )
    else:
        config = RLConfig(**given)
        records = train(config, args.out, progress=not args.quiet, options=options)
    if records:
        last = records[-1]
        keys = ("step", "reward", "mismatch_mean", "pop_fraction", "reverse_kl")
        print("  ".join(f"{k} {last[k]:.4g}" for k in keys if last.get(k) is not None))
    print(f"run folder: {args.out} (metrics.jsonl, curves.png, checkpoint/)")
    return 0
