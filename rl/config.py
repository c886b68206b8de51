"""What defines an RL run: :class:`RLConfig` (saved with each checkpoint), its bounds
and defaults, and the tiny GLM-5 policy a run trains (:func:`policy_config`). Every
field is checked at construction: a bad one is a one-line :class:`ConfigError`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from glmport.core.errors import ConfigError, check_int
from glmport.model import GlmMoeDsaConfig
from glmport.model.choices import KINDS
from glmport.model.sampling import SamplingNames, check_sampling

from .losses import KL_KINDS
from .tasks import Task, make_task
from .workers import DTYPES

# Adam's learning rate (``lr`` None): distillation's per-token advantages are large
# (log-prob gaps of several nats), so it steps more gently.
DEFAULT_LR = 2e-3
DEFAULT_LR_DISTILL = 5e-4
DEFAULT_KL_COEF = 0.1
MODES = ("sync", "async")
ASYNC_LOSSES = ("dsis", "pg")


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
    ``mode``: ``"sync"`` (:class:`~glmport.rl.trainer.Trainer`) or ``"async"``
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
            above = is_number(value) and (low <= value if closed else low < value)
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


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float (a bool is not)."""
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
