"""What the choosing modules and the forward drivers see of a choice tape.

The modules that make a discrete choice (the router, the lightning indexer) and the
forwards that name tokens (packed and cached) only ask the tape open in their thread or
asyncio task (:func:`active_tape`) through :class:`TapeHooks`; the tape itself, with its
recording and replay, is :class:`glmport.model.choices.ChoiceTape`. Kept apart so that
the model's modules do not import the tape that inspects them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import nn

ROUTING = "routing"
INDICES = "indices"
KINDS = (ROUTING, INDICES)


class TapeHooks(Protocol):
    """The calls a forward makes on an open tape (``kind``: :data:`ROUTING` or
    :data:`INDICES`)."""

    def rows(self, keys: torch.Tensor, positions: torch.Tensor) -> AbstractContextManager[None]:
        """Name the ``T`` tokens of the forward inside the block: sequence ``keys [T]``
        and ``positions [T]`` (int64)."""
        ...

    def tracks(self, kind: str, module: nn.Module) -> bool:
        """Whether ``module``'s choices of ``kind`` are recorded."""
        ...

    def replays(self, kind: str, module: nn.Module) -> bool:
        """Whether ``module``'s choices of ``kind`` come from the tape."""
        ...

    def replayed(self, kind: str, module: nn.Module) -> torch.Tensor:
        """The replayed rows ``[T, width]`` int64 of the current forward's tokens."""
        ...

    def record(self, kind: str, module: nn.Module, values: torch.Tensor) -> None:
        """Keep the rows ``[T, width]`` chosen for the current forward's tokens."""
        ...


_TAPE: ContextVar[TapeHooks | None] = ContextVar("glmport_choice_tape", default=None)
# Tapes open in all threads and tasks together: while none is, active_tape() reads a
# plain int, which torch.compile traces (and guards), where it cannot trace a ContextVar.
_open_tapes = 0
_open_lock = threading.Lock()


def active_tape() -> TapeHooks | None:
    """The tape open in this thread / asyncio task, if any."""
    if not _open_tapes:
        return None
    return _TAPE.get()


@contextmanager
def tape_opened(tape: TapeHooks) -> Iterator[None]:
    """Make ``tape`` the active one in this thread / asyncio task inside the block
    (blocks nest: the inner tape wins until it closes)."""
    global _open_tapes
    with _open_lock:
        _open_tapes += 1
    token = _TAPE.set(tape)
    try:
        yield
    finally:
        _TAPE.reset(token)
        with _open_lock:
            _open_tapes -= 1
