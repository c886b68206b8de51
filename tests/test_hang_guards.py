"""The tests' hang guards are sized from the work and the machine (tests/hang_guard.py):
a loaded machine stretches them, and no test waits a fixed number of seconds."""

from __future__ import annotations

import re
from pathlib import Path

import hang_guard
import pytest
from hang_guard import guard_s

TESTS = Path(__file__).resolve().parent

# A number of seconds written at a wait: a subprocess, a reply, a barrier, a deadline.
_FIXED_WAIT = re.compile(
    r"timeout\s*=\s*[0-9]|monotonic\(\)\s*\+\s*[0-9]|_read_line\([^)]*,\s*[0-9]"
)
# Fixed numbers that are not hang guards, and why.
NOT_GUARDS = {
    "ray_local.wait(mine, num_returns=len(mine), timeout=0)": "a poll: returns at once",
    "GatewayClient(url, timeout=2.0)": "the client's own setting, to a port that refuses",
}


def test_no_test_waits_a_fixed_number_of_seconds():
    fixed = []
    for path in sorted(TESTS.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if _FIXED_WAIT.search(line) and not any(ok in line for ok in NOT_GUARDS):
                fixed.append(f"{path.name}:{number}: {line.strip()}")
    assert not fixed, "use hang_guard.guard_s(idle seconds):\n" + "\n".join(fixed)


@pytest.mark.parametrize(("load", "cpus"), [(15.0, 2), (0.3, 2), (64.0, 16)])
def test_a_guard_grows_with_the_load_per_cpu(monkeypatch, load, cpus):
    monkeypatch.setattr(hang_guard.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(hang_guard.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    per_cpu = max(1.0, load / cpus)
    for idle in (0.5, 40, 120):
        assert guard_s(idle) == max(hang_guard.FLOOR_S, idle * hang_guard.MARGIN * per_cpu)
    if load / cpus >= 7:  # the machine of the two failures: load ~15 on 2 cores
        assert guard_s(120) > 4 * 600 and guard_s(40) > 4 * 240  # export, rl_async smoke
