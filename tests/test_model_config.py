"""Model configuration, presets, parameter counts and HF-format safetensors I/O."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

import glmport
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.weights import INDEX_FILE, SINGLE_FILE


def test_glm5_preset_on_meta_has_744b_total_and_40b_active_parameters():
    model = GlmMoeDsaForCausalLM.from_config("glm5", device="meta")
    total = model.num_parameters()
    active = model.num_parameters(active=True)
    embeddings = 2 * 154880 * 6144  # input embedding and untied LM head
    assert 743e9 < total < 745e9
    assert 39.5e9 < active - embeddings < 40.5e9
    assert model.num_parameters(include_mtp=True) > total  # the MTP layer is a full MoE layer


def test_real_glm5_config_json_fields_load():
    data = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "num_nextn_predict_layers": 1,
        "indexer_rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "dtype": "bfloat16",
        "scoring_func": "sigmoid",
    }
    cfg = GlmMoeDsaConfig.from_dict(data)
    assert (cfg.rope_theta, cfg.num_nextn_predict_layers, cfg.indexer_rope_interleave) == (
        1e6,
        1,
        True,
    )
    assert cfg.extra == {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "dtype": "bfloat16",
        "scoring_func": "sigmoid",
    }
    back = cfg.to_dict()
    assert back["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert back["dtype"] == "bfloat16" and back["num_key_value_heads"] == cfg.num_attention_heads


def test_config_without_rope_uses_transformers_default_theta_and_dsv32_half_split_indexer():
    cfg = GlmMoeDsaConfig.from_dict({"model_type": "deepseek_v32"})
    assert cfg.rope_theta == 10000.0
    assert cfg.indexer_rope_interleave is False


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"model_type": "llama"}, "model_type 'llama'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 4}},
            "rope_type 'dynamic' is not implemented",
        ),
        ({"n_routed_experts": 10, "n_group": 4}, "n_group 4"),
    ],
)
def test_unsupported_configs_are_clear_errors(data, needle):
    with pytest.raises(glmport.ConfigError, match=needle):
        GlmMoeDsaConfig.from_dict(data)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(glmport.ConfigError, match="glm5, tiny"):
        GlmMoeDsaForCausalLM.from_config("huge")


def _ids():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("max_shard_bytes", [5 << 30, 40_000])
def test_save_and_load_round_trip_with_mtp_and_shards(tmp_path, max_shard_bytes):
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=3)
    model.save_pretrained(tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / INDEX_FILE).exists()
    assert sharded == (max_shard_bytes < 5 << 30)
    files = sorted(tmp_path.glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys |= set(handle.keys())
    layers = model.config.num_hidden_layers
    assert f"model.layers.{layers}.eh_proj.weight" in keys  # the MTP layer, checkpoint-named
    assert f"model.layers.{layers}.shared_head.head.weight" in keys
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys  # per-expert, like the hub
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    assert back.config.num_nextn_predict_layers == 1
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, back(_ids()).logits)
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_loading_a_mismatched_checkpoint_names_the_tensors(tmp_path):
    GlmMoeDsaForCausalLM.from_config("tiny").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["v_head_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(glmport.ConfigError, match=r"kv_b_proj\.weight has shape"):
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)


def test_loading_a_folder_without_safetensors_is_a_clear_error(tmp_path):
    GlmMoeDsaConfig.tiny().to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(glmport.ConfigError, match=f"no {re.escape(SINGLE_FILE)}"):
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("ids", "mask", "needle"),
    [
        (torch.zeros(5, dtype=torch.long), None, r"\[B, S\]"),
        (torch.full((1, 3), 500), None, r"\[0, 128\)"),
        (torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 4), "attention_mask shape"),
    ],
)
def test_bad_model_inputs_are_clear_errors(ids, mask, needle):
    model = GlmMoeDsaForCausalLM.from_config("tiny")
    with pytest.raises(glmport.ConfigError, match=needle):
        model(ids, mask)


def test_labels_give_the_shifted_next_token_loss():
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=1)
    ids = _ids()
    with torch.no_grad():
        out = model(ids, labels=ids)
    logp = torch.log_softmax(out.logits[:, :-1].double(), dim=-1)
    want = -logp.gather(2, ids[:, 1:, None]).mean()
    assert abs(out.loss.item() - want.item()) < 1e-5


# -- construction ----------------------------------------------------------------------


def test_the_constructor_initialises_every_weight_as_transformers_does():
    """``GlmMoeDsaForCausalLM(config)`` as transformers users build it: every weight
    finite, the routed experts and routers drawn like the rest (normal with std
    ``initializer_range``, not nn.Linear's kaiming default nor ``torch.empty``'s
    leftovers), norms at one, and a forward gives finite logits."""
    cfg = GlmMoeDsaConfig.tiny(initializer_range=0.05)
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg)
    for name, p in model.named_parameters():
        assert bool(torch.isfinite(p).all()), name
    # Every matrix (Linear, Embedding, router) and the fused experts; vectors are norms.
    drawn = {n: p.detach() for n, p in model.named_parameters() if p.dim() >= 2}
    experts = [n for n in drawn if ".mlp.experts." in n]
    routers = [n for n in drawn if n.endswith(".mlp.gate.weight")]
    assert len(experts) == 3 * 2 and len(routers) == 3  # MoE layers 1, 2 and the MTP layer
    for name, p in drawn.items():
        std, mean = float(p.std()), float(p.mean())
        assert 0.8 * 0.05 < std < 1.25 * 0.05, (name, std)
        assert abs(mean) < 0.25 * 0.05, (name, mean)
    for name, p in model.named_parameters():
        if p.dim() == 1:  # RMSNorm / LayerNorm weights (no bias in this config)
            assert torch.equal(p, torch.ones_like(p)) or name.endswith("k_norm.bias"), name
    with torch.no_grad():
        logits = model(_ids()).logits
    assert logits.shape == (2, 9, 128) and bool(torch.isfinite(logits).all())
    assert float(logits.std()) > 0


def test_the_constructor_draws_from_the_global_seed():
    cfg = GlmMoeDsaConfig.tiny()
    torch.manual_seed(7)
    a = GlmMoeDsaForCausalLM(cfg).state_dict()
    torch.manual_seed(7)
    b = GlmMoeDsaForCausalLM(cfg).state_dict()
    torch.manual_seed(8)
    c = GlmMoeDsaForCausalLM(cfg).state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for key in ("lm_head.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        assert not torch.equal(a[key], c[key]), key
    assert not torch.equal(a["model.layers.1.mlp.gate.weight"], c["model.layers.1.mlp.gate.weight"])


def test_from_config_draws_from_its_own_seed():
    """``from_config(seed=s)``: the same weights whatever the global RNG holds, its
    first draw (the input embedding) the first normal draw of a generator seeded ``s``."""
    cfg = GlmMoeDsaConfig.tiny()
    torch.manual_seed(1)
    a = GlmMoeDsaForCausalLM.from_config(cfg, seed=5)
    torch.manual_seed(2)
    b = GlmMoeDsaForCausalLM.from_config(cfg, seed=5)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    embed = a.model.embed_tokens.weight
    want = torch.randn(embed.shape, generator=torch.Generator().manual_seed(5)) * 0.02
    assert torch.equal(embed, want)
    other = GlmMoeDsaForCausalLM.from_config(cfg, seed=6)
    assert not torch.equal(a.lm_head.weight, other.lm_head.weight)


def test_meta_construction_draws_nothing():
    """On the meta device even GLM-5's 744B parameters build at once: shapes only, no
    draw from the global RNG."""
    before = torch.get_rng_state()
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.glm5())
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.num_parameters() > 7e11
    assert torch.equal(torch.get_rng_state(), before)


def test_from_pretrained_does_not_initialise(tmp_path, monkeypatch):
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=3)
    model.save_pretrained(tmp_path)

    def refuse(self, seed=0):
        raise AssertionError("from_pretrained drew an initialisation it then overwrote")

    monkeypatch.setattr(GlmMoeDsaForCausalLM, "init_weights", refuse)
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    with pytest.raises(AssertionError, match="drew an initialisation"):
        GlmMoeDsaForCausalLM(model.config)  # the patch does catch an initialisation
