"""Per-session KV cache reuse for the token-in-token-out gateway (one rollout worker).

A session is a conversation an agent keeps extending: each request sends the whole
token list so far, and the worker keeps that session's keys and values in one
:class:`~glmport.model.cache.PagedKVCache`. A request whose ``input_ids`` extend the
tokens the session holds **continues** it (only the new suffix is fed); a request that
diverges **forks** it: the cache is truncated to the longest common prefix and the rest
is fed. Either way the outputs are those of a fresh :func:`~glmport.model.generation.generate`
on the full ``input_ids`` (same sampler, same seed, same log-probabilities).

After a request the session holds ``input_ids + output_ids[:-1]``: the last sampled
token has not been fed to the model yet, so the next turn (which starts with it) feeds it.
"""

from __future__ import annotations

import numbers
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from glmport.core.errors import ConfigError, check_int
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.generation import DecodeRun, TokenScorer, check_token_ids, validate_generation
from glmport.model.sampling import (
    PYTHON_NAMES,
    Sampler,
    SamplingNames,
    SamplingParams,
    check_sampling,
)

# Default cache room per session, in tokens: enough for agent turns on the toy tasks,
# and a few MiB for the tiny model; a session longer than this evicts others.
DEFAULT_TOKENS_PER_SESSION = 1024


@dataclass
class SessionOutput:
    """One request's result: ``output_ids`` (new tokens, ending at a stop token or after
    ``max_new_tokens``), ``output_logprobs`` (each new token's log-probability under the
    temperature-scaled distribution, fp32 values as floats, as ``generate`` with
    ``return_logprobs``), ``cached_tokens`` (tokens of ``input_ids`` whose keys and
    values were reused from the session's cache, not recomputed)."""

    output_ids: list[int]
    output_logprobs: list[float]
    cached_tokens: int


def check_request(
    input_ids: Sequence[int],
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    *,
    vocab_size: int,
    max_positions: int,
) -> None:
    """Refuse (:class:`~glmport.core.errors.ConfigError` naming it) empty ``input_ids``,
    ids outside ``[0, vocab_size)`` in ``input_ids`` or ``stop_tokens``, ``max_new_tokens``
    not an int >= 1, or ``input_ids`` + ``max_new_tokens`` beyond ``max_positions``."""
    check_token_ids("input_ids", input_ids, vocab_size, non_empty=True)
    check_token_ids("stop_tokens", stop_tokens, vocab_size, non_empty=False)
    check_int("max_new_tokens", max_new_tokens, 1)
    if len(input_ids) + max_new_tokens > max_positions:
        raise ConfigError(
            f"input_ids ({len(input_ids)} tokens) + max_new_tokens {max_new_tokens} "
            f"exceeds max_position_embeddings {max_positions}"
        )


def session_sampling(
    temperature: object = 1.0,
    top_p: object = 1.0,
    top_k: object = 0,
    seed: object = None,
    *,
    names: SamplingNames = PYTHON_NAMES,
) -> SamplingParams:
    """The gateway's sampling parameters, checked by
    :func:`~glmport.model.sampling.check_sampling`: ``temperature`` 0 means greedy (so the
    greedy spelling in its errors is ``temperature 0``), any other goes to the check."""
    zero = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
    return check_sampling(
        greedy=zero and temperature == 0,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        names=replace(names, greedy=f"{names.temperature} 0"),
    )


