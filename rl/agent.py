"""Drive the toy agent environment through the token-in-token-out gateway.

:func:`run_episode` plays one episode: each turn it builds the request context with a
context strategy (:mod:`glmport.rl.context`), asks a :class:`PolicyClient` for one
action (``POST /generate``, stop token END), lets the environment
(:mod:`glmport.rl.agent_env`) answer it, and records the sampled tokens, their
log-probabilities and policy version, and the observation in a
:class:`~glmport.rl.agent_env.Trajectory`. With no context management every request
extends the previous one, so the gateway continues the session's KV cache; a folded or
discarded context diverges and the gateway forks it.

:class:`GatewayClient` is the HTTP client (httpx, imported when one is made).
"""

from __future__ import annotations

import contextlib
import math
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from glmport.core.errors import ConfigError, GlmportError, check_int
from glmport.rl.agent_env import AgentEnv, AgentProblem, Trajectory, Turn
from glmport.rl.context import ContextStrategy, FullContext
from glmport.rl.sessions import session_sampling

__all__ = [
    "GatewayClient",
    "GatewayError",
    "PolicyClient",
    "episode_summary",
    "local_gateway",
    "mean_summary",
    "run_episode",
    "run_episodes",
]


class GatewayError(GlmportError, RuntimeError):
    """The gateway refused a request, could not be reached, or answered out of contract."""


class PolicyClient(Protocol):
    """Anything that answers ``POST /generate`` requests."""

    def generate(self, input_ids: list[int], session_id: str, **sampling: Any) -> dict:
        """``sampling``: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
        ``seed``, ``stop_tokens``, ``request_id``. Returns the gateway's reply:
        ``output_ids``, ``output_logprobs``, ``policy_version``, ``cached_tokens``..."""


class GatewayClient:
    """A synchronous client of the gateway.

    Args:
        url: the gateway's base URL, e.g. ``http://127.0.0.1:8000`` (anything else is a
            ConfigError naming ``source``, the argument or flag it came from).
        token: the bearer token, if the gateway wants one.
        timeout: seconds per request.
        http: an ``httpx.Client`` to send through instead of a new one (e.g. FastAPI's
            ``TestClient`` over an in-process app); it is not closed by :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        http: Any = None,
        source: str = "url",
    ) -> None:
        import httpx

        try:
            parts = urllib.parse.urlsplit(url)
            usable = parts.scheme in ("http", "https") and parts.hostname
            usable = usable and (parts.port is None or parts.port > 0)
        except (ValueError, TypeError, AttributeError):  # "[::1", a bad port, not text
            usable = False
        if not usable:
            raise ConfigError(
                f"{source} must be an http(s) URL of a gateway, e.g. http://127.0.0.1:8000, "
                f"got {url!r}"
            )
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = http is None
        self._http = httpx.Client(timeout=timeout) if http is None else http
        self._timeout = timeout

    def close(self) -> None:
        """Close the HTTP connection pool (unless it was passed in)."""
        if self._own:
            self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        try:
            reply = self._http.request(
                method, self.url + path, json=body, headers=self._headers, timeout=self._timeout
            )
        except httpx.TimeoutException as err:
            raise GatewayError(
                f"no answer from the gateway at {self.url} within {self._timeout:g} s "
                f"({type(err).__name__})"
            ) from err
        except (httpx.HTTPError, httpx.InvalidURL) as err:
            raise GatewayError(f"cannot reach the gateway at {self.url}: {err}") from err
        try:
            data = reply.json()
        except ValueError:
            data = None
        if reply.status_code >= 400:
            detail = data.get("detail", data) if isinstance(data, dict) else reply.text[:500]
            raise GatewayError(f"gateway {method} {path}: HTTP {reply.status_code}: {detail}")
        if not isinstance(data, dict):
            raise GatewayError(f"gateway {method} {path}: reply is not a JSON object")
        return data

    def health(self) -> dict:
        """``GET /health``'s JSON."""
        return self._request("GET", "/health")

    def generate(self, input_ids: list[int], session_id: str, **sampling: Any) -> dict:
        """``POST /generate`` with ``input_ids``, ``session_id`` and the ``sampling``
        fields (:class:`PolicyClient`); returns the reply's JSON. Raises
        :class:`GatewayError` with the gateway's ``detail`` on HTTP 4xx / 5xx."""
        return self._request(
            "POST",
            "/generate",
            {"input_ids": list(input_ids), "session_id": session_id, **sampling},
        )


