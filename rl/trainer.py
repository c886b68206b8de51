"""The synchronous GRPO + IcePop trainer (GLM-5's reasoning RL) and on-policy distillation.

One step:

1. **Rollout** on the rollout backend and dtype: ``group_size`` samples of each of
   ``prompts_per_step`` task prompts, with each token's log-probability under the
   sampling distribution (``token_logprobs``) and, for replay, the discrete choices
   (routed experts, indexer selections) the rollout made.
2. **Old log-probabilities** recomputed on the training backend (``theta_old``, no
   grad), replaying the recorded choices if asked: their difference from the rollout's
   is the train/inference mismatch IcePop corrects, reported every step.
3. **Updates**: the rollout split into ``minibatches`` (>= 2, so the PPO clip acts),
   each an Adam step with gradient-norm clipping on the GRPO + IcePop loss (or, with a
   teacher, the on-policy distillation advantage).

The rollout policy is a copy of the trained one in the rollout dtype, refreshed after
every step (its ``version`` counts the refreshes). Every random draw of step ``s``
comes from generators seeded by ``(seed, s)``, so a run resumed from a checkpoint
reproduces the uninterrupted run.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import save_file

import glmport
from glmport.core.errors import ConfigError, check_int
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.choices import KINDS
from glmport.model.generation import generate
from glmport.model.sampling import SamplingNames, check_sampling
from glmport.model.scoring import continuation_logprobs
from glmport.model.weights import atomic_folder

from .checkpoint import OPTIMIZER, POLICY, STATE, SavedState, read_state, read_weights
from .losses import (
    KL_KINDS,
    group_advantages,
    grpo_icepop_loss,
    kl_penalty,
    mismatch_stats,
    opd_advantages,
)
from .tasks import Task, make_task, shuffled_rewards
from .workers import DTYPES

CHECKPOINT = "checkpoint"  # the run folder's checkpoint (layout: glmport.rl.checkpoint)
# Adam's learning rate (``lr`` None): distillation's per-token advantages are large
# (log-prob gaps of several nats), so it steps more gently.
DEFAULT_LR = 2e-3
DEFAULT_LR_DISTILL = 5e-4
DEFAULT_KL_COEF = 0.1
# The KL coefficient never decays below this fraction of its start: with none left, a
# near-deterministic policy's rare differing samples drive Adam's steps and undo it.
KL_FLOOR = 0.2
MODES = ("sync", "async")
ASYNC_LOSSES = ("dsis", "pg")
# Per-update statistics averaged over the minibatches into the step's metrics.
UPDATE_STATS = ("clip_fraction", "ppo_kl", "zeroed_fraction", "is_kl", "loss", "grad_norm", "kl")


@dataclass
class RLConfig:
    """Everything that defines a run (saved with each checkpoint).

    The policy is a tiny GLM-5 (:meth:`GlmMoeDsaConfig.tiny` with the task's
    vocabulary and ``model`` overrides) unless ``init`` names a checkpoint folder.
    ``replay``: the kinds of rollout choices the training forward replays
    (``"routing"``, ``"indices"``). ``opd_teacher``: a checkpoint folder; the
    advantage becomes ``sg[log pi_teacher - log pi_train]`` per token (reward unused).
    ``shuffle_rewards``: the control run (rewards permuted across samples).
    ``lr`` None: 2e-3, or 5e-4 when distilling.
    ``eval_every``: steps between greedy evaluations on held-out prompts (0: never;
    also after the last step), reported as ``eval_reward``.
    ``mode``: ``"sync"`` (this module's :class:`Trainer`) or ``"async"``
    (:class:`~glmport.rl.async_trainer.AsyncTrainer`: ``rollout_workers`` Ray actors
    sample continuously, groups at most ``max_staleness`` policy versions old are
    trained with ``async_loss``: ``"dsis"``, direct double-sided importance sampling,
    or ``"pg"``, plain policy gradient, the control); the rollout workers get new
    weights every ``publish_every`` versions (the weight-sync interval: more than 1
    makes their samples older, never beyond ``max_staleness``).

    The defaults learn the toy tasks from random initialisation (docs/rl.md): GLM-5's
    clip and IcePop settings, plus two changes a randomly initialised policy needs —
    a k3 KL to the initial (near-uniform) policy, which keeps it exploring instead of
    collapsing onto a partial answer (``kl_coef`` None: 0.1, or 0 when distilling,
    where the teacher is the anchor), decayed linearly to a fifth of that over
    ``kl_decay_steps`` (0: constant) so the policy can sharpen once it has found the
    answer; and
    advantages divided by the group's std. GLM-5 itself uses neither (``kl_coef=0``,
    ``normalize_std=False``).
    """

    task: str = "reverse"
    task_args: dict = field(default_factory=dict)
    steps: int = 100
    prompts_per_step: int = 32
    group_size: int = 8
    minibatches: int = 2
    lr: float | None = None
    grad_clip: float = 1.0
    temperature: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    icepop_beta: float | None = 2.0
    normalize_std: bool = True
    kl_kind: str = "k3"
    kl_coef: float | None = None
    kl_decay_steps: int = 600
    rollout_backend: str | None = None
    train_backend: str | None = None
    rollout_dtype: str = "fp32"
    replay: tuple[str, ...] = ()
    opd_teacher: str | None = None
    shuffle_rewards: bool = False
    init: str | None = None
    model: dict = field(default_factory=dict)
    seed: int = 0
    checkpoint_every: int = 25
    eval_every: int = 25
    eval_prompts: int = 256
    mode: str = "sync"
    max_staleness: int = 4
    rollout_workers: int = 2
    async_loss: str = "dsis"
    publish_every: int = 1

    def __post_init__(self) -> None:
        self._check_types()
        for name, (low, high) in _COUNTS.items():
            check_int(name, getattr(self, name), low, high)
        if self.group_size < 2 and self.opd_teacher is None:
            raise ConfigError(
                "group_size must be an int >= 2: GRPO's advantage is a sample's reward minus "
                "its group's mean, 0 for a group of 1 (only distillation, opd_teacher, "
                "takes 1)"
            )
        try:
            task = make_task(self.task, **self.task_args)
            if self.init is None:  # the policy's architecture, checked before any work
                policy_config(task, self.model)
        except ConfigError as err:
            raise ConfigError(f"task {self.task!r}, task_args, model: {err}") from err
        samples = self.prompts_per_step * self.group_size
        if samples > MAX_SAMPLES_PER_STEP:
            raise ConfigError(
                f"prompts_per_step x group_size ({self.prompts_per_step} x {self.group_size}) "
                f"exceeds {MAX_SAMPLES_PER_STEP} samples a step"
            )
        length = task.prompt_len + task.response_len
        for what, rows in (("a step's samples", samples), ("eval_prompts", self.eval_prompts)):
            if rows * length > MAX_TOKENS_PER_STEP:
                raise ConfigError(
                    f"{what} ({rows}) x the task's {length} tokens each exceeds "
                    f"{MAX_TOKENS_PER_STEP} tokens (task_args {self.task_args})"
                )
        if self.minibatches > samples:
            raise ConfigError(
                f"minibatches ({self.minibatches}) exceeds the samples per step ({samples})"
            )
        if self.lr is None:
            self.lr = DEFAULT_LR_DISTILL if self.opd_teacher is not None else DEFAULT_LR
        if self.kl_coef is None:
            self.kl_coef = 0.0 if self.opd_teacher is not None else DEFAULT_KL_COEF
        for name, (low, high, closed) in _REALS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            above = _is_number(value) and (low <= value if closed else low < value)
            if not (above and value < high):
                bound = "[" if closed else "("
                raise ConfigError(
                    f"{name} must be a number in {bound}{low}, {high}), got {value!r}"
                )
        # Rollouts sample at it: the range every sampling caller has.
        check_sampling(temperature=self.temperature, names=SamplingNames(greedy=""))
        for name, allowed in (("rollout_dtype", DTYPES), ("kl_kind", KL_KINDS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        unknown = sorted(set(self.replay) - set(KINDS))
        if unknown:
            raise ConfigError(f"unknown replay kinds {unknown}; kinds: {', '.join(KINDS)}")
        if len(set(self.replay)) < len(self.replay):
            raise ConfigError(f"replay names a kind twice: {list(self.replay)}")
        self._check_mode()
        for name in ("opd_teacher", "init"):
            folder = getattr(self, name)
            if folder is not None and not (Path(folder) / "config.json").is_file():
                raise ConfigError(f"{name}: {folder!r} is not a checkpoint folder (no config.json)")

    def _check_types(self) -> None:
        """Every field of the type its annotation says (a JSON list for ``replay``)."""
        if isinstance(self.replay, (list, tuple)):
            self.replay = tuple(self.replay)
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _KINDS.get(f.name)
            if kind is None:  # ints, checked with their ranges; reals with theirs
                continue
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if f.name in _OPTIONAL and value is None:
                ok = True
            elif kind in (dict, tuple) and ok:  # str keys, str kinds
                ok = all(isinstance(k, str) for k in value)
            if not ok:
                want = {str: "a str", bool: "a bool", dict: "an object with str keys"}.get(
                    kind, "a list of str"
                )
                if f.name in _OPTIONAL:
                    want += " or None"
                raise ConfigError(f"{f.name} must be {want}, got {type(value).__name__} {value!r}")

    def _check_mode(self) -> None:
        for name, allowed in (("mode", MODES), ("async_loss", ASYNC_LOSSES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.mode != "async":
            defaults = {f.name: f.default for f in fields(self)}
            for name in ASYNC_FIELDS:
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(
                        f"{name} ({getattr(self, name)!r}) is a setting of mode 'async'; this "
                        f"run's mode is {self.mode!r}"
                    )
        if self.publish_every > self.max_staleness + 1:
            raise ConfigError(
                f"publish_every ({self.publish_every}) exceeds max_staleness + 1 "
                f"({self.max_staleness + 1}): every sample would be too stale to train on"
            )
        if self.mode == "async":
            # Replayed choices and a teacher's scores belong to one policy version; the
            # asynchronous trainer's samples span several.
            for name in ("replay", "opd_teacher"):
                if getattr(self, name):
                    raise ConfigError(f"{name} is not supported with mode 'async'")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object, *, complete: bool = False) -> RLConfig:
        """The config of ``to_json``'s dict ``data``; ``complete``: every field must be
        there (a checkpoint's config is written whole: a missing field would silently
        take its default)."""
        if not isinstance(data, dict):
            raise ConfigError(f"RL config must be an object, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(map(str, set(data) - set(known)))
        if unknown:
            raise ConfigError(f"RL config: unknown fields {unknown}")
        missing = [name for name in known if name not in data]
        if complete and missing:
            raise ConfigError(f"RL config: fields {missing} missing")
        return cls(**data)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Sizes past these cannot fit in memory or finish: refused up front, not in the allocator.
MAX_STEPS = 10**9
MAX_SAMPLES_PER_STEP = 1 << 16
MAX_TOKENS_PER_STEP = 1 << 22
MAX_ROLLOUT_WORKERS = 1024
MAX_STALENESS = 1024
# RLConfig's int fields: (lowest, highest) value.
_COUNTS = {
    "steps": (0, MAX_STEPS),
    "prompts_per_step": (1, MAX_SAMPLES_PER_STEP),
    "group_size": (1, MAX_SAMPLES_PER_STEP),
    "minibatches": (1, MAX_SAMPLES_PER_STEP),
    "checkpoint_every": (1, MAX_STEPS),
    "eval_every": (0, MAX_STEPS),
    "eval_prompts": (1, MAX_SAMPLES_PER_STEP),
    "kl_decay_steps": (0, MAX_STEPS),
    "max_staleness": (0, MAX_STALENESS),
    "rollout_workers": (1, MAX_ROLLOUT_WORKERS),
    "publish_every": (1, MAX_STALENESS + 1),
    "seed": (-(1 << 63), (1 << 64) - 1),
}
# Its real fields: (low, high, low included); high is never included (finite values).
_REALS = {
    "lr": (0, math.inf, False),
    "grad_clip": (0, math.inf, False),
    "eps_low": (0, 1, True),
    "eps_high": (0, math.inf, True),
    "icepop_beta": (1, math.inf, False),
    "kl_coef": (0, math.inf, True),
}
# Its other fields' types, and those that may be None.
_KINDS = {
    "task": str,
    "task_args": dict,
    "normalize_std": bool,
    "kl_kind": str,
    "rollout_backend": str,
    "train_backend": str,
    "rollout_dtype": str,
    "replay": tuple,
    "opd_teacher": str,
    "shuffle_rewards": bool,
    "init": str,
    "model": dict,
    "mode": str,
    "async_loss": str,
}
_OPTIONAL = {"rollout_backend", "train_backend", "opd_teacher", "init", "icepop_beta"}
# The settings of the asynchronous trainer only.
ASYNC_FIELDS = ("max_staleness", "rollout_workers", "async_loss", "publish_every")


def policy_config(task: Task, overrides: dict) -> GlmMoeDsaConfig:
    """The tiny GLM-5 for ``task``: its vocabulary, no MTP layer, 2 decoder layers
    (one dense, one MoE), RoPE base 100; ``overrides`` (GlmMoeDsaConfig fields) win.
    The indexer's top-k covers the whole sequence by default: a task's answer needs
    keys an untrained indexer would not pick (sequences shorter than ``index_topk``
    are GLM-5's regime for short RL samples too); set ``index_topk`` lower to make
    DSA select."""
    unknown = sorted(set(overrides) - {f.name for f in fields(GlmMoeDsaConfig)})
    if unknown:
        raise ConfigError(f"model overrides: unknown GlmMoeDsaConfig fields {unknown}")
    length = task.prompt_len + task.response_len
    base = dict(
        vocab_size=task.vocab_size,
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
        index_topk=length,
        # Positions run to a dozen or so: a smaller base than GLM-5's 10^6 leaves the
        # 8 rotary dims' frequencies able to tell them apart.
        rope_theta=100.0,
        max_position_embeddings=max(64, length),
    )
    return GlmMoeDsaConfig.tiny(**{**base, **overrides})


def _rows(advantages: torch.Tensor, part: torch.Tensor, width: int) -> torch.Tensor:
    """The advantages of sample rows ``part``: ``[b]`` per sample or ``[b, width]`` per
    token."""
    return advantages[part] if advantages.dim() == 1 else advantages[part, :width]


def _seed_for(seed: int, step: int, stream: int) -> int:
    """The seed of one purpose (``stream``) of step ``step`` of run ``seed``."""
    return (seed * 1_000_003 + step * 7919 + stream * 104_729) % (1 << 63)


def _generator(seed: int, step: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_for(seed, step, stream))


class Trainer:
    """Runs :class:`RLConfig`; :meth:`step` does one RL step, :meth:`save` /
    :meth:`resume` checkpoint into ``out``."""

    MODE = "sync"  # the mode of the runs this class resumes

    def __init__(self, config: RLConfig, out: str | Path | None = None) -> None:
        self.config = config
        self.out = None if out is None else Path(out)
        self.task = make_task(config.task, **config.task_args)
        # An unknown or unavailable backend fails here, not mid-run.
        for name in (config.rollout_backend, config.train_backend):
            with glmport.use_backend(name or None):
                pass
        if config.init is not None:
            self.policy = GlmMoeDsaForCausalLM.from_pretrained(config.init, dtype=torch.float32)
        else:
            model_config = policy_config(self.task, config.model)
            self.policy = GlmMoeDsaForCausalLM.from_config(model_config, seed=config.seed)
        if self.policy.config.vocab_size < self.task.vocab_size:
            raise ConfigError(
                f"the policy's vocabulary ({self.policy.config.vocab_size}) is smaller than "
                f"task {config.task!r}'s ({self.task.vocab_size})"
            )
        self.rollout_policy = copy.deepcopy(self.policy).to(DTYPES[config.rollout_dtype])
        self.rollout_policy.requires_grad_(False)
        self.teacher = None
        if config.opd_teacher is not None:
            self.teacher = GlmMoeDsaForCausalLM.from_pretrained(config.opd_teacher)
            self.teacher.requires_grad_(False)
            if self.teacher.config.vocab_size != self.policy.config.vocab_size:
                raise ConfigError(
                    f"the teacher's vocabulary ({self.teacher.config.vocab_size}) differs from "
                    f"the student's ({self.policy.config.vocab_size})"
                )
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.lr)
        self.step_index = 0
        self.version = 0

    # -- one step ---------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One rollout and its minibatch updates; returns the step's metrics."""
        c = self.config
        s = self.step_index
        t0 = time.perf_counter()
        problems = self.task.sample(c.prompts_per_step, _generator(c.seed, s, 0))
        samples = [p for p in problems for _ in range(c.group_size)]
        prompts = [list(p.prompt) for p in samples]
        with glmport.use_backend(c.rollout_backend or None), torch.no_grad():
            result = generate(
                self.rollout_policy,
                prompts,
                self.task.response_len,
                greedy=False,
                temperature=c.temperature,
                seed=_seed_for(c.seed, s, 1),
                return_logprobs=True,
                record_choices=bool(c.replay),
            )
        t_rollout = time.perf_counter() - t0
        responses = result.output_ids
        rewards = torch.tensor(
            [self.task.reward(p, r) for p, r in zip(samples, responses, strict=True)]
        )
        metrics: dict[str, float] = {
            "step": s + 1,
            "policy_version": self.version,
            "reward": float(rewards.mean()),
        }
        if c.shuffle_rewards:
            rewards = shuffled_rewards(rewards, _generator(c.seed, s, 2))
        t1 = time.perf_counter()
        replay = result.choices if c.replay else None
        with glmport.use_backend(c.train_backend or None), torch.no_grad():
            old = continuation_logprobs(
                self.policy,
                prompts,
                responses,
                temperature=c.temperature,
                replay=replay,
                kinds=c.replay,
            )
        mask = old.mask
        rollout_logp = torch.zeros_like(old.logprobs).masked_scatter(
            mask, torch.cat(result.logprobs)
        )
        if self.teacher is not None:
            with glmport.use_backend(c.train_backend or None), torch.no_grad():
                teacher = continuation_logprobs(
                    self.teacher, prompts, responses, temperature=c.temperature
                )
            advantages = opd_advantages(teacher.logprobs, old.logprobs, mask)
            gap = (old.logprobs - teacher.logprobs)[mask]
            metrics["reverse_kl"] = float(gap.mean())
        else:
            advantages = group_advantages(rewards, c.group_size, normalize_std=c.normalize_std)
        ref_logp = self._reference_logprobs(prompts, responses)
        mismatch = mismatch_stats(old.logprobs, rollout_logp, mask, c.icepop_beta or 2.0)
        metrics.update(
            mismatch_mean=float(mismatch.pop("logp_mismatch_mean")),
            mismatch_max=float(mismatch.pop("logp_mismatch_max")),
            entropy=float(old.entropy[mask].mean()),
        )
        metrics.update({k: float(v) for k, v in mismatch.items()})

        def loss_fn(logp: torch.Tensor, part: torch.Tensor, width: int):
            return grpo_icepop_loss(
                logp,
                old.logprobs[part, :width],
                rollout_logp[part, :width],
                _rows(advantages, part, width),
                mask[part, :width],
                eps_low=c.eps_low,
                eps_high=c.eps_high,
                beta=c.icepop_beta,
            )

        updates = self._update(prompts, responses, loss_fn, s, replay=replay, ref_logp=ref_logp)
        metrics.update(updates)
        t_train = time.perf_counter() - t1
        self.rollout_policy.load_state_dict(self.policy.state_dict())
        self.version += 1
        self.step_index += 1
        tokens = int(mask.sum())
        metrics.update(
            rollout_tokens_per_s=tokens / t_rollout,
            train_tokens_per_s=tokens * (1 + c.minibatches) / t_train,
            step_seconds=time.perf_counter() - t0,
        )
        if c.eval_every and (self.step_index % c.eval_every == 0 or self.step_index == c.steps):
            metrics["eval_reward"] = self.evaluate()
        return metrics

    def evaluate(self) -> float:
        """Mean reward of greedy answers to ``eval_prompts`` held-out prompts (the same
        every time: drawn from the run's seed, apart from the training prompts' draws),
        on the rollout backend with the rollout policy."""
        c = self.config
        problems = self.task.sample(c.eval_prompts, _generator(c.seed, -1, 0))
        with glmport.use_backend(c.rollout_backend or None), torch.no_grad():
            result = generate(
                self.rollout_policy, [list(p.prompt) for p in problems], self.task.response_len
            )
        rewards = [self.task.reward(p, r) for p, r in zip(problems, result.output_ids, strict=True)]
        return sum(rewards) / len(rewards)

    def kl_weight(self, step: int) -> float:
        """The KL penalty's coefficient at (0-based) ``step``: ``kl_coef``, decayed
        linearly to ``KL_FLOOR * kl_coef`` at ``kl_decay_steps``, then constant."""
        c = self.config
        if not c.kl_decay_steps:
            return c.kl_coef
        return c.kl_coef * max(KL_FLOOR, 1.0 - step / c.kl_decay_steps)

    def _reference_logprobs(self, prompts, responses) -> torch.Tensor | None:
        """``[B, L]`` log-probs of the responses under the initial policy (None without
        a KL penalty)."""
        if self.reference is None:
            return None
        with glmport.use_backend(self.config.train_backend or None), torch.no_grad():
            return continuation_logprobs(
                self.reference, prompts, responses, temperature=self.config.temperature
            ).logprobs

    def _update(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, dict]],
        s: int,
        *,
        replay: list | None = None,
        ref_logp: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """The step's Adam updates: the samples shuffled into ``minibatches``, each
        scored on the training backend and stepped on ``loss_fn(logp, rows, width)``
        (``logp`` ``[b, width]`` of sample ``rows``) plus the decayed KL penalty to
        ``ref_logp``. Returns :data:`UPDATE_STATS` averaged over the minibatches."""
        c = self.config
        order = torch.randperm(len(prompts), generator=_generator(c.seed, s, 3))
        totals: dict[str, float] = {}
        for part in order.tensor_split(c.minibatches):
            rows = part.tolist()
            with glmport.use_backend(c.train_backend or None):
                scored = continuation_logprobs(
                    self.policy,
                    [prompts[i] for i in rows],
                    [responses[i] for i in rows],
                    temperature=c.temperature,
                    replay=None if replay is None else [replay[i] for i in rows],
                    kinds=c.replay,
                )
                width = scored.logprobs.shape[1]
                loss, stats = loss_fn(scored.logprobs, part, width)
                if ref_logp is not None:
                    kl = kl_penalty(scored.logprobs, ref_logp[part, :width], c.kl_kind)
                    m = scored.mask
                    kl_mean = (kl * m).sum() / m.sum().clamp(min=1)
                    loss = loss + self.kl_weight(s) * kl_mean
                    stats = {**stats, "kl": kl_mean.detach()}
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.grad_clip)
                self.optimizer.step()
            stats = {**stats, "loss": loss.detach(), "grad_norm": norm}
            for k, v in stats.items():
                if k in UPDATE_STATS:
                    totals[k] = totals.get(k, 0.0) + float(v) / c.minibatches
        return totals

    # -- runs and checkpoints ----------------------------------------------------------

    def run(self, on_step: Callable[[dict[str, float]], None] | None = None) -> list[dict]:
        """Steps until ``config.steps``, checkpointing every ``checkpoint_every`` steps
        and at the end when ``out`` is set; returns the metrics of the steps run."""
        history = []
        while self.step_index < self.config.steps:
            metrics = self.step()
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
            done = self.step_index == self.config.steps
            if self.out is not None and (
                done or self.step_index % self.config.checkpoint_every == 0
            ):
                self.save()
        return history

    def save(self, folder: str | Path | None = None) -> Path:
        """Write the policy (HF safetensors + config.json, loadable by
        ``from_pretrained``), the optimizer state (safetensors) and ``state.json``
        (step, policy version, RL config, optimizer hyper-parameters), atomically
        (layout: :mod:`glmport.rl.checkpoint`)."""
        folder = Path(folder) if folder is not None else self._checkpoint_dir()
        tensors, groups = _optimizer_tensors(self.optimizer)
        with atomic_folder(folder) as tmp:
            self.policy.save_pretrained(tmp / POLICY)
            save_file(tensors, str(tmp / OPTIMIZER))
            state = {
                "step": self.step_index,
                "policy_version": self.version,
                "rl_config": self.config.to_json(),
                # Step s draws only from generators seeded by (seed, s): this is the RNG state.
                "rng": {"seed": self.config.seed, "next_step": self.step_index},
                "optimizer_param_groups": groups,
                "optimizer_state_params": sorted(self.optimizer.state_dict()["state"]),
                **self._extra_state(),
            }
            (tmp / STATE).write_text(json.dumps(state, indent=2))
        return folder

    def _extra_state(self) -> dict:
        """What a subclass adds to ``state.json`` (checked by :meth:`_check_extra`,
        restored by :meth:`_restore`)."""
        return {}

    def _check_extra(self, saved: SavedState) -> object:
        """Check what :meth:`_extra_state` saved (``saved.extra``, the keys of
        ``state.json`` beyond the common ones) without using it; returns what
        :meth:`_restore` takes."""
        if saved.extra:
            raise ConfigError(
                f"{saved.file} has keys of another trainer: {', '.join(sorted(saved.extra))} "
                f"(this run's mode is {self.config.mode!r})"
            )
        return None

    def _restore(self, extra: object) -> None:
        """Take back what :meth:`_check_extra` returned."""

    def close(self) -> None:
        """Release what the run holds (nothing here; the asynchronous trainer's Ray)."""

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _checkpoint_dir(self) -> Path:
        if self.out is None:
            raise ConfigError("Trainer.save: no folder given and the trainer has no out dir")
        return self.out / CHECKPOINT

    @classmethod
    def resume(
        cls,
        folder: str | Path,
        out: str | Path | None = None,
        *,
        options: dict | None = None,
        **changes,
    ) -> Trainer:
        """A trainer continuing the checkpoint in ``folder`` (as written by :meth:`save`);
        ``changes`` may only raise ``steps``; ``options``: the constructor's keyword
        arguments besides the config (where the run executes, not what it computes).

        The whole checkpoint is checked first (:mod:`glmport.rl.checkpoint`): a damaged
        one is a :class:`ConfigError` naming the file and the field, and nothing of it
        is loaded."""
        if set(changes) - {"steps"}:
            raise ConfigError(f"resume may change only steps, got {sorted(changes)}")
        saved = read_state(folder)
        config = saved.config
        if config.mode != cls.MODE:
            raise ConfigError(
                f"{saved.file}: rl_config.mode is {config.mode!r}; {cls.__name__} resumes mode "
                f"{cls.MODE!r} runs"
            )
        if changes:
            config = RLConfig.from_json({**config.to_json(), **changes})
        if saved.step > config.steps:
            raise ConfigError(f"the checkpoint is at step {saved.step}, past steps={config.steps}")
        trainer = cls(config, out, **(options or {}))
        try:
            weights = read_weights(saved, trainer.policy, trainer.optimizer)
            extra = trainer._check_extra(saved)
        except BaseException:
            trainer.close()
            raise
        trainer.policy.load_state_dict(weights.policy)
        trainer.rollout_policy.load_state_dict(weights.policy)
        trainer.optimizer.load_state_dict(weights.optimizer)
        trainer.step_index = trainer.version = saved.step
        trainer._restore(extra)
        return trainer


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """The optimizer's per-parameter state as flat named tensors and its param groups."""
    state = optimizer.state_dict()
    tensors = {
        f"state.{index}.{name}": torch.as_tensor(value).clone().contiguous()
        for index, per_param in state["state"].items()
        for name, value in per_param.items()
    }
    return tensors, state["param_groups"]
