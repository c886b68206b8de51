"""No silently wrong numbers (issue 12): fast GEMM kernels only inside the layouts and
sizes they handle, valid inputs that overflow float32 internally computed stably or
rejected, and 0-d tensors / numpy scalars rejected where an int or float goes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import glmport
from glmport import ops
from glmport.backends.generic import moe as gmoe
from glmport.backends.generic import quant as gquant
from glmport.conformance.cases import all_cases
from glmport.core.registry import REGISTRY
from glmport.core.specs import SPECS

SHAPES = [(5, 24, 1), (5, 1, 64), (1, 24, 64), (1, 1, 1), (20, 16, 8), (17, 8, 16)]


def _reference(fn):
    with glmport.use_backend("cpu"), REGISTRY.get("cpu").float64():
        return fn().double()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "unsqueezed"])
def test_int_mm_only_inside_its_bounds_and_exact(monkeypatch, m, n, k, layout):
    """Under cuBLASLt's bounds (M > 16, K and N multiples of 8) as on a GPU, every
    ``_int_mm`` call sees exactly row-major operands within them, and the result equals
    the float64 reference on any layout of x."""
    monkeypatch.setattr(gquant, "_INT_MM_MIN_ROWS", {})
    gquant._has("cpu", "int_mm")  # its probe call is not one under test
    calls = []
    real = torch._int_mm

    def spy(a, b):
        calls.append((a.shape, a.stride(), b.shape, b.stride()))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    if layout == "transposed":
        x = x.T.contiguous().T
    elif layout == "unsqueezed" and k == 1:
        x = x[:, 0].clone().unsqueeze(1)  # [M, 1] with strides (1, 1)
    wq, ws = ops.quantize_weight(torch.randn(3, n, k, generator=gen), "w8a8")
    offs = torch.tensor([0, m // 2, m // 2, m], dtype=torch.int32)
    with glmport.use_backend("generic"):
        got = ops.quant_gemm(x, wq[0], ws[0], "w8a8").double()
        got_g = ops.grouped_gemm(x, wq, offs, ws, "w8a8").double()
    want = _reference(lambda: ops.quant_gemm(x, wq[0], ws[0], "w8a8"))
    want_g = _reference(lambda: ops.grouped_gemm(x, wq, offs, ws, "w8a8"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-5)
    for a_shape, a_stride, b_shape, b_stride in calls:
        assert a_shape[0] > 16 and a_shape[1] % 8 == 0 and b_shape[1] % 8 == 0
        assert a_stride == (a_shape[1], 1) and b_stride == (b_shape[1], 1)
    assert bool(calls) == (m > 16 and k % 8 == 0 and n % 8 == 0)


@pytest.mark.parametrize(("m", "n", "k"), [(5, 24, 1), (5, 1, 128), (1, 32, 128), (4, 32, 128)])
def test_scaled_mm_only_on_multiples_of_16(monkeypatch, m, n, k):
    gquant._has("cpu", "scaled_mm")  # its probe call is not one under test
    calls = []
    real = torch._scaled_mm

    def spy(a, b, **kw):
        calls.append((a.shape, b.shape))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    wq, ws = ops.quantize_weight(w, "fp8_block")
    with glmport.use_backend("generic"):
        got = ops.quant_gemm(x, wq, ws, "fp8_block").double()
    want = _reference(lambda: ops.quant_gemm(x, wq, ws, "fp8_block"))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert all(a[1] % 16 == 0 and b[1] % 16 == 0 for a, b in calls)
    assert bool(calls) == (n % 16 == 0 and k % 16 == 0)


@pytest.mark.parametrize(("m", "n", "k"), [(6, 16, 1), (6, 1, 16), (1, 16, 16), (6, 16, 16)])
def test_grouped_mm_only_on_aligned_row_major_operands(monkeypatch, m, n, k):
    monkeypatch.setattr(gmoe, "_fused_grouped_mm", lambda device_type, dtype: True)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(m, k, generator=gen), torch.randn(2, n, k, generator=gen)
    offs = torch.tensor([0, m // 2, m], dtype=torch.int32)
    with glmport.use_backend("generic"):
        got = ops.grouped_gemm(x, w, offs).double()
    want = _reference(lambda: ops.grouped_gemm(x, w, offs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert gmoe._grouped_mm_fits(x, w) == (k % 4 == 0 and n % 4 == 0)


def test_degenerate_gemm_cases_cover_every_scheme():
    from glmport.core.formats import SCHEMES

    cases = all_cases(ops=("quant_gemm", "grouped_gemm"))
    for op in ("quant_gemm", "grouped_gemm"):
        for name in ("k1", "n1", "m1_n24", "mnk1"):
            schemes = {c.scheme for c in cases if c.op == op and c.name == name}
            assert set(SCHEMES) <= schemes, (op, name)


# -- float32 overflow inside valid inputs ------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_rms_norm_of_large_rows_is_exact_within_the_checked_range(backend):
    """Rows near the float32 limit of their sum of squares, and tiny rows."""
    x = torch.tensor([[1e18, -3e18, 2e17, 5e18], [1e-30, 2e-30, -1e-30, 0.0]])
    w = torch.tensor([1.0, 0.5, 2.0, 1.5])
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    with glmport.use_backend(backend):
        got = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_the_reference_rms_norm_is_exact_beyond_the_checked_range(monkeypatch):
    """The reference scales rows by max |x| first, so it stays exact where the check
    would refuse the input. Fused kernels (generic's torch rms_norm, cuda, npu) sum
    squares in float32 unscaled: for them the default check is the guard."""
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    big = torch.full((1, 4), 1e30)
    with glmport.use_backend("cpu"):
        assert torch.allclose(ops.rms_norm(big, torch.ones(4)), torch.ones(1, 4))


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_inputs_overflowing_float32_are_rejected_naming_why(backend, monkeypatch):
    # sparse_attention's bound needs max |k| over the whole cache: a strict-mode check.
    monkeypatch.setenv("GLMPORT_VALIDATE", "strict")
    q, k = torch.randn(2, 2, 8), torch.randn(5, 1, 8)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    h, lm = torch.randn(2, 8), torch.randn(10, 8)
    tgt = torch.zeros(2, dtype=torch.long)
    with glmport.use_backend(backend):
        with pytest.raises(glmport.OpInputError, match=r"'x'.*float32 range"):
            ops.rms_norm(torch.full((2, 8), 1e30), torch.ones(8))
        with pytest.raises(glmport.OpInputError, match=r"'scale'.*float32 range"):
            ops.sparse_attention(q, k, k, idx, 1e38)
        with pytest.raises(glmport.OpInputError, match=r"'temperature'.*float32 range"):
            ops.token_logprobs(h, lm, tgt, 1e-40)


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_extreme_but_valid_scale_and_temperature_are_finite_and_right(backend):
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 8, generator=gen), torch.randn(5, 1, 8, generator=gen)
    v = torch.randn(5, 1, 4, generator=gen)
    idx = torch.tensor([[0, 1, 2], [2, 3, 4]], dtype=torch.int32)
    h, lm = torch.randn(3, 8, generator=gen), torch.randn(10, 8, generator=gen)
    tgt = torch.tensor([0, 3, 9])
    with glmport.use_backend(backend):
        out, lse = ops.sparse_attention(q, k, v, idx, 1e30)
        logp, ent = ops.token_logprobs(h, lm, tgt, 1e-30)
    with glmport.use_backend("cpu"), REGISTRY.get("cpu").float64():
        out_r, lse_r = ops.sparse_attention(q, k, v, idx, 1e30)
        logp_r, ent_r = ops.token_logprobs(h, lm, tgt, 1e-30)
    for got in (out, lse, logp, ent):
        assert torch.isfinite(got).all()
    torch.testing.assert_close(out.double(), out_r.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse_r.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(logp.double(), logp_r.double(), rtol=1e-5, atol=0)
    torch.testing.assert_close(ent.double(), ent_r.double(), rtol=1e-5, atol=1e-3)


# -- scalars -----------------------------------------------------------------------

_SCALARS = [
    (op, i, name)
    for op, spec in SPECS.items()
    for i, (name, kind) in enumerate(zip(spec.arg_names, spec.arg_types, strict=True))
    if kind in ("int", "float")
]
_BAD = {
    "tensor": lambda: torch.tensor(2.7),
    "int_tensor": lambda: torch.tensor(2),
    "numpy_int": lambda: np.int64(2),
    "numpy_float32": lambda: np.float32(2.0),
    "bool": lambda: True,
}


def _case_args(op):
    return list(next(c for c in all_cases(ops=(op,)) if c.dtype == torch.float32).args())


_SCALAR_IDS = [f"{o}-{n}" for o, _, n in _SCALARS]


@pytest.mark.parametrize(("op", "index", "name"), _SCALARS, ids=_SCALAR_IDS)
@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("grad", [False, True], ids=["eager", "dispatcher"])
def test_non_number_scalars_are_rejected(op, index, name, bad, grad):
    """Eager calls and calls through torch.ops (an input needing grad) alike."""
    args = _case_args(op)
    args[index] = _BAD[bad]()
    if grad:
        args[0] = args[0].detach().clone().requires_grad_(args[0].is_floating_point())
    with pytest.raises(glmport.OpInputError, match=f"'{name}'"):
        getattr(ops, op)(*args)


# -- empty inputs and stable softmax (fuzz findings) -------------------------------


def _attention64(q, k, v, indices, scale):
    """Float64 sparse attention from its definition (every index valid)."""
    qd, kd, vd = q.double(), k.double(), v.double()
    kg, vg = kd[indices.long()][:, :, 0], vd[indices.long()][:, :, 0]  # [T, K, D], Hkv = 1
    s = torch.einsum("thd,tkd->thk", qd, kg) * scale
    return torch.einsum("thk,tkd->thd", torch.softmax(s, -1), vg), torch.logsumexp(s, -1)


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_sparse_attention_with_no_query_gives_empty_outputs(backend):
    q, kv = torch.empty(0, 2, 3), torch.ones(4, 1, 3)
    v = torch.ones(4, 1, 5)
    with glmport.use_backend(backend):
        out, lse = ops.sparse_attention(q, kv, v, torch.empty(0, 2, dtype=torch.int32), 1.0)
    assert (tuple(out.shape), out.dtype) == ((0, 2, 5), torch.float32)
    assert (tuple(lse.shape), lse.dtype) == ((0, 2), torch.float32)


@pytest.mark.parametrize("backend", ["cpu", "generic"])
def test_sparse_attention_with_a_huge_scale_subtracts_the_max(backend):
    """``|lse|`` ~ 3e4: ``exp(s - lse)`` would lose 2e-4 to lse's float32 ulp; scores
    here are exact in float32, so only the softmax's own arithmetic can err."""
    q = torch.tensor([[[1.0]], [[0.0]], [[1.0]]])
    k = torch.tensor([[[-3.0]], [[-3.0]], [[-5.0]]])
    v = torch.tensor([[[0.3643]], [[-1.25]], [[7.0]]])
    idx = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 1, 2]], dtype=torch.int32)
    want_out, want_lse = _attention64(q, k, v, idx, 1e4)
    q.requires_grad_(True)
    v.requires_grad_(True)
    with glmport.use_backend(backend):
        out, lse = ops.sparse_attention(q, k, v, idx, 1e4)
        out.sum().backward()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1.2e-7, atol=0)  # fp32 rounding
    # d sum(out) / d v: each slot's probabilities summed over the queries.
    torch.testing.assert_close(v.grad.double().flatten(), torch.tensor([2.5, 0.5, 0.0]).double())


