"""The tiny GLM-5 compiled by TVM (Relax VM), from torch.export and from the ONNX
export: prefill and decode steps on the VM's own caches against the eager model's own
forward; a saved library; an op TVM cannot take; ``glmport export tvm`` on a saved
checkpoint."""

from __future__ import annotations

import pytest
import torch

import glmport
import glmport.cli
from glmport.conformance.model_case import run_model_check
from glmport.core.errors import ConfigError, UnsupportedError
from glmport.export.check import compare, sample_ids
from glmport.export.graph import GraphInputError
from glmport.export.tvm_model import TvmModel
from glmport.export.tvm_runtime import to_tvm
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.quantize import quantize_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()


@pytest.fixture(scope="module")
def tvm_prefill(model) -> TvmModel:
    return TvmModel.build(model, "prefill")


def test_tvm_prefill_from_torch_export_matches_torch(model, tvm_prefill):
    found = compare(model, tvm_prefill.run, "prefill")
    assert found.max_abs <= TOLERANCE, found
    found = compare(model, tvm_prefill.run, "prefill", batch=3, prompt=17)
    assert found.max_abs <= TOLERANCE, found


def test_tvm_decode_steps_on_their_own_caches_match_torch(model):
    found = compare(model, TvmModel.build(model, "decode").run, "decode", steps=4)
    assert found.max_abs <= TOLERANCE, found


def test_tvm_from_the_onnx_export_matches_torch_at_its_fixed_shape(model):
    built = TvmModel.build(model, "prefill", source="onnx", fixed={"batch": 2, "seq": 9})
    found = compare(model, built.run, "prefill", batch=2, prompt=9)
    assert found.max_abs <= TOLERANCE, found
    # Another shape is refused by name, a bad id by the graph's own assert as well.
    with pytest.raises(GraphInputError, match="'input_ids' must be batch 2, the fixed axis"):
        built.run(sample_ids(model, 3, 9))
    bad = sample_ids(model, 2, 9)
    bad[1, 4] = -1
    with pytest.raises(AssertionError, match=r"glmport guard: input_ids in \[0, 128\)"):
        built._main(to_tvm(bad))


def test_a_bf16_model_is_refused_with_tvms_reason():
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).to(torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"layer_norm.*bfloat16"):
        TvmModel.build(model, "prefill")


def test_the_onnx_road_asks_for_its_fixed_axes(model):
    with pytest.raises(ConfigError, match="batch and past"):
        TvmModel.build(model, "decode", source="onnx", fixed={"batch": 2})


def test_a_saved_tvm_library_loads_and_runs(model, tvm_prefill, tmp_path):
    loaded = TvmModel.load(tvm_prefill.save(tmp_path / "tvm"))
    ids = sample_ids(model, 1, 6)
    torch.testing.assert_close(loaded.run(ids)[0], tvm_prefill.run(ids)[0], rtol=0, atol=0)


def test_tvm_names_the_op_it_cannot_take():
    config = GlmMoeDsaConfig.tiny()
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0).eval()
    with glmport.use_backend("cpu"):
        quantize_model(model, experts="none", dense="fp8_block")
    with pytest.raises(UnsupportedError, match=r"quant_gemm.*fp8"):
        TvmModel.build(model, "prefill")


def test_the_model_level_check_judges_what_tvm_takes_and_names_what_it_cannot():
    verdict = run_model_check(torch.float32, "tvm", torch.device("cpu"))
    assert verdict.ok, verdict.reason
    assert "w4a8+fp8_block not judged" in verdict.reason and "float8" in verdict.reason
    assert verdict.metrics["max_abs_dlogp"] < 1e-4
    assert "w4a8+w8a8 T=1: max_abs_dlogp" in verdict.metrics


def test_cli_exports_a_saved_checkpoint_to_tvm_decode(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "ckpt")
    args = ["export", "tvm", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "tvm")]
    assert glmport.cli.main([*args, "--decode"]) == 0
    assert (tmp_path / "tvm" / "model.so").is_file()
    assert "check against eager torch" in capsys.readouterr().out
