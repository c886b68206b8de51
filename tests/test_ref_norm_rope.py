"""rms_norm and rope on the cpu reference against independent float64 formulas written
as explicit loops over rows / pairs (math.sqrt, per-pair rotation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tol(dtype):
    """The op computes in fp32 and rounds once to ``dtype``: half an ulp plus fp32 noise."""
    return dict(rtol=torch.finfo(dtype).eps, atol=1e-5)


# -- rms_norm -----------------------------------------------------------------------


def loop_rms_norm(x, weight, eps):
    xn = x.detach().double().numpy()
    wn = weight.detach().double().numpy()
    rows = xn.reshape(-1, xn.shape[-1])
    out = np.empty_like(rows)
    d = rows.shape[1]
    for r in range(rows.shape[0]):
        inv = 1.0 / math.sqrt(math.fsum(float(v) ** 2 for v in rows[r]) / d + eps)
        for i in range(d):
            out[r, i] = rows[r, i] * inv * wn[i]
    return torch.from_numpy(out.reshape(xn.shape))


@pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 3, 8), (2, 1, 3, 12)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_matches_loop_reference_for_any_leading_shape(shape, dtype):
    g = _gen(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    y = glmport.ops.rms_norm(x, weight, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), loop_rms_norm(x, weight, 1e-5), **_tol(dtype))


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_rms_norm_mixed_weight_dtype_returns_x_dtype(x_dtype, w_dtype):
    g = _gen(2)
    x = torch.randn(4, 24, generator=g).to(x_dtype)
    weight = torch.randn(24, generator=g).to(w_dtype)
    y = glmport.ops.rms_norm(x, weight, 1e-6)
    assert y.dtype == x_dtype
    torch.testing.assert_close(y.double(), loop_rms_norm(x, weight, 1e-6), **_tol(x_dtype))


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_float64_reference_mode_is_tight_and_uses_eps(eps):
    g = _gen(3)
    x = torch.randn(5, 10, generator=g) * 0.01  # mean(x**2) ~ 1e-4: eps matters
    weight = torch.randn(10, generator=g)
    with float64_reference():
        y = glmport.ops.rms_norm(x, weight, eps)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, loop_rms_norm(x, weight, eps), rtol=1e-10, atol=1e-12)


def test_rms_norm_default_eps_is_1e_minus_6():
    g = _gen(4)
    x = torch.randn(3, 8, generator=g) * 1e-3  # mean(x**2) ~ 1e-6, the size of eps
    weight = torch.ones(8)
    with float64_reference():
        y = glmport.ops.rms_norm(x, weight)
    torch.testing.assert_close(y, loop_rms_norm(x, weight, 1e-6), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(y, loop_rms_norm(x, weight, 1e-5), rtol=1e-3, atol=0)


def test_rms_norm_of_zero_row_is_zero():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    y = glmport.ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(y, torch.zeros_like(y))


def _rms_grads(fn, x, weight, eps, r):
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss = (fn(x, weight, eps).double() * r).sum()
    return torch.autograd.grad(loss, (x, weight))


def torch_rms_norm(x, weight, eps):
    d = x.shape[-1]
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) / d + eps) * weight


@pytest.mark.parametrize("shape", [(5, 12), (2, 3, 8)])
def test_rms_norm_grads_wrt_x_and_weight_match_reference(shape):
    g = _gen(5)
    x = torch.randn(shape, generator=g)
    weight = torch.randn(shape[-1], generator=g)
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    got = _rms_grads(glmport.ops.rms_norm, x, weight, 1e-5, r)
    want = _rms_grads(torch_rms_norm, x.double(), weight.double(), 1e-5, r)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


# -- rope ---------------------------------------------------------------------------


def _pairs(d, interleaved):
    """The (first, second) positions of each rotary pair."""
    if interleaved:
        return [(2 * i, 2 * i + 1) for i in range(d // 2)]
    return [(i, i + d // 2) for i in range(d // 2)]


def loop_rope(x, cos, sin, interleaved):
    xn = x.detach().double().numpy()
    c, s = cos.double().numpy(), sin.double().numpy()
    out = np.empty_like(xn)
    t, d = xn.shape[0], xn.shape[-1]
    for ti in range(t):
        rows = xn[ti].reshape(-1, d)
        res = out[ti].reshape(-1, d)  # a view into out
        for r in range(rows.shape[0]):
            for i, (p0, p1) in enumerate(_pairs(d, interleaved)):
                a, b = rows[r, p0], rows[r, p1]
                res[r, p0] = a * c[ti, i] - b * s[ti, i]
                res[r, p1] = a * s[ti, i] + b * c[ti, i]
    return torch.from_numpy(out)


def _angles(seed, t, d):
    g = _gen(seed)
    pos = torch.arange(t, dtype=torch.float64)[:, None] + torch.rand(
        t, 1, generator=g, dtype=torch.float64
    )
    inv_freq = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    theta = pos * inv_freq
    return theta.cos().float(), theta.sin().float()


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(5, 8), (4, 3, 8), (3, 2, 2, 6)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_matches_loop_reference(interleaved, shape, dtype):
    g = _gen(6)
    x = torch.randn(shape, generator=g).to(dtype)
    cos, sin = _angles(7, shape[0], shape[-1])
    y = glmport.ops.rope(x, cos, sin, interleaved)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), loop_rope(x, cos, sin, interleaved), **_tol(dtype))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_float64_reference_mode_is_tight_with_arbitrary_cos_sin(interleaved):
    # cos / sin need not lie on the unit circle for the formula to hold: pins which
    # factor multiplies which component.
    g = _gen(8)
    x = torch.randn(3, 2, 10, generator=g)
    cos, sin = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    with float64_reference():
        y = glmport.ops.rope(x, cos, sin, interleaved)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, loop_rope(x, cos, sin, interleaved), rtol=1e-10, atol=1e-12)


def test_rope_default_layout_is_interleaved():
    g = _gen(9)
    x = torch.randn(4, 8, generator=g)
    cos, sin = _angles(10, 4, 8)
    with float64_reference():
        y = glmport.ops.rope(x, cos, sin)
    torch.testing.assert_close(y, loop_rope(x, cos, sin, True), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(y, loop_rope(x, cos, sin, False), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_zero_angle_is_identity(interleaved, dtype):
    x = torch.randn(3, 2, 8, generator=_gen(11)).to(dtype)
    y = glmport.ops.rope(x, torch.ones(3, 4), torch.zeros(3, 4), interleaved)
    assert torch.equal(y, x)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_preserves_norm_of_each_pair(interleaved, dtype):
    g = _gen(12)
    x = torch.randn(4, 3, 12, generator=g).to(dtype)
    theta = (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5) * 2 * math.pi
    y = glmport.ops.rope(x, theta.cos().float(), theta.sin().float(), interleaved).double()
    xd = x.double()
    for p0, p1 in _pairs(12, interleaved):
        before = xd[..., p0] ** 2 + xd[..., p1] ** 2
        after = y[..., p0] ** 2 + y[..., p1] ** 2
        torch.testing.assert_close(after, before, rtol=4 * torch.finfo(dtype).eps, atol=1e-5)
    assert not torch.allclose(y, xd, atol=1e-1)  # the pairs really moved


def torch_rope(x, cos, sin, interleaved):
    d = x.shape[-1]
    pairs = _pairs(d, interleaved)
    first = torch.tensor([p for p, _ in pairs])
    second = torch.tensor([p for _, p in pairs])
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    c, s = cos.double().reshape(view), sin.double().reshape(view)
    a, b = x[..., first], x[..., second]
    out = torch.zeros_like(x)
    out = out.index_add(-1, first, a * c - b * s)
    return out.index_add(-1, second, a * s + b * c)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(4, 8), (3, 2, 6)])
def test_rope_grad_wrt_x_matches_reference(interleaved, shape):
    g = _gen(14)
    x = torch.randn(shape, generator=g)
    cos, sin = (
        torch.randn(shape[0], shape[-1] // 2, generator=g),
        torch.randn(shape[0], shape[-1] // 2, generator=g),
    )
    r = torch.randn(shape, generator=g, dtype=torch.float64)
    xg = x.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(
        (glmport.ops.rope(xg, cos, sin, interleaved).double() * r).sum(), xg
    )
    xd = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad((torch_rope(xd, cos, sin, interleaved) * r).sum(), xd)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
