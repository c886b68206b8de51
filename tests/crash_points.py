"""Simulated process deaths for the tests of atomic saves (tests/test_checkpoints.py,
tests/test_rl_checkpoints.py).

:func:`die_at` numbers every filesystem change a save makes (mkdir, file writes,
fsync, rename, link, rmtree) and makes the ``k``-th one and every later one raise
:class:`Killed` before it acts: from that point on nothing the save would still do —
its own clean-up included — reaches the disk, as when the process is killed there.
``finally`` blocks still run, so file descriptors close and ``flock`` locks drop, as
the kernel does for a dead process. A killed ``rmtree`` first removes one file of its
folder (a removal cut short).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest


class Killed(BaseException):
    """The simulated death (a BaseException: no ``except Exception`` swallows it)."""


@dataclass
class Operations:
    """The filesystem changes seen so far: ``(name, first path argument)``."""

    kill_at: int
    seen: list[tuple[str, str]] = field(default_factory=list)

    def index(self, name: str, needle: str, start: int = 0) -> int:
        """The number of the first ``name`` operation from ``start`` on whose path's
        last component contains ``needle``."""
        return next(
            i
            for i, (n, arg) in enumerate(self.seen)
            if i >= start and n == name and needle in Path(arg).name
        )


def die_at(monkeypatch: pytest.MonkeyPatch, kill_at: int, *modules: object) -> Operations:
    """Patch the filesystem changes (and ``save_file`` as ``modules`` import it) so the
    ``kill_at``-th one (0-based) and all later ones raise :class:`Killed`."""
    ops = Operations(kill_at)

    def wrap(owner: object, name: str) -> None:
        real = getattr(owner, name)

        def operation(*args, **kwargs):
            ops.seen.append((name, str(args[0]) if args else ""))
            if len(ops.seen) > kill_at:
                if name == "rmtree":
                    _remove_one_file(Path(args[0]))
                raise Killed(f"killed at operation {len(ops.seen) - 1}: {name} {args[:2]}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, operation)

    for name in ("rename", "replace", "mkdir", "fsync", "link", "symlink"):
        wrap(os, name)
    wrap(shutil, "rmtree")
    wrap(shutil, "copy2")
    wrap(Path, "write_text")
    wrap(Path, "write_bytes")
    for module in modules:
        wrap(module, "save_file")
    return ops


def _remove_one_file(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if files:
        files[0].unlink()
