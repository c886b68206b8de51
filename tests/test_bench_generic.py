"""``bench/generic.py``: the generic backend's benchmark runs end to end on small
shapes (``--quick``), measures glmport against both baselines at 1 and 2 threads, and
never overwrites the committed figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "generic.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_quick_run_measures_every_case_against_its_baselines(tmp_path):
    out = tmp_path / "generic.json"
    committed = SCRIPT.parent / "results" / "generic.json"
    before = committed.read_bytes()
    proc = _run("--quick", "--out", str(out))
    assert committed.read_bytes() == before
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"].endswith("--quick")
    for threads in (1, 2):
        run = data[f"threads_{threads}"]
        assert [r["N"] for r in run["decode"]] == [1024, 4096]
        for r in run["decode"]:
            assert r["speedup_vs_sdpa"] > 0 and r["speedup_vs_naive"] > 0
        assert {r["op"] for r in run["validation"]} >= {"lightning_indexer", "sparse_attention"}
        assert run["prefill"] and all(r["speedup_vs_sdpa"] > 0 for r in run["prefill"])
