"""Verifiable toy tasks for the CPU-sized RL demonstrations.

Token layout shared by every task: digits are token ids ``0 .. base-1``, then two
special tokens, ``SEP = base`` and ``PLUS = base + 1``; the task vocabulary has
``vocab_size = base + 2`` tokens. A policy may have a larger vocabulary: a response
token ``>= vocab_size`` is simply a wrong answer. Responses have a fixed length
(``response_len``) and no stop token, so the reward is the fraction of the
``response_len`` positions that hold the right token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from glmport.core.errors import ConfigError, check_int

__all__ = [
    "MAX_BASE",
    "MAX_DIGITS",
    "TASKS",
    "AdditionTask",
    "Problem",
    "ReverseTask",
    "Task",
    "chance_reward",
    "make_task",
    "shuffled_rewards",
]


# The toy tasks are CPU-sized: a sample is about 3 x digits tokens, rolled out and
# trained on prompts x group-size times a step, and the vocabulary is base + 2 rows of
# the policy. Beyond these a run is a typo that would end in the allocator.
MAX_DIGITS = 64
MAX_BASE = 1024


def _size(name: str, value: object, minimum: int, maximum: int) -> int:
    value = check_int(f"argument {name!r}", value, minimum)
    if value > maximum:
        raise ConfigError(
            f"argument {name!r} must be at most {maximum} (a CPU-sized toy task), got {value}"
        )
    return value


@dataclass(frozen=True)
class Problem:
    """One problem: the prompt token ids and the exact expected response token ids."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]


class Task(ABC):
    """A task with verifiable answers.

    Attributes:
        name: the registry name (a key of :data:`TASKS`).
        base: number of digit tokens (ids ``0 .. base-1``).
        vocab_size: ``base + 2`` (digits, SEP, PLUS).
        prompt_len: length of every prompt.
        response_len: length of every answer (and of the response that is scored).
    """

    name: str
    base: int
    vocab_size: int
    prompt_len: int
    response_len: int

    @property
    def sep(self) -> int:
        """Token id of SEP, the last prompt token (``base``)."""
        return self.base

    @property
    def plus(self) -> int:
        """Token id of PLUS (``base + 1``)."""
        return self.base + 1

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        """Draw ``n`` problems; deterministic given the generator's state (it advances)."""

    @abstractmethod
    def describe(self) -> str:
        """One line saying what the task is."""

    def reward(self, problem: Problem, response: Sequence[int] | torch.Tensor) -> float:
        """Fraction of the ``response_len`` positions where ``response`` equals the answer.

        Args:
            problem: a problem of this task.
            response: token ids (a sequence of ints or a 1-D integer tensor). Positions
                missing from a short response count as wrong; tokens past
                ``response_len`` are ignored.

        Returns:
            A float in [0, 1].
        """
        if isinstance(response, torch.Tensor):
            if response.dim() != 1:
                raise ConfigError(
                    f"argument 'response' must be a 1-D tensor of token ids, "
                    f"got shape {tuple(response.shape)}"
                )
            response = response.tolist()
        if len(problem.answer) != self.response_len:
            raise ConfigError(
                f"argument 'problem' must have an answer of length {self.response_len} "
                f"for task '{self.name}', got length {len(problem.answer)}"
            )
        # a short response zips shorter: its missing positions count as wrong
        given = response[: self.response_len]
        hits = sum(1 for want, got in zip(problem.answer, given, strict=False) if got == want)
        return hits / self.response_len

    def _digits(self, n: int, width: int, generator: torch.Generator) -> torch.Tensor:
        check_int("argument 'n'", n, 0)
        return torch.randint(0, self.base, (n, width), generator=generator, dtype=torch.int64)


class ReverseTask(Task):
    """Reverse ``digits`` random digits.

    Prompt: ``d_1 .. d_k SEP`` (``prompt_len = digits + 1``); answer: ``d_k .. d_1``
    (``response_len = digits``).
    """

    def __init__(self, digits: int = 3, base: int = 10) -> None:
        self.name = "reverse"
        self.digits = _size("digits", digits, 1, MAX_DIGITS)
        self.base = _size("base", base, 2, MAX_BASE)
        self.vocab_size = self.base + 2
        self.prompt_len = self.digits + 1
        self.response_len = self.digits

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        """Draw ``n`` problems; deterministic given the generator's state (it advances)."""
        rows = self._digits(n, self.digits, generator).tolist()
        return [Problem(prompt=(*row, self.sep), answer=tuple(reversed(row))) for row in rows]

    def describe(self) -> str:
        """One line saying what the task is."""
        return (
            f"reverse: {self.digits} base-{self.base} digits, answered back to front "
            f"(prompt {self.prompt_len} tokens, response {self.response_len}, "
            f"vocab {self.vocab_size})"
        )


