"""IndexCache (Bai et al., arXiv 2603.12201): shared layers that reuse the top-k of the
nearest preceding full layer. The config's derivation equals transformers'; checkpoints
transformers writes with shared layers load and match its logits; the shared layers
attend their full layer's selection in the packed forward, the paged cache (which keeps
no indexer keys for them), the choice tape and the training KL."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_hf import HF_TINY, _batch, _hf_model

from glmport.conformance.diff import _tape_agreement
from glmport.core.errors import ConfigError
from glmport.export.graph import StepGraph
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.attention import AttentionRecord, record_attention
from glmport.model.cache import PagedKVCache, forward_cached
from glmport.model.choices import INDICES, ROUTING, Choices, choice_tape
from glmport.model.config_fields import indexer_types_of
from glmport.model.generation import generate
from glmport.model.training import (
    SPARSE_ADAPTATION,
    attention_target,
    configure_stage,
    indexer_kl,
    served_attentions,
    served_target,
    training_losses,
)

transformers = pytest.importorskip("transformers", minversion="5.18")

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
FSSF = ["full", "shared", "shared", "full"]
# index_topk 4 below the sequence lengths used: the indexers really select.
CONFIG = GlmMoeDsaConfig.tiny(num_hidden_layers=4, indexer_types=FSSF, vocab_size=64)


@pytest.fixture(scope="module")
def model() -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).eval()


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


# -- config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"index_topk_freq": 2},
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_freq": 2, "index_skip_topk_offset": 0},  # layer 0 shared: refused
        {"index_topk_freq": 4, "index_skip_topk_offset": 1},
        {"index_topk_freq": 4, "index_skip_topk_offset": 3},
        {"index_topk_pattern": "FSSFSS"},
        {"index_topk_pattern": "FFSFSS"},
        {"index_topk_pattern": ["full", "shared", "full", "full", "shared", "full"]},
    ],
)
def test_indexer_types_equal_transformers_and_round_trip(kwargs):
    hf = transformers.GlmMoeDsaConfig(**{**HF_TINY, "num_hidden_layers": 6}, **kwargs)
    assert indexer_types_of({"num_hidden_layers": 6, **kwargs}) == hf.indexer_types
    hand_written = {**hf.to_dict(), **kwargs}
    hand_written.pop("indexer_types")
    for data in (hf.to_dict(), hand_written):
        if hf.indexer_types[0] == "shared":  # transformers fails at its first forward
            with pytest.raises(ConfigError, match="config field indexer_types must start"):
                GlmMoeDsaConfig.from_dict(data)
            continue
        ours = GlmMoeDsaConfig.from_dict(data)
        assert ours.indexer_types == hf.indexer_types
        written = ours.to_dict()
        assert written["indexer_types"] == hf.indexer_types
        for key, value in kwargs.items():  # kept as given, as transformers keeps them
            assert written[key] == value
        assert transformers.GlmMoeDsaConfig(**written).indexer_types == hf.indexer_types


@pytest.mark.parametrize(
    ("types", "needle"),
    [
        (["full", "shared"], "indexer_types has 2 entries for num_hidden_layers 4"),
        (["full", "shared", "skip", "full"], "indexer_types must be a list of 'full'"),
        (["shared", "full", "full", "full"], "indexer_types must start with 'full'"),
    ],
)
def test_bad_indexer_types_are_config_errors(types, needle):
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(CONFIG, indexer_types=types)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        GlmMoeDsaConfig.tiny(extra={"index_topk_pattern": "FXF"})


def test_deepseek_v32_reads_no_indexcache_key():
    # transformers' DeepSeek-V3.2 has no shared layers: the keys are bookkeeping.
    data = {
        **transformers.DeepseekV32Config(**HF_TINY).to_dict(),
        "index_topk_freq": 2,
        "indexer_types": ["full", "shared", "full"],
    }
    ours = GlmMoeDsaConfig.from_dict(data)
    assert ours.indexer_types == ["full"] * 3
    written = ours.to_dict()
    assert written["index_topk_freq"] == 2
    assert written["indexer_types"] == ["full", "shared", "full"]  # as given


def test_shared_layers_have_no_indexer_weights_and_the_count_says_so(model):
    names = model.state_dict()
    assert not [
        n
        for n in names
        if n.startswith(("model.layers.1.", "model.layers.2.")) and ".indexer." in n
    ]
    assert [n for n in names if n.startswith("model.layers.3.self_attn.indexer.")]
    assert [n for n in names if n.startswith("model.layers.4.self_attn.indexer.")]  # MTP
    assert CONFIG.parameter_count() == sum(t.numel() for t in names.values())
    full = dataclasses.replace(CONFIG, indexer_types=["full"] * 4)
    per_indexer = sum(p.numel() for p in model.model.layers[0].self_attn.indexer.parameters())
    assert full.parameter_count() - CONFIG.parameter_count() == 2 * per_indexer
    assert GlmMoeDsaConfig.glm5().indexer_types == ["full"] * 78
    assert [CONFIG.indexer_source(i) for i in range(5)] == [0, 0, 0, 3, 4]


# -- against transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """transformers' model with layers F S S F, saved by transformers and loaded by
    glmport's from_pretrained: ``(hf, ours, folder)``."""
    folder = tmp_path_factory.mktemp("fssf")
    hf = _hf_model("glm", num_hidden_layers=4, index_topk_pattern="FSSF")
    assert hf.config.indexer_types == FSSF
    assert hf.model.layers[1].self_attn.indexer is None
    hf.save_pretrained(folder)
    return hf, GlmMoeDsaForCausalLM.from_pretrained(folder), folder


