"""How long a test waits for work before calling it hung: a subprocess, a server's first
line, a worker's restart, another thread, an HTTP reply from a local server.

A guard must catch a hang and never fail a run that is merely slow. A fixed guard near
the idle time does: from a fresh clone on a 2-core machine at load average ~15, the
suite's bench smoke tests overran guards of 600 s and 240 s (each process got about an
eighth of a core). So every guard here is sized from the work and the machine: the
work's time on an idle 2-core machine, times a margin, times how oversubscribed this
machine is when the wait begins (load average per core, at least 1), and never under a
floor. A slow run then costs time, not a failure; a real hang is still caught.
"""

from __future__ import annotations

import os

# Head-room over the idle time for what one load reading misses: load that rises while
# the work runs, bursts, a slower CPU than the 2-core machines the idle times are from.
MARGIN = 4
FLOOR_S = 60.0


def oversubscription() -> float:
    """The 1-minute load average per CPU this process may use, at least 1 (1 where the
    platform reports no load)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        return 1.0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1.0, load / max(1, cpus or 1))


def guard_s(idle_s: float) -> float:
    """Seconds to wait for work that takes ``idle_s`` on an idle 2-core machine."""
    return max(FLOOR_S, idle_s * MARGIN * oversubscription())
