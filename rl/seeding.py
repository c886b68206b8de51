"""The seeds of a run's random draws: step ``s`` of run ``seed`` draws each of its
purposes (its ``stream``: prompts, sampling, shuffles, ...) from a generator seeded by
``(seed, s, stream)`` alone, so a resumed run reproduces the uninterrupted one."""

from __future__ import annotations

import torch


def seed_for(seed: int, step: int, stream: int) -> int:
    """The seed of one purpose (``stream``) of step ``step`` of run ``seed``."""
    return (seed * 1_000_003 + step * 7919 + stream * 104_729) % (1 << 63)


def step_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """A cpu generator seeded with :func:`seed_for` ``(seed, step, stream)``."""
    return torch.Generator().manual_seed(seed_for(seed, step, stream))
