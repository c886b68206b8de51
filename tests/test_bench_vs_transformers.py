"""``bench/vs_transformers.py``: the comparison with transformers runs end to end on
a short prompt (``--quick``), times every case on both sides, and glmport's logits
equal transformers' once glmport replays transformers' discrete choices."""

from __future__ import annotations

import pytest
from bench_scripts import run_bench, run_bench_json

pytest.importorskip("transformers", minversion="5.18")


def test_quick_run_times_both_sides_and_agrees_with_transformers(tmp_path):
    out = tmp_path / "vs.json"
    data = run_bench_json("vs_transformers.py", out, "--quick", idle_s=150)
    assert data["config"]["index_topk"] < 300  # the quick prompt runs the indexer
    for case in ("prefill", "decode"):
        (row,) = data[case]
        assert row["length"] == 300 and row["threads"] == 1
        assert row["glmport_median_s"] > 0 and row["transformers_median_s"] > 0
    (mem,) = data["memory"]
    assert mem["glmport_mib"] > 0 and mem["transformers_mib"] > 0
    (agree,) = data["agreement"]
    # Same weights, same choices: only rounding separates the two implementations.
    assert agree["max_abs_logit_diff_replaying_hf_choices"] < 1e-4
    assert agree["indexer_rows"] == 3 * 300 and agree["routing_rows"] == 2 * 300
    assert len(agree["indexer_rows_differing"]) == 3 and len(agree["routing_rows_differing"]) == 2
    # The first layer sees identical inputs on both sides: only near ties may differ.
    assert agree["indexer_rows_differing"][0] <= 300 // 20


def test_quick_needs_an_out_path():
    proc = run_bench("vs_transformers.py", "--quick")
    assert proc.returncode == 2 and "--quick needs --out" in proc.stderr
