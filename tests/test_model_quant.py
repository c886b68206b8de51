"""Quantised inference (``quantize_model``, ``QuantLinear``) and INT4 QAT (``enable_qat``)
on the tiny GLM-5 config: accuracy and memory against the fp32 model, backend
agreement, the absorbed-attention path, and that QAT is exactly fake quantisation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import glmport
from glmport.core.errors import ConfigError
from glmport.core.formats import SCHEMES, fake_quant
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.blocks import Experts
from glmport.model.generation import generate
from glmport.model.packing import pack
from glmport.model.quantize import QuantLinear, enable_qat, quantize_model

SEQ = 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**overrides) -> GlmMoeDsaForCausalLM:
    return GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(**overrides), seed=0).eval()


def _stable_model() -> GlmMoeDsaForCausalLM:
    # Random weights leave router and index scores nearly tied, so any perturbation
    # (even 1e-3) flips top-k choices and moves logits by a jump that is no measure of
    # quantisation error. Here every key is selected (index_topk > SEQ) and every
    # expert routed: the indexer, router and grouped GEMMs still run, nothing flips.
    return _model(index_topk=32, num_experts_per_tok=8)


def _ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


# Measured on _stable_model (max |logit| 0.55; the layers move logits by ~75% of that):
# w4a8+w8a8 0.0199, fp8_block 0.0472, w8a8 0.0115 (seeds 0-3 stay within 0.024, 0.068,
# 0.020). Ignored or misapplied scales give errors of order 1 and more.
@pytest.mark.parametrize(
    "experts, dense, bound",
    [("w4a8", "w8a8", 0.04), ("fp8_block", "fp8_block", 0.09), ("w8a8", "w8a8", 0.03)],
)
def test_logits_error_vs_fp32(experts: str, dense: str, bound: float) -> None:
    model = _stable_model()
    ids = _ids()
    ref = _logits(model, ids)
    quantize_model(model, experts=experts, dense=dense)
    err = _rel_err(_logits(model, ids), ref)
    print(f"{experts}+{dense}: max |logit error| / max |logit| = {err:.4f}")
    assert 1e-4 < err < bound  # really quantised, and accurately


def test_int4_error_exceeds_int8() -> None:
    """Int4 experts cost accuracy over int8 ones (catches an int4 path that isn't)."""
    ids = _ids()
    ref = _logits(_stable_model(), ids)
    errs = {}
    for scheme in ("w4a16", "w8a8"):
        model = _stable_model()
        quantize_model(model, experts=scheme, dense="none")
        errs[scheme] = _rel_err(_logits(model, ids), ref)
    assert errs["w4a16"] > 1.2 * errs["w8a8"], errs


def test_memory_report_counts_packed_bytes() -> None:
    cfg = GlmMoeDsaConfig.tiny()
    model = _model()
    before = sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))
    report = quantize_model(model, experts="w4a8", dense="w8a8")
    print(report)
    assert report.bytes_before == before
    assert report.bytes_after == sum(
        t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
    )
    # Three MoE layers (two decoder layers and the MTP layer); int4 groups of 32 (the
    # largest of 128, 64, 32 dividing moe_intermediate_size 32): 0.5 byte per weight
    # plus one fp32 scale per 32, against 4 bytes: 6.4x.
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    per_layer = 3 * e * h * i
    assert report.expert_bytes_before == 3 * per_layer * 4
    assert report.expert_bytes_after == 3 * (per_layer // 2 + per_layer // 32 * 4)
    assert report.expert_saving == pytest.approx(6.4)
    assert report.saving > 2.9  # measured 3.01x: embeddings, lm_head, norms stay fp32
    # 6 projections x 4 attention layers, a dense MLP (3), 3 shared experts (3), eh_proj.
    assert report.converted == {"w4a8": 3, "w8a8": 37}


def test_fp8_block_memory() -> None:
    report = quantize_model(_model(), experts="fp8_block", dense="fp8_block")
    # One byte per weight plus one fp32 scale per (up to) 128 x 128 tile.
    assert 3.9 < report.expert_saving < 4.0  # measured 3.99x
    assert report.saving > 2.6  # measured 2.71x
    assert report.converted == {"fp8_block": 40}


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w4a16", "fp8_block"])
def test_quant_linear_is_quant_gemm(scheme: str) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, 5, 64, generator=gen)
    q, scale = glmport.ops.quantize_weight(linear.weight, scheme, 32)
    want = glmport.ops.quant_gemm(x.reshape(10, 64), q, scale, scheme) + linear.bias
    got = QuantLinear.from_linear(linear, scheme, 32)(x)
    assert got.shape == (2, 5, 48)
    torch.testing.assert_close(got, want.reshape(2, 5, 48), rtol=0, atol=0)
    want_qat = glmport.ops.quant_gemm(x.reshape(10, 64), linear.weight, None, scheme, 32)
    got_qat = QuantLinear.from_linear(linear, scheme, 32, qat=True)(x)
    torch.testing.assert_close(got_qat, (want_qat + linear.bias).reshape(2, 5, 48))


