"""The cpu reference of ``quantize``, ``quant_gemm`` and ``quantize_weight`` against an
independent numpy / float64 definition written here: hand-decoded int4 nibbles and e4m3
bits, exact int64 group sums, per-128 K blocks for FP8, straight-through gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

ops = glmport.ops


# -- an independent definition of the formats --------------------------------------

E4M3_GRID = np.array(
    [
        (c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
        for c in range(127)
    ]
)
QMAX = {"int8_row": 127, "int4_group": 7}
WEIGHT_FMT = {
    "w8a8": "int8_row",
    "w4a8": "int4_group",
    "w4a16": "int4_group",
    "fp8_block": "fp8_block",
    "fp8_block_ue8m0": "fp8_block_pow2",
}
ACT_FMT = {
    "w8a8": "int8_row",
    "w4a8": "int8_row",
    "w4a16": None,
    "fp8_block": "fp8_group",
    "fp8_block_ue8m0": "fp8_group_pow2",
}


def round_e4m3(v):
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3_GRID, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - E4M3_GRID[lo], E4M3_GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * np.where(pick_hi, E4M3_GRID[hi], E4M3_GRID[lo])


def ceil_pow2(s):
    m, e = math.frexp(s)
    return s if m == 0.5 else 2.0**e


def scale_tiles(fmt, rows, cols, g):
    """(scale index, row slice, col slice) for every scale of ``fmt``."""
    if fmt == "int8_row":
        return [((r,), slice(r, r + 1), slice(0, cols)) for r in range(rows)]
    if fmt.startswith("fp8_block"):
        return [
            ((i, j), slice(i * g, (i + 1) * g), slice(j * g, (j + 1) * g))
            for i in range(-(-rows // g))
            for j in range(-(-cols // g))
        ]
    return [
        ((r, j), slice(r, r + 1), slice(j * g, (j + 1) * g))
        for r in range(rows)
        for j in range(-(-cols // g))
    ]


def scale_shape(fmt, rows, cols, g):
    if fmt == "int8_row":
        return (rows,)
    if fmt.startswith("fp8_block"):
        return (-(-rows // g), -(-cols // g))
    return (rows, -(-cols // g))


def ref_quantize(x, fmt, g):
    """float ``[R, C]`` -> (grid values float64 ``[R, C]``, float32 scales)."""
    xf = x.detach().float().numpy()
    rows, cols = xf.shape
    fp8 = fmt.startswith("fp8")
    scale = np.zeros(scale_shape(fmt, rows, cols, g), np.float32)
    values = np.zeros((rows, cols))
    for idx, rs, cs in scale_tiles(fmt, rows, cols, g):
        s = np.maximum(np.abs(xf[rs, cs]).max(), np.float32(1e-4 if fp8 else 1e-12))
        s = s / np.float32(QMAX.get(fmt, 448))
        if fmt.endswith("pow2"):
            s = np.float32(ceil_pow2(float(s)))
        scale[idx] = s
        v = xf[rs, cs] / s
        if fp8:
            values[rs, cs] = round_e4m3(np.clip(v, -448, 448))
        else:
            q = QMAX[fmt]
            values[rs, cs] = np.clip(np.rint(v), -q, q)
    return values, scale


def expand(scale, fmt, rows, cols, g):
    """Scales broadcast to ``[rows, cols]`` (float64)."""
    out = np.zeros((rows, cols))
    for idx, rs, cs in scale_tiles(fmt, rows, cols, g):
        out[rs, cs] = float(scale[idx])
    return out


def stored_values(q, fmt):
    """Stored values as float64, decoded by hand (int4 nibbles, fp8 bits)."""
    if fmt == "int4_group":
        b = q.numpy().astype(np.int64)
        nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
        return np.where(nib >= 8, nib - 16, nib).astype(np.float64)
    if fmt.startswith("fp8"):
        codes = q.view(torch.uint8).numpy().astype(np.int64)
        assert not ((codes & 0x7F) == 0x7F).any()
        return np.where(codes & 0x80, -1.0, 1.0) * E4M3_GRID[codes & 0x7F]
    return q.numpy().astype(np.float64)


def fake_q(x, fmt, g):
    """Fake quantisation: grid value times scale, rounded to float32 (as defined)."""
    vals, scale = ref_quantize(x, fmt, g)
    rows, cols = vals.shape
    return (vals.astype(np.float32) * expand(scale, fmt, rows, cols, g).astype(np.float32)).astype(
        np.float64
    )


def packed_weight_deq(wq, ws, scheme, k):
    """A packed weight as float64, dequantised in float32 as the scheme defines."""
    fmt = WEIGHT_FMT[scheme]
    vals = stored_values(wq, fmt)
    g = 128 if fmt.startswith("fp8") else (k if fmt == "int8_row" else k // ws.shape[-1])
    s = expand(ws.numpy(), fmt, vals.shape[0], k, g)
    return (vals.astype(np.float32) * s.astype(np.float32)).astype(np.float64)


def ref_packed_gemm(x, wq, ws, scheme):
    """(y float64 ``[M, N]``, sum of |terms| for error bounds) by the documented formula."""
    k = x.shape[1]
    n = wq.shape[0]
    wfmt, afmt = WEIGHT_FMT[scheme], ACT_FMT[scheme]
    if afmt is None:  # w4a16: float x against the dequantised weight
        xd = x.detach().double().numpy()
        wd = packed_weight_deq(wq, ws, scheme, k)
        return xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    if afmt == "int8_row":
        qx, sx = ref_quantize(x, "int8_row", k)
        qw = stored_values(wq, wfmt).astype(np.int64)
        sw = ws.numpy().astype(np.float64).reshape(n, -1)
        g = k // sw.shape[1]
        terms = []
        for j in range(sw.shape[1]):
            cols = slice(j * g, (j + 1) * g)
            exact = qx[:, cols].astype(np.int64) @ qw[:, cols].T  # int64: exact
            terms.append(sx.astype(np.float64)[:, None] * sw[None, :, j] * exact)
        terms = np.stack(terms)
        return terms.sum(0), np.abs(terms).sum(0)
    qx, sx = ref_quantize(x, afmt, 128)
    qw = stored_values(wq, wfmt)
    sw = ws.numpy().astype(np.float64)
    terms = []
    for kb in range(-(-k // 128)):
        cols = slice(kb * 128, (kb + 1) * 128)
        block = qx[:, cols] @ qw[:, cols].T  # exact in float64 (4-bit mantissas)
        sw_n = np.repeat(sw[:, kb], 128)[:n]
        terms.append(sx[:, kb].astype(np.float64)[:, None] * sw_n[None, :] * block)
    terms = np.stack(terms)
    return terms.sum(0), np.abs(terms).sum(0)


def fq_act(x, scheme):
    afmt = ACT_FMT[scheme]
    if afmt is None:
        return x.detach().double().numpy()
    return fake_q(x, afmt, x.shape[1] if afmt == "int8_row" else 128)


def fq_weight(w, scheme, group_size):
    fmt = WEIGHT_FMT[scheme]
    g = 128 if fmt.startswith("fp8") else (w.shape[1] if fmt == "int8_row" else group_size)
    return fake_q(w, fmt, g)


def assert_close(got, want, abs_terms, rtol):
    """``|got - want| <= rtol * sum|terms|`` element-wise (a rounding-error bound)."""
    got = got.detach().double().numpy()
    err = np.abs(got - want)
    bound = rtol * abs_terms + 1e-300
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (worst, got[worst], want[worst], bound[worst])


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def weights(n, k, seed):
    """Weights with per-row magnitudes spread over 3 decades."""
    return randn(n, k, seed=seed) * torch.logspace(-2, 1, n)[:, None]


# -- quantize ------------------------------------------------------------------------

FORMAT_CASES = [
    ("int8_row", 5, 96, 128),
    ("int4_group", 4, 128, 32),
    ("int4_group", 3, 192, 64),
    ("int4_group", 2, 256, 128),
    ("fp8_group", 3, 300, 128),
    ("fp8_group_pow2", 3, 300, 128),
    ("fp8_group", 2, 64, 32),
    ("fp8_block", 130, 200, 128),
    ("fp8_block_pow2", 130, 200, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fmt", "rows", "cols", "g"), FORMAT_CASES)
def test_quantize_op_matches_independent_definition_bitwise(fmt, rows, cols, g, dtype):
    x = (randn(rows, cols, seed=rows * cols) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    q, scale = ops.quantize(x, fmt, g)
    want_vals, want_scale = ref_quantize(x, fmt, g)
    assert scale.dtype == torch.float32
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(stored_values(q, fmt), want_vals)


def test_quantize_op_keeps_float32_quantisation_inside_float64_reference():
    x = randn(4, 256, seed=1)
    with float64_reference():
        q, scale = ops.quantize(x, "int4_group", 64)
    want_vals, want_scale = ref_quantize(x, "int4_group", 64)
    assert scale.dtype == torch.float32 and q.dtype == torch.uint8
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(stored_values(q, "int4_group"), want_vals)


# -- quant_gemm, packed --------------------------------------------------------------

PACKED_CASES = [
    # scheme, group_size, M, N, K
    ("w8a8", 128, 5, 24, 256),
    ("w8a8", 128, 1, 8, 96),
    ("w4a8", 32, 5, 24, 256),
    ("w4a8", 64, 3, 16, 192),
    ("w4a8", 128, 1, 8, 256),
    ("w4a16", 32, 4, 16, 128),
    ("w4a16", 64, 1, 8, 256),
    ("w4a16", 128, 3, 12, 256),
    ("fp8_block", 128, 5, 24, 256),
    ("fp8_block", 128, 3, 130, 200),  # ragged N block and K block
    ("fp8_block", 128, 1, 16, 72),  # K < 128: one short block
    ("fp8_block_ue8m0", 128, 5, 24, 256),
    ("fp8_block_ue8m0", 128, 2, 130, 300),
]


@pytest.mark.parametrize(("scheme", "g", "m", "n", "k"), PACKED_CASES)
def test_packed_quant_gemm_matches_documented_formula_to_fp32_rounding(scheme, g, m, n, k):
    x = randn(m, k, seed=m + k) * 3
    wq, ws = ops.quantize_weight(weights(n, k, seed=n), scheme, g)
    y = ops.quant_gemm(x, wq, ws, scheme)  # group size read off ws, not the default 128
    want, abs_terms = ref_packed_gemm(x, wq, ws, scheme)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # integer schemes: exact sums, so only the few float scale products round
    rtol = 1e-6 if ACT_FMT[scheme] == "int8_row" else 1e-5
    assert_close(y, want, abs_terms, rtol)


@pytest.mark.parametrize(("scheme", "g", "m", "n", "k"), PACKED_CASES)
def test_packed_quant_gemm_in_float64_reference_is_exact_formula(scheme, g, m, n, k):
    x = randn(m, k, seed=m + k) * 3
    wq, ws = ops.quantize_weight(weights(n, k, seed=n), scheme, g)
    with float64_reference():
        y = ops.quant_gemm(x, wq, ws, scheme)
    assert y.dtype == torch.float64
    want, abs_terms = ref_packed_gemm(x, wq, ws, scheme)
    assert_close(y, want, abs_terms, 1e-13)


def test_w8a8_integer_accumulation_is_exact_beyond_float32_integers():
    # sum_k qx*qw = 127 * 127 * 2047 = 33016063: odd and > 2**24, so a float32
    # accumulation cannot represent it; the int32 sum times the scales can.
    k = 2048
    x = torch.ones(1, k)
    x[0, 0] = 0.0
    w = torch.ones(2, k)
    w[1] *= 2.0
    wq, ws = ops.quantize_weight(w, "w8a8")
    with float64_reference():
        y = ops.quant_gemm(x, wq, ws, "w8a8")
    sx = float(np.float32(1.0) / np.float32(127))
    sw = np.array([1.0, 2.0], np.float32) / np.float32(127)
    want = sx * sw.astype(np.float64) * (127 * 127 * 2047)
    np.testing.assert_allclose(y[0].numpy(), want, rtol=1e-15)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w4a16", "fp8_block", "fp8_block_ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_quant_gemm_takes_half_precision_inputs_and_returns_their_dtype(scheme, dtype):
    m, n, k = 3, 16, 256
    x = randn(m, k, seed=4, dtype=dtype)
    wq, ws = ops.quantize_weight(weights(n, k, seed=5), scheme, 64)
    y = ops.quant_gemm(x, wq, ws, scheme)
    assert y.dtype == dtype and y.shape == (m, n)
    want, abs_terms = ref_packed_gemm(x, wq, ws, scheme)
    out_eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    got = y.double().numpy()
    assert np.all(np.abs(got - want) <= out_eps * np.abs(want) + 1e-5 * abs_terms)
    with float64_reference():  # the half-precision x is upcast exactly
        y64 = ops.quant_gemm(x, wq, ws, scheme)
    assert_close(y64, want, abs_terms, 1e-13)


def test_packed_quant_gemm_with_no_rows_returns_empty():
    wq, ws = ops.quantize_weight(weights(8, 128, seed=0), "w4a8", 32)
    y = ops.quant_gemm(torch.zeros(0, 128), wq, ws, "w4a8")
    assert y.shape == (0, 8) and y.dtype == torch.float32


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w4a16", "fp8_block", "fp8_block_ue8m0"])
def test_packed_quant_gemm_grad_wrt_x_is_dy_times_dequantised_weight(scheme):
    m, n, k = 4, 12, 200 if scheme.startswith("fp8") else 256
    x = randn(m, k, seed=8).requires_grad_(True)
    wq, ws = ops.quantize_weight(weights(n, k, seed=9), scheme, 64)
    dy = randn(m, n, seed=10)
    ops.quant_gemm(x, wq, ws, scheme).backward(dy)
    wd = packed_weight_deq(wq, ws, scheme, k)
    dyd = dy.double().numpy()
    assert_close(x.grad, dyd @ wd, np.abs(dyd) @ np.abs(wd), 1e-5)


# -- quant_gemm, QAT (fake-quant) ----------------------------------------------------

QAT_CASES = [
    ("w8a8", 128, 4, 12, 256),
    ("w4a8", 32, 4, 12, 256),
    ("w4a8", 64, 1, 8, 128),
    ("w4a16", 32, 3, 12, 128),
    ("w4a16", 128, 3, 12, 256),
    ("fp8_block", 128, 3, 130, 200),
    ("fp8_block_ue8m0", 128, 3, 20, 300),
]


@pytest.mark.parametrize(("scheme", "g", "m", "n", "k"), QAT_CASES)
def test_qat_quant_gemm_is_float_gemm_of_fake_quantised_operands(scheme, g, m, n, k):
    x = randn(m, k, seed=20) * 2
    w = weights(n, k, seed=21)
    qx, qw = fq_act(x, scheme), fq_weight(w, scheme, g)
    want, abs_terms = qx @ qw.T, np.abs(qx) @ np.abs(qw).T
    y = ops.quant_gemm(x, w, None, scheme, g)
    assert y.dtype == torch.float32
    assert_close(y, want, abs_terms, 1e-5)
    with float64_reference():
        y64 = ops.quant_gemm(x, w, None, scheme, g)
    assert_close(y64, want, abs_terms, 1e-13)


@pytest.mark.parametrize(("scheme", "g", "m", "n", "k"), QAT_CASES)
def test_qat_quant_gemm_gradients_pass_straight_through(scheme, g, m, n, k):
    x = (randn(m, k, seed=30) * 2).requires_grad_(True)
    w = weights(n, k, seed=31).requires_grad_(True)
    dy = randn(m, n, seed=32)
    ops.quant_gemm(x, w, None, scheme, g).backward(dy)
    qx, qw = fq_act(x, scheme), fq_weight(w, scheme, g)
    dyd = dy.double().numpy()
    assert_close(x.grad, dyd @ qw, np.abs(dyd) @ np.abs(qw), 1e-5)  # dx = dy @ Q(w)
    assert_close(w.grad, dyd.T @ qx, np.abs(dyd).T @ np.abs(qx), 1e-5)  # dw = dy.T @ Q(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["w4a8", "fp8_block"])
def test_qat_quant_gemm_half_precision_forward_and_grads_keep_input_dtypes(scheme, dtype):
    m, n, k = 3, 8, 128
    x = randn(m, k, seed=40, dtype=dtype).requires_grad_(True)
    w = weights(n, k, seed=41).to(dtype).requires_grad_(True)
    dy = randn(m, n, seed=42, dtype=dtype)
    y = ops.quant_gemm(x, w, None, scheme, 32)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    qx, qw = fq_act(x, scheme), fq_weight(w, scheme, 32)
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    dyd = dy.double().numpy()
    for got, want, terms in (
        (y, qx @ qw.T, np.abs(qx) @ np.abs(qw).T),
        (x.grad, dyd @ qw, np.abs(dyd) @ np.abs(qw)),
        (w.grad, dyd.T @ qx, np.abs(dyd).T @ np.abs(qx)),
    ):
        g = got.detach().double().numpy()
        assert np.all(np.abs(g - want) <= eps * np.abs(want) + 1e-5 * terms)


def test_qat_w4a8_group_size_argument_sets_the_weight_groups():
    x = randn(2, 128, seed=50)
    w = weights(6, 128, seed=51)
    y32 = ops.quant_gemm(x, w, None, "w4a8", 32).double().numpy()
    y128 = ops.quant_gemm(x, w, None, "w4a8", 128).double().numpy()
    qx = fq_act(x, "w4a8")
    for y, g in ((y32, 32), (y128, 128)):
        qw = fq_weight(w, "w4a8", g)
        assert np.all(np.abs(y - qx @ qw.T) <= 1e-5 * (np.abs(qx) @ np.abs(qw).T))
    assert not np.allclose(y32, y128, rtol=1e-4, atol=0)


# -- quantize_weight -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "g", "n", "k"),
    [
        ("w8a8", 128, 6, 64),
        ("w4a8", 32, 6, 64),
        ("w4a16", 64, 4, 128),
        ("fp8_block", 64, 130, 200),  # group_size is ignored: FP8 blocks are 128 x 128
        ("fp8_block_ue8m0", 128, 20, 160),
    ],
)
def test_quantize_weight_on_expert_stack_quantises_each_expert(scheme, g, n, k):
    e = 3
    w = torch.stack([weights(n, k, seed=60 + i) * (i + 1) for i in range(e)])
    wq, ws = ops.quantize_weight(w, scheme, g)
    fmt = WEIGHT_FMT[scheme]
    fg = 128 if fmt.startswith("fp8") else g
    assert ws.shape == (e, *scale_shape(fmt, n, k, fg)) and ws.dtype == torch.float32
    assert wq.shape[0] == e
    for i in range(e):
        vals, scale = ref_quantize(w[i], fmt, fg)
        np.testing.assert_array_equal(ws[i].numpy(), scale)
        np.testing.assert_array_equal(stored_values(wq[i], fmt), vals)
    two_d = ops.quantize_weight(w[1], scheme, g)
    assert torch.equal(two_d[1], ws[1])
    assert torch.equal(two_d[0].view(torch.uint8), wq[1].view(torch.uint8))
