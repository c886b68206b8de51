"""Sampling parameters, their accepted ranges, and the next-token sampler.

:func:`check_sampling` is the one check of ``temperature``, ``top_p``, ``top_k`` and
``seed``: :func:`~glmport.model.generation.generate`, the gateway's session store and
request check, the RL rollout workers, the agent loop, ``glmport generate`` and the
scoring side (``continuation_logprobs``'s temperature) all call it, so each rule below
holds everywhere and is written once. Its error, :class:`SamplingParameterError`,
names the parameter as the caller spells it (``top_p``, ``--top-p``) and carries the
name, the value and the accepted range.

The ranges, and why:

- ``temperature`` (sampling only) in ``[1e-6, 1e6]``: the span the ``token_logprobs``
  conformance cases cover. Logits are fp32 and the reported log-probability comes from a
  second matmul (``token_logprobs``), so two logits one ulp apart differ by ``ulp / T``
  in it: at ``T = 1e-30`` a sampled token was reported at -5.96e22, below about 1e-45
  ``T`` itself rounds to 0 in fp32 (sampling divided by zero), and above about 3.4e38 it
  rounds to inf (NaN log-probabilities). Nothing is lost at the ends: at 1e-6 a logit
  gap of 1e-4 already has odds of e^-100 (greedy, to fp32 precision), at 1e6 logits
  spanning less than 1 are within 1e-6 of uniform. Argmax decoding is ``greedy`` (the
  gateway: ``temperature`` 0), never a tiny temperature.
- ``top_p`` in ``(0, 1]``: the best token always stays, so a ``top_p`` at or below its
  probability (down to the smallest float) is greedy, the limit, and never an empty
  distribution.
- ``top_k``: an int ``>= 0`` (0: off; above the vocabulary: off).
- ``seed``: ``None`` (torch's global generator) or an int in ``[-2**63, 2**64)``, what
  ``torch.Generator.manual_seed`` takes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from glmport.core.errors import ConfigError

TEMPERATURE_RANGE = (1e-6, 1e6)
SEED_RANGE = (-(1 << 63), 1 << 64)  # [low, high)


class SamplingParameterError(ConfigError):
    """A sampling parameter outside its accepted range.

    Attributes:
        field: the parameter's Python name: ``temperature``, ``top_p``, ``top_k``, ``seed``.
        name: the parameter as the caller spelled it (``--top-p`` for the CLI).
        value: what came.
        accepted: the accepted values, in words (``"a number in (0, 1]"``).
    """

    def __init__(self, field: str, name: str, value: object, accepted: str, hint: str = "") -> None:
        self.field, self.name, self.value, self.accepted = field, name, value, accepted
        message = f"{name} must be {accepted}, got {value!r}"
        super().__init__(f"{message} ({hint})" if hint else message)


@dataclass(frozen=True)
class SamplingNames:
    """How a caller spells the sampling parameters, for :class:`SamplingParameterError`:
    the Python API's names by default. ``greedy`` is how that caller asks for argmax
    decoding (``"greedy=True"``, ``"--greedy"``, ``"temperature 0"``; empty where it
    cannot: RL rollouts always sample)."""

    temperature: str = "temperature"
    top_p: str = "top_p"
    top_k: str = "top_k"
    seed: str = "seed"
    greedy: str = "greedy=True"


PYTHON_NAMES = SamplingNames()


@dataclass(frozen=True)
class SamplingParams:
    """Checked sampling parameters (:func:`check_sampling`).

    ``temperature`` is the temperature of the reported log-probabilities as well as of
    the sampling: 1.0 when ``greedy`` (argmax decoding reports log-probabilities at
    temperature 1).
    """

    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(
    *,
    greedy: bool = False,
    temperature: object = 1.0,
    top_p: object = 1.0,
    top_k: object = 0,
    seed: object = None,
    names: SamplingNames = PYTHON_NAMES,
) -> SamplingParams:
    """The sampling parameters as :class:`SamplingParams`, or a
    :class:`SamplingParameterError` naming the first one outside its range (the module
    docstring gives the ranges). ``temperature`` is checked only when sampling (not
    ``greedy``); the others always. ``names``: how the caller spells them."""
    if not isinstance(greedy, bool):
        raise ConfigError(f"greedy must be True or False, got {greedy!r}")
    low, high = TEMPERATURE_RANGE
    if not greedy and not (_is_number(temperature) and low <= temperature <= high):
        raise SamplingParameterError(
            "temperature",
            names.temperature,
            temperature,
            f"a number in [{low:g}, {high:g}] when sampling",
            f"for argmax decoding use {names.greedy}" if names.greedy else "",
        )
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise SamplingParameterError("top_p", names.top_p, top_p, "a number in (0, 1] (1: off)")
    if not (_is_int(top_k) and top_k >= 0):
        raise SamplingParameterError("top_k", names.top_k, top_k, "an int >= 0 (0: off)")
    if seed is not None and not (_is_int(seed) and SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise SamplingParameterError(
            "seed", names.seed, seed, "an int from -2**63 to 2**64-1 (64 bits)"
        )
    return SamplingParams(
        greedy=greedy,
        temperature=1.0 if greedy else float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        seed=None if seed is None else int(seed),
    )


class Sampler:
    """Next-token choice from logits ``[B, V]``: argmax when ``params.greedy``, else
    temperature / top-k / top-p sampling with a ``torch.Generator`` seeded by
    ``params.seed`` (``None``: torch's global generator) on ``device``."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.gen = None
        if params.seed is not None:
            self.gen = torch.Generator(device=device).manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B]`` int64 token ids."""
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1)
        x = logits.float()
        # Shift before scaling: at a small temperature the best token stays 0 (not inf)
        # and the rest go to -inf, so sampling tends to greedy instead of NaN.
        x = (x - x.amax(dim=-1, keepdim=True)) / p.temperature
        if p.top_k:
            kth = x.topk(min(p.top_k, x.shape[-1]), dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, -math.inf)
        if p.top_p < 1.0:
            order = x.argsort(dim=-1, descending=True)
            probs = x.gather(-1, order).softmax(dim=-1)
            # Keep the smallest head of the ranking whose mass reaches top_p. The best
            # token always stays, even where top_p rounds to 0 in fp32: top_p -> 0 is
            # greedy, never an empty distribution.
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            drop[:, 0] = False
            x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return torch.multinomial(x.softmax(dim=-1), 1, generator=self.gen).squeeze(1)
