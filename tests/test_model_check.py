"""The model-level conformance check covers the quantised model (W4A8 experts with
W8A8 or FP8-block projections), log-probs at a sampling temperature and
group-limited routing: a backend with a bug in any of them fails it, in the variant
the bug touches."""

from __future__ import annotations

import pytest

import glmport
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest

pytestmark = pytest.mark.usefixtures("one_thread")


def _ref(op):
    return REGISTRY.kernels(REGISTRY.reference(), False)[op]


def _ignores_temperature(hidden, lm_head, targets, temperature=1.0):
    return _ref("token_logprobs")(hidden, lm_head, targets, 1.0)


def _ignores_groups(logits, bias, top_k, n_group=1, topk_group=1, *rest):
    return _ref("moe_gate")(logits, bias, top_k, 1, 1, *rest)


def _scales_off_by_one_percent(x, w, w_scale, scheme, group_size=128):
    return _ref("quant_gemm")(x, w, None if w_scale is None else w_scale * 1.01, scheme, group_size)


# bug -> (kernels, the variants it must fail, as "<variant> T=<t>")
BUGS = {
    "temperature_ignored": (
        {"token_logprobs": _ignores_temperature},
        {"float T=0.7", "w4a8+w8a8 T=0.7", "w4a8+fp8_block T=0.7"},
    ),
    "router_groups_ignored": (
        {"moe_gate": _ignores_groups},
        {f"{v} T={t}" for v in ("float", "w4a8+w8a8", "w4a8+fp8_block") for t in ("1", "0.7")},
    ),
    "quant_scales_off": (
        {"quant_gemm": _scales_off_by_one_percent},
        {f"{v} T={t}" for v in ("w4a8+w8a8", "w4a8+fp8_block") for t in ("1", "0.7")},
    ),
}


class _Broken(Backend):
    def __init__(self, name, kernels):
        self.manifest = BackendManifest(
            name=name, device_type="cpu", description="deliberately broken", ops=tuple(kernels)
        )
        self.table = kernels

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        return self.table


def _model_records(backend: str):
    return [run_check(c, backend) for c in suite_checks() if c.kind == "model"]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_model_check_fails_a_bug_in_the_variant_it_touches(bug):
    kernels, variants = BUGS[bug]
    name = f"model_{bug}"
    glmport.register_backend(_Broken(name, kernels))
    try:
        records = _model_records(name)
    finally:
        glmport.unregister_backend(name)
    assert [r.dtype for r in records] == ["float32", "bfloat16"]
    for r in records:
        assert r.outcome == "fail" and r.op == "model", (r.outcome, r.reason)
        failed = {part.split(":")[0] for part in r.reason.split("; ")}
        assert failed == variants, r.reason
        for variant in variants:
            assert r.metrics[f"{variant}: icepop_pop_fraction"] > 0.01


def test_the_model_check_reports_every_variant_within_its_bounds():
    (r, _) = _model_records("generic")
    assert r.outcome == "pass", r.reason
    keys = [k for k in r.metrics if k.endswith(": mean_abs_dlogp")]
    assert [k.split(":")[0] for k in keys] == [
        f"{v} T={t}" for v in ("float", "w4a8+w8a8", "w4a8+fp8_block") for t in ("1", "0.7")
    ]
    assert all(r.metrics[k] <= r.tolerance[k] for k in r.tolerance)
    assert r.tolerance["w4a8+w8a8 T=1: mean_abs_dlogp"] > r.tolerance["float T=1: mean_abs_dlogp"]
