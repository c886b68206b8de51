"""A multi-turn toy agent environment with verifiable tool calls, at the token level.

The vocabulary follows :mod:`glmport.rl.tasks`: digits are token ids ``0 .. base-1``,
then special tokens (:class:`AgentVocab`). A problem asks for the sum of ``terms``
numbers of ``digits`` digits each. In the ``add`` task the numbers are in the prompt;
in the ``lookup`` task the prompt only names one-digit keys of a table that is hidden
and drawn afresh per episode, so the agent has to call the LOOKUP tool to see them.

Prompt: ``OP x_1 PLUS x_2 ... PLUS x_n SEP`` with ``OP`` = ADD (``x_i``: numbers,
most significant digit first) or LOOKUP (``x_i``: one key digit each).

Every policy turn is one action, generated up to END (the stop token):

- ``ADD a PLUS b END`` (``a``, ``b``: 1 .. width digits): observation
  ``RESULT s END``, ``s = a + b`` in ``width`` digits (an overflowing sum is an error);
- ``LOOKUP k END`` (``k``: one digit, lookup task only): observation
  ``RESULT v END``, the table's value of ``k`` in ``width`` digits;
- ``ANSWER d_1 .. d_width END``: ends the episode; the reward is the fraction of the
  ``width`` answer positions that hold the right digit (1.0: exact). A missing END
  (the turn ran out of tokens) still scores the digits given;
- anything else (garbage, a bad argument, a missing END) is malformed: observation
  ``ERROR``, and the episode goes on.

``width`` is the number of digits of the largest possible sum. Numbers the
environment writes are zero-padded to ``width``, most significant digit first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from glmport.core.errors import ConfigError, check_int

__all__ = [
    "AGENT_TASKS",
    "AgentEnv",
    "AgentProblem",
    "AgentVocab",
    "Step",
    "Trajectory",
    "Turn",
]

AGENT_TASKS = ("add", "lookup")

# names of the special tokens in id order after the digits
_SPECIALS = ("SEP", "PLUS", "ADD", "LOOKUP", "END", "RESULT", "ERROR", "ANSWER", "FOLD")


@dataclass(frozen=True)
class AgentVocab:
    """Token ids of the agent environment: digits ``0 .. base-1``, then, in order,
    SEP, PLUS (as in :mod:`glmport.rl.tasks`), ADD, LOOKUP, END, RESULT, ERROR,
    ANSWER, FOLD; ``vocab_size = base + 9``. FOLD is written only by the context
    strategies (:mod:`glmport.rl.context`), never by the environment."""

    base: int = 10

    def __post_init__(self) -> None:
        check_int("argument 'base'", self.base, 2)

    def _special(self, name: str) -> int:
        return self.base + _SPECIALS.index(name)

    sep = property(lambda self: self._special("SEP"), doc="SEP: ends the prompt.")
    plus = property(lambda self: self._special("PLUS"), doc="PLUS: separates operands.")
    add = property(lambda self: self._special("ADD"), doc="ADD: the add tool / task.")
    lookup = property(lambda self: self._special("LOOKUP"), doc="LOOKUP: the lookup tool / task.")
    end = property(lambda self: self._special("END"), doc="END: closes an action or result.")
    result = property(lambda self: self._special("RESULT"), doc="RESULT: opens a tool result.")
    error = property(lambda self: self._special("ERROR"), doc="ERROR: a malformed action.")
    answer = property(lambda self: self._special("ANSWER"), doc="ANSWER: opens the answer.")
    fold = property(lambda self: self._special("FOLD"), doc="FOLD: a folded observation.")

    @property
    def vocab_size(self) -> int:
        """Number of token ids the environment uses (``base + 9``)."""
        return self.base + len(_SPECIALS)

    def is_digit(self, token: int) -> bool:
        """Whether ``token`` is a digit id (``0 <= token < base``)."""
        return 0 <= token < self.base

    def render(self, tokens: Sequence[int]) -> str:
        """Human-readable text of token ids, e.g. ``"ADD 4 2 PLUS 1 7 END"``; ids past
        the vocabulary (a policy with a larger one) print as ``<id>``."""
        names = []
        for t in tokens:
            if self.is_digit(t):
                names.append(str(t))
            elif self.base <= t < self.vocab_size:
                names.append(_SPECIALS[t - self.base])
            else:
                names.append(f"<{t}>")
        return " ".join(names)


@dataclass(frozen=True)
class AgentProblem:
    """One episode's problem.

    Attributes:
        prompt: the task prompt token ids.
        answer: the expected answer digits (``width`` of them, most significant first).
        table: the hidden lookup table (value of key ``k`` at index ``k``; ``base``
            entries), or None for the add task.
    """

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    table: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Step:
    """What the environment made of one action.

    Attributes:
        kind: ``"call"`` (a tool call that ran), ``"error"`` (malformed) or ``"answer"``.
        observation: token ids the environment appends (empty after an answer).
        reward: the episode's reward after an answer, else None.
    """

    kind: str
    observation: tuple[int, ...]
    reward: float | None = None


@dataclass(frozen=True)
class Turn:
    """One policy turn: the request's context, the sampled action, the observation.

    Attributes:
        action: token ids the policy generated (sampled; these are trained on).
        observation: token ids the environment inserted after them (loss-masked).
        kind: the :class:`Step` kind.
        logprobs: the sampling log-probability of each action token (gateway's).
        policy_version: the policy version that sampled the action.
        context: the ``input_ids`` of the request (after the context strategy): the
            exact tokens the action was sampled after.
        cached_tokens: prefix tokens the gateway reused from the session's KV cache.
        folded: tokens the context strategy folded out of this request.
        dropped: tokens the context strategy discarded from this request.
    """

    action: tuple[int, ...]
    observation: tuple[int, ...]
    kind: str = "call"
    logprobs: tuple[float, ...] = ()
    policy_version: int = -1
    context: tuple[int, ...] = ()
    cached_tokens: int = 0
    folded: int = 0
    dropped: int = 0


@dataclass
class Trajectory:
    """A whole episode.

    Attributes:
        problem: the problem.
        turns: the policy turns in order.
        reward: the reward (0.0 when the episode ended without an answer).
        end: why it ended: ``"answer"``, ``"max_turns"`` or ``"max_context"``.
    """

    problem: AgentProblem
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    end: str = ""

    def tokens(self) -> list[int]:
        """The full record: prompt, then every turn's action and observation (what the
        context would be with no context management)."""
        out = list(self.problem.prompt)
        for turn in self.turns:
            out += turn.action + turn.observation
        return out

    def action_mask(self) -> list[bool]:
        """Aligned with :meth:`tokens`: True on the tokens the policy sampled, False on
        the prompt and the observations (the loss mask)."""
        out = [False] * len(self.problem.prompt)
        for turn in self.turns:
            out += [True] * len(turn.action) + [False] * len(turn.observation)
        return out

    def logprobs(self) -> list[float]:
        """Aligned with :meth:`tokens`: the sampling log-probability of each sampled
        token, 0.0 where :meth:`action_mask` is False."""
        out = [0.0] * len(self.problem.prompt)
        for turn in self.turns:
            out += list(turn.logprobs) + [0.0] * len(turn.observation)
        return out

    def training_rows(self) -> list[tuple[list[int], list[bool], list[float]]]:
        """One row per turn, what that action was sampled from: ``(tokens, mask,
        logprobs)`` with ``tokens = context + action`` (the request's ``input_ids`` after
        the context strategy, then the sampled tokens), ``mask`` True on the action, and
        ``logprobs`` aligned (0.0 off the action). Under a folding or discarding strategy
        the policy never saw the full record, so train on these rows, not on
        :meth:`tokens`."""
        rows = []
        for turn in self.turns:
            pad = len(turn.context)
            rows.append(
                (
                    list(turn.context + turn.action),
                    [False] * pad + [True] * len(turn.action),
                    [0.0] * pad + list(turn.logprobs),
                )
            )
        return rows

    @property
    def generated_tokens(self) -> int:
        """Number of tokens the policy sampled over the episode."""
        return sum(len(t.action) for t in self.turns)

    @property
    def context_tokens(self) -> int:
        """Number of input tokens sent over all requests."""
        return sum(len(t.context) for t in self.turns)

    @property
    def cached_tokens(self) -> int:
        """Number of input tokens the gateway reused from KV caches, over all requests."""
        return sum(t.cached_tokens for t in self.turns)

    @property
    def folded(self) -> int:
        """Tokens folded out of the requests, summed over requests."""
        return sum(t.folded for t in self.turns)

    @property
    def dropped(self) -> int:
        """Tokens discarded from the requests, summed over requests."""
        return sum(t.dropped for t in self.turns)


class AgentEnv:
    """The toy agent environment (see the module docstring for the protocol).

    Args:
        task: ``"add"`` or ``"lookup"``.
        terms: numbers to sum (>= 2).
        digits: digits per number (>= 1).
        base: digit alphabet size (>= 2).
        max_turns: policy turns per episode at most (>= 1).
        max_new_tokens: tokens per action at most (default: the longest valid
            action, ``ADD a PLUS b END`` with ``width``-digit operands).
        max_context: bound on a request's ``len(input_ids) + max_new_tokens``; an
            episode whose next request would pass it ends (``"max_context"``).
    """

    def __init__(
        self,
        task: str = "lookup",
        *,
        terms: int = 2,
        digits: int = 2,
        base: int = 10,
        max_turns: int = 8,
        max_new_tokens: int | None = None,
        max_context: int = 256,
    ) -> None:
        if task not in AGENT_TASKS:
            raise ConfigError(
                f"argument 'task': unknown agent task {task!r}; valid: {', '.join(AGENT_TASKS)}"
            )
        self.task = task
        self.terms = check_int("argument 'terms'", terms, 2)
        self.digits = check_int("argument 'digits'", digits, 1)
        self.vocab = AgentVocab(base)
        self.base = base
        self.max_turns = check_int("argument 'max_turns'", max_turns, 1)
        self.width = len(self._to_digits(self.terms * (base**self.digits - 1), 0))
        longest = 2 * self.width + 3
        self.max_new_tokens = check_int(
            "argument 'max_new_tokens'", longest if max_new_tokens is None else max_new_tokens, 1
        )
        self.max_context = check_int("argument 'max_context'", max_context, 1)
        prompt_len = 2 + self.terms * (self.digits if task == "add" else 1) + self.terms - 1
        if prompt_len + self.max_new_tokens > self.max_context:
            raise ConfigError(
                f"argument 'max_context' ({max_context}) leaves no room for the prompt "
                f"({prompt_len} tokens) and one action ({self.max_new_tokens} tokens)"
            )

    def describe(self) -> str:
        """One line saying what the environment is."""
        what = "numbers given" if self.task == "add" else "values behind one-digit keys (hidden)"
        return (
            f"{self.task}: sum {self.terms} {self.digits}-digit base-{self.base} {what}, "
            f"tools ADD{'' if self.task == 'add' else ' + LOOKUP'}, answer {self.width} digits, "
            f"<= {self.max_turns} turns of <= {self.max_new_tokens} tokens, "
            f"vocab {self.vocab.vocab_size}"
        )

    def _to_digits(self, value: int, width: int) -> list[int]:
        """``value`` in base ``base``, most significant first, zero-padded to ``width``."""
        out = []
        while value or len(out) < max(width, 1):
            value, d = divmod(value, self.base)
            out.append(d)
        return out[::-1]

    def _value(self, digits: Sequence[int]) -> int:
        value = 0
        for d in digits:
            value = value * self.base + d
        return value

    def sample(self, generator: torch.Generator) -> AgentProblem:
        """Draw one problem (and, for lookup, its hidden table); deterministic given the
        generator's state (it advances)."""
        v = self.vocab
        if self.task == "add":
            rows = torch.randint(
                0, self.base, (self.terms, self.digits), generator=generator
            ).tolist()
            values = [self._value(r) for r in rows]
            operands, table, opener = rows, None, v.add
        else:
            table = tuple(
                torch.randint(0, self.base**self.digits, (self.base,), generator=generator).tolist()
            )
            keys = torch.randint(0, self.base, (self.terms,), generator=generator).tolist()
            values = [table[k] for k in keys]
            operands, opener = [[k] for k in keys], v.lookup
        prompt = [opener]
        for i, operand in enumerate(operands):
            prompt += ([v.plus] if i else []) + operand
        prompt.append(v.sep)
        answer = tuple(self._to_digits(sum(values), self.width))
        return AgentProblem(prompt=tuple(prompt), answer=answer, table=table)

    def _number(self, digits: Sequence[int]) -> int | None:
        """The value of 1 .. width digit tokens, or None when they are not that."""
        if not 1 <= len(digits) <= self.width or not all(map(self.vocab.is_digit, digits)):
            return None
        return self._value(digits)

    def _result(self, value: int) -> tuple[int, ...]:
        return (self.vocab.result, *self._to_digits(value, self.width), self.vocab.end)

    def step(self, problem: AgentProblem, action: Sequence[int]) -> Step:
        """Run one action (the tokens of one policy turn) against ``problem``.

        Args:
            problem: the episode's problem.
            action: token ids, any ints (ids past the vocabulary make it malformed).

        Returns:
            :class:`Step`: a tool result, an ``ERROR`` observation, or the reward.
        """
        v = self.vocab
        action = list(action)
        error = Step("error", (v.error,))
        if not action:
            return error
        opener, body = action[0], action[1:]
        if opener == v.answer:
            given = body[: body.index(v.end)] if v.end in body else body
            hits = sum(1 for want, got in zip(problem.answer, given, strict=False) if want == got)
            return Step("answer", (), hits / self.width)
        if not body or body[-1] != v.end:
            return error
        args = body[:-1]
        if opener == v.add and v.plus in args:
            cut = args.index(v.plus)
            a, b = self._number(args[:cut]), self._number(args[cut + 1 :])
            if a is None or b is None or a + b >= self.base**self.width:
                return error
            return Step("call", self._result(a + b))
        if opener == v.lookup and problem.table is not None:
            if len(args) != 1 or not v.is_digit(args[0]):
                return error
            return Step("call", self._result(problem.table[args[0]]))
        return error
