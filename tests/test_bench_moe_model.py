"""``bench/moe.py`` and ``bench/model.py`` run end to end in their ``--quick`` modes,
name their baselines, report median and spread, and check in the same run that
glmport's MoE layer equals the plain torch loop and that the dense attention baseline
computes the same model as DSA with a top-k covering every key."""

from __future__ import annotations

from pathlib import Path

from bench_scripts import run_bench_json


def _run(script: str, out: Path) -> dict:
    return run_bench_json(script, out, "--quick", env={"OMP_NUM_THREADS": "1"})


def test_moe_bench_times_every_baseline_and_agrees_with_the_loop(tmp_path):
    data = _run("moe.py", tmp_path / "moe.json")
    assert data["max_rel_error_vs_loop"] < 1e-5
    (run,) = data["runs"]
    assert run["threads"] == 1
    assert set(run["paths"]) == {
        "glmport",
        "per-expert loop",
        "torch.matmul, same FLOPs",
        "GEMMs alone",
    }
    for path in run["paths"].values():
        lo, hi = path["iqr_s"]
        assert 0 < path["min_s"] <= lo <= path["median_s"] <= hi <= path["max_s"]
        assert len(path["samples_s"]) == data["repeats"]


def test_model_bench_dense_baseline_is_the_same_model_by_sdpa(tmp_path):
    data = _run("model.py", tmp_path / "model.json")
    assert data["dense_vs_dsa_all_keys_max_rel_error"] < 1e-4
    assert "scaled_dot_product_attention" in data["dense_baseline"]
    (run,) = data["runs"]
    assert [r["context"] for r in run["contexts"]] == [256, 1024]
    for row in run["contexts"]:
        for key in ("dsa_decode_tok_per_s", "dense_decode_tok_per_s", "dense_prefill_tok_per_s"):
            rate = row[key]
            assert 0 < rate["min"] <= rate["median"] <= rate["max"]
    assert {r["model"] for r in run["speculative"]} == {"random weights", "agreeing MTP"}