def _checked(reply: Any, input_len: int, max_new_tokens: int) -> dict:
    """The reply, after checking it keeps the gateway's contract (a wrong reply would
    otherwise end up in the trajectory as if the policy had sampled it)."""

    def fail(what: str) -> GatewayError:
        return GatewayError(f"gateway reply: {what}, got {str(reply)[:300]}")

    if not isinstance(reply, dict):
        raise fail("not a JSON object")
    ids, logprobs = reply.get("output_ids"), reply.get("output_logprobs")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise fail("'output_ids' must be a list of token ids")
    if not 1 <= len(ids) <= max_new_tokens:
        raise fail(f"'output_ids' must hold 1 .. {max_new_tokens} tokens")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        raise fail("'output_logprobs' must be a list as long as 'output_ids'")
    if not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
        for x in logprobs
    ):
        raise fail("'output_logprobs' must be finite numbers <= 0")
    version, cached = reply.get("policy_version"), reply.get("cached_tokens")
    if isinstance(version, bool) or not isinstance(version, int):
        raise fail("'policy_version' must be an int")
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached <= input_len:
        raise fail(f"'cached_tokens' must be an int in [0, {input_len}]")
    return reply


def run_episode(
    env: AgentEnv,
    client: PolicyClient,
    session_id: str,
    *,
    problem: AgentProblem,
    context: ContextStrategy | None = None,
    max_turns: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
) -> Trajectory:
    """Play one episode of ``problem`` through ``client``.

    Args:
        env: the environment.
        client: the policy (a :class:`GatewayClient` or anything with its ``generate``).
        session_id: the gateway session (one per episode: its KV cache is the episode's).
        problem: from ``env.sample``.
        context: the context strategy (default :class:`~glmport.rl.context.FullContext`).
        max_turns, max_new_tokens: default the environment's.
        temperature, top_p, top_k: sampling (``temperature`` 0: greedy).
        seed: request ``i`` is sampled with seed ``seed + i`` (None: unseeded).

    Returns:
        The :class:`~glmport.rl.agent_env.Trajectory`; it ends at an answer, after
        ``max_turns`` turns (reward 0), or when the next request would pass
        ``env.max_context`` (reward 0).

    Raises:
        GatewayError: the gateway refused a request or broke its contract.
    """
    context = FullContext() if context is None else context
    max_turns = env.max_turns if max_turns is None else max_turns
    max_new = env.max_new_tokens if max_new_tokens is None else max_new_tokens
    for name, value in (("max_turns", max_turns), ("max_new_tokens", max_new)):
        check_int(f"argument '{name}'", value, 1)
    session_sampling(temperature, top_p, top_k, seed)  # refused here, before any request
    trajectory = Trajectory(problem)
    for i in range(max_turns):
        view = context(problem.prompt, trajectory.turns, env.vocab.fold)
        if len(view.tokens) + max_new > env.max_context:
            trajectory.end = "max_context"
            return trajectory
        reply = _checked(
            client.generate(
                list(view.tokens),
                session_id,
                request_id=f"{session_id}/{i}",
                max_new_tokens=max_new,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=top_k,
                seed=None if seed is None else seed + i,
                stop_tokens=[env.vocab.end],
            ),
            len(view.tokens),
            max_new,
        )
        step = env.step(problem, reply["output_ids"])
        trajectory.turns.append(
            Turn(
                action=tuple(reply["output_ids"]),
                observation=step.observation,
                kind=step.kind,
                logprobs=tuple(float(x) for x in reply["output_logprobs"]),
                policy_version=reply["policy_version"],
                context=view.tokens,
                cached_tokens=reply["cached_tokens"],
                folded=view.folded,
                dropped=view.dropped,
            )
        )
        if step.reward is not None:
            trajectory.reward, trajectory.end = step.reward, "answer"
            return trajectory
    trajectory.end = "max_turns"
    return trajectory