@pytest.mark.parametrize("seq_len", [14, 24])  # non-absorbed and absorbed MLA
def test_a_checkpoint_with_shared_layers_matches_transformers(saved, seq_len):
    hf, ours, _ = saved
    assert ours.config.indexer_types == FSSF
    assert [layer.self_attn.indexer is None for layer in ours.model.decoder_layers] == [
        False,
        True,
        True,
        False,
    ]
    ids, mask = _batch(seq_len)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, mask).logits
    valid = mask.bool()
    assert want.abs()[valid].max() > 1.0
    assert (got - want).abs()[valid].max() <= TOL


def test_shared_layers_with_deepseek_yarn_match_transformers(tmp_path):
    """The issue's two halves in one checkpoint: layers F S S F and DeepSeek-V3.2's
    YaRN (its original length cut to 8, so 24 positions reach 3x beyond it)."""
    from test_model_hf_fields import DSV32_YARN

    hf = _hf_model(
        "glm", num_hidden_layers=4, index_topk_pattern="FSSF", rope_parameters=DSV32_YARN
    )
    hf.save_pretrained(tmp_path)
    ours = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    assert ours.config.indexer_types == FSSF and ours.config.rope_scaling["rope_type"] == "yarn"
    ids, mask = _batch(24)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(ids, mask).logits
    valid = mask.bool()
    assert (got - want).abs()[valid].max() <= TOL


def test_save_and_load_round_trip_and_transformers_reads_the_config(saved, tmp_path):
    _, ours, _ = saved
    ours.save_pretrained(tmp_path)
    again = GlmMoeDsaForCausalLM.from_pretrained(tmp_path)
    assert again.config.indexer_types == FSSF
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert transformers.AutoConfig.from_pretrained(tmp_path).indexer_types == FSSF


# -- the shared layers use their full layer's selection ------------------------------


def _records(model, ids: torch.Tensor) -> list[AttentionRecord]:
    attentions = [layer.self_attn for layer in model.model.decoder_layers]
    with record_attention(attentions) as records, torch.no_grad():
        model(ids[None])
    return [records[a][0] for a in attentions]


