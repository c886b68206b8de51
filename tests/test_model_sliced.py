"""Loading a slice of a checkpoint's decoder layers (``from_pretrained(layers=...)``,
``--layers`` on the commands that take one): exactly those layers' tensors are read,
renumbered from 0, each layer keeps its MLP and indexer kind, and a slice that cannot
stand alone (out of range, an IndexCache shared layer first) is a ConfigError naming
it before anything is read."""

from __future__ import annotations

import json

import pytest
import torch

from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model import weights as weights_module
from glmport.model.generation import generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model (layer 0 dense, 1-2 MoE, one MTP layer), saved in two shards."""
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder, max_shard_bytes=200_000)
    assert (folder / "model.safetensors.index.json").exists()
    return model, folder


def _reads(monkeypatch) -> list[str]:
    """The keys read from safetensors files from now on."""
    keys: list[str] = []
    real = weights_module._read_keys

    def counted(file, name, wanted):
        keys.extend(wanted)
        return real(file, name, wanted)

    monkeypatch.setattr(weights_module, "_read_keys", counted)
    return keys


def test_a_slice_reads_and_holds_exactly_its_layers_renumbered(saved, monkeypatch):
    full, folder = saved
    reads = _reads(monkeypatch)
    part = GlmMoeDsaForCausalLM.from_pretrained(folder, layers=range(1, 3))
    c = part.config
    assert (c.num_hidden_layers, c.num_nextn_predict_layers, len(part.model.layers)) == (2, 0, 2)
    assert [c.is_moe_layer(i) for i in range(2)] == [True, True]  # layers 1-2 are MoE
    layer_keys = {k.split(".")[2] for k in reads if k.startswith("model.layers.")}
    assert layer_keys == {"1", "2"}  # neither layer 0 nor the MTP layer (3) was read
    assert {k for k in reads if not k.startswith("model.layers.")} == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    full_state = full.state_dict()
    for key, value in part.state_dict().items():
        if key.startswith("model.layers."):
            index, rest = key.split(".", 3)[2], key.split(".", 3)[3]
            key = f"model.layers.{int(index) + 1}.{rest}"
        assert torch.equal(value, full_state[key]), key
    out = generate(part, [[5, 17, 33]], 3)  # the slice runs on its own
    assert len(out.output_ids[0]) == 3


def test_a_whole_range_slice_is_the_model_without_mtp(saved):
    full, folder = saved
    part = GlmMoeDsaForCausalLM.from_pretrained(folder, layers=range(0, 3))
    ids = torch.tensor([[5, 17, 33, 2, 90]])
    with torch.no_grad():
        torch.testing.assert_close(part(ids).logits, full(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "layers, needle",
    [
        (range(2, 5), "layers 2-4 lie outside the model's decoder layers 0-2"),
        (range(1, 1), "non-empty range"),
        (range(0, 3, 2), "step 1"),
        ([0, 1], "range"),
    ],
)
def test_a_slice_outside_the_model_is_refused_before_any_read(saved, monkeypatch, layers, needle):
    reads = _reads(monkeypatch)
    with pytest.raises(ConfigError, match=needle):
        GlmMoeDsaForCausalLM.from_pretrained(saved[1], layers=layers)
    assert reads == []


def test_a_slice_that_starts_at_a_shared_indexcache_layer_names_its_full_layer():
    config = GlmMoeDsaConfig.tiny(indexer_types=["full", "shared", "full"])
    with pytest.raises(ConfigError, match="layer 1 reuses layer 0's index selection"):
        config.sliced(range(1, 3))
    assert config.sliced(range(0, 2)).indexer_types == ["full", "shared"]
    assert config.sliced(range(2, 3)).indexer_types == ["full"]


def test_generate_and_diff_take_layers(saved, capsys):
    _, folder = saved
    argv = ["generate", "--model", str(folder), "--layers", "1-2", "--input-ids", "5,17,33"]
    assert main([*argv, "--max-new-tokens", "2", "--greedy", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["output_ids"]) == 2
    diff = ["diff", "--model", str(folder), "--layers", "0", "--backends", "cpu,generic"]
    assert main([*diff, "--input-ids", "5,17,33"]) == 0


@pytest.mark.parametrize(
    "model, layers, needle",
    [
        ("folder", "one", "--layers must be a layer or a range of layers such as 0-1"),
        ("folder", "2-1", "--layers must name layers a-b with 0 <= a <= b"),
        ("folder", "0-7", "layers 0-7 lie outside"),
        ("tiny", "0", "--layers slices a checkpoint folder"),
    ],
)
def test_bad_layers_on_the_command_line_are_clear_errors(saved, capsys, model, layers, needle):
    spec = str(saved[1]) if model == "folder" else "tiny"
    argv = ["generate", "--model", spec, "--layers", layers, "--input-ids", "1,2"]
    assert main([*argv, "--max-new-tokens", "1"]) == 2
    assert needle in capsys.readouterr().err
