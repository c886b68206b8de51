"""Every config field of transformers' GlmMoeDsaConfig / DeepseekV32Config: classified
(model/config_fields.py's FIELD_RULES), honoured (logits equal to transformers' on checkpoints
written by transformers with the fields changed from their defaults, RoPE scaling
included), or refused with a ConfigError naming it; the RoPE parameters round-trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_model_hf import HF_TINY, VARIANT, _batch, _hf_model

import glmport
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.causal_lm import TIED_EMBEDDING, TIED_HEAD
from glmport.model.config_fields import (
    BOOKKEEPING,
    FIELD_RULES,
    HONOURED,
    REFUSED,
    indexer_types_of,
)
from glmport.model.generation import generate
from glmport.model.weights import checkpoint_plan

transformers = pytest.importorskip("transformers", minversion="5.18")

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
CLASSES = {"glm": transformers.GlmMoeDsaConfig, "dsv32": transformers.DeepseekV32Config}
# DeepSeek-V3.2's YaRN with its original length cut from 4096 to 8, so that the
# test's 24 positions reach 3x beyond it (factor, betas and mscales as released).
DSV32_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40,
    "original_max_position_embeddings": 8,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
ROPES = {
    "yarn-dsv32": DSV32_YARN,
    # no mscale: the cos / sin factor is mscale(factor), the softmax scale is unchanged
    "yarn-plain": {
        "rope_type": "yarn",
        "rope_theta": 500.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    # an explicit cos / sin factor and a softmax mscale of its own
    "yarn-factors": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 6,
        "attention_factor": 1.3,
        "mscale": 0.7,
        "mscale_all_dim": 0.5,
    },
    "linear": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
# Every other honoured field away from its default (routing and norm values kept where
# the HF_TINY dimensions need them), and bookkeeping ones changed too.
FIELDS_CHANGED = dict(
    mlp_layer_types=["sparse", "dense", "sparse"],  # not what first_k_dense_replace says
    first_k_dense_replace=2,
    routed_scaling_factor=1.7,
    norm_topk_prob=False,
    rms_norm_eps=1e-3,
    attention_bias=True,
    n_shared_experts=2,
    num_experts_per_tok=3,
    max_position_embeddings=64,
    initializer_range=0.05,
    use_cache=False,
    pad_token_id=3,
    bos_token_id=5,
    eos_token_id=[6, 7],
    output_router_logits=True,
    mlp_bias=True,
)


def _saved(kind: str, tmp_path, **overrides):
    """transformers' model with random weights, saved by transformers and loaded by
    glmport's from_pretrained: ``(hf, ours)``."""
    hf = _hf_model(kind, **overrides)
    hf.save_pretrained(tmp_path)
    return hf, GlmMoeDsaForCausalLM.from_pretrained(tmp_path)


def _logits_gap(hf, ours, seq_len: int = 24) -> float:
    """Largest logit difference over the real tokens of a padded batch (the longer
    sequence's later queries see more than 4 x index_topk keys: absorbed MLA)."""
    ids, mask = _batch(seq_len)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, mask).logits
    assert want.abs()[mask.bool()].max() > 1.0
    return float((got - want).abs()[mask.bool()].max())


