"""Ray for asynchronous RL and the gateway: the session and the rollout-worker actor.

This module imports ray (the ``rl`` extra); glmport imports it only when a run asks for
Ray (``glmport rl train --mode async``, ``glmport rl serve``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from glmport.core.errors import GlmportError

from .workers import RolloutWorker

log = logging.getLogger(__name__)

# Weight-update notices must reach a worker while it samples: they run in their own
# concurrency group; rollouts and gateway requests run one at a time in the default one.
_CONTROL = "control"
# A worker that died or is restarting (ActorUnavailableError is a subclass).
ACTOR_DIED = ray.exceptions.RayActorError
INIT_ATTEMPTS = 3


@contextmanager
def ray_session(address: str | None = None, *, num_cpus: int | None = None) -> Iterator[None]:
    """Ray for the duration of the block.

    Args:
        address: None: start a local Ray instance sized to this machine (``num_cpus``,
            default every core), dashboard off, and shut it down at the end. An address
            (``ray://host:port``, ``host:port`` or ``auto``): join that cluster and
            leave it running.
        num_cpus: the local instance's CPUs (ignored when joining).

    Ray already initialised in this process (a caller's own cluster) is used as it is
    and left alone.
    """
    if ray.is_initialized():
        yield
        return
    # Workers' own log lines stay in Ray's session logs; their errors reach the caller
    # through the results.
    options: dict[str, Any] = dict(configure_logging=False, log_to_driver=False)
    if address is None:
        options.update(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    log.info("ray: %s", f"joining {address}" if address else "starting a local instance")
    _init(address, options)
    try:
        yield
    finally:
        ray.shutdown()


def _init(address: str | None, options: dict[str, Any]) -> None:
    """``ray.init``, tried again when a local node times out during start-up (its raylet
    waits a fixed time for Ray's metrics agent, which a loaded machine can outlast)."""
    for attempt in range(1, INIT_ATTEMPTS + 1):
        try:
            ray.init(address=address, **options)
            return
        except Exception as err:  # Ray raises a bare Exception for the start-up timeout
            ray.shutdown()
            if address is not None or "timed out during startup" not in str(err):
                raise GlmportError(f"Ray did not start: {err}") from err
            if attempt == INIT_ATTEMPTS:
                raise GlmportError(
                    f"Ray's local node timed out during start-up {INIT_ATTEMPTS} times "
                    "(the machine is overloaded?)"
                ) from err
            log.warning("ray: the local node timed out during start-up; trying again")


@ray.remote(concurrency_groups={_CONTROL: 1})
class _RayRolloutWorker(RolloutWorker):
    """:class:`RolloutWorker` as a Ray actor: published weights come from the object
    store; :meth:`notify` and :meth:`health` run beside a rollout or a request."""

    @ray.method(concurrency_group=_CONTROL)
    def notify(self, version: int) -> None:
        super().notify(version)

    @ray.method(concurrency_group=_CONTROL)
    def health(self) -> dict:
        return super().health()

    def _resolve(self, handle: Any) -> dict:
        return ray.get(handle)


def rollout_actor(**options: Any) -> Any:
    """The Ray actor class of :class:`RolloutWorker`, with Ray actor ``options``
    (``max_restarts``, ``num_cpus``, ...); ``.remote(...)`` takes RolloutWorker's
    arguments."""
    return _RayRolloutWorker.options(**options) if options else _RayRolloutWorker
