"""``bench/indexcache.py`` runs end to end in its ``--quick`` mode: both models (all
full, and 1-in-4 with the same weights) measured side by side, positive rates with their
spread, indexer shares in [0, 1], and fewer indexer calls for the 1-in-4 model (its full
layers only)."""

from __future__ import annotations

from bench_scripts import run_bench_json


def test_indexcache_bench_measures_both_patterns_side_by_side(tmp_path):
    data = run_bench_json(
        "indexcache.py", tmp_path / "indexcache.json", "--quick", env={"OMP_NUM_THREADS": "1"}
    )
    assert {"environment", "config", "runs", "logprob_delta"} <= set(data)
    types = data["config"]["indexer_types"]
    assert "".join(t[0] for t in types["1-in-4"]) == "fsssfsss"
    assert set(types["full"]) == {"full"}
    assert data["logprob_delta"]["mean_abs_delta_logp"] >= 0
    (run,) = data["runs"]
    assert run["threads"] == 1
    for row in run["contexts"]:
        for phase in ("prefill", "decode"):
            models = row[phase]
            assert set(models) == {"full", "1-in-4"}
            for m in models.values():
                rate, share = m["tok_per_s"], m["indexer_share"]
                assert 0 < rate["min"] <= rate["median"] <= rate["max"]
                assert 0 <= share["min"] <= share["max"] <= 1
            # One selection per full layer per forward: 8 against 2.
            assert models["1-in-4"]["indexer_calls"] * 4 == models["full"]["indexer_calls"] > 0
            assert row[f"{phase}_speedup"]["median"] > 0
