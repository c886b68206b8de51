"""``bench/export.py`` runs end to end in its ``--quick`` mode: every path is timed with
its spread, and every runtime's logits agree with eager torch's in the same run."""

from __future__ import annotations

from bench_scripts import run_bench_json

PATHS = {"eager torch (generic)", "onnxruntime", "onnxruntime, inlined", "tvm"}


def test_export_bench_times_every_runtime_and_checks_its_logits(tmp_path):
    data = run_bench_json(
        "export.py", tmp_path / "export.json", "--quick", idle_s=120
    )  # 430 s at load 13
    (run,) = data["runs"]
    assert run["threads"] == 1
    assert {(c["graph"], c["length"]) for c in run["cases"]} == {("prefill", 16), ("decode", 16)}
    for case in run["cases"]:
        assert set(case["paths"]) == PATHS
        assert max(case["max_abs_logits_vs_eager"].values()) <= 1e-4
        for path in case["paths"].values():
            lo, hi = path["iqr"]
            assert 0 < path["min"] <= lo <= path["median"] <= hi <= path["max"]
            assert len(path["samples_s"]) == data["repeats"]
