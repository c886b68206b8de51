"""The tiny GLM-5 exported to ONNX and run in onnxruntime: prefill over several batch
sizes and lengths (above ``index_topk`` too, so the indexer selects) and decode steps on
the runtime's own caches, each compared with the eager model's own forward; the inlined
export; ``glmport export onnx`` on the tiny model."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

import glmport
import glmport.cli
from glmport.conformance.model_case import run_model_check
from glmport.core.errors import UnsupportedError
from glmport.core.extras import install_command
from glmport.export.check import compare, sample_ids
from glmport.export.graph import GRAPH_OUTPUTS
from glmport.export.onnx_model import OnnxRuntimeModel, export_onnx, save_onnx
from glmport.export.onnx_ops import DOMAIN
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.quantize import quantize_model

TOLERANCE = 1e-4
# Every op the model's forward calls.
MODEL_OPS = {
    "rms_norm",
    "rope",
    "lightning_indexer",
    "sparse_attention",
    "moe_gate",
    "moe_dispatch",
    "grouped_gemm",
    "moe_combine",
}


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()


@pytest.fixture(scope="module")
def onnx_prefill(model):
    return export_onnx(model, "prefill")


def test_the_documented_sample_output_has_the_exports_node_counts(onnx_prefill):
    """docs/export.md's sample run of ``glmport export onnx --model tiny`` names this
    export's nodes: per glmport op and the standard ones (the figures drift as the graph
    changes)."""
    doc = (Path(__file__).parents[1] / "docs" / "export.md").read_text()
    sample = re.search(
        r"wrote tiny\.onnx: prefill graph, (\d+) ai\.glmport nodes \(([^)]*)\) and (\d+) "
        r"standard nodes",
        doc,
    )
    assert sample, "docs/export.md lost its sample 'wrote tiny.onnx: ...' line"
    ours = Counter(n.op_type for n in onnx_prefill.graph.node if n.domain == DOMAIN)
    listed = ", ".join(f"{op} x{n}" for op, n in sorted(ours.items()))
    standard = len(onnx_prefill.graph.node) - ours.total()
    assert (int(sample[1]), sample[2], int(sample[3])) == (ours.total(), listed, standard)


def _eager_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), glmport.use_backend("generic"):
        return model(ids).logits


def test_onnx_prefill_carries_one_glmport_node_per_op_call_with_its_function(onnx_prefill):
    ops = {n.op_type for n in onnx_prefill.graph.node if n.domain == DOMAIN}
    assert ops == MODEL_OPS
    assert {f.name for f in onnx_prefill.functions if f.domain == DOMAIN} >= MODEL_OPS
    assert [o.name for o in onnx_prefill.graph.output] == list(GRAPH_OUTPUTS)


@pytest.mark.parametrize(("batch", "length"), [(1, 3), (2, 9), (3, 17)])
def test_onnxruntime_prefill_matches_torch_at_every_batch_and_length(
    model, onnx_prefill, batch, length
):
    ids = sample_ids(model, batch, length, seed=length)
    logits = OnnxRuntimeModel.load(onnx_prefill).run(ids)[0]
    assert logits.shape == (batch, length, model.config.vocab_size)
    assert float((logits - _eager_logits(model, ids)).abs().max()) <= TOLERANCE


def test_onnxruntime_decode_steps_on_their_own_caches_match_torch(model):
    runner = OnnxRuntimeModel.load(export_onnx(model, "decode"))
    found = compare(model, runner.run, "decode", steps=4)
    assert found.max_abs <= TOLERANCE, found


def test_inlined_onnx_holds_only_standard_ops_and_the_same_function(model):
    proto = export_onnx(model, "prefill", inline=True)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    assert not proto.functions
    found = compare(model, OnnxRuntimeModel.load(proto).run, "prefill")
    assert found.max_abs <= TOLERANCE, found


@pytest.mark.parametrize(("experts", "dense"), [("w4a8", "w8a8"), ("w4a8", "fp8_block")])
def test_quantised_gemms_export_and_match_torch(experts, dense):
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()
    with glmport.use_backend("cpu"):
        quantize_model(model, experts=experts, dense=dense)
    proto = export_onnx(model, "prefill")
    ops = {n.op_type for n in proto.graph.node if n.domain == DOMAIN}
    assert {"quant_gemm", "grouped_gemm"} <= ops
    with glmport.use_backend("generic"):
        found = compare(model, OnnxRuntimeModel.load(proto).run, "prefill")
    assert found.max_abs <= TOLERANCE, found


def test_a_bf16_model_onnxruntime_cannot_run_is_unsupported_naming_the_op(model):
    proto = export_onnx(GlmMoeDsaForCausalLM.from_config("tiny", seed=0).to(torch.bfloat16))
    with pytest.raises(UnsupportedError, match="Gemm"):
        OnnxRuntimeModel.load(proto)


def test_the_model_level_conformance_check_runs_the_exported_model(monkeypatch):
    runs = []
    load = OnnxRuntimeModel.load
    monkeypatch.setattr(OnnxRuntimeModel, "load", lambda *a, **k: runs.append(1) or load(*a, **k))
    verdict = run_model_check(torch.float32, "onnxruntime", torch.device("cpu"))
    assert verdict.ok, verdict.reason
    assert len(runs) == 3  # one export per weight variant: float, w4a8+w8a8, w4a8+fp8_block
    assert verdict.metrics["max_abs_dlogp"] < 1e-4


def test_a_saved_onnx_file_loads_and_runs(model, onnx_prefill, tmp_path):
    path = save_onnx(onnx_prefill, tmp_path / "m.onnx")
    ids = sample_ids(model, 2, 5)
    got = OnnxRuntimeModel.load(path).run(ids)[0]
    assert float((got - _eager_logits(model, ids)).abs().max()) <= TOLERANCE


def test_cli_exports_the_tiny_model_to_onnx_and_checks_it(tmp_path, capsys):
    out = tmp_path / "tiny.onnx"
    assert glmport.cli.main(["export", "onnx", "--model", "tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.is_file() and f"{DOMAIN} nodes" in printed
    assert "check against eager torch: max |logits - torch|" in printed


def test_cli_without_the_export_extra_names_the_missing_package(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tvm" else real(name, *a)
    )
    args = ["export", "tvm", "--model", "tiny", "--out", str(tmp_path / "t")]
    assert glmport.cli.main(args) == 2
    want = f"export extra (apache-tvm not installed): {install_command(['tvm'])}"
    assert want in capsys.readouterr().err


def test_cli_bad_model_argument_is_one_error_line(tmp_path, capsys):
    args = ["export", "onnx", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]
    assert glmport.cli.main(args) == 2
    assert "--model must be 'tiny' or a checkpoint folder" in capsys.readouterr().err
