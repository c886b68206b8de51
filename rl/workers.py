"""Rollout workers: a copy of the policy on its own backend and dtype that samples GRPO
groups for asynchronous RL and serves the gateway's token-in-token-out sessions.

The classes are plain Python: :mod:`glmport.rl.ray_runtime` makes :class:`RolloutWorker`
a Ray actor (the trainer and ``glmport rl serve`` use it so), and tests also drive it
in-process. Weights travel by version: a worker loads a published state dict only when
the version it is asked to sample with differs from the one it holds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

import glmport
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.generation import GenerationAborted, generate
from glmport.model.sampling import check_sampling

from .sessions import SessionStore
from .tasks import Problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class GroupSpec:
    """One prompt to roll out ``group_size`` times: the unit asynchronous RL tracks.

    ``group_id`` is unique within a run; ``attempt`` counts earlier dispatches of the
    same group (a requeued group is sampled again with a new ``seed``).
    """

    group_id: int
    attempt: int
    problem: Problem
    seed: int


@dataclass(frozen=True)
class GroupSampling:
    """How a worker samples a group: ``group_size`` continuations of ``max_new_tokens``
    tokens at ``temperature``."""

    group_size: int
    max_new_tokens: int
    temperature: float

    def __post_init__(self) -> None:
        check_sampling(temperature=self.temperature)


@dataclass
class Group:
    """A sampled group: ``output_ids[i]`` with each token's rollout log-probability
    ``logprobs[i]`` (fp32 ``[len(output_ids[i])]``) under policy ``version``;
    ``seconds``: its share of the batched generation's time."""

    spec: GroupSpec
    version: int
    worker: int
    output_ids: list[list[int]]
    logprobs: list[torch.Tensor]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


@dataclass(frozen=True)
class Interrupted:
    """A rollout given up because a newer policy version was published meanwhile; its
    partial output is dropped and its groups go back to the queue."""

    specs: tuple[GroupSpec, ...]
    version: int
    worker: int


class PolicyHost:
    """A policy copy on ``backend`` in ``dtype``, without gradients.

    Args:
        model_config: ``GlmMoeDsaConfig.to_dict()`` of the policy.
        backend: the glmport backend its forward runs on (None: the selection).
        dtype: ``fp32``, ``bf16`` or ``fp16``.
        threads: torch intra-op threads of this process (None: leave as is).
    """

    def __init__(
        self,
        model_config: dict,
        *,
        backend: str | None = None,
        dtype: str = "fp32",
        threads: int | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        with glmport.use_backend(backend):  # unknown or unavailable: fail at start
            pass
        self.backend = backend
        config = GlmMoeDsaConfig.from_dict(model_config)
        self.model = GlmMoeDsaForCausalLM.from_config(config, seed=None).to(DTYPES[dtype])
        self.model.eval().requires_grad_(False)
        self.version = -1

    def load_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hold policy ``version`` with weights ``state`` (cast to this copy's dtype)."""
        self.model.load_state_dict(state)
        self.version = version

    def _resolve(self, handle: Any) -> dict[str, torch.Tensor]:
        """The state dict a published-weights handle stands for (in-process: itself; the
        Ray actor fetches it from the object store)."""
        return handle


class RolloutWorker(PolicyHost):
    """A :class:`PolicyHost` that samples GRPO groups and serves gateway sessions.

    Args:
        index: this worker's number in its pool (reported with what it produces).
        sampling: how :meth:`rollout` samples groups (None: this worker serves only).
        max_sessions: sessions whose KV cache :meth:`serve` keeps (least recent evicted).
    """

    def __init__(
        self,
        model_config: dict,
        *,
        backend: str | None = None,
        dtype: str = "fp32",
        threads: int | None = None,
        index: int = 0,
        sampling: GroupSampling | None = None,
        max_sessions: int = 64,
    ) -> None:
        super().__init__(model_config, backend=backend, dtype=dtype, threads=threads)
        self.index = index
        self.sampling = sampling
        self.sessions = SessionStore(self.model, max_sessions=max_sessions)
        self._newest = -1
        self._lock = threading.Lock()

    def load_weights(self, version: int, state: dict[str, torch.Tensor]) -> None:
        super().load_weights(version, state)
        self.sessions.clear()  # caches computed with the old weights are void

    def notify(self, version: int) -> None:
        """Policy ``version`` has been published: a rollout of an older one stops."""
        with self._lock:
            self._newest = max(self._newest, version)

    def health(self) -> dict:
        """``worker``, ``policy_version`` and ``sessions`` held (answered beside a
        running rollout or request in a Ray actor)."""
        return {
            "worker": self.index,
            "policy_version": self.version,
            "sessions": len(self.sessions),
        }

    def _superseded(self, version: int) -> bool:
        with self._lock:
            return self._newest > version

    def rollout(
        self, specs: list[GroupSpec], version: int, weights: list[Any]
    ) -> list[Group] | Interrupted:
        """Sample the groups ``specs`` (in one batched generation) with policy ``version``.

        Args:
            specs: the groups; the first one's seed seeds the sampling.
            version: the policy version to sample with.
            weights: a one-element list holding that version's published weights (a
                list, so Ray passes the object-store handle unresolved: the worker
                fetches it only when its own version differs).

        Returns:
            One :class:`Group` per spec, or :class:`Interrupted` when a newer version
            was published before they finished.
        """
        if self.sampling is None:
            raise ConfigError(f"rollout worker {self.index} was built without group sampling")
        if self.version != version:
            self.load_weights(version, self._resolve(weights[0]))
        self.notify(version)
        s = self.sampling
        prompts = [list(spec.problem.prompt) for spec in specs for _ in range(s.group_size)]
        t0 = time.perf_counter()
        try:
            with glmport.use_backend(self.backend), torch.no_grad():
                result = generate(
                    self.model,
                    prompts,
                    s.max_new_tokens,
                    greedy=False,
                    temperature=s.temperature,
                    seed=specs[0].seed,
                    return_logprobs=True,
                    abort=lambda: self._superseded(version),
                )
        except GenerationAborted:
            return Interrupted(tuple(specs), version, self.index)
        seconds = (time.perf_counter() - t0) / len(specs)
        g = s.group_size
        return [
            Group(
                spec,
                version,
                self.index,
                result.output_ids[i * g : (i + 1) * g],
                result.logprobs[i * g : (i + 1) * g],
                seconds,
            )
            for i, spec in enumerate(specs)
        ]

    def serve(self, session_id: str, input_ids: list[int], sampling: dict) -> dict:
        """One gateway request on this worker's session caches.

        Args:
            session_id: the session (its KV cache is reused when ``input_ids`` extends it).
            input_ids: the whole token context of the request.
            sampling: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
                ``stop_tokens``.

        Returns:
            ``output_ids``, ``output_logprobs``, ``policy_version``, ``cached_tokens``,
            ``worker``.
        """
        with glmport.use_backend(self.backend), torch.no_grad():
            out = self.sessions.generate(session_id, input_ids, **sampling)
        return {
            "output_ids": out.output_ids,
            "output_logprobs": out.output_logprobs,
            "policy_version": self.version,
            "cached_tokens": out.cached_tokens,
            "worker": self.index,
        }
