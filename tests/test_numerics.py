"""Numerical guarantees every backend keeps at the edges of float32.

* A log-probability is never above 0 and an entropy never below 0, at any accepted
  temperature (the conformance suite's temperature cases, 1e-6 to 1e6, judged with the
  sign rule of :func:`glmport.conformance.judges.logprobs`).
"""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.conformance.cases.logprobs import LOGPROB_TEMPERATURES
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.formats import quantize_tensor
from glmport.core.registry import REGISTRY

pytestmark = pytest.mark.usefixtures("one_thread")

EMULATED = ("cuda", "ascend")
TEMPERATURE_CHECKS = [
    c for c in suite_checks(ops=("token_logprobs",)) if c.kind == "value" and "temperature" in c.id
]
# TVM compiles a module per temperature (a scalar of the graph): its extremes only.
TVM_TEMPERATURES = (min(LOGPROB_TEMPERATURES), max(LOGPROB_TEMPERATURES))


def _temperature_checks(backend: str) -> list:
    if backend != "tvm":
        return TEMPERATURE_CHECKS
    return [
        c
        for c in TEMPERATURE_CHECKS
        if dict(c.case.params)["temperature"] in TVM_TEMPERATURES and "float32" in c.id
    ]


@pytest.mark.parametrize("backend", ["cpu", "generic", "cuda", "ascend", "onnxruntime", "tvm"])
def test_log_probabilities_are_never_positive_at_extreme_temperatures(backend):
    checks = _temperature_checks(backend)
    assert checks
    for check in checks:
        rec = run_check(check, backend, emulate=backend in EMULATED)
        assert rec.outcome == "pass", f"{check.id} on {rec.ran_on}: {rec.reason}"


# -- float32 overflow on finite inputs ----------------------------------------------

BACKENDS = ("cpu", "generic", "cuda", "ascend", "onnxruntime", "tvm")


def _on(backend: str):
    return glmport.use_backend(backend, emulate=backend in EMULATED)


def _indexer_args(q_scale: float):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, generator=gen).clamp(-1, 1) * q_scale
    k, w = torch.randn(6, 8, generator=gen), torch.randn(2, 2, generator=gen)
    return q, k, w, torch.zeros(2, dtype=torch.int32), torch.full((2,), 6, dtype=torch.int32)


def _overflowing_calls() -> dict[str, tuple[str, tuple, str]]:
    """The issue's reproductions (float64 reference finite, float32 overflows inside),
    each with the argument its refusal names."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 8, generator=gen), torch.randn(5, 1, 8, generator=gen)
    v = torch.randn(5, 1, 8, generator=gen)
    idx = torch.randint(0, 5, (2, 3), generator=gen)
    x = torch.randn(4, 128, generator=gen).clamp(-1, 1) * 3e38
    w, w_scale = quantize_tensor(torch.randn(8, 128, generator=gen) * 0.01, "fp8_block", 128)
    h, lm = torch.full((2, 4), 1e20), torch.full((3, 4), 1e20)  # h . w = 4e40, T > V
    return {
        "sparse_attention scale 1e38": ("sparse_attention", (q, k, v, idx, 1e38), "scale"),
        "sparse_attention scale 3e38": ("sparse_attention", (q, k, v, idx, 3e38), "scale"),
        "indexer_logits q x 3e38": ("indexer_logits", (*_indexer_args(3e38), None, None), "q"),
        "lightning_indexer q x 3e38": (
            "lightning_indexer",
            (*_indexer_args(3e38), 3, None, None),
            "q",
        ),
        "quant_gemm fp8_block x x 3e38": ("quant_gemm", (x, w, w_scale, "fp8_block", 128), "x"),
        "token_logprobs h . w overflows at T > V": (
            "token_logprobs",
            (h, lm, torch.zeros(2, dtype=torch.long), 1e6),
            "temperature",
        ),
    }


OVERFLOWS = _overflowing_calls()


@pytest.mark.parametrize("mode", ["full", "strict"])
@pytest.mark.parametrize("name", list(OVERFLOWS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_inputs_overflowing_float32_are_refused_on_every_backend(
    backend, name, mode, monkeypatch
):
    """Never NaN where the float64 reference is finite: an OpInputError naming the
    argument (strict: always, before the kernel). Under full a bound that needs the
    key cache is checked once the outputs show the overflow: a backend whose float32
    arithmetic did not overflow returns the reference's result instead."""
    monkeypatch.setenv("GLMPORT_VALIDATE", mode)
    op, args, arg = OVERFLOWS[name]
    try:
        with _on(backend):
            outs = getattr(glmport.ops, op)(*args)
    except glmport.OpInputError as err:
        assert (err.op, err.arg) == (op, arg) and "float32 range" in str(err), err
        return
    assert mode == "full", f"{name} was not refused under strict"
    kernels = REGISTRY.kernels("cpu", False)
    with REGISTRY.get("cpu").float64():
        refs = kernels[op](*args)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out.double(), ref.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_products_beyond_its_range_are_refused(backend):
    """A product that float32 holds but float16 does not (65504): the result shows it."""
    x, w = torch.full((2, 64), 60.0, dtype=torch.float16), torch.full((3, 2, 64), 30.0)
    offsets = torch.tensor([0, 1, 2, 2])
    with _on(backend), pytest.raises(glmport.OpInputError, match="float16 range") as info:
        glmport.ops.grouped_gemm(x, w.half(), offsets)
    assert info.value.arg == "x"


def _score_overflow_args(dtype: torch.dtype, nan: bool):
    """Key 1 scores beyond float32 (+inf), or, with ``nan``, through terms of both signs
    (NaN: +inf - inf) though its exact score, 3e38 * (2 - 2 + 1) * 3 ... is the best."""
    q = torch.zeros(1, 1, 128)
    q[0, 0, :3] = 3e38 if nan else 1e20
    k = torch.zeros(3, 128)
    k[:, :3] = 1e-30
    k[1, :3] = torch.tensor([2.0, -2.0, 1.0]) if nan else 1e20
    ranges = torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    return q.to(dtype), k.to(dtype), torch.ones(1, 1), *ranges


@pytest.mark.parametrize("nan", [False, True], ids=["inf", "nan"])
@pytest.mark.parametrize(
    ("backend", "dtype"),
    # tvm compiles a module per dtype (slow): float32 covers its lowering.
    [(b, torch.float32) for b in BACKENDS] + [(b, torch.bfloat16) for b in BACKENDS if b != "tvm"],
)
def test_an_overflowed_indexer_score_ranks_first_and_keeps_its_slot(
    backend, dtype, nan, monkeypatch
):
    """Unchecked (meta), a score beyond float32 is +inf (or NaN): the best key, never
    dropped as -1 when topk exceeds the keys in range, on every backend."""
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    args = _score_overflow_args(dtype, nan)
    with _on(backend):
        indices, scores = glmport.ops.lightning_indexer(*args, 5)
    assert indices.tolist() == [[1, 0, 2, -1, -1]]
    assert not torch.isfinite(scores[0, 0]) and scores[0, 0] != float("-inf")
    assert torch.isfinite(scores[0, 1:3]).all() and (scores[0, 3:] == float("-inf")).all()