def test_backends_agree_on_quantised_model() -> None:
    ids = _ids()
    with glmport.use_backend("cpu"):
        model = _model()
        quantize_model(model)
        cpu = _logits(model, ids)
    with glmport.use_backend("generic"):
        other = _model()
        quantize_model(other)  # the generic backend's quantize op packs the same bits
        for (name, a), (_, b) in zip(model.named_buffers(), other.named_buffers(), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        generic = _logits(model, ids)
    torch.testing.assert_close(generic, cpu, rtol=1e-5, atol=1e-6)


def test_absorbed_attention_after_quantisation() -> None:
    """kv_b_proj stays float, so the KV-cache (absorbed) path equals the prefill one."""
    model = _model()
    quantize_model(model)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, nn.Linear) and isinstance(attn.o_proj, QuantLinear)
    batch = pack(_ids())
    cos, sin = model.model.rope(batch.positions)
    h = torch.randn(batch.ids.shape[0], 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = attn(h, batch, cos, sin)
        step = attn.prolog(h, cos, sin)
        keys = attn.indexer.keys(h, cos, sin)
        slots = attn.indexer.select(
            h, step.q_res, cos, sin, keys, batch.k_start, batch.k_end, batch.widths
        )
        absorbed = attn.attend_latent(step.q, torch.cat((step.latent, step.k_rope), -1), slots)
    torch.testing.assert_close(absorbed, full, rtol=1e-4, atol=1e-6)


def test_cached_and_speculative_generation_after_quantisation() -> None:
    """Paged-cache decoding (absorbed attention) and MTP speculation on the quantised
    model give its own full-forward greedy tokens: activation scales are per token, so
    batching tokens differently changes nothing."""
    model = _model()
    quantize_model(model)
    prompts, n = [[1, 5, 7, 9, 11], [3, 4]], 6
    want = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(_logits(model, torch.tensor([ids]))[0, -1].argmax()))
        want.append(ids[len(prompt) :])
    with torch.no_grad():
        assert generate(model, prompts, n).output_ids == want
        assert generate(model, prompts, n, speculative=True).output_ids == want


def test_float_modules_and_mtp_layer() -> None:
    model = _model()
    float_model = copy.deepcopy(model)
    quantize_model(model)
    kept = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert kept == {"lm_head", "model.layers.3.shared_head.head"} | {
        f"model.layers.{i}.self_attn.{name}"
        for i in range(4)
        for name in ("kv_b_proj", "indexer.weights_proj")
    }
    assert model.model.embed_tokens.weight.dtype == torch.float32
    mtp, float_mtp = model.model.mtp_layers[0], float_model.model.mtp_layers[0]
    assert isinstance(mtp.eh_proj, QuantLinear) and mtp.mlp.experts.scheme == "w4a8"
    assert not any(True for _ in mtp.mlp.experts.parameters())  # float experts deleted

    ids = _ids()
    batch = pack(ids[:, 1:])  # MTP: hidden state at i with the token at i + 1
    cos, sin = model.model.rope(batch.positions)

    def draft(m: GlmMoeDsaForCausalLM, layer) -> torch.Tensor:
        with torch.no_grad():
            hidden = m(ids[:, :-1]).hidden_states.reshape(-1, 64)
            return layer.logits(layer(layer.fuse(hidden, batch.ids), batch, cos, sin)[0])

    out, ref = draft(model, mtp), draft(float_model, float_mtp)
    assert out.shape == (2 * (SEQ - 1), 128) and torch.isfinite(out).all()
    assert 0 < _rel_err(out, ref) < 0.5  # routing may flip here; a sanity bound