@dataclass
class _Session:
    seq: int  # its sequence id in the cache
    tokens: list[int]  # exactly the tokens the cache holds for it, in order


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionStore:
    """Sessions of one model, each holding its tokens' keys and values in one shared
    paged cache.

    Args:
        model: a :class:`~glmport.model.GlmMoeDsaForCausalLM` (eval mode).
        max_sessions: sessions kept at most; past it the least recently used is evicted.
        block_size: slots per cache block.
        cache_tokens: cache slots in all (default: ``max_sessions`` x 1024, and at least
            one full ``max_position_embeddings`` sequence). When a request needs more
            room than is free, least recently used sessions are evicted until it fits.

    Thread-safe: requests run one at a time (a lock), as they would on a Ray actor.
    """

    def __init__(
        self,
        model,
        *,
        max_sessions: int = 64,
        block_size: int = 16,
        cache_tokens: int | None = None,
    ) -> None:
        for name, value in (("max_sessions", max_sessions), ("block_size", block_size)):
            check_int(f"SessionStore: {name}", value, 1)
        self.model = model
        self.max_sessions = max_sessions
        limit = model.config.max_position_embeddings
        if cache_tokens is None:
            cache_tokens = max_sessions * min(limit, DEFAULT_TOKENS_PER_SESSION)
        if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int):
            raise ConfigError(f"SessionStore: cache_tokens must be an int, got {cache_tokens!r}")
        # One request may fill a whole sequence: the cache always has room for one.
        blocks = -(-max(cache_tokens, limit) // block_size)
        weight = model.lm_head.weight
        self.cache = PagedKVCache.for_config(
            model.config,
            model.config.num_hidden_layers,
            blocks,
            block_size,
            dtype=weight.dtype,
            device=weight.device,
        )
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def held_tokens(self, session_id: str) -> list[int]:
        """The tokens whose keys and values the cache holds for ``session_id`` (empty for
        an unknown session)."""
        session = self._sessions.get(session_id)
        return [] if session is None else list(session.tokens)

    def clear(self) -> None:
        """Drop every session (e.g. after a weight update: their caches are void)."""
        with self._lock:
            for session in self._sessions.values():
                self.cache.free(session.seq)
            self._sessions.clear()

    def _evict_oldest(self) -> None:
        _, session = self._sessions.popitem(last=False)
        self.cache.free(session.seq)

    def generate(
        self,
        session_id: str,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_tokens: Sequence[int] = (),
    ) -> SessionOutput:
        """Continue ``input_ids`` (the whole token list of the session so far) by up to
        ``max_new_tokens`` (``>= 1``) tokens, reusing the session's cache.

        ``temperature == 0`` means greedy (argmax; log-probabilities at temperature 1,
        as ``generate(greedy=True)``); else sampling at ``temperature`` with ``top_k``
        (``0``: off) and ``top_p`` (``1``: off), seeded by ``seed`` (``None``: torch's
        global RNG), in the ranges of :mod:`glmport.model.sampling`
        (:func:`session_sampling`). Raises :class:`~glmport.core.errors.ConfigError`
        naming the bad argument (ids outside the vocabulary, empty input, input +
        ``max_new_tokens`` beyond ``max_position_embeddings``, a sampling parameter out
        of range...).
        """
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError(f"session_id must be a non-empty string, got {session_id!r}")
        config = self.model.config
        check_request(
            input_ids,
            max_new_tokens,
            stop_tokens,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
        )
        sampling = session_sampling(temperature, top_p, top_k, seed)
        stop_tokens = tuple(stop_tokens)
        input_ids = list(input_ids)
        validate_generation(self.model, [input_ids], max_new_tokens, sampling, stop_tokens, False)
        with self._lock, torch.no_grad():
            return self._generate(session_id, input_ids, max_new_tokens, sampling, stop_tokens)

    def _generate(
        self,
        session_id: str,
        input_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_tokens: tuple[int, ...],
    ) -> SessionOutput:
        session = self._session(session_id)
        # At least the last input token is fed: its logits choose the first new token.
        reuse = min(_common_prefix(session.tokens, input_ids), len(input_ids) - 1)
        if reuse < len(session.tokens):  # a fork (or a repeat): drop the diverging tail
            self.cache.truncate(session.seq, reuse)
            del session.tokens[reuse:]
        # The cache ends holding input + every new token but the last.
        self._make_room(session, len(input_ids) - reuse + max_new_tokens - 1)
        weight = self.model.lm_head.weight
        sampler = Sampler(sampling, weight.device)
        logprobs: list[list[torch.Tensor]] = [[]]
        scorer = TokenScorer(self.model, sampling.temperature, logprobs)
        run = DecodeRun(1, max_new_tokens, stop_tokens)
        feed = input_ids[reuse:]
        try:
            while True:
                step = forward_cached(self.model, self.cache, [session.seq], [feed], last_only=True)
                session.tokens += feed
                chosen = sampler(step.logits)
                scorer(step, [0], chosen)
                if run.emit(0, chosen.tolist()):
                    break
                feed = run.out[0][-1:]
        except BaseException:
            # An interrupted step leaves the cache and the token list out of step.
            self._drop(session_id)
            raise
        return SessionOutput(
            output_ids=run.out[0],
            output_logprobs=torch.cat(logprobs[0]).tolist(),
            cached_tokens=reuse,
        )

    def _session(self, session_id: str) -> _Session:
        """The session, most recently used now; created (evicting the least recently
        used past ``max_sessions``) when new."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
            return session
        while len(self._sessions) >= self.max_sessions:
            self._evict_oldest()
        session = _Session(self.cache.add_sequence(), [])
        self._sessions[session_id] = session
        return session

    def _make_room(self, session: _Session, tokens: int) -> None:
        """Evict least recently used other sessions until ``tokens`` more fit."""
        while self.cache.blocks_needed(session.seq, tokens) > self.cache.num_free_blocks:
            oldest = next(iter(self._sessions.values()))
            if oldest is session:  # only this one is left; the cache fits one full sequence
                break
            self._evict_oldest()

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.cache.free(session.seq)
