"""Prepared weights: a backend converts each quantised weight once, at load time, and
its ``"<op>:prepared"`` kernels run on the converted weight; every other call takes
the canonical weight."""

from __future__ import annotations

import logging

import pytest
import torch

import glmport
from glmport.core.registry import REGISTRY, Backend, BackendManifest
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.quantize import prepare_weights, quantize_model


class _Repacking(Backend):
    """A vendor whose native layout is the packed weight transposed; it counts how
    often it converts a weight and how often its prepared kernels run."""

    manifest = BackendManifest(
        name="repack",
        device_type="cpu",
        description="test double",
        ops=("quant_gemm", "grouped_gemm"),
        priority=-1,
    )

    def __init__(self, with_kernels=True):
        self.prepared, self.calls = 0, 0
        self.with_kernels = with_kernels

    def prepare_weight(self, op, w, w_scale, scheme, emulate):
        self.prepared += 1
        return {"w_t": w.transpose(-1, -2).contiguous()}

    def load_kernels(self, emulate):
        ref = REGISTRY.kernels("cpu", emulate)

        def quant_gemm_prepared(x, p, w_scale, scheme, group_size):
            self.calls += 1
            return ref["quant_gemm"](x, p.native["w_t"].T, w_scale, scheme, group_size)

        def grouped_gemm_prepared(x, p, offsets, w_scale, scheme, group_size):
            self.calls += 1
            w = p.native["w_t"].transpose(-1, -2)
            return ref["grouped_gemm"](x, w, offsets, w_scale, scheme, group_size)

        kernels = {"quant_gemm": ref["quant_gemm"], "grouped_gemm": ref["grouped_gemm"]}
        if self.with_kernels:
            kernels["quant_gemm:prepared"] = quant_gemm_prepared
            kernels["grouped_gemm:prepared"] = grouped_gemm_prepared
        return kernels


@pytest.fixture
def repack():
    backend = _Repacking()
    glmport.register_backend(backend)
    yield backend
    glmport.unregister_backend("repack")


def _packed(scheme="w8a8", n=24, k=64):
    gen = torch.Generator().manual_seed(0)
    return glmport.ops.quantize_weight(torch.randn(n, k, generator=gen), scheme, 32)


def _quantized_tiny_model():
    model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    quantize_model(model, experts="w4a8", dense="w8a8", group_size=32)
    return model


def test_the_hook_runs_once_per_weight_not_per_call(repack):
    model = _quantized_tiny_model()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with glmport.use_backend("repack"), torch.no_grad():
        canonical = model(ids).logits
        count = prepare_weights(model)
        assert count > 0 and repack.prepared == count
        repack.calls = 0
        outs = [model(ids).logits for _ in range(3)]
    assert repack.prepared == count  # three forwards converted nothing
    assert repack.calls > 0 and repack.calls % 3 == 0
    for out in outs:
        assert torch.equal(out, canonical)


def test_a_prepared_weight_gives_the_canonical_result_on_every_backend_layout():
    w, s = _packed("w4a8")
    x = torch.randn(5, 64)
    for name in ("cpu", "generic"):
        with glmport.use_backend(name):
            prepared = glmport.prepare_weight("quant_gemm", w, s, "w4a8")
            assert prepared.backend == name
            assert torch.equal(
                glmport.ops.quant_gemm(x, prepared), glmport.ops.quant_gemm(x, w, s, "w4a8")
            )


def test_generic_keeps_integer_weights_unpacked_and_transposed():
    w, s = _packed("w4a8")
    with glmport.use_backend("generic"):
        prepared = glmport.prepare_weight("quant_gemm", w, s, "w4a8")
        fp8 = glmport.prepare_weight("quant_gemm", *_packed("fp8_block", 128, 128), "fp8_block")
    (w_t,) = prepared.native.values()
    assert w_t.dtype == torch.int8 and w_t.shape == (64, 24) and w_t.is_contiguous()
    assert fp8.native is None  # no native layout of its own: the canonical one


def test_another_backend_selected_later_runs_the_canonical_weight_with_one_log_line(repack, caplog):
    w, s = _packed()
    x = torch.randn(3, 64)
    with glmport.use_backend("repack"):
        prepared = glmport.prepare_weight("quant_gemm", w, s, "w8a8")
    with caplog.at_level(logging.WARNING, logger="glmport"), glmport.use_backend("cpu"):
        for _ in range(2):
            y = glmport.ops.quant_gemm(x, prepared)
    assert repack.calls == 0
    assert torch.equal(y, glmport.ops.quant_gemm(x, w, s, "w8a8"))
    lines = [r.getMessage() for r in caplog.records if "'repack'" in r.getMessage()]
    assert len(lines) == 1 and "prepared a weight" in lines[0]


def test_calls_that_need_autograd_take_the_canonical_path(repack):
    w, s = _packed()
    x = torch.randn(3, 64, requires_grad=True)
    with glmport.use_backend("repack"):
        prepared = glmport.prepare_weight("quant_gemm", w, s, "w8a8")
        glmport.ops.quant_gemm(x, prepared).sum().backward()
    assert repack.calls == 0
    x_ref = x.detach().clone().requires_grad_(True)
    glmport.ops.quant_gemm(x_ref, w, s, "w8a8").sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_a_weight_changed_after_preparing_is_stale(repack, caplog):
    model = _quantized_tiny_model()
    ids = torch.tensor([[2, 7, 1, 8]])
    with glmport.use_backend("repack"), torch.no_grad():
        prepare_weights(model)
        model.load_state_dict(model.state_dict())  # in-place copies: versions move
        repack.calls = 0
        with caplog.at_level(logging.WARNING, logger="glmport"):
            model(ids)
    assert repack.calls == 0
    assert any("stale" in r.getMessage() for r in caplog.records)


def test_prepare_weight_checks_its_inputs():
    w, s = _packed()
    with pytest.raises(glmport.OpInputError, match="'op'"):
        glmport.prepare_weight("rms_norm", w, s, "w8a8")
    with pytest.raises(glmport.OpInputError, match="'w_scale'"):
        glmport.prepare_weight("quant_gemm", w, None, "w8a8")
    with pytest.raises(glmport.OpInputError, match=r"'w_scale'.*finite"):
        glmport.prepare_weight("quant_gemm", w, torch.full_like(s, float("nan")), "w8a8")
    with pytest.raises(glmport.OpInputError, match="'w'"):
        glmport.prepare_weight("grouped_gemm", w, s, "w8a8")  # not [E, N, K']


def test_a_backend_that_prepares_without_a_prepared_kernel_is_refused():
    glmport.register_backend(_Repacking(with_kernels=False))
    try:
        w, s = _packed()
        with (
            glmport.use_backend("repack"),
            pytest.raises(glmport.BackendUnavailableError, match="quant_gemm:prepared"),
        ):
            glmport.prepare_weight("quant_gemm", w, s, "w8a8")
    finally:
        glmport.unregister_backend("repack")