@pytest.mark.parametrize("backend", ["cpu", "generic", "cuda"])
@pytest.mark.parametrize(
    ("fmt", "group", "cols", "q_shape", "scale_shape"),
    [
        ("fp8_block", 1, 1, (0, 1), (0, 1)),
        ("fp8_block_pow2", 4, 6, (0, 6), (0, 2)),
        ("fp8_group", 2, 5, (0, 5), (0, 3)),
        ("int4_group", 2, 2, (0, 1), (0, 1)),
        ("int8_row", 128, 4, (0, 4), (0,)),
    ],
)
def test_quantize_with_no_rows_gives_empty_outputs(backend, fmt, group, cols, q_shape, scale_shape):
    kwargs = {"emulate": True} if backend == "cuda" else {}
    with glmport.use_backend(backend, **kwargs):
        q, scale = ops.quantize(torch.empty(0, cols), fmt, group)
    assert tuple(q.shape) == q_shape and tuple(scale.shape) == scale_shape
    assert scale.dtype == torch.float32


@pytest.mark.parametrize("backend", ["cpu", "generic"])
@pytest.mark.parametrize("tile", [None, 7])
def test_token_logprobs_at_a_small_temperature_is_accurate(monkeypatch, backend, tile):
    """Logits ~3e3 at temperature 1e-3: the max is taken out before scaling, so the
    float32 ulp of a large logit (2.4e-4) does not reach log p."""
    if tile is not None:  # several vocabulary tiles: the online merge is exercised
        monkeypatch.setattr(glmport.backends.generic.logprobs, "VOCAB_TILE", tile)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        lm = torch.randint(-3, 4, (20, 1), generator=gen).float()
        h, tgt = torch.ones(2, 1), torch.tensor([19, int(lm.argmax())])
        with glmport.use_backend(backend):
            logp, ent = ops.token_logprobs(h, lm, tgt, 1e-3)
        z = lm.double()[:, 0] / 1e-3
        logp_all = torch.log_softmax(z, -1)
        want_logp, want_ent = logp_all[tgt], -(logp_all.exp() * logp_all).sum().expand(2)
        bound = 2e-5 * max(float(want_logp.abs().max()), 1.0)
        assert (logp.double() - want_logp).abs().max() <= bound, seed
        assert (ent.double() - want_ent).abs().max() <= 2e-5, seed


