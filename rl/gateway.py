"""The token-in-token-out gateway's workers: session affinity and worker pools.

``glmport rl serve`` puts :mod:`glmport.rl.gateway_app` (FastAPI) in front of a pool of
:class:`~glmport.rl.workers.RolloutWorker` objects. A session sticks to one worker, picked
by a consistent-hash ring on its ``session_id`` (:class:`HashRing`), so that worker's
:class:`~glmport.rl.sessions.SessionStore` reuses the session's KV cache turn after turn.

Pools (what the app talks to): :class:`LocalPool` runs the workers in this process (a
thread each), :class:`RayPool` drives Ray actors. Both: ``size``, ``vocab_size``,
``max_positions``, ``async serve(worker, session_id, input_ids, sampling) -> dict``,
``async health() -> list[dict]``, ``close()``.

This module imports no optional package at import time (Ray, uvicorn load on use).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from glmport.core.errors import ConfigError, GlmportError, check_int

from .workers import RolloutWorker

VIRTUAL_NODES = 64  # ring points per worker: each gets within ~15% of an even share
HEALTH_TIMEOUT_S = 5.0


class WorkerUnavailable(GlmportError):
    """The worker a request was routed to is dead or restarting (HTTP 503)."""


# -- session affinity ------------------------------------------------------------------


def stable_hash(key: str) -> int:
    """A 64-bit hash of ``key`` that is the same in every process and run (Python's
    ``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring of worker numbers with ``vnodes`` points each: a key goes
    to the worker owning the first point at or after its hash (wrapping). Removing a
    worker moves only the keys it owned; adding one takes keys only from the others."""

    def __init__(self, nodes: Iterable[int], *, vnodes: int = VIRTUAL_NODES) -> None:
        check_int("HashRing: vnodes", vnodes, 1)
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[int] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> set[int]:
        return set(self._owners)

    def add(self, node: int) -> None:
        """Put ``node`` on the ring (a no-op when it is there)."""
        if node in self._owners:
            return
        for i in range(self.vnodes):
            point = stable_hash(f"worker-{node}#{i}")
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, node)

    def remove(self, node: int) -> None:
        """Take ``node`` off the ring."""
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def node_for(self, key: str) -> int:
        """The worker number ``key`` maps to."""
        if not self._points:
            raise ConfigError("HashRing: no workers on the ring")
        at = bisect.bisect_left(self._points, stable_hash(key))
        return self._owners[at % len(self._points)]


# -- pools -----------------------------------------------------------------------------


class LocalPool:
    """In-process workers; each serves on its own thread, one request at a time.

    Args:
        workers: the :class:`RolloutWorker` objects (weights loaded), worker ``i`` at
            index ``i``.
    """

    def __init__(self, workers: Sequence[RolloutWorker]) -> None:
        if not workers:
            raise ConfigError("LocalPool: at least one worker")
        self.workers = list(workers)
        config = self.workers[0].model.config
        self.vocab_size, self.max_positions = config.vocab_size, config.max_position_embeddings
        # One thread per worker: its requests run one at a time, in arrival order, and a
        # busy worker never holds up another's.
        self._threads = [
            ThreadPoolExecutor(1, thread_name_prefix=f"gateway-worker-{i}")
            for i in range(len(self.workers))
        ]

    @property
    def size(self) -> int:
        return len(self.workers)

    async def serve(
        self, worker: int, session_id: str, input_ids: list[int], sampling: dict
    ) -> dict:
        """``RolloutWorker.serve`` on worker ``worker``'s thread."""
        loop = asyncio.get_running_loop()
        call = self.workers[worker].serve
        return await loop.run_in_executor(
            self._threads[worker], call, session_id, input_ids, sampling
        )

    async def health(self) -> list[dict]:
        return [{"alive": True, **w.health(), "worker": i} for i, w in enumerate(self.workers)]

    def close(self) -> None:
        for thread in self._threads:
            thread.shutdown(wait=True)


class RayPool:
    """Rollout-worker Ray actors (``glmport.rl.ray_runtime.rollout_actor``).

    Ray restarts a dead actor (``max_restarts``) with fresh, unloaded weights; the pool
    notices (a failed call, or a reply from another policy version) and loads the
    published weights into it again before it serves. A request in flight on a dying
    actor fails with :class:`WorkerUnavailable` (HTTP 503); it is not retried, so no
    request is ever answered twice.

    Args:
        actors: the actor handles, worker ``i`` at index ``i``.
        model_config: ``GlmMoeDsaConfig.to_dict()`` of their policy.
        version / weights: the policy version and an object-store ref of its state dict,
            which every actor holds (see :func:`start_ray_pool`).
    """

    def __init__(self, actors: Sequence[Any], model_config: dict, version: int, weights) -> None:
        if not actors:
            raise ConfigError("RayPool: at least one actor")
        self.actors = list(actors)
        self.vocab_size = model_config["vocab_size"]
        self.max_positions = model_config["max_position_embeddings"]
        self.version, self.weights = version, weights
        self._reload = [False] * len(self.actors)

    @property
    def size(self) -> int:
        return len(self.actors)

    async def serve(
        self, worker: int, session_id: str, input_ids: list[int], sampling: dict
    ) -> dict:
        """``RolloutWorker.serve`` on actor ``worker``."""
        from .ray_runtime import ACTOR_DIED

        actor = self.actors[worker]
        try:
            if self._reload[worker]:
                await actor.load_weights.remote(self.version, self.weights)
                self._reload[worker] = False
            out = await self._call(actor.serve.remote(session_id, input_ids, sampling))
            if out["policy_version"] != self.version:
                # Restarted since its last call (weights unloaded): that answer came from
                # the wrong weights; load them and serve the request again.
                await actor.load_weights.remote(self.version, self.weights)
                out = await self._call(actor.serve.remote(session_id, input_ids, sampling))
        except ACTOR_DIED as err:
            self._reload[worker] = True
            raise WorkerUnavailable(
                f"rollout worker {worker} is unavailable (restarting or dead); retry later: "
                f"{type(err).__name__}"
            ) from None
        return out

    @staticmethod
    async def _call(ref) -> dict:
        """Await an actor call; a ``GlmportError`` raised inside the actor is raised here
        as itself (Ray wraps it in a ``RayTaskError``)."""
        import ray

        try:
            return await ref
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, GlmportError):
                raise err.cause from None
            raise

    async def health(self) -> list[dict]:
        """Each actor's liveness and policy version; ``alive`` None when it did not
        answer within 5 s."""
        from .ray_runtime import ACTOR_DIED

        async def one(i: int, actor) -> dict:
            try:
                info = await asyncio.wait_for(actor.health.remote(), HEALTH_TIMEOUT_S)
                return {"alive": True, **info, "worker": i}
            except asyncio.TimeoutError:
                return {"worker": i, "alive": None, "policy_version": None}
            except ACTOR_DIED:
                self._reload[i] = True
                return {"worker": i, "alive": False, "policy_version": None}

        return list(await asyncio.gather(*(one(i, a) for i, a in enumerate(self.actors))))

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


