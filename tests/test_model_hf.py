"""GLM-5 on glmport ops against transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM:
same random tiny config and weights, a padded batch of two lengths, sequences longer
than index_topk (sparsity is real), on the cpu and generic backends."""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.attention import ABSORB_BEYOND, Attention

transformers = pytest.importorskip("transformers", minversion="5.18")

HF_TINY = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # transformers' default (64) would not match 4 heads
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=24,
    qk_rope_head_dim=8,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    # 16 indexer heads: with 4, relu zeros give exactly tied index scores, and
    # transformers' torch.topk and glmport's lower-slot rule pick different (equally
    # valid) keys.
    index_n_heads=16,
    index_head_dim=16,
    index_topk=4,
    first_k_dense_replace=1,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    attn_implementation="eager",
)


# DeepSeek-V3.2 routes group-limited: 4 groups of 2 experts, the best 2 groups kept.
VARIANT = {"glm": {}, "dsv32": {"n_group": 4, "topk_group": 2}}


def _hf_model(kind: str, **overrides):
    overrides = {**VARIANT[kind], **overrides}
    cfg_cls, model_cls = {
        "glm": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
        "dsv32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**HF_TINY, **overrides})).eval()
    with torch.no_grad():  # random everything, norms and the router bias included
        named = list(hf.named_parameters()) + [
            (n, b) for n, b in hf.named_buffers() if "e_score" in n
        ]
        for name, t in named:
            if "norm" in name and name.endswith("weight"):
                t.copy_(1 + 0.2 * torch.randn_like(t))
            elif "e_score" in name:
                t.copy_(0.3 * torch.randn_like(t))
            else:
                t.normal_(0, 0.15)
    return hf


def _ours_from(hf, **config_overrides) -> GlmMoeDsaForCausalLM:
    data = {**hf.config.to_dict(), "num_nextn_predict_layers": 0, **config_overrides}
    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.from_dict(data))
    model.load_hf_state_dict(hf.state_dict())
    return model


def _batch(seq_len=14, pad=5):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, seq_len), generator=gen)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, seq_len - pad :] = 0  # the second sequence is shorter (right padding)
    return ids, mask


# 14 tokens: every query sees at most ABSORB_BEYOND x index_topk keys, MLA runs
# non-absorbed; 24: the longer sequence's later queries see more, it runs absorbed.
@pytest.mark.parametrize("seq_len, absorbed", [(14, False), (24, True)])
@pytest.mark.parametrize("backend", ["cpu", "generic"])
@pytest.mark.parametrize("kind", ["glm", "dsv32"])
def test_logits_match_transformers_on_a_padded_sparse_batch(
    kind, backend, seq_len, absorbed, monkeypatch
):
    hf = _hf_model(kind)
    ours = _ours_from(hf)
    assert (seq_len > ABSORB_BEYOND * ours.config.index_topk) == absorbed
    forms = []
    for form in ("_absorbed", "_non_absorbed"):
        real = getattr(Attention, form)
        monkeypatch.setattr(
            Attention, form, lambda *a, _real=real, _form=form: forms.append(_form) or _real(*a)
        )
    ids, mask = _batch(seq_len)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with glmport.use_backend(backend):
            got = ours(ids, mask).logits
    assert set(forms) == {"_absorbed" if absorbed else "_non_absorbed"}
    valid = mask.bool()
    assert (got - want).abs()[valid].max() <= 1e-4
    assert want.abs()[valid].max() > 1.0  # logits large enough for the bound to mean something
    assert torch.all(got[~valid] == 0)  # padding positions carry no logits


def test_left_padding_gives_the_same_logits_as_no_padding():
    hf = _hf_model("glm")
    ours = _ours_from(hf)
    ids, _ = _batch()
    left = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids[:1]), dim=1)
    mask = torch.cat(
        (torch.zeros(1, 3, dtype=torch.long), torch.ones(1, ids.shape[1], dtype=torch.long)), 1
    )
    with torch.no_grad():
        alone = ours(ids[:1]).logits
        padded = ours(left, mask).logits[:, 3:]
    assert (alone - padded).abs().max() <= 1e-5


def test_the_comparison_detects_the_wrong_indexer_rope_layout():
    """DeepSeek-V3.2's indexer is half-split; run it interleaved and the logits move."""
    hf = _hf_model("dsv32")
    wrong = _ours_from(hf, indexer_rope_interleave=True)
    ids, mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = wrong(ids, mask).logits
    assert (got - want).abs()[mask.bool()].max() > 1e-2


def test_checkpoint_written_by_transformers_loads_and_round_trips(tmp_path):
    hf = _hf_model("glm")
    hf.save_pretrained(tmp_path / "hf")
    ours = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "hf")
    assert ours.config.num_nextn_predict_layers == 0  # transformers writes no MTP layer
    ids, mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert (ours(ids, mask).logits - want).abs()[mask.bool()].max() <= 1e-4
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    )
    for key, value in hf.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