def episode_summary(trajectory: Trajectory) -> dict:
    """A JSON-ready summary of one episode: reward, end, turns, tool calls, malformed
    actions, tokens generated / sent / reused from the cache / folded / dropped, and the
    cache reuse ratio (reused / sent input tokens)."""
    kinds = [t.kind for t in trajectory.turns]
    sent = trajectory.context_tokens
    return {
        "reward": trajectory.reward,
        "end": trajectory.end,
        "turns": len(trajectory.turns),
        "calls": kinds.count("call"),
        "errors": kinds.count("error"),
        "generated_tokens": trajectory.generated_tokens,
        "context_tokens": sent,
        "cached_tokens": trajectory.cached_tokens,
        "folded_tokens": trajectory.folded,
        "dropped_tokens": trajectory.dropped,
        "cache_reuse": trajectory.cached_tokens / sent if sent else 0.0,
    }


def mean_summary(summaries: Sequence[dict]) -> dict:
    """Over the :func:`episode_summary` dicts of a run (at least one): episodes, mean
    reward, episodes solved (reward 1), and the totals of turns and of tokens generated,
    folded and dropped, and the cache reuse ratio over all requests."""
    if not summaries:
        raise ConfigError("mean_summary: no episodes")

    def total(key: str) -> float:
        return sum(s[key] for s in summaries)

    sent = total("context_tokens")
    return {
        "episodes": len(summaries),
        "mean_reward": total("reward") / len(summaries),
        "solved": sum(s["reward"] == 1.0 for s in summaries),
        "turns": total("turns"),
        "generated_tokens": total("generated_tokens"),
        "folded_tokens": total("folded_tokens"),
        "dropped_tokens": total("dropped_tokens"),
        "cache_reuse": total("cached_tokens") / sent if sent else 0.0,
    }


def run_episodes(
    env: AgentEnv,
    client: PolicyClient,
    *,
    episodes: int,
    context: ContextStrategy | None = None,
    seed: int = 0,
    temperature: float = 1.0,
    session_prefix: str = "agent",
) -> list[Trajectory]:
    """Play ``episodes`` episodes, one gateway session each
    (``f"{session_prefix}-{seed}-{e}"``); problems and request seeds are drawn from a
    generator seeded with ``seed``, so a run is reproducible on the same gateway."""
    check_int("argument 'episodes'", episodes, 1)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for e in range(episodes):
        problem = env.sample(generator)
        request_seed = int(torch.randint(0, 2**31, (1,), generator=generator))
        out.append(
            run_episode(
                env,
                client,
                f"{session_prefix}-{seed}-{e}",
                problem=problem,
                context=context,
                temperature=temperature,
                seed=request_seed,
            )
        )
    return out


@contextlib.contextmanager
def local_gateway(model, version: int = 0) -> Iterator[GatewayClient]:
    """Serve ``model`` (a :class:`~glmport.model.GlmMoeDsaForCausalLM`) as policy
    ``version`` through the gateway app on a free loopback port (one in-process rollout
    worker), for the block; yields a :class:`GatewayClient` to it."""
    from glmport.rl.gateway import running_server, start_local_pool
    from glmport.rl.gateway_app import create_app

    pool = start_local_pool(model, version)
    try:
        with running_server(create_app(pool)) as url, GatewayClient(url) as client:
            yield client
    finally:
        pool.close()