# -- the classification --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_every_field_transformers_writes_is_classified(kind):
    written = set(CLASSES[kind](**HF_TINY).to_dict())
    assert written - set(FIELD_RULES) == set()
    own = {f.name for f in dataclasses.fields(GlmMoeDsaConfig)} - {"extra"}
    assert own - set(FIELD_RULES) == set()
    kinds = {rule.kind for rule in FIELD_RULES.values()}
    assert kinds == {HONOURED, BOOKKEEPING, REFUSED}
    for name, rule in FIELD_RULES.items():
        assert (rule.runs is not None) == (rule.kind == REFUSED), name
        assert rule.reason, name


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"index_topk_freq": 2},
        {"index_topk_freq": 4, "index_skip_topk_offset": 1},
        {"index_topk_freq": 3, "index_skip_topk_offset": 0},
        {"index_topk_pattern": "FSSF"},
        {"index_topk_pattern": ["full", "shared", "full", "full"]},
    ],
)
def test_indexer_types_are_derived_as_transformers_does(kwargs):
    hf = CLASSES["glm"](**{**HF_TINY, "num_hidden_layers": 4}, **kwargs)
    fields = {"num_hidden_layers": 4, **kwargs}
    assert indexer_types_of(fields) == hf.indexer_types
    # glmport reads the list transformers writes, and derives the same one from a
    # hand-written config that carries only the pattern / frequency keys.
    data = {**hf.to_dict(), "model_type": "glm_moe_dsa"}
    bare = {k: v for k, v in data.items() if k != "indexer_types"}
    if hf.indexer_types[0] == "shared":  # no full layer before it: transformers' forward fails
        with pytest.raises(glmport.ConfigError, match="config field indexer_types must start"):
            GlmMoeDsaConfig.from_dict(data)
        return
    assert GlmMoeDsaConfig.from_dict(data).to_dict()["indexer_types"] == hf.indexer_types
    assert GlmMoeDsaConfig.from_dict({**bare, **kwargs}).indexer_types == hf.indexer_types


# -- honoured fields: logits equal to transformers' ------------------------------------


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_rope_scaling_logits_match_transformers(kind, rope, tmp_path):
    hf, ours = _saved(kind, tmp_path, rope_parameters=dict(ROPES[rope]))
    assert ours.config.rope_scaling["rope_type"] == ROPES[rope]["rope_type"]
    assert _logits_gap(hf, ours) <= TOL
    # Discriminative: the same weights under default RoPE give other logits.
    plain = dataclasses.replace(ours.config, rope_scaling={"rope_type": "default"})
    default = GlmMoeDsaForCausalLM(plain)
    default.load_state_dict(ours.state_dict())
    assert _logits_gap(hf, default) > 1e-2


