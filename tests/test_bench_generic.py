"""``bench/generic.py``: the generic backend's benchmark runs end to end on small
shapes (``--quick``), measures glmport against both baselines at 1 and 2 threads, and
never overwrites the committed figures."""

from __future__ import annotations

from bench_scripts import BENCH, run_bench_json


def test_quick_run_measures_every_case_against_its_baselines(tmp_path):
    out = tmp_path / "generic.json"
    committed = BENCH / "results" / "generic.json"
    before = committed.read_bytes()
    data = run_bench_json("generic.py", out, "--quick")
    assert committed.read_bytes() == before
    assert data["command"].endswith("--quick")
    for threads in (1, 2):
        run = data[f"threads_{threads}"]
        assert [r["N"] for r in run["decode"]] == [1024, 4096]
        for r in run["decode"]:
            assert r["speedup_vs_sdpa"] > 0 and r["speedup_vs_naive"] > 0
        assert {r["op"] for r in run["validation"]} >= {"lightning_indexer", "sparse_attention"}
        assert run["prefill"] and all(r["speedup_vs_sdpa"] > 0 for r in run["prefill"])
