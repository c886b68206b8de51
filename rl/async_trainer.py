"""GLM-5's asynchronous RL on Ray: rollout decoupled from training.

``rollout_workers`` Ray actors (:class:`~glmport.rl.workers.RolloutWorker`, each with a
policy copy on the rollout backend and dtype) sample GRPO groups continuously. The
trainer (this process):

- dispatches groups while AReaL's capacity rule allows
  (:class:`~glmport.rl.staleness.StalenessManager`): at most ``max_staleness + 1``
  versions' worth of groups accepted or in flight ahead of training, two in flight per
  worker at most; otherwise the workers wait (backpressure);
- buffers returned groups, tagged with the policy version that sampled them, and trains
  on the oldest ``prompts_per_step`` of them with direct double-sided importance
  sampling against the rollout log-probs (no recomputed theta_old);
- publishes each new policy version through Ray's object store and tells every worker,
  so a rollout of an older version stops and its group goes back to the queue (partial
  rollouts are never trained on); a group staler than the bound when it comes back, or
  whose worker died, is requeued too;
- records every group's events in ``ledger.jsonl`` (:class:`~glmport.rl.staleness.GroupLedger`).

Workers restart through Ray (``max_restarts``); groups in flight on a dead worker are
requeued. Checkpoints hold the queue (every group not yet trained), so a resumed run
neither loses nor repeats a group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmport.core.errors import ConfigError, GlmportError, check_int
from glmport.core.extras import require

from .checkpoint import SavedState, exact_keys, field_error
from .config import RLConfig, is_number
from .losses import (
    advantage_rows,
    double_sided_is_loss,
    group_advantages,
    policy_gradient_loss,
)
from .seeding import seed_for, step_generator
from .staleness import GroupLedger, StalenessManager
from .tasks import Problem, shuffled_rewards
from .trainer import Trainer
from .workers import DTYPES, Group, GroupSampling, GroupSpec, Interrupted

log = logging.getLogger(__name__)

LEDGER = "ledger.jsonl"
IN_FLIGHT_PER_WORKER = 2  # one sampling, one queued: a worker never idles on a round trip
# A group whose worker died under it this often means something is broken: stop. (Being
# interrupted or too stale is normal and not counted: each happens only after a step.)
MAX_FAILURES = 8
# A checkpoint's pending group has been sampled at most this often (interruptions and
# staleness are unbounded in principle; 2**31 of them are not a run).
MAX_ATTEMPTS = (1 << 31) - 1
MAX_WORKER_THREADS = 1024
DEFAULT_WAIT_S = 300.0
# Seed streams of a group (see seeding.seed_for), apart from the sync trainer's 0-3.
_PROBLEM_STREAM, _SAMPLE_STREAM = 5, 6


class AsyncTrainer(Trainer):
    """Runs an :class:`RLConfig` with ``mode="async"`` (see the module docstring).

    Args:
        config: the run.
        out: the run folder (checkpoints, ``ledger.jsonl``); None: nothing written.
        ray_address: None: a local Ray instance sized to this machine, shut down by
            :meth:`close`; an address: join that cluster.
        worker_threads: torch threads per rollout worker (None: the machine's cores
            shared among the workers, at least 1).
        max_restarts: Ray restarts of a dead worker before it is given up.
        wait_s: longest wait for any group to come back before the run stops with an
            error.
        groups_per_call: groups a worker samples in one batched generation (None: a
            quarter of a step's groups per worker, at least 1).
    """

    MODE = "async"

    def __init__(
        self,
        config: RLConfig,
        out: str | Path | None = None,
        *,
        ray_address: str | None = None,
        worker_threads: int | None = None,
        max_restarts: int = 3,
        wait_s: float = DEFAULT_WAIT_S,
        groups_per_call: int | None = None,
    ) -> None:
        if config.mode != "async":
            raise ConfigError(f"AsyncTrainer runs mode 'async' configs, got {config.mode!r}")
        for name, value, low, high in (
            ("worker_threads", worker_threads, 1, MAX_WORKER_THREADS),
            ("max_restarts", max_restarts, 0, MAX_ATTEMPTS),
            ("groups_per_call", groups_per_call, 1, config.prompts_per_step),
        ):
            if value is not None:
                check_int(name, value, low, high)
        if not (is_number(wait_s) and 0 < wait_s < math.inf):
            raise ConfigError(f"wait_s must be a finite number of seconds > 0, got {wait_s!r}")
        super().__init__(config, out)
        self.ray_address = ray_address
        cores = os.cpu_count() or 1
        self.worker_threads = worker_threads or max(1, cores // config.rollout_workers)
        self.max_restarts = max_restarts
        self.wait_s = wait_s
        self.groups_per_call = groups_per_call or max(
            1, config.prompts_per_step // (4 * config.rollout_workers)
        )
        self.staleness = StalenessManager(
            config.prompts_per_step,
            config.max_staleness,
            config.rollout_workers * IN_FLIGHT_PER_WORKER * self.groups_per_call,
        )
        self.queue: deque[GroupSpec] = deque()
        self.buffer: list[Group] = []
        self.next_group = 0
        # In memory until start(): a resumed run first takes the checkpoint's records.
        self.ledger = GroupLedger()
        self.workers: list[Any] = []
        self._in_flight: dict[Any, tuple[list[GroupSpec], int]] = {}
        self._dead: set[int] = set()
        self._group_failures: dict[int, int] = {}
        self._probes: dict[int, Any] = {}  # restarting workers: their pending health call
        self._weights: Any = None
        self._published = -1  # the version the workers sample with
        self._ray: contextlib.ExitStack | None = None
        self._counts = dict(interrupted=0, failed=0, stale=0)
        self._produced_tokens = 0
        self._last_step_end: float | None = None

    # -- Ray lifetime ------------------------------------------------------------------

    def start(self) -> None:
        """Start (or join) Ray, the rollout workers, and publish the current policy."""
        if self._ray is not None:
            return
        require("asynchronous RL (mode 'async')", "ray")
        from .ray_runtime import ray_session, rollout_actor

        c = self.config
        if self.out is not None:
            self.ledger = GroupLedger(self.out / LEDGER, self.ledger.records)
        stack = contextlib.ExitStack()
        stack.enter_context(ray_session(self.ray_address))
        self._ray = stack
        cores = os.cpu_count() or 1
        actor = rollout_actor(
            max_restarts=self.max_restarts,
            max_task_retries=0,
            num_cpus=min(1.0, cores / c.rollout_workers),
        )
        sampling = GroupSampling(c.group_size, self.task.response_len, c.temperature)
        model_config = self.policy.config.to_dict()
        self.workers = [
            actor.remote(
                model_config,
                backend=c.rollout_backend,
                dtype=c.rollout_dtype,
                threads=self.worker_threads,
                index=i,
                sampling=sampling,
            )
            for i in range(c.rollout_workers)
        ]
        self._publish()
        log.info("async RL: %d rollout workers started", c.rollout_workers)

    def close(self) -> None:
        """Record every group not trained as pending, stop the workers and Ray."""
        if self._ray is None:
            self.ledger.close()
            return
        import ray

        for spec in self._pending():
            self.ledger.record("pending", spec.group_id, attempt=spec.attempt)
        self.ledger.close()
        for worker in self.workers:
            ray.kill(worker)
        self.workers, self._in_flight = [], {}
        self._ray.close()
        self._ray = None

    def _pending(self) -> list[GroupSpec]:
        """Every issued group not trained yet: buffered, in flight, queued (oldest first)."""
        specs = [g.spec for g in self.buffer]
        specs += [s for batch, _ in self._in_flight.values() for s in batch]
        specs += list(self.queue)
        return sorted(specs, key=lambda s: s.group_id)

    def _publish(self) -> None:
        """Put the policy's weights in the object store as version ``self.version``
        (every ``publish_every`` versions)."""
        import ray

        if self._published >= 0 and self.version - self._published < self.config.publish_every:
            return
        self._published = self.version
        dtype = DTYPES[self.config.rollout_dtype]
        state = {k: v.detach().to(dtype).clone() for k, v in self.policy.state_dict().items()}
        self._weights = ray.put(state)
        for worker in self.workers:
            worker.notify.remote(self.version)

    # -- groups ------------------------------------------------------------------------

    def _spec(self, group: int, attempt: int) -> GroupSpec:
        """Attempt ``attempt`` of group ``group``: its problem and sampling seed follow
        from the run's seed and those two numbers alone."""
        seed = self.config.seed
        problem = self.task.sample(1, step_generator(seed, group, _PROBLEM_STREAM))[0]
        stream = _SAMPLE_STREAM + 100 * attempt
        return GroupSpec(group, attempt, problem, seed_for(seed, group, stream))

    def _issue(self) -> GroupSpec:
        spec = self._spec(self.next_group, 0)
        self.next_group += 1
        self.ledger.record("issued", spec.group_id, prompt=list(spec.problem.prompt))
        return spec

    def _requeue(self, spec: GroupSpec, event: str, **details: Any) -> None:
        self.ledger.record(event, spec.group_id, attempt=spec.attempt, **details)
        if event == "failed":
            failures = self._group_failures.get(spec.group_id, 0) + 1
            self._group_failures[spec.group_id] = failures
            if failures >= MAX_FAILURES:
                raise GlmportError(
                    f"group {spec.group_id} lost its worker {MAX_FAILURES} times; "
                    "the rollout workers keep dying"
                )
        self.queue.appendleft(self._spec(spec.group_id, spec.attempt + 1))

    def _dispatch(self) -> None:
        """Send groups to the least busy live workers, ``groups_per_call`` per call, while
        the capacity rule allows."""
        load = [0] * len(self.workers)
        for _, i in self._in_flight.values():
            load[i] += 1
        room = self.staleness.capacity(self.version)
        while room > 0:
            live = [i for i in range(len(self.workers)) if self._usable(i)]
            i = min(live, key=lambda j: load[j], default=None)
            if i is None or load[i] >= IN_FLIGHT_PER_WORKER:
                return
            specs = [self._next_spec() for _ in range(min(room, self.groups_per_call))]
            ref = self.workers[i].rollout.remote(specs, self._published, [self._weights])
            self._in_flight[ref] = (specs, i)
            load[i] += 1
            room -= len(specs)
            for spec in specs:
                self.staleness.on_dispatch()
                self.ledger.record(
                    "dispatched",
                    spec.group_id,
                    attempt=spec.attempt,
                    worker=i,
                    version=self._published,
                )

    def _next_spec(self) -> GroupSpec:
        return self.queue.popleft() if self.queue else self._issue()

    def _usable(self, i: int) -> bool:
        """Worker ``i`` neither died for good nor is restarting (a restarting worker is
        back once its health call answers: groups are not sent to fail meanwhile)."""
        import ray

        from .ray_runtime import ACTOR_DIED

        if i in self._dead:
            return False
        probe = self._probes.get(i)
        if probe is None:
            return True
        if not ray.wait([probe], timeout=0)[0]:
            return False
        try:
            ray.get(probe)
        except ACTOR_DIED as err:
            self._failed(i, err)
            return False
        del self._probes[i]
        log.info("rollout worker %d is back", i)
        return True

    def _failed(self, i: int, err: Exception) -> None:
        """Worker ``i`` failed: probe it while Ray restarts it, or give it up."""
        import ray

        if isinstance(err, ray.exceptions.ActorUnavailableError):
            self._probes[i] = self.workers[i].health.remote()
        else:  # Ray restarts it no more
            self._dead.add(i)
            self._probes.pop(i, None)
            log.warning("rollout worker %d is gone for good: %s", i, err)

    def _collect(self) -> None:
        """Wait for at least one group to come back and file what came back."""
        import ray

        from .ray_runtime import ACTOR_DIED

        if not self._in_flight:
            if len(self._dead) == len(self.workers):
                raise GlmportError("every rollout worker died; the run cannot go on")
            if not ray.wait(list(self._probes.values()), num_returns=1, timeout=self.wait_s)[0]:
                raise GlmportError(f"no rollout worker came back within {self.wait_s:g} s")
            return
        ready, _ = ray.wait(list(self._in_flight), num_returns=1, timeout=self.wait_s)
        if not ready:
            raise GlmportError(f"no rollout came back within {self.wait_s:g} s")
        for ref in ready:
            specs, i = self._in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except ACTOR_DIED as err:
                if i not in self._probes and i not in self._dead:
                    log.warning("rollout worker %d failed; its groups are requeued: %s", i, err)
                    self._failed(i, err)
                for spec in reversed(specs):
                    self._counts["failed"] += 1
                    self.staleness.on_reject()
                    self._requeue(spec, "failed", worker=i)
                continue
            if isinstance(result, Interrupted):
                for spec in reversed(result.specs):
                    self._counts["interrupted"] += 1
                    self.staleness.on_reject()
                    self._requeue(spec, "interrupted", worker=i, version=result.version)
                continue
            for group in result:
                self._file(group)

    def _file(self, group: Group) -> None:
        """Buffer a returned group, or requeue it when it is already too stale."""
        spec = group.spec
        if self.version - group.version > self.config.max_staleness:
            self._counts["stale"] += 1
            self.staleness.on_reject()
            self._requeue(spec, "stale", worker=group.worker, version=group.version)
            return
        self.staleness.on_accept()
        self._produced_tokens += group.tokens
        self.buffer.append(group)
        self.ledger.record(
            "returned",
            spec.group_id,
            attempt=spec.attempt,
            worker=group.worker,
            version=group.version,
            seconds=round(group.seconds, 4),
        )

    def _next_batch(self) -> list[Group]:
        """The oldest ``prompts_per_step`` buffered groups within the staleness bound,
        gathering rollouts until there are enough; staler ones are requeued."""
        c = self.config
        while True:
            fresh = []
            for group in self.buffer:
                if self.version - group.version > c.max_staleness:
                    self._counts["stale"] += 1
                    self.staleness.on_discard(1)
                    self._requeue(group.spec, "stale", worker=group.worker, version=group.version)
                else:
                    fresh.append(group)
            self.buffer = fresh
            if len(self.buffer) >= c.prompts_per_step:
                self.buffer.sort(key=lambda g: (g.version, g.spec.group_id))
                batch, self.buffer = (
                    self.buffer[: c.prompts_per_step],
                    self.buffer[c.prompts_per_step :],
                )
                return batch
            self._dispatch()
            self._collect()

    # -- one step ----------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        """Train on the next batch of groups; returns the step's metrics."""
        self.start()
        c, s = self.config, self.step_index
        t0 = time.perf_counter()
        self._dispatch()
        batch = self._next_batch()
        t_wait = time.perf_counter() - t0
        prompts = [list(g.spec.problem.prompt) for g in batch for _ in g.output_ids]
        responses = [list(o) for g in batch for o in g.output_ids]
        problems: list[Problem] = [g.spec.problem for g in batch for _ in g.output_ids]
        rewards = torch.tensor(
            [self.task.reward(p, r) for p, r in zip(problems, responses, strict=True)]
        )
        lags = torch.tensor([float(self.version - g.version) for g in batch])
        metrics: dict[str, float] = {
            "step": s + 1,
            "policy_version": self.version,
            "reward": float(rewards.mean()),
            "staleness_mean": float(lags.mean()),
            "staleness_max": float(lags.max()),
        }
        if c.shuffle_rewards:
            rewards = shuffled_rewards(rewards, step_generator(c.seed, s, 2))
        advantages = group_advantages(rewards, c.group_size, normalize_std=c.normalize_std)
        lengths = torch.tensor([len(r) for r in responses])
        mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        rollout_logp = torch.zeros(mask.shape).masked_scatter(
            mask, torch.cat([lp for g in batch for lp in g.logprobs]).float()
        )
        ref_logp = self._reference_logprobs(prompts, responses)

        def loss_fn(logp: torch.Tensor, part: torch.Tensor, width: int):
            adv, m = advantage_rows(advantages, part, width), mask[part, :width]
            if c.async_loss == "pg":
                return policy_gradient_loss(logp, adv, m)
            return double_sided_is_loss(
                logp, rollout_logp[part, :width], adv, m, eps_low=c.eps_low, eps_high=c.eps_high
            )

        t1 = time.perf_counter()
        metrics.update(self._update(prompts, responses, loss_fn, s, ref_logp=ref_logp))
        t_train = time.perf_counter() - t1
        for group in batch:
            self.ledger.record(
                "trained",
                group.spec.group_id,
                step=s + 1,
                version=group.version,
                staleness=self.version - group.version,
            )
        self.version += 1
        self.step_index += 1
        self._publish()
        now = time.perf_counter()
        since = now - (self._last_step_end or t0)
        self._last_step_end = now
        tokens = int(mask.sum())
        metrics.update(
            rollout_tokens_per_s=self._produced_tokens / since,
            train_tokens_per_s=tokens * c.minibatches / t_train,
            wait_seconds=t_wait,
            step_seconds=now - t0,
            buffered=len(self.buffer),
            **{f"{k}_total": v for k, v in self._counts.items()},
        )
        self._produced_tokens = 0
        if c.eval_every and (self.step_index % c.eval_every == 0 or self.step_index == c.steps):
            self.rollout_policy.load_state_dict(self.policy.state_dict())
            metrics["eval_reward"] = self.evaluate()
        return metrics

    # -- checkpoints -------------------------------------------------------------------

    def _extra_state(self) -> dict:
        pending = [
            {
                "group": s.group_id,
                "attempt": s.attempt,
                "prompt": list(s.problem.prompt),
                "answer": list(s.problem.answer),
                "seed": s.seed,
            }
            for s in self._pending()
        ]
        return {
            "async": {
                "next_group": self.next_group,
                "pending": pending,
                "ledger_records": len(self.ledger.records),
                "counts": self._counts,
            }
        }

    def _check_extra(self, saved: SavedState) -> _Saved:
        """The checkpoint's ``async`` section, checked: the queue's groups are exactly
        those issued and not trained (``next_group == step x prompts_per_step +
        len(pending)``), each with the prompt, answer and seed its group id and attempt
        give; the ledger in ``out`` holds the records the checkpoint counted."""
        c = self.config
        file = saved.file
        if set(saved.extra) != {"async"}:
            raise ConfigError(
                f"{file}: an asynchronous run's state has one key beside the common ones, "
                f"async; got {sorted(saved.extra)}"
            )
        section = exact_keys(
            saved.extra["async"],
            ("next_group", "pending", "ledger_records", "counts"),
            f"{file}: async",
        )
        next_group = check_int(f"{file}: async.next_group", section["next_group"], 0)
        records = check_int(f"{file}: async.ledger_records", section["ledger_records"], 0)
        counts = exact_keys(section["counts"], tuple(self._counts), f"{file}: async.counts")
        for key, value in counts.items():
            check_int(f"{file}: async.counts.{key}", value, 0)
        pending = section["pending"]
        if not isinstance(pending, list):
            raise field_error(f"{file}: async.pending", f"must be a list, got {pending!r:.60}")
        trained = saved.step * c.prompts_per_step
        if next_group != trained + len(pending):
            raise field_error(
                f"{file}: async.next_group",
                f"is {next_group}; {saved.step} steps trained {trained} groups and "
                f"{len(pending)} are pending",
            )
        specs = []
        for i, entry in enumerate(pending):
            where = f"{file}: async.pending[{i}]"
            exact_keys(entry, ("group", "attempt", "prompt", "answer", "seed"), where)
            group = check_int(f"{where}.group", entry["group"], 0, next_group - 1)
            attempt = check_int(f"{where}.attempt", entry["attempt"], 0, MAX_ATTEMPTS)
            spec = self._spec(group, attempt)
            for key, want in (
                ("prompt", list(spec.problem.prompt)),
                ("answer", list(spec.problem.answer)),
                ("seed", spec.seed),
            ):
                if entry[key] != want or isinstance(entry[key], bool):
                    raise field_error(
                        f"{where}.{key}",
                        f"is {entry[key]!r:.60}; group {group}, attempt {attempt} of this "
                        f"run has {want!r}",
                    )
            specs.append(spec)
        if len({s.group_id for s in specs}) < len(specs):
            raise field_error(f"{file}: async.pending", "lists a group twice")
        ledger = None
        if self.out is not None:
            ledger = self._saved_ledger(records, file)
        return _Saved(next_group, dict(counts), specs, ledger)

    def _saved_ledger(self, records: int, file: Path) -> list[dict]:
        """The first ``records`` records of ``out/ledger.jsonl`` (those the checkpoint
        counted; later ones were written by a run that then stopped)."""
        path = self.out / LEDGER
        if path.is_symlink():
            raise ConfigError(f"{path} is a link; a run's ledger is its own file")
        if not path.is_file():
            if records:
                raise ConfigError(
                    f"{path} is missing; {file} counts {records} ledger records (async."
                    "ledger_records)"
                )
            return []
        try:
            ledger = GroupLedger.read(path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{path} is not a readable ledger: {err}") from err
        if len(ledger) < records or not all(isinstance(r, dict) for r in ledger[:records]):
            raise ConfigError(
                f"{path} holds {len(ledger)} records; {file} counts {records} "
                "(async.ledger_records)"
            )
        return ledger[:records]

    def _restore(self, extra: object) -> None:
        assert isinstance(extra, _Saved)
        self.next_group = extra.next_group
        self._counts = extra.counts
        self.queue.extend(extra.pending)
        # Groups trained after the checkpoint are trained again by this run: its ledger
        # continues from the checkpoint's.
        if extra.ledger is not None:
            self.ledger = GroupLedger(None, extra.ledger)
        self.staleness.accepted = self.version * self.config.prompts_per_step


@dataclass(frozen=True)
class _Saved:
    """An asynchronous checkpoint's queue and counters, checked (see
    :meth:`AsyncTrainer._check_extra`); ``ledger``: the records to continue (None
    without an out dir)."""

    next_group: int
    counts: dict[str, int]
    pending: list[GroupSpec]
    ledger: list[dict] | None
