"""``bench/ascend_backend.py``: the Ascend benchmark runs end to end on tiny shapes against the
emulated torch_npu ops (``--smoke``), so it is known to work before an NPU sees it;
its agreement rule (``compare`` within the op's tolerance, integer outputs exactly,
NaN never agrees) and its report of calls the ascend backend does not serve or fails."""

from __future__ import annotations

import importlib.util
import math
import sys

import torch
from bench_scripts import BENCH, run_bench_json

from glmport.backends.ascend import BACKEND

SCRIPT = BENCH / "ascend_backend.py"
SECTIONS = {"attention", "indexer", "moe", "quant", "norm_rope", "mla"}


def test_smoke_run_covers_every_section_and_agrees_with_generic(tmp_path):
    out = tmp_path / "ascend-smoke.json"
    data = run_bench_json("ascend_backend.py", out, "--smoke", idle_s=150)
    rows = data["rows"]
    assert data["smoke"] is True and {r["section"] for r in rows} == SECTIONS
    ops = {r["op"] for r in rows}
    assert ops == {
        "sparse_attention", "lightning_indexer", "indexer_logits", "moe_gate", "moe_dispatch",
        "moe_combine", "grouped_gemm", "quantize", "quant_gemm", "rms_norm", "rope", "mla_prolog",
    }  # fmt: skip
    assert [r for r in rows if "error" in r] == []
    served = [r for r in rows if r["served_by"] == "ascend"]
    assert served and all(r["agrees"] and r["max_rel_vs_generic"] < 5e-2 for r in served), served
    # A call the ascend backend does not take says why, and is timed on generic only.
    assert all(r["fallback"] and "ascend_ms" not in r for r in rows if r not in served)
    # Every op the backend declares is served by it on at least one bench row (expert
    # parallelism takes two processes: tests/test_ascend_ep.py).
    assert {r["op"] for r in served} == set(BACKEND.manifest.ops) - {"expert_parallel"}


def _bench_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_ascend", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_ascend", module)  # for its dataclasses
    monkeypatch.setattr(sys, "path", list(sys.path))  # it edits the path for its helpers
    spec.loader.exec_module(module)
    return module


def test_agreement_is_the_tolerance_of_the_op_and_dtype(monkeypatch):
    bench = _bench_module(monkeypatch)
    ref = torch.linspace(-1, 1, 64)
    same = bench.agreement(ref.clone(), ref, "rope", torch.bfloat16)
    assert same.ok and same.max_rel == 0.0
    # 0.5% off everywhere: inside bf16's 1.5e-2 / 6e-3, outside fp16's 2e-3 / 1e-3.
    off = ref * 1.005
    assert bench.agreement(off, ref, "rope", torch.bfloat16).ok
    assert not bench.agreement(off, ref, "rope", torch.float16).ok
    nan = ref.clone()
    nan[3] = math.nan
    worst = bench.agreement((ref, nan), (ref, ref), "rope", torch.float32)
    assert not worst.ok and math.isnan(worst.max_rel)


def test_integer_outputs_must_match_exactly(monkeypatch):
    bench = _bench_module(monkeypatch)
    x = torch.randn(4, 8)
    ids = torch.arange(4, dtype=torch.int32)
    assert bench.agreement((x, ids), (x, ids.clone()), "moe_dispatch", torch.bfloat16).ok
    moved = bench.agreement((x, ids.flip(0)), (x, ids), "moe_dispatch", torch.bfloat16)
    assert not moved.ok and moved.max_rel == math.inf


def test_fallbacks_and_failures_are_reported_not_timed(monkeypatch):
    bench = _bench_module(monkeypatch)
    b = bench.Bench.__new__(bench.Bench)
    b.rows = [
        {"section": "quant", "name": "quant_gemm fp8_block", "op": "quant_gemm",
         "served_by": "generic", "generic_ms": 2.0,
         "fallback": "ascend: scheme fp8_block (it takes w8a8)"},
        {"section": "norm_rope", "name": "rope", "op": "rope", "served_by": "ascend",
         "generic_ms": 2.0, "ascend_ms": 1.0, "ascend_p20_ms": 0.9, "ascend_p80_ms": 1.1,
         "speedup_vs_generic": 2.0, "max_rel_vs_generic": 0.02, "agrees": False},
        {"section": "moe", "name": "moe_gate", "op": "moe_gate", "served_by": "ascend",
         "generic_ms": 2.0, "error": "NpuContractError: npu_moe_gating_top_k: k"},
    ]  # fmt: skip
    text = bench.render(b, markdown=False)
    assert "Not served by ascend:\nquant_gemm fp8_block: ascend: scheme fp8_block" in text
    assert "Failed on ascend:\nmoe_gate: NpuContractError: npu_moe_gating_top_k: k" in text
    assert "2.0e-02 DISAGREES" in text and "1.000 (0.900-1.100)" in text
