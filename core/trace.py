"""Op-call tracing: every op call made inside a block, with copies of its inputs and
outputs and the backend whose kernel ran it.

``glmport diff`` runs one model on two backends under a trace each and lines the two
traces up call by call. The trace is context-local (thread or asyncio task), and
costs one context-variable read per op call when no trace is open::

    with trace_ops() as trace:
        with trace.scope("layers.0"):        # optional: name where calls come from
            model(...)
    trace.calls                               # [OpCall, ...] in call order
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


def _snapshot(value: object) -> object:
    """A detached CPU copy of a tensor (other values as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


@dataclass(frozen=True)
class OpCall:
    """One op call: ``args`` in schema order (a prepared weight as its canonical
    tensor), ``outputs`` always a tuple; tensors are detached CPU copies."""

    op: str
    backend: str
    scope: str
    args: tuple
    outputs: tuple


class OpTrace:
    """The calls recorded so far (:attr:`calls`) and the current scope, a name the
    caller pushes with :meth:`scope` (``glmport diff`` pushes module paths)."""

    def __init__(self) -> None:
        self.calls: list[OpCall] = []
        self._scopes: list[str] = []

    @property
    def current_scope(self) -> str:
        return self._scopes[-1] if self._scopes else ""

    def push(self, name: str) -> None:
        self._scopes.append(name)

    def pop(self) -> None:
        self._scopes.pop()

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop()

    def add(self, op: str, backend: str, args: tuple, out: object) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        self.calls.append(
            OpCall(
                op,
                backend,
                self.current_scope,
                tuple(_snapshot(a) for a in args),
                tuple(_snapshot(o) for o in outs),
            )
        )


_TRACE: ContextVar[OpTrace | None] = ContextVar("glmport_op_trace", default=None)


def active_trace() -> OpTrace | None:
    """The trace open in this thread / asyncio task, if any."""
    return _TRACE.get()


@contextmanager
def trace_ops() -> Iterator[OpTrace]:
    """Record every ``glmport.ops`` call made in the block (nested traces: the
    innermost records)."""
    trace = OpTrace()
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)
