"""``mla_prolog`` (MLAPO): the cpu reference against the formula written out here in
float64 (float and W8A8 projections); the model's cached step calls it once per layer
and decodes the tokens the composite projections decode (float and W8A8 models), and
keeps the composite where the op cannot serve (other quantisations, gradients); the
ascend adapter's ``npu_mla_prolog_v3`` calls at DeepSeek-V3.2's widths (unquantised
and full quantisation), its Atlas A2 fallback, and the emulator's documented refusals."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import glmport
from glmport.backends.ascend import emulator
from glmport.backends.ascend import mla as ascend_mla
from glmport.backends.ascend.profile import (
    NpuProfile,
    SelfTestError,
    detect_profile,
    prolog_conventions,
)
from glmport.backends.cpu.precision import float64_reference
from glmport.conformance.cases import all_cases
from glmport.core import selection
from glmport.core.tolerance import compare, tolerance
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.generation import generate
from glmport.model.quantize import quantize_model


def _on_grid(a: torch.Tensor) -> torch.Tensor:
    """``a [T, K]`` quantised per row to int8 and back, in float64: ``amax / 127``
    scales, rounding half to even, in float32 (``int8_row`` in glmport.core.formats)."""
    scale = a.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(a.float() / scale).clamp(-127, 127).double() * scale.double()


def _formula(x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, eps, *scales):
    """The op's docstring, in float64, written without glmport. With the three
    scales (W8A8): the int8 weights times their row scales, each projection's input on
    its per-token int8 grid, ``x @ w_dq.T`` and ``q_norm`` rounded to ``x``'s dtype
    before ``q_norm`` is put there, and returned so."""
    dtype = x.dtype
    weights = (w_dq, w_uq, w_dkv)
    if scales and scales[0] is not None:
        grid = _on_grid
        w_dq, w_uq, w_dkv = (
            w.double() * s.double()[:, None] for w, s in zip(weights, scales, strict=True)
        )
    else:
        grid = torch.Tensor.double
    x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv = (
        a.double() for a in (x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv)
    )
    c, s = cos.double(), sin.double()

    def norm(v, g):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * g

    def rotate(v):  # interleaved pairs (2i, 2i + 1)
        view = (v.shape[0],) + (1,) * (v.dim() - 2) + (c.shape[1],)
        a, b = v[..., 0::2], v[..., 1::2]
        cc, ss = c.reshape(view), s.reshape(view)
        return torch.stack((a * cc - b * ss, a * ss + b * cc), -1).flatten(-2)

    heads, nope, kv_lora = w_uk.shape
    c_q = grid(x) @ w_dq.T
    if grid is _on_grid:  # the roundings before the codes are taken, in x's dtype
        c_q = c_q.to(dtype).double()
    q_norm = norm(c_q, gamma_cq)
    if grid is _on_grid:
        q_norm = _on_grid(q_norm.to(dtype))
    q = (q_norm @ w_uq.T).reshape(x.shape[0], heads, -1)
    q_latent = torch.stack([q[:, h, :nope] @ w_uk[h] for h in range(heads)], dim=1)
    kv = grid(x) @ w_dkv.T
    return (
        q_latent,
        rotate(q[..., nope:]),
        q_norm,
        norm(kv[:, :kv_lora], gamma_ckv),
        rotate(kv[:, kv_lora:]),
    )


@pytest.mark.parametrize("name", ["tiny", "tail", "t1", "tiny_w8a8", "tail_w8a8"])
def test_the_reference_is_the_formula(name):
    case = next(
        c for c in all_cases(ops=("mla_prolog",)) if c.name == name and c.dtype == torch.float32
    )
    args = case.args()
    with glmport.use_backend("cpu"), float64_reference():
        got = glmport.ops.mla_prolog(*args)
    for out, want in zip(got, _formula(*args), strict=True):
        assert out.dtype == torch.float64 and out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


# -- the model -------------------------------------------------------------------------


def _model() -> GlmMoeDsaForCausalLM:
    config = GlmMoeDsaConfig.tiny(index_n_heads=16)
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    with torch.no_grad():  # peaked logits, real index selections (tests/test_model_*)
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model


PROMPTS = [[5, 17, 33, 2, 90, 11, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


def _decode(model, monkeypatch, *, fused: bool) -> tuple[list, int]:
    """Greedy tokens of a cached decode, and how many mla_prolog calls it made; with
    ``fused`` False the layers take the composite projections."""
    calls = []
    real = glmport.ops.mla_prolog

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    with monkeypatch.context() as m:
        m.setattr(glmport.ops, "mla_prolog", counted)
        if not fused:
            m.setattr(type(model.model.layers[0].self_attn), "_prolog_weights", lambda s, h: None)
        out = generate(model, PROMPTS, 5, block_size=4)
    return out.output_ids, len(calls)


@pytest.mark.parametrize(
    "backend, scheme", [("generic", None), ("cpu", None), ("generic", "w8a8"), ("cpu", "w8a8")]
)
def test_the_cached_decode_calls_mla_prolog_per_layer_and_decodes_as_the_composite(
    backend, scheme, monkeypatch
):
    model = _model()
    if scheme:  # the prolog takes the packed projections (the indexer's quantises q_norm alike)
        quantize_model(model, experts="none", dense=scheme)
    layers = model.config.num_hidden_layers  # (model.layers also holds the MTP layer)
    with glmport.use_backend(backend):
        fused, calls = _decode(model, monkeypatch, fused=True)
        composite, none = _decode(model, monkeypatch, fused=False)
    # Every cached step (the prompts' prefill, then 4 decode steps) in every layer.
    assert none == 0 and calls >= 5 * layers and calls % layers == 0
    assert fused == composite


def test_other_quantisations_and_gradients_keep_the_composite():
    model = _model()
    attn = model.model.layers[0].self_attn
    h = torch.randn(3, model.config.hidden_size)
    cos, sin = model.model.rope(torch.arange(3))
    with torch.no_grad():
        assert attn._prolog_weights(h) is not None
        with_op = attn.prolog(h, cos, sin)
    assert attn._prolog_weights(h) is None  # grad mode on, parameters that want gradients
    composite = attn.prolog(h, cos, sin)
    assert composite.q.requires_grad  # the gradient path is intact
    for a, b in zip(
        (with_op.q, with_op.q_res, with_op.latent, with_op.k_rope),
        (composite.q, composite.q_res, composite.latent, composite.k_rope),
        strict=True,
    ):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    quantize_model(model, experts="none", dense="fp8_block")
    with torch.no_grad():
        assert model.model.layers[0].self_attn._prolog_weights(h) is None


def test_a_w8a8_layer_hands_mla_prolog_its_packed_weights():
    model = _model()
    quantize_model(model, experts="none", dense="w8a8")
    attn = model.model.layers[0].self_attn
    h = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        (w_dq, w_uq, w_dkv), scales = attn._prolog_weights(h)
    assert w_dq is attn.q_a_proj.weight_q and scales[1] is attn.q_b_proj.weight_scale
    assert all(w.dtype == torch.int8 for w in (w_dq, w_uq, w_dkv))


# -- ascend ----------------------------------------------------------------------------


def _dsv32_args(name: str = "dsv32") -> tuple:
    case = next(c for c in all_cases(ops=("mla_prolog",)) if c.name == name)
    return case.args()


@pytest.mark.parametrize("name, mode", [("dsv32", 0), ("dsv32_w8a8", 2)])
def test_the_ascend_adapter_runs_npu_mla_prolog_v3_at_deepseek_widths(name, mode, monkeypatch):
    args = _dsv32_args(name)
    calls = []
    real = emulator.npu_mla_prolog_v3

    def recorded(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(emulator, "npu_mla_prolog_v3", recorded)
    got = ascend_mla.mla_prolog(emulator, *args, profile=NpuProfile(generation="A3"))
    assert len(calls) == 1
    assert calls[0]["cache_mode"] == "PA_BSND" and calls[0]["query_norm_flag"] is True
    assert calls[0].get("weight_quant_mode", 0) == mode
    with glmport.use_backend("cpu"), float64_reference():
        want = glmport.ops.mla_prolog(*args)
    tol = tolerance("mla_prolog", torch.bfloat16)
    for i, (out, ref) in enumerate(zip(got, want, strict=True)):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape, i
        assert compare(out, ref, tol).ok, i


CONVENTIONS = [(c, r) for c in ("per_head", "split") for r in ("interleaved", "half")]
A2_SOC = "Ascend910B3"  # an Atlas A2's SoC name


@pytest.mark.parametrize("columns, rope", CONVENTIONS)
def test_the_start_up_check_tells_each_prolog_convention_apart(columns, rope):
    build = emulator.EmulatedBuild(prolog_columns=columns, prolog_rope=rope)
    with emulator.emulated_build(build):
        profile = detect_profile(emulator, torch.device("cpu"))
    assert (profile.prolog_columns, profile.prolog_rope) == (columns, rope)
    assert f"{columns} columns, {rope} rope pairs" in profile.describe()
    with emulator.emulated_build(dataclasses.replace(build, soc_name=A2_SOC)):
        a2 = detect_profile(emulator, torch.device("cpu"))  # no prolog call on an A2
    assert (a2.generation, a2.prolog_columns, a2.prolog_rope) == ("A2", "per_head", "interleaved")


@pytest.mark.parametrize("name", ["dsv32", "dsv32_w8a8"])
@pytest.mark.parametrize("columns, rope", CONVENTIONS)
def test_the_adapter_serves_every_prolog_convention(columns, rope, name):
    args = _dsv32_args(name)
    with glmport.use_backend("cpu"), float64_reference():
        want = glmport.ops.mla_prolog(*args)
    tol = tolerance("mla_prolog", torch.bfloat16)
    build = emulator.EmulatedBuild(prolog_columns=columns, prolog_rope=rope)
    with emulator.emulated_build(build):
        measured = NpuProfile(prolog_columns=columns, prolog_rope=rope)
        got = ascend_mla.mla_prolog(emulator, *args, profile=measured)
        assumed = ascend_mla.mla_prolog(emulator, *args, profile=NpuProfile())
    assert all(compare(o, r, tol).ok for o, r in zip(got, want, strict=True))
    # Assuming DeepSeek's layout on another build is wrong where the layouts differ.
    wrong = [
        i for i, (o, r) in enumerate(zip(assumed, want, strict=True)) if not compare(o, r, tol).ok
    ]
    assert (wrong == []) == ((columns, rope) == ("per_head", "interleaved")), wrong


def test_an_unknown_answer_at_start_up_is_an_error_that_says_what_came_back(monkeypatch):
    def silent(token_x, *args, **kwargs):  # an op that writes and returns nothing useful
        t, heads = token_x.shape[0], args[3].shape[0]
        zeros = torch.zeros(t, heads, 512, dtype=torch.bfloat16)
        return zeros, torch.zeros(t, heads, 64, dtype=torch.bfloat16), None, None, None

    monkeypatch.setattr(emulator, "npu_mla_prolog_v3", silent)
    with pytest.raises(SelfTestError, match="npu_mla_prolog_v3's start-up check"):
        prolog_conventions(emulator, torch.device("cpu"))


def test_an_atlas_a2_runs_the_generic_composite_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(selection, "_logged_fallbacks", set())
    monkeypatch.setattr(emulator, "npu_mla_prolog_v3", None)  # never reached
    args = _dsv32_args()
    with caplog.at_level(logging.WARNING, logger="glmport"):
        for _ in range(2):
            got = ascend_mla.mla_prolog(emulator, *args, profile=NpuProfile(generation="A2"))
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) == 1 and "Atlas A3 only" in lines[0]
    with glmport.use_backend("generic"):
        want = glmport.ops.mla_prolog(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _npu_args(**changes) -> dict:
    """A valid npu_mla_prolog_v3 call (one token, one head, DeepSeek-V3.2's widths)."""
    bf = torch.bfloat16
    args = {
        "token_x": torch.zeros(1, 7168, dtype=bf),
        "weight_dq": torch.zeros(7168, 1536, dtype=bf),
        "weight_uq_qr": torch.zeros(1536, 192, dtype=bf),
        "weight_uk": torch.zeros(1, 128, 512, dtype=bf),
        "weight_dkv_kr": torch.zeros(7168, 576, dtype=bf),
        "rmsnorm_gamma_cq": torch.ones(1536, dtype=bf),
        "rmsnorm_gamma_ckv": torch.ones(512, dtype=bf),
        "rope_sin": torch.zeros(1, 64, dtype=bf),
        "rope_cos": torch.ones(1, 64, dtype=bf),
        "kv_cache": torch.zeros(1, 16, 1, 512, dtype=bf),
        "kr_cache": torch.zeros(1, 16, 1, 64, dtype=bf),
        "cache_index": torch.zeros(1, dtype=torch.int64),
    }
    args.update(changes)
    return args


REFUSALS = {
    "token_x must be [T, He] with He in (7168, 7680)": {
        "token_x": torch.zeros(1, 6144, dtype=torch.bfloat16)
    },
    "weight_dq must be bfloat16 [7168, 1536]": {
        "weight_dq": torch.zeros(7168, 2048, dtype=torch.bfloat16)
    },
    "weight_uk must be [N, 128, 512] with N in": {
        "weight_uk": torch.zeros(3, 128, 512, dtype=torch.bfloat16)
    },
    "weight_uq_qr must be bfloat16 [1536, 192]": {
        "weight_uq_qr": torch.zeros(1536, 256, dtype=torch.bfloat16)
    },
    "token_x must be contiguous": {
        "token_x": torch.zeros(1, 2 * 7168, dtype=torch.bfloat16)[:, ::2]
    },
    "BlockSize 16..1024": {"kv_cache": torch.zeros(1, 8, 1, 512, dtype=torch.bfloat16)},
    "cache_index must lie in": {"cache_index": torch.tensor([16])},
    "weight_quant_mode=1 is not emulated": {"weight_quant_mode": 1},
    "cache_mode 'PA_NZ' is not emulated": {"cache_mode": "PA_NZ"},
    "dequant_scale_x is not emulated in this scenario": {"dequant_scale_x": torch.ones(1)},
}


def _quantised(**changes) -> dict:
    """:func:`_npu_args` as the full-quantisation scenario (int8 x and weights, scales)."""
    i8, f32 = torch.int8, torch.float32
    return {
        "token_x": torch.zeros(1, 7168, dtype=i8),
        "weight_dq": torch.zeros(7168, 1536, dtype=i8),
        "weight_uq_qr": torch.zeros(1536, 192, dtype=i8),
        "weight_dkv_kr": torch.zeros(7168, 576, dtype=i8),
        "dequant_scale_x": torch.ones(1, dtype=f32),
        "dequant_scale_w_dq": torch.ones(1, 1536, dtype=f32),
        "dequant_scale_w_uq_qr": torch.ones(1, 192, dtype=f32),
        "dequant_scale_w_dkv_kr": torch.ones(1, 576, dtype=f32),
        "weight_quant_mode": 2,
        **changes,
    }


REFUSALS |= {
    "token_x must be int8 [1, 7168]": _quantised(token_x=torch.zeros(1, 7168)),
    "weight_dkv_kr must be int8": _quantised(weight_dkv_kr=torch.zeros(7168, 576)),
    "dequant_scale_w_dq must be given": _quantised(dequant_scale_w_dq=None),
    "dequant_scale_w_uq_qr must be float32 [1, 192]": _quantised(
        dequant_scale_w_uq_qr=torch.ones(192)
    ),
    "dequant_scale_x must be float [T] or [T, 1]": _quantised(dequant_scale_x=torch.ones(2)),
    "smooth_scales_cq is not emulated": _quantised(smooth_scales_cq=torch.ones(1, 1536)),
    "kv_cache_quant_mode=1 is not emulated": _quantised(kv_cache_quant_mode=1),
}


def test_the_quantised_scenario_returns_query_norm_as_int8_codes_and_scales():
    g = torch.Generator().manual_seed(0)
    args = _quantised(
        token_x=torch.randint(-127, 128, (1, 7168), generator=g, dtype=torch.int8),
        weight_dq=torch.randint(-127, 128, (7168, 1536), generator=g, dtype=torch.int8),
        dequant_scale_x=torch.full((1,), 1e-3),
        dequant_scale_w_dq=torch.full((1, 1536), 1e-3),
    )
    *_, query_norm, scale = emulator.npu_mla_prolog_v3(**_npu_args(**args), query_norm_flag=True)
    assert query_norm.dtype == torch.int8 and query_norm.shape == (1, 1536)
    assert scale.shape == (1, 1) and int(query_norm.abs().max()) == 127


@pytest.mark.parametrize("message", list(REFUSALS))
def test_the_emulator_refuses_documented_violations(message):
    with pytest.raises(emulator.NpuContractError, match="npu_mla_prolog_v3") as err:
        emulator.npu_mla_prolog_v3(**_npu_args(**REFUSALS[message]))
    assert message in str(err.value)