def test_judges_take_empty_outputs_and_all_zero_scores():
    from glmport.conformance.judges import gate, gemm, indexer

    logits, ids = torch.empty(0, 4), torch.empty(0, 2, dtype=torch.int64)
    gate_args = (logits, None, 2, 1, 1, 1.0, True, "sigmoid")
    assert gate("moe_gate", torch.float32, gate_args, (torch.empty(0, 2), ids), (None, ids)).ok
    bad = gate("moe_gate", torch.float32, gate_args, (torch.empty(0, 3), ids), (None, ids))
    assert not bad.ok and "shape" in bad.reason

    x, w = torch.empty(0, 8), torch.randn(3, 8)
    gemm_args = (x, w, None, "none", 128)
    assert gemm("quant_gemm", torch.float32, gemm_args, torch.empty(0, 3), torch.empty(0, 3)).ok
    assert not gemm("quant_gemm", torch.float32, gemm_args, torch.empty(0, 2), torch.empty(0, 3)).ok

    start, end = torch.zeros(2, dtype=torch.int32), torch.full((2,), 5, dtype=torch.int32)
    zeros = torch.zeros(2, 5, dtype=torch.float64)
    # Distinct positive keys, a positive query: no exact tie the tie-order rule sees.
    q, k = torch.ones(2, 1, 2), torch.arange(1.0, 11).view(5, 2)
    args = (q, k, None, start, end, 2)
    idx = torch.tensor([[0, 1], [4, 2]], dtype=torch.int32)
    assert indexer("lightning_indexer", torch.float32, args, (idx, torch.zeros(2, 2)), zeros).ok
    off = indexer("lightning_indexer", torch.float32, args, (idx, torch.ones(2, 2)), zeros)
    assert not off.ok and "scores off" in off.reason
