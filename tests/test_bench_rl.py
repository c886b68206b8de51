"""``bench/rl.py``: the RL benchmark runs end to end on a tiny batch (``--smoke``),
measures every case against its transformers baseline, and glmport's log-probs agree
with transformers' on the same tokens."""

from __future__ import annotations

import pytest
from bench_scripts import BENCH, run_bench, run_bench_json

pytest.importorskip("transformers", minversion="5.18")


def test_smoke_run_measures_every_case_and_agrees_with_transformers(tmp_path):
    out = tmp_path / "rl-smoke.json"
    data = run_bench_json("rl.py", out, "--smoke")
    assert data["smoke"] is True and data["threads"] == [1] and data["repeats"] == 1
    # 4 prompts x 2 samples, 4 new tokens each: 32 tokens per rollout / training batch.
    assert data["batch"]["sequences"] == 4 * 2
    assert data["environment"]["torch"] and data["transformers"]

    rollout = {r["name"]: r for r in data["rollout"]}
    assert set(rollout) == {
        "glmport generate + logprobs",
        "glmport generate + logprobs + choices",
        "transformers generate + log_softmax",
    }
    training = {r["name"]: r for r in data["training"]}
    assert set(training) == {
        "glmport continuation_logprobs",
        "glmport continuation_logprobs, replayed choices",
        "transformers forward + log_softmax gather",
    }
    for r in data["rollout"] + data["training"]:
        assert r["threads"] == 1 and r["tokens"] == 4 * 2 * 4
        assert len(r["samples_s"]) == 1 and r["samples_s"][0] > 0
        # tokens/s is the batch's tokens over the sample's seconds.
        assert r["median_tokens_per_s"] == pytest.approx(32 / r["samples_s"][0])
        assert r["min_tokens_per_s"] <= r["median_tokens_per_s"] <= r["max_tokens_per_s"]
    for rows, hf in (
        (rollout, "transformers generate + log_softmax"),
        (training, "transformers forward + log_softmax gather"),
    ):
        assert rows[hf]["vs_hf"] == 1.0
        for r in rows.values():
            expected = r["median_tokens_per_s"] / rows[hf]["median_tokens_per_s"]
            assert r["vs_hf"] == pytest.approx(expected)

    (step,) = data["trainer_step"]
    assert step["median_s"] > 0 and len(step["samples_s"]) == 1
    assert step["median_rollout_tokens_per_s"] > 0 and step["median_train_tokens_per_s"] > 0

    # Same tokens, same weights: fp32 log-probs agree far below 1e-4.
    assert 0 <= data["logprob_agreement_max_abs"] <= 1e-4
    assert 0 <= data["rollout_logprob_agreement_max_abs"] <= 1e-4


def test_smoke_refuses_to_write_into_bench_results():
    proc = run_bench("rl.py", "--smoke")
    assert proc.returncode == 2 and "--smoke needs --out" in proc.stderr
    results = BENCH / "results" / "rl-smoke.json"
    proc = run_bench("rl.py", "--smoke", "--out", str(results))
    assert proc.returncode == 2 and not results.exists()
