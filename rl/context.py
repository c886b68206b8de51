"""GLM-5's context management for agents, as pure transforms of a trajectory's turns.

A strategy maps ``(prompt, turns so far)`` to the ``input_ids`` of the next request
(:class:`ContextView`); the trajectory itself always keeps the full record. Every turn
before the next request is a tool turn (an answer ends the episode), malformed calls
included.

- :class:`FullContext` (``none``): prompt, then every turn's action and observation.
- :class:`KeepRecent` (``keep-recent:K``): the last ``k`` tool turns in full; every
  older turn keeps its action (the call) and has its observation replaced by the one
  token FOLD. GLM-5 folds tool *results*: in its agent tasks those (web pages, files)
  are what fills the context, while the calls are short and say what was done.
- :class:`DiscardAll` (``discard-all:T``): once the context would pass ``threshold``
  tokens (``len > threshold``; exactly ``threshold`` is kept) the history is dropped
  and the next request restarts from the task prompt alone; later turns build on that
  restart until it passes the threshold again. It wraps an inner strategy and tests
  the threshold on the inner strategy's context.
- :func:`hybrid` (``hybrid:K,T``): GLM-5's combination, keep-recent-k inside
  discard-all: fold first, and discard once even the folded context passes ``T``.

Accounting: ``folded`` is the number of tokens folding removed from the request,
``dropped`` the number of full-record tokens of the discarded turns; so
``len(prompt) + sum(len(action) + len(observation)) == len(tokens) + folded + dropped``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from glmport.core.errors import ConfigError, check_int
from glmport.rl.agent_env import Turn

__all__ = [
    "ContextStrategy",
    "ContextView",
    "DiscardAll",
    "FullContext",
    "KeepRecent",
    "hybrid",
    "parse_context",
]


@dataclass(frozen=True)
class ContextView:
    """The next request's context.

    Attributes:
        tokens: the ``input_ids`` to send.
        folded: tokens removed by folding observations.
        dropped: tokens of the turns removed by discarding history.
    """

    tokens: tuple[int, ...]
    folded: int = 0
    dropped: int = 0


class ContextStrategy(ABC):
    """A context-management strategy: a pure function of the prompt and the turns."""

    @abstractmethod
    def __call__(self, prompt: Sequence[int], turns: Sequence[Turn], fold: int) -> ContextView:
        """The context of the request after ``turns``.

        Args:
            prompt: the task prompt token ids.
            turns: the episode's turns so far (their ``action`` and ``observation``).
            fold: the FOLD token id (:attr:`AgentVocab.fold`).
        """

    @abstractmethod
    def spec(self) -> str:
        """The command-line spelling, e.g. ``"keep-recent:2"``."""


@dataclass(frozen=True)
class FullContext(ContextStrategy):
    """No context management: prompt, then every action and observation."""

    def __call__(self, prompt: Sequence[int], turns: Sequence[Turn], fold: int) -> ContextView:
        """Prompt + every turn's action and observation; nothing folded or dropped."""
        out = list(prompt)
        for turn in turns:
            out += turn.action + turn.observation
        return ContextView(tuple(out))

    def spec(self) -> str:
        """``"none"``."""
        return "none"


@dataclass(frozen=True)
class KeepRecent(ContextStrategy):
    """Keep the last ``k`` tool turns in full; older ones keep their action and have
    their observation folded into one FOLD token (``k = 0``: every turn folded)."""

    k: int

    def __post_init__(self) -> None:
        check_int("argument 'k'", self.k, 0)

    def __call__(self, prompt: Sequence[int], turns: Sequence[Turn], fold: int) -> ContextView:
        """Prompt + folded older turns + the last ``k`` turns in full."""
        out, folded = list(prompt), 0
        cut = max(len(turns) - self.k, 0)
        for i, turn in enumerate(turns):
            out += turn.action
            if i < cut and turn.observation:
                out.append(fold)
                folded += len(turn.observation) - 1
            else:
                out += turn.observation
        return ContextView(tuple(out), folded=folded)

    def spec(self) -> str:
        """``"keep-recent:K"``."""
        return f"keep-recent:{self.k}"


@dataclass(frozen=True)
class DiscardAll(ContextStrategy):
    """Drop the history and restart from the prompt whenever the ``inner`` strategy's
    context passes ``threshold`` tokens (``len > threshold``)."""

    threshold: int
    inner: ContextStrategy = FullContext()

    def __post_init__(self) -> None:
        check_int("argument 'threshold'", self.threshold, 1)

    def __call__(self, prompt: Sequence[int], turns: Sequence[Turn], fold: int) -> ContextView:
        """Replays the episode: after each turn the context since the last restart is
        tested against the threshold; the turns before the last restart are dropped."""
        start = 0
        for i in range(len(turns)):
            if len(self.inner(prompt, turns[start : i + 1], fold).tokens) > self.threshold:
                start = i + 1
        view = self.inner(prompt, turns[start:], fold)
        dropped = sum(len(t.action) + len(t.observation) for t in turns[:start])
        return ContextView(view.tokens, folded=view.folded, dropped=view.dropped + dropped)

    def spec(self) -> str:
        """``"discard-all:T"`` or ``"hybrid:K,T"``."""
        if isinstance(self.inner, KeepRecent):
            return f"hybrid:{self.inner.k},{self.threshold}"
        return f"discard-all:{self.threshold}"


def hybrid(k: int, threshold: int) -> DiscardAll:
    """GLM-5's hybrid: keep-recent-``k``, and discard-all once the folded context
    passes ``threshold`` tokens."""
    return DiscardAll(threshold, KeepRecent(k))


def parse_context(spec: str) -> ContextStrategy:
    """A strategy from its spelling: ``none``, ``keep-recent:K``, ``discard-all:T`` or
    ``hybrid:K,T`` (``K >= 0``, ``T >= 1``).

    Raises:
        ConfigError: any other spelling, naming the valid ones.
    """
    name, _, arg = spec.partition(":")
    try:
        numbers = [int(x) for x in arg.split(",")] if arg else []
        if name == "none" and not arg:
            return FullContext()
        if name == "keep-recent" and len(numbers) == 1:
            return KeepRecent(numbers[0])
        if name == "discard-all" and len(numbers) == 1:
            return DiscardAll(numbers[0])
        if name == "hybrid" and len(numbers) == 2:
            return hybrid(*numbers)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"context strategy {spec!r}: {err}") from None
    raise ConfigError(
        f"unknown context strategy {spec!r}; valid: none, keep-recent:K, discard-all:T, "
        "hybrid:K,T (K >= 0 turns kept in full, T >= 1 tokens)"
    )
