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
import time
from collections.abc import Callable
from pathlib import Path

import torch

import glmport
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.generation import generate
from glmport.model.scoring import continuation_logprobs

from .checkpoint import SavedState, read_state, read_weights, write_checkpoint
from .config import RLConfig, policy_config
from .losses import (
    advantage_rows,
    group_advantages,
    grpo_icepop_loss,
    kl_penalty,
    mismatch_stats,
    opd_advantages,
)
from .seeding import seed_for, step_generator
from .tasks import make_task, shuffled_rewards
from .workers import DTYPES

CHECKPOINT = "checkpoint"  # the run folder's checkpoint (layout: glmport.rl.checkpoint)
# The KL coefficient never decays below this fraction of its start: with none left, a
# near-deterministic policy's rare differing samples drive Adam's steps and undo it.
KL_FLOOR = 0.2
# Per-update statistics averaged over the minibatches into the step's metrics.
UPDATE_STATS = ("clip_fraction", "ppo_kl", "zeroed_fraction", "is_kl", "loss", "grad_norm", "kl")


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
        problems = self.task.sample(c.prompts_per_step, step_generator(c.seed, s, 0))
        samples = [p for p in problems for _ in range(c.group_size)]
        prompts = [list(p.prompt) for p in samples]
        with glmport.use_backend(c.rollout_backend or None), torch.no_grad():
            result = generate(
                self.rollout_policy,
                prompts,
                self.task.response_len,
                greedy=False,
                temperature=c.temperature,
                seed=seed_for(c.seed, s, 1),
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
            rewards = shuffled_rewards(rewards, step_generator(c.seed, s, 2))
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
                advantage_rows(advantages, part, width),
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
        problems = self.task.sample(c.eval_prompts, step_generator(c.seed, -1, 0))
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
        order = torch.randperm(len(prompts), generator=step_generator(c.seed, s, 3))
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
        write_checkpoint(
            folder,
            self.policy,
            self.optimizer,
            step=self.step_index,
            version=self.version,
            config=self.config,
            extra=self._extra_state(),
        )
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
