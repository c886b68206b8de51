"""Bounded staleness for asynchronous RL, and the ledger that proves no group is lost.

:class:`StalenessManager` is AReaL's capacity rule (../shared/reference/RL.md): with
``batch`` groups trained per policy version, at most ``max_staleness + 1`` versions'
worth of groups may be accepted or in flight ahead of training::

    capacity = min(max_concurrent - running,
                   (max_staleness + version + 1) * batch - (accepted + running))

so a group dispatched under version ``u`` is trained by version ``u + max_staleness``
at the latest, and rollout workers wait (backpressure) instead of running ahead.

:class:`GroupLedger` records every group's life (issued, dispatched, returned,
interrupted, failed, stale, requeued, trained) as JSON lines; :meth:`GroupLedger.audit`
checks that no group was trained twice and that every issued group was trained or is
still pending.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmport.core.errors import ConfigError, GlmportError, check_int

from .report import rewrite_jsonl

EVENTS = (
    "issued",  # a new group id and its prompt
    "dispatched",  # sent to a worker (attempt n)
    "returned",  # sampled and buffered for training
    "interrupted",  # a newer policy was published mid-rollout: requeued
    "failed",  # its worker died: requeued
    "stale",  # older than the bound when it came back: requeued
    "trained",  # in a training batch (terminal)
    "pending",  # still queued, in flight or buffered when the run stopped
)


@dataclass
class StalenessManager:
    """AReaL's capacity rule over counts of groups.

    ``batch``: groups per training step; ``max_staleness``: versions a trained group may
    lag the trainer; ``max_concurrent``: groups in flight at most. ``accepted`` counts
    groups accepted since version 0 (trained ones included), ``running`` those in
    flight.
    """

    batch: int
    max_staleness: int
    max_concurrent: int
    accepted: int = 0
    running: int = 0

    def __post_init__(self) -> None:
        for name, low in (("batch", 1), ("max_staleness", 0), ("max_concurrent", 1)):
            check_int(name, getattr(self, name), low)

    def capacity(self, version: int) -> int:
        """Groups that may be dispatched now, with the trainer at ``version``."""
        ahead = (self.max_staleness + version + 1) * self.batch - (self.accepted + self.running)
        return max(0, min(self.max_concurrent - self.running, ahead))

    def on_dispatch(self) -> None:
        self.running += 1

    def on_accept(self) -> None:
        """A group came back and was buffered for training."""
        self.running -= 1
        self.accepted += 1

    def on_reject(self) -> None:
        """A group came back unusable (interrupted, failed, stale): it will be redone."""
        self.running -= 1

    def on_discard(self, n: int) -> None:
        """``n`` accepted groups were given up untrained (a stale buffered group)."""
        self.accepted -= n


class LedgerError(GlmportError):
    """The ledger shows a group trained twice or lost."""


class GroupLedger:
    """Append-only JSON-lines record of every group's events (``path`` None: memory only).

    Each record: ``{"event": ..., "group": id, ...details}``.
    """

    def __init__(self, path: Path | None = None, records: list[dict] | None = None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = list(records or [])
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            rewrite_jsonl(path, self.records)  # a kill meanwhile keeps the old ledger
            self._file = path.open("a")

    def record(self, event: str, group: int, **details: Any) -> None:
        if event not in EVENTS:
            raise ConfigError(f"unknown ledger event {event!r}; events: {', '.join(EVENTS)}")
        entry = {"event": event, "group": group, **details}
        self.records.append(entry)
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def audit(self) -> dict[str, int]:
        """Check exactly-once training; returns counts of each event.

        Raises:
            LedgerError: a group trained more than once, trained without having
                returned, or issued and neither trained nor recorded pending.
        """
        return audit(self.records)


def audit(records: list[dict[str, Any]]) -> dict[str, int]:
    """:meth:`GroupLedger.audit` over ledger ``records``."""
    trained = Counter(r["group"] for r in records if r["event"] == "trained")
    twice = sorted(g for g, n in trained.items() if n > 1)
    if twice:
        raise LedgerError(f"groups trained more than once: {twice[:10]}")
    returned = {r["group"] for r in records if r["event"] == "returned"}
    unreturned = sorted(set(trained) - returned)
    if unreturned:
        raise LedgerError(f"groups trained without being sampled: {unreturned[:10]}")
    issued = {r["group"] for r in records if r["event"] == "issued"}
    pending = {r["group"] for r in records if r["event"] == "pending"}
    lost = sorted(issued - set(trained) - pending)
    if lost:
        raise LedgerError(f"groups issued but neither trained nor pending: {lost[:10]}")
    return dict(Counter(r["event"] for r in records))
