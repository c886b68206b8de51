"""``bench/rl_async.py``: the asynchronous-RL benchmark runs end to end on a tiny batch
(``--smoke``), counts the sampled tokens right, its ratios are quotients of its medians,
and a smoke run never writes into ``bench/results``."""

from __future__ import annotations

import statistics

import pytest
from bench_scripts import BENCH, run_bench, run_bench_json

pytest.importorskip("ray")

# --smoke: 4 prompts x 2 samples of the 3-digit reverse task (3 new tokens each).
SEQUENCES, NEW_TOKENS = 4 * 2, 3
TOKENS = SEQUENCES * NEW_TOKENS


def test_smoke_run_measures_pools_baselines_and_trainers(tmp_path):
    out = tmp_path / "rl_async-smoke.json"
    # idle_s: an estimate; it took 110 s at load average 14 on 2 cores
    data = run_bench_json("rl_async.py", out, "--smoke", idle_s=40)
    assert data["smoke"] is True and data["repeats"] == 1 and data["workers"] == [1, 2]
    assert data["new_tokens"] == NEW_TOKENS and data["environment"]["torch"] and data["ray"]
    assert data["groups"] == {
        "prompts": 4,
        "samples_per_prompt": 2,
        "sequences": SEQUENCES,
        "groups_per_call": 1,
        "calls": 4,
    }

    rows = data["rollout"]
    baselines = {r["threads"]: r for r in rows if r["kind"] == "generate"}
    pools = {r["workers"]: r for r in rows if r["kind"] == "pool"}
    assert set(baselines) == set(data["baseline_threads"]) == {1, 2}
    calls = {r["threads"]: r for r in rows if r["kind"] == "generate_calls"}
    assert set(pools) == {1, 2} and set(calls) == {1, 2} and len(rows) == 6
    assert all(r["name"].endswith(", 4 calls") for r in calls.values())  # 4 groups, 1 a call
    for w, r in pools.items():
        assert r["threads"] == max(1, data["cores"] // w)
    for r in rows:
        # Every sequence's new tokens came back, and tokens/s is tokens over seconds.
        assert r["tokens"] == TOKENS
        assert len(r["samples_s"]) == 1 and r["samples_s"][0] > 0
        assert r["median_tokens_per_s"] == pytest.approx(TOKENS / r["samples_s"][0])
        assert r["min_tokens_per_s"] <= r["median_tokens_per_s"] <= r["max_tokens_per_s"]
        # Each ratio is this row's median over that baseline's median.
        assert set(r["vs_baseline"]) == {"1", "2"}
        for t, base in baselines.items():
            expected = r["median_tokens_per_s"] / base["median_tokens_per_s"]
            assert r["vs_baseline"][str(t)] == pytest.approx(expected)
    for t, base in baselines.items():
        assert base["vs_baseline"][str(t)] == pytest.approx(1.0)

    e2e = data["end_to_end"]
    assert e2e["trainer_threads"] == 1 and e2e["warmup_steps"] == 1
    assert e2e["config"]["prompts_per_step"] == 4 and e2e["config"]["group_size"] == 2
    assert e2e["config"]["mode"] == "sync" and e2e["async_config"]["mode"] == "async"
    assert e2e["async_config"]["rollout_workers"] == 2
    for r in (e2e["sync"], e2e["async"]):
        assert r["steps"] == 2 and len(r["step_s"]) == 2 and min(r["step_s"]) > 0
        assert r["median_s"] == pytest.approx(statistics.median(r["step_s"]))
        assert r["steps_per_s"] == pytest.approx(2 / sum(r["step_s"]))
        assert r["median_rollout_tokens_per_s"] > 0
        assert all(0 <= x <= 1 for x in r["reward"])
    assert e2e["async_vs_sync_steps_per_s"] == pytest.approx(
        e2e["async"]["steps_per_s"] / e2e["sync"]["steps_per_s"]
    )
    a, bound = e2e["async"], e2e["async_config"]["max_staleness"]
    assert 0 <= a["staleness_mean"] <= a["staleness_max"] <= bound
    assert a["staleness_max"] == int(a["staleness_max"])  # whole versions
    for kind in ("interrupted", "stale", "failed"):
        assert 0 <= a[f"{kind}_timed"] <= a[f"{kind}_total"]
    assert a["failed_total"] == 0  # no worker was killed


def test_smoke_refuses_to_write_into_bench_results():
    proc = run_bench("rl_async.py", "--smoke")
    assert proc.returncode == 2 and "--smoke needs --out" in proc.stderr
    results = BENCH / "results" / "rl_async-smoke.json"
    proc = run_bench("rl_async.py", "--smoke", "--out", str(results))
    assert proc.returncode == 2 and not results.exists()