def test_yarn_scales_cos_sin_and_the_softmax_as_transformers_does():
    """DeepSeek-V3.2's released rope_scaling (legacy key, real dimensions): the same
    frequencies (bit for bit), cos / sin factor and softmax scale as transformers."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds

    real = {
        "model_type": "deepseek_v32",
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    }
    hf_cfg = transformers.DeepseekV32Config.from_dict(real)
    rotary = ds.DeepseekV32RotaryEmbedding(hf_cfg)
    scaling = ds.yarn_apply_mscale(hf_cfg.rope_parameters, 192**-0.5)
    with torch.device("meta"):  # shapes only: the rope tables are made on the cpu anyway
        ours = GlmMoeDsaForCausalLM(GlmMoeDsaConfig.from_dict(real))
    assert torch.equal(ours.model.inv_freq, rotary.inv_freq)
    assert ours.model.attention_factor == rotary.attention_scaling == 1.0
    attn = ours.model.layers[0].self_attn
    assert attn.scale == pytest.approx(scaling, rel=1e-12)
    assert attn.scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    positions = torch.arange(0, 163840, 997)
    cos, sin = ours.model.rope(positions)
    want_cos, want_sin = rotary(torch.zeros(1), positions[None])
    assert torch.equal(cos, want_cos[0, :, :32]) and torch.equal(sin, want_sin[0, :, :32])


def test_rope_frequencies_stay_float32_in_a_bfloat16_model():
    cfg = GlmMoeDsaConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    model = GlmMoeDsaForCausalLM.from_config(cfg)
    positions = torch.arange(100_000, 100_050)
    want = model.model.rope(positions)
    model.to(torch.bfloat16)
    assert model.model.inv_freq.dtype == torch.float32
    for got, ref in zip(model.model.rope(positions), want, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, ref)


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_every_other_field_changed_from_its_default_matches_transformers(kind, tmp_path):
    rope = {"rope_type": "default", "rope_theta": 300.0}
    hf, ours = _saved(kind, tmp_path, rope_parameters=rope, **FIELDS_CHANGED)
    c = ours.config
    assert [c.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert (c.routed_scaling_factor, c.norm_topk_prob, c.attention_bias) == (1.7, False, True)
    assert c.rope_theta == 300.0 and c.extra["mlp_bias"] is True
    assert _logits_gap(hf, ours) <= TOL


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_tied_word_embeddings_are_one_tensor_as_in_transformers(kind, tmp_path):
    hf, ours = _saved(kind, tmp_path / "hf", tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # transformers ties them too
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert _logits_gap(hf, ours) <= TOL
    with torch.no_grad():  # one Parameter: a change to the embedding moves the logits
        ours.model.embed_tokens.weight.mul_(2)
    assert _logits_gap(hf, ours) > 1e-2
    with torch.no_grad():
        ours.model.embed_tokens.weight.div_(2)
    ours.save_pretrained(tmp_path / "ours")  # written once, as transformers writes it
    keys = {k for _, names in checkpoint_plan(tmp_path / "ours") for k in names}
    assert TIED_EMBEDDING in keys and TIED_HEAD not in keys
    again = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "ours")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, ours.lm_head.weight)
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters()) - sum(
        p.numel() for p in hf.model.layers[ours.config.num_hidden_layers :].parameters()
    )


def test_a_tied_checkpoint_whose_head_differs_from_its_embedding_is_refused():
    config = GlmMoeDsaConfig.tiny(tie_word_embeddings=True)
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    state = dict(model.state_dict())
    state[TIED_HEAD] = state[TIED_EMBEDDING] + 1
    with pytest.raises(
        ConfigError, match="tie_word_embeddings is true but the checkpoint's lm_head"
    ):
        model.load_hf_state_dict(state)
    state[TIED_HEAD] = state[TIED_EMBEDDING].clone()  # the same values: accepted
    model.load_hf_state_dict(state)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_expert_count_aliases_and_a_top_level_original_length_read_as_in_transformers():
    data = {
        **HF_TINY,
        "num_local_experts": 16,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0},
        "original_max_position_embeddings": 32,
    }
    data.pop("attn_implementation")
    hf = transformers.GlmMoeDsaConfig.from_dict(data)
    ours = GlmMoeDsaConfig.from_dict(data)
    assert ours.n_routed_experts == hf.n_routed_experts == 16
    rotary = transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaRotaryEmbedding(hf)
    assert ours.rope_scaling["original_max_position_embeddings"] == 32
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(ours)
    assert torch.equal(model.model.inv_freq, rotary.inv_freq)
    assert GlmMoeDsaConfig.from_dict({**data, "num_experts": 8}).n_routed_experts == 8


# -- cached decode under YaRN ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_yarn_cached_decode_and_generation_equal_the_full_forward(kind, tmp_path):
    _, model = _saved(kind, tmp_path, rope_parameters=dict(DSV32_YARN))
    ids = torch.randint(0, 100, (20,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids[None]).logits[0]
    cache = PagedKVCache.for_config(model.config, 3, num_blocks=8, block_size=4)
    seq = cache.add_sequence()
    got = [forward_cached(model, cache, [seq], [ids[:6]]).logits]  # prefill inside 8
    got += [forward_cached(model, cache, [seq], [ids[i : i + 1]]).logits for i in range(6, 20)]
    assert (torch.cat(got) - full).abs().max() <= TOL
    # greedy generation on the paged cache = argmax of the full forward, recomputed
    prompt, n = ids[:5].tolist(), 10
    seq_ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq_ids.append(int(model(torch.tensor([seq_ids])).logits[0, -1].argmax()))
    assert generate(model, [prompt], n).output_ids[0] == seq_ids[len(prompt) :]


# -- refused fields and bad RoPE parameters --------------------------------------------

# One value glmport cannot run per REFUSED key of FIELD_RULES.
REFUSED_VALUES = {
    "hidden_act": "gelu",
    "num_key_value_heads": 2,
    "attention_dropout": 0.1,
    "layer_types": ["full_attention"] * 3,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "moe_layer_freq": 2,
    "rope_interleave": False,
}


def test_every_refused_field_has_a_case():
    assert set(REFUSED_VALUES) == {k for k, r in FIELD_RULES.items() if r.kind == REFUSED}


@pytest.mark.parametrize("kind", ["glm", "dsv32"])
@pytest.mark.parametrize("name", list(REFUSED_VALUES))
def test_an_unimplemented_field_set_away_from_its_default_is_a_config_error(kind, name):
    settings = {**HF_TINY, **VARIANT[kind], name: REFUSED_VALUES[name]}
    data = CLASSES[kind](**settings).to_dict()
    data[name] = REFUSED_VALUES[name]  # as written, whatever transformers' class kept
    with pytest.raises(glmport.ConfigError, match=f"config field {name} = ") as err:
        GlmMoeDsaConfig.from_dict(data)
    assert "not implemented" in str(err.value)
    assert repr(REFUSED_VALUES[name])[:20] in str(err.value)


@pytest.mark.parametrize(
    ("rope", "needle"),
    [
        ({"rope_type": "yarn"}, r"rope_parameters\.factor is required"),
        ({"rope_type": "yarn", "factor": 0.5}, r"rope_parameters\.factor must be >= 1"),
        ({"rope_type": "linear", "factor": 2, "beta_fast": 4}, r"rope_parameters\.beta_fast"),
        ({"rope_type": "default", "factor": 2}, r"rope_parameters\.factor is not read"),
        (
            {"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 2},
            r"rope_parameters\.beta_fast 1 must be >= beta_slow 2",
        ),
        (
            {"rope_type": "yarn", "factor": 4, "partial_rotary_factor": 0.5},
            r"rope_parameters\.partial_rotary_factor 0\.5 is not implemented",
        ),
        ({"rope_type": "yarn", "factor": 4, "truncate": "no"}, r"rope_parameters\.truncate"),
        (
            {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0},
            r"rope_parameters\.original_max_position_embeddings",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8,
                "low_freq_factor": 4,
                "high_freq_factor": 1,
                "original_max_position_embeddings": 16,
            },
            r"rope_parameters\.high_freq_factor 1 must be > low_freq_factor 4",
        ),
        ({"rope_type": "dynamic", "factor": 2}, r"rope_type 'dynamic' is not implemented"),
        (
            {"rope_type": "longrope", "short_factor": [1], "long_factor": [2]},
            r"rope_type 'longrope' is not implemented",
        ),
        ({"rope_type": "ntk"}, r"rope_type 'ntk' is unknown"),
        ({"rope_type": "linear", "factor": "4"}, r"rope_parameters\.factor must be a finite"),
    ],
)
def test_bad_rope_parameters_are_config_errors_naming_the_key(rope, needle):
    with pytest.raises(glmport.ConfigError, match=needle):
        GlmMoeDsaConfig.from_dict({"rope_parameters": rope})


# -- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_parameters_round_trip_and_transformers_reads_them_back(rope, tmp_path):
    legacy = {k: v for k, v in ROPES[rope].items() if k not in ("rope_type", "rope_theta")}
    data = {
        **{k: v for k, v in HF_TINY.items() if k != "attn_implementation"},
        "model_type": "deepseek_v32",
        "rope_theta": ROPES[rope]["rope_theta"],
        "rope_scaling": {"type": ROPES[rope]["rope_type"], **legacy},  # the legacy spelling
        "mlp_layer_types": ["dense", "sparse", "dense"],
    }
    want = transformers.DeepseekV32Config.from_dict(data)
    cfg = GlmMoeDsaConfig.from_dict(data)
    again = GlmMoeDsaConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    assert dataclasses.replace(again, extra={}) == dataclasses.replace(cfg, extra={})
    cfg.to_json_file(tmp_path / "config.json")
    back = transformers.DeepseekV32Config.from_pretrained(tmp_path)
    read = {k: v for k, v in want.rope_parameters.items() if k != "type"}
    assert back.rope_parameters == read
    assert back.mlp_layer_types == want.mlp_layer_types == cfg.mlp_layer_types
    assert cfg.to_dict()["rope_parameters"] == read