def test_save_pretrained_refuses_quantised(tmp_path) -> None:
    model = _model()
    quantize_model(model, experts="none")  # packed dense projections alone suffice
    with pytest.raises(ConfigError, match="save_pretrained writes float weights"):
        model.save_pretrained(tmp_path)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="'w3a8' is not a quantisation scheme"):
        quantize_model(_model(), experts="w3a8")
    model = _model()
    quantize_model(model)
    with pytest.raises(ConfigError, match="already holds packed"):
        quantize_model(model)
    # No int4 group in (128, 64, 32, 16) divides the dense MLP's K = 100.
    model = _model(intermediate_size=100)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.down_proj.*\[100\]"):
        quantize_model(model, dense="w4a16")
    assert model.model.layers[1].mlp.experts.scheme == "none"  # nothing converted
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    quantize_model(_model(intermediate_size=100), dense="w8a8")  # per-row: any K


# -- QAT ---------------------------------------------------------------------------


def test_qat_group_sizes() -> None:
    model = _model()
    enable_qat(model, group_size=128)
    layers = model.model.layers
    assert layers[1].mlp.experts.group_size == 32  # divides both H = 64 and I = 32
    assert layers[0].mlp.down_proj.group_size == 32  # K = 96
    assert layers[0].self_attn.q_a_proj.group_size == 64  # K = 64
    assert layers[0].self_attn.o_proj.group_size == 128  # K = 128


def test_qat_is_fake_quantisation() -> None:
    """The QAT forward equals a float model whose weights were fake-quantised."""
    ids = _ids()
    model = _model()
    explicit = copy.deepcopy(model)
    report = enable_qat(model, scheme="w4a16")
    assert report.bytes_after == report.bytes_before  # weights stay float
    fmt = SCHEMES["w4a16"].weight.name  # int4_group
    qat_modules = dict(model.named_modules())
    with torch.no_grad():
        for name, module in explicit.named_modules():
            qat = qat_modules[name]
            if isinstance(qat, QuantLinear):
                module.weight.copy_(fake_quant(module.weight, fmt, qat.group_size))
            elif isinstance(qat, Experts):
                for w in (module.gate_up_proj, module.down_proj):
                    w.copy_(torch.stack([fake_quant(e, fmt, qat.group_size) for e in w]))
    qat_logits, float_logits = _logits(model, ids), _logits(explicit, ids)
    torch.testing.assert_close(qat_logits, float_logits, rtol=1e-5, atol=1e-6)
    assert _rel_err(qat_logits, _logits(_model(), ids)) > 1e-3  # not the float model
    # Packing the QAT model keeps its forward (w4a16: activations stay float).
    quantize_model(model, experts="w4a16", dense="w4a16")
    torch.testing.assert_close(_logits(model, ids), qat_logits, rtol=1e-5, atol=1e-6)


def test_qat_gradients_and_training() -> None:
    model = _model().train()
    float_model = copy.deepcopy(model)
    params_before = dict(model.named_parameters())
    enable_qat(model, scheme="w4a16")
    # Same Parameter objects: an optimiser built before enable_qat keeps working.
    assert dict(model.named_parameters()) == params_before
    ids = _ids()

    def with_grad(m: nn.Module) -> set[str]:
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        return {n for n, p in m.named_parameters() if p.grad is not None and p.grad.any()}

    got = with_grad(model)
    # Straight-through: every weight the float model trains gets a gradient (the
    # indexer's selection and the unused MTP layer give none, in both).
    assert got == with_grad(float_model)
    qat_weights = {
        n
        for n, p in model.named_parameters()
        if n.endswith(("proj.weight", "gate_up_proj", "down_proj")) and ".layers.3." not in n
    }
    qat_weights -= {n for n in qat_weights if ".indexer." in n}
    assert qat_weights and qat_weights <= got

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("QAT losses", [round(v, 3) for v in losses])
    assert losses[-1] < losses[0] - 0.5