# -- building a pool from a model ------------------------------------------------------


def policy_source(spec: str) -> tuple[str, int]:
    """``--model`` of ``glmport rl serve``: ``"tiny"``, a model folder, or an RL
    checkpoint (``out/checkpoint``, whose model is ``policy/``). Returns the model spec
    to load (``"tiny"`` or a folder) and its policy version: ``policy_version`` from the
    checkpoint's ``state.json`` for an RL checkpoint or its ``policy/``, else 0."""
    if spec == "tiny":
        return spec, 0
    folder = Path(spec)
    if (folder / "state.json").is_file() and (folder / "policy").is_dir():
        folder = folder / "policy"
    state = folder.parent / "state.json"
    if folder.name != "policy" or not state.is_file():
        return str(folder), 0
    try:
        version = json.loads(state.read_text())["policy_version"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{state}: no policy_version ({type(err).__name__}: {err})") from err
    if isinstance(version, bool) or not isinstance(version, int):
        raise ConfigError(f"{state}: policy_version must be an int, got {version!r}")
    return str(folder), version


def start_local_pool(
    model,
    version: int,
    *,
    workers: int = 1,
    backend: str | None = None,
    dtype: str = "fp32",
    max_sessions: int = 64,
) -> LocalPool:
    """``workers`` in-process rollout workers holding ``model``'s weights as ``version``."""
    state = model.state_dict()
    pool = []
    for i in range(workers):
        worker = RolloutWorker(
            model.config.to_dict(), backend=backend, dtype=dtype, index=i, max_sessions=max_sessions
        )
        worker.load_weights(version, state)
        pool.append(worker)
    return LocalPool(pool)


def start_ray_pool(
    model,
    version: int,
    *,
    workers: int = 1,
    backend: str | None = None,
    dtype: str = "fp32",
    max_sessions: int = 64,
    max_restarts: int = 3,
) -> RayPool:
    """``workers`` rollout-worker Ray actors (Ray must be running, e.g. in
    ``ray_session()``), sharing the machine's cores, holding ``model``'s weights as
    ``version`` (published once to the object store)."""
    import ray

    import glmport

    from .ray_runtime import rollout_actor

    with glmport.use_backend(backend):  # an unknown backend fails here, not in every actor
        pass
    cores = os.cpu_count() or 1
    actor = rollout_actor(
        max_restarts=max_restarts, max_task_retries=0, num_cpus=min(1.0, cores / workers)
    )
    config = model.config.to_dict()
    actors = [
        actor.remote(
            config,
            backend=backend,
            dtype=dtype,
            threads=max(1, cores // workers),
            index=i,
            max_sessions=max_sessions,
        )
        for i in range(workers)
    ]
    weights = ray.put(model.state_dict())
    ray.get([a.load_weights.remote(version, weights) for a in actors])
    return RayPool(actors, config, version, weights)


# -- running the server ----------------------------------------------------------------


def _bound_url(server, host: str) -> str:
    port = server.servers[0].sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


@contextlib.contextmanager
def running_server(app, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0):
    """Serve ``app`` with uvicorn on a background thread for the block; yields its URL
    (``port`` 0: a free port). Stops the server at the end."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="gateway-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise GlmportError(f"the gateway did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield _bound_url(server, host)
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def serve_forever(app, host: str, port: int, *, announce) -> None:
    """Serve ``app`` in the foreground until SIGINT / SIGTERM (uvicorn stops gracefully);
    ``announce(url)`` runs once the socket is bound."""
    import signal

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

    async def main() -> None:
        async def watch() -> None:
            while not server.started:
                await asyncio.sleep(0.02)
            announce(_bound_url(server, host))

        watcher = asyncio.ensure_future(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    # uvicorn re-raises the signal that stopped it once it has shut down: as
    # KeyboardInterrupt, so the caller's clean-up (Ray) runs for SIGTERM too.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except SystemExit:  # uvicorn exits when it cannot bind; said below, as glmport does
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise GlmportError(f"the gateway could not listen on {host}:{port} (see the log above)")