def test_shared_layers_attend_the_selection_of_their_full_layer(model):
    rec = _records(model, _ids(20))
    assert (rec[0].indices >= 0).sum(dim=1).max() == CONFIG.index_topk  # it selects
    assert torch.equal(rec[1].indices, rec[0].indices)
    assert torch.equal(rec[2].indices, rec[0].indices)
    assert not torch.equal(rec[3].indices, rec[0].indices)  # its own indexer
    # Another layer-0 indexer: the shared layers follow its new choice.
    other = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[0].self_attn.indexer.weights_proj.weight.neg_()
    moved = _records(other, _ids(20))
    assert not torch.equal(moved[0].indices, rec[0].indices)
    assert torch.equal(moved[1].indices, moved[0].indices)
    assert torch.equal(moved[2].indices, moved[0].indices)


def test_cached_decode_equals_the_full_forward_and_keeps_no_shared_keys(model):
    ids = _ids(20)
    with torch.no_grad():
        full = model(ids[None]).logits[0]
    cache = PagedKVCache.for_config(model.config, 4, num_blocks=8, block_size=4)
    assert [k is None for k in cache.index_keys] == [False, True, True, False]
    assert all(latent.shape == (32, CONFIG.kv_lora_rank) for latent in cache.latent)
    assert all(rope.shape == (32, CONFIG.qk_rope_head_dim) for rope in cache.rope)
    mtp_cache = PagedKVCache.for_config(model.config, 1, num_blocks=8, block_size=4)
    assert mtp_cache.index_keys[0].shape == (32, CONFIG.index_head_dim)
    seq = cache.add_sequence()
    got = [forward_cached(model, cache, [seq], [ids[:6]]).logits]
    got += [forward_cached(model, cache, [seq], [ids[i : i + 1]]).logits for i in range(6, 20)]
    assert (torch.cat(got) - full).abs().max() <= TOL
    # greedy and MTP-speculative generation (the MTP layer runs its own indexer) agree
    prompts = [ids[:7].tolist(), ids[:3].tolist()]
    plain = generate(model, prompts, 8).output_ids
    assert generate(model, prompts, 8, speculative=True).output_ids == plain


def test_choice_tape_records_full_layers_and_replays_through_them(model):
    ids = _ids(16)
    with choice_tape(model) as tape, torch.no_grad():
        want = model(ids[None]).logits
    choices = tape.recorded()[0]
    assert choices.indices.shape == (2, 16, CONFIG.index_topk)  # layers 0 and 3
    other = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.model.layers[0].self_attn.indexer.weights_proj.weight.neg_()
        moved = other(ids[None]).logits
        with choice_tape(other, replay=[choices], kinds=("indices",)):
            replayed = other(ids[None]).logits
    assert (moved - want).abs().max() > 100 * TOL  # layers 0-2 attend other keys
    assert (replayed - want).abs().max() <= TOL  # the shared layers replay layer 0's


def test_diff_reports_a_shared_layer_with_its_full_layers_overlap():
    rows = torch.arange(6, dtype=torch.int32).view(1, 3, 2).expand(2, 3, 2).clone()
    moved = rows.clone()
    moved[1] = -1  # layer 3's choice differs entirely
    a, b = {0: Choices(None, rows)}, {0: Choices(None, moved)}
    overlaps = [
        _tape_agreement(a, b, layer, INDICES, ROUTING, CONFIG)["topk_overlap"] for layer in range(4)
    ]
    assert overlaps[:3] == [1.0, 1.0, 1.0] and overlaps[3] < 1.0


def test_export_refuses_shared_layers(model):
    with pytest.raises(ConfigError, match=r"indexer_types .*export of shared-indexer layers"):
        StepGraph(model)


# -- training --------------------------------------------------------------------------