class AdditionTask(Task):
    """Add two ``digits``-digit numbers.

    Prompt: the digits of ``a`` most significant first (fixed width, leading zeros),
    PLUS, the digits of ``b`` likewise, SEP (``prompt_len = 2 * digits + 2``).
    Answer: ``a + b`` written LEAST significant digit first in ``digits + 1`` digits
    (``response_len = digits + 1``). Least significant first because a left-to-right
    model then produces each digit after the ones its carry depends on, which makes
    the task learnable token by token.
    """

    def __init__(self, digits: int = 2, base: int = 10) -> None:
        self.name = "add"
        self.digits = _size("digits", digits, 1, MAX_DIGITS)
        self.base = _size("base", base, 2, MAX_BASE)
        self.vocab_size = self.base + 2
        self.prompt_len = 2 * self.digits + 2
        self.response_len = self.digits + 1

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        """Draw ``n`` problems; deterministic given the generator's state (it advances)."""
        rows = self._digits(n, 2 * self.digits, generator).tolist()
        problems = []
        for row in rows:
            a_digits, b_digits = row[: self.digits], row[self.digits :]
            total = self._value(a_digits) + self._value(b_digits)
            answer = []
            for _ in range(self.response_len):
                total, digit = divmod(total, self.base)
                answer.append(digit)
            problems.append(
                Problem(prompt=(*a_digits, self.plus, *b_digits, self.sep), answer=tuple(answer))
            )
        return problems

    def _value(self, digits_msb_first: list[int]) -> int:
        value = 0
        for d in digits_msb_first:
            value = value * self.base + d
        return value

    def describe(self) -> str:
        """One line saying what the task is."""
        return (
            f"add: a + b for {self.digits}-digit base-{self.base} numbers, answer least "
            f"significant digit first (prompt {self.prompt_len} tokens, response "
            f"{self.response_len}, vocab {self.vocab_size})"
        )


TASKS: dict[str, type[Task]] = {"reverse": ReverseTask, "add": AdditionTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by registry name (``"reverse"`` or ``"add"``) with its keyword arguments.

    Raises:
        ConfigError: unknown name, unknown keyword, or a bad value (digits < 1, base < 2,
            not an int).
    """
    if name not in TASKS:
        raise ConfigError(
            f"argument 'name': unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}"
        )
    try:
        return TASKS[name](**kwargs)
    except TypeError as err:
        raise ConfigError(
            f"task {name!r} takes keyword arguments 'digits' and 'base', "
            f"got {sorted(kwargs)}: {err}"
        ) from err


def shuffled_rewards(rewards: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The control experiment: the batch's rewards permuted at random across samples.

    Args:
        rewards: any shape, float; all elements are treated as one batch of samples
            (a ``[prompts, G]`` tensor is permuted across prompts too).
        generator: a CPU generator; the permutation is drawn from it.

    Returns:
        A tensor of the same shape, dtype and device holding the same multiset of values,
        so it carries no information about which sample earned which reward.
    """
    if not isinstance(rewards, torch.Tensor):
        raise ConfigError(
            f"argument 'rewards' must be a torch.Tensor, got {type(rewards).__name__}"
        )
    flat = rewards.reshape(-1)
    perm = torch.randperm(flat.numel(), generator=generator).to(flat.device)
    return flat[perm].reshape(rewards.shape)


def chance_reward(task: Task) -> float:
    """Expected reward of a response of uniformly random tokens.

    Assumes each response token is uniform over the task's ``vocab_size`` tokens
    (digits and the two special tokens), independently. Every answer token is a digit
    inside that vocabulary, so each position matches with probability exactly
    ``1 / vocab_size`` whatever the answer distribution, and the expected fraction of
    correct positions is ``1 / vocab_size``. A policy over a larger vocabulary has a
    lower chance level.
    """
    return 1.0 / task.vocab_size