def test_the_kl_target_of_a_full_layer_averages_the_layers_it_serves(model):
    rec = _records(model, _ids(20))
    scale = model.model.layers[0].self_attn.scale
    per_layer = [attention_target(r, scale) for r in rec[:3]]
    target = served_target(rec[:3], scale)
    torch.testing.assert_close(target, (per_layer[0] + per_layer[1] + per_layer[2]) / 3)
    torch.testing.assert_close(target.sum(dim=-1), torch.ones(20))
    assert (target - per_layer[0]).abs().max() > 1e-3  # the shared layers count
    with pytest.raises(ConfigError, match="attended different slots"):
        served_target([rec[0], rec[3]], scale)


def test_training_distils_each_indexer_on_the_layers_it_serves(model):
    layers = model.model.layers
    served = served_attentions(model)
    assert list(served) == [layers[0].self_attn, layers[3].self_attn, layers[4].self_attn]
    assert served[layers[0].self_attn] == [layers[i].self_attn for i in range(3)]
    ids = _ids(20)[None]
    # mtp_depth 0: the MTP layer's indexer makes no call, the decoder's two make one each
    losses = training_losses(model, ids, stage=SPARSE_ADAPTATION, mtp_depth=0)
    attentions = [a for group in served.values() for a in group]
    with record_attention(attentions) as records, torch.no_grad():
        model(ids)
        expected = [
            indexer_kl(full, [records[a][0] for a in group])
            for full, group in served.items()
            if records[full]
        ]
        alone = indexer_kl(layers[0].self_attn, records[layers[0].self_attn])
    assert len(expected) == 2
    torch.testing.assert_close(losses.indexer_kl.detach(), torch.stack(expected).mean())
    # the shared layers' distributions count (the KLs of a random tiny model are small)
    assert abs(float(alone - expected[0])) > 0.1 * float(expected[0]) > 0
    # only full layers (and the MTP layer) have indexer parameters to train
    try:
        params = configure_stage(model, "dense_warmup")
        own = {id(p) for i in (0, 3, 4) for p in layers[i].self_attn.indexer.parameters()}
        assert {id(p) for p in params} == own
    finally:
        configure_stage(model, SPARSE_ADAPTATION)


def test_dense_warmup_trains_the_full_layers_indexers_only():
    model = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=1)
    params = configure_stage(model, "dense_warmup")
    losses = training_losses(model, _ids(12)[None], stage="dense_warmup", mtp_depth=1)
    losses.loss.backward()
    assert torch.isfinite(losses.loss) and float(losses.indexer_kl.detach()) > 0
    assert all(p.grad is not None for p in params)  # layers 0, 3 and the MTP layer
    assert all(layer.self_attn.indexer is None for layer in model.model.layers[1:3])


def test_quantised_shared_layers_keep_attending_their_full_layers_selection():
    """quantize_model packs a model with shared layers (they have no indexer to
    quantise); the quantised model's shared layers still attend exactly the slots
    their full layer selected, and its cached decode equals its full forward."""
    from glmport.model.quantize import quantize_model

    quantised = GlmMoeDsaForCausalLM.from_config(CONFIG, seed=0).eval()
    quantize_model(quantised, experts="w4a8", dense="w8a8")
    assert [a.indexer is None for a in _attentions(quantised)] == [False, True, True, False]
    ids = _ids(20)
    with record_attention(_attentions(quantised)) as records, torch.no_grad():
        full = quantised(ids[None]).logits[0]
    slots = [records[a][0].indices for a in _attentions(quantised)]
    assert torch.equal(slots[1], slots[0]) and torch.equal(slots[2], slots[0])
    assert not torch.equal(slots[3], slots[0])  # layer 3 runs its own indexer
    cache = PagedKVCache.for_config(quantised.config, 4, num_blocks=8, block_size=4)
    seq = cache.add_sequence()
    got = [forward_cached(quantised, cache, [seq], [ids[:6]]).logits]
    got += [forward_cached(quantised, cache, [seq], [ids[i : i + 1]]).logits for i in range(6, 20)]
    assert (torch.cat(got) - full).abs().max() <= 1e-3  # activations quantised per call


def _attentions(m: GlmMoeDsaForCausalLM) -> list:
    return [layer.self_attn for layer in m.model.decoder_layers]
