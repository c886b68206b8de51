"""The emulated ``torch_npu.npu_rms_norm`` and ``torch_npu.npu_rotary_mul`` against
their documentation (Atlas A2 / A3), in the vendor's layouts: values from independent
float64 arithmetic written here, the documented output dtypes and shapes (rstd float32
``[..., 1]``), every layout / broadcast of r1 the rotary op documents, and one
``NpuContractError`` per documented constraint."""

from __future__ import annotations

import pytest
import torch

from glmport.backends.ascend.emulator.contract import NpuContractError
from glmport.backends.ascend.emulator.norm_rope import npu_rms_norm, npu_rotary_mul

HALF_DTYPES = (torch.float16, torch.bfloat16)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).abs().max() / expected.abs().max())


# -- npu_rms_norm -------------------------------------------------------------------


def rms_expected(x: torch.Tensor, gamma: torch.Tensor, eps: float, dims: int = 1):
    """float64 ``(y, rstd)`` by rows, the mean over the last ``dims`` dims."""
    lead = x.shape[: x.dim() - dims]
    rows = x.double().reshape(-1, gamma.numel())
    g = gamma.double().reshape(-1)
    y, rstd = torch.empty_like(rows), torch.empty(rows.shape[0], dtype=torch.float64)
    for i, row in enumerate(rows):
        rstd[i] = 1.0 / (sum(v * v for v in row.tolist()) / row.numel() + eps) ** 0.5
        y[i] = row * rstd[i] * g
    return y.reshape(x.shape), rstd.reshape(*lead, *([1] * dims))


def test_rms_norm_hand_computed_row():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    gamma = torch.tensor([2.0, 0.5])
    y, rstd = npu_rms_norm(x, gamma, epsilon=0.5)
    # Row 0: mean square 12.5, + 0.5 = 13; row 1: 1 + 0.5 = 1.5.
    assert torch.allclose(rstd, torch.tensor([[13**-0.5], [1.5**-0.5]]))
    assert torch.allclose(
        y, torch.tensor([[6 / 13**0.5, 2 / 13**0.5], [2 / 1.5**0.5, -0.5 / 1.5**0.5]])
    )


@pytest.mark.parametrize(
    ("x_dtype", "g_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_rms_norm_documented_dtype_pairs_give_x_dtype_and_fp32_rstd(x_dtype, g_dtype):
    g = gen(0)
    x = (3 * torch.randn(4, 3, 40, generator=g)).to(x_dtype)
    gamma = (1 + 0.1 * torch.randn(40, generator=g)).to(g_dtype)
    y, rstd = npu_rms_norm(x, gamma, 1e-5)
    assert y.dtype == x_dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (4, 3, 1)
    ey, erstd = rms_expected(x, gamma, 1e-5)
    assert rel_err(rstd, erstd) < 1e-6
    # fp32 arithmetic, one rounding to x's dtype.
    assert rel_err(y, ey) < {torch.float32: 1e-6, torch.float16: 1e-3}.get(x_dtype, 8e-3)


def test_rms_norm_gamma_of_several_dims_normalises_over_all_of_them():
    g = gen(1)
    x = torch.randn(2, 3, 4, generator=g)
    gamma = torch.randn(3, 4, generator=g)
    y, rstd = npu_rms_norm(x, gamma)
    assert rstd.shape == (2, 1, 1)
    ey, erstd = rms_expected(x, gamma, 1e-6, dims=2)
    assert rel_err(y, ey) < 1e-6 and rel_err(rstd, erstd) < 1e-6


def test_rms_norm_takes_strided_and_empty_input():
    g = gen(2)
    base = torch.randn(6, 50, generator=g)
    x = base[:, 5:37].T.contiguous().T  # column-major rows
    y, _ = npu_rms_norm(x, torch.ones(32), 1e-6)
    assert rel_err(y, rms_expected(x, torch.ones(32), 1e-6)[0]) < 1e-6
    y, rstd = npu_rms_norm(torch.randn(0, 8), torch.ones(8))
    assert y.shape == (0, 8) and rstd.shape == (0, 1)


@pytest.mark.parametrize(
    ("x", "gamma", "names"),
    [
        (torch.randn(2, 4).double(), torch.ones(4).double(), "self must be float16"),
        (torch.ones(2, 4, dtype=torch.int32), torch.ones(4), "self must be float16"),
        (torch.randn(2, 4), torch.ones(4, dtype=torch.int8), "gamma must be float16"),
        (torch.randn(4), torch.ones(4), "self must have 2 to 8 dims"),
        (torch.randn([1] * 9 + [4]), torch.ones(4), "self must have 2 to 8 dims"),
        (torch.randn(2, 4), torch.ones(1, 2, 4), "gamma must have 1 to self.dim()"),
        (torch.randn(2, 4), torch.ones(()), "gamma must have 1 to self.dim()"),
        (torch.randn(2, 4), torch.ones(5), "gamma's shape must be self's trailing"),
        (torch.randn(2, 3, 4), torch.ones(2, 4), "gamma's shape must be self's trailing"),
        (torch.randn(2, 4), torch.ones(4).bfloat16(), "not a supported pair"),
        (torch.randn(2, 4).bfloat16(), torch.ones(4).half(), "not a supported pair"),
        (torch.randn(2, 4).half(), torch.ones(4).bfloat16(), "not a supported pair"),
    ],
)
def test_rms_norm_documented_constraints_raise(x, gamma, names):
    with pytest.raises(NpuContractError, match=f"npu_rms_norm: .*{names}"):
        npu_rms_norm(x, gamma)


# -- npu_rotary_mul -----------------------------------------------------------------


def rotary_expected(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str):
    """float64 ``x * r1 + rotate(x) * r2`` element by element, r1 / r2 broadcast."""
    xd = x.double()
    c, s = (r.double().expand(x.shape) for r in (r1, r2))
    d = x.shape[-1]
    out = torch.empty_like(xd)
    for j in range(d):
        if mode == "half":
            partner = -xd[..., j + d // 2] if j < d // 2 else xd[..., j - d // 2]
        else:
            partner = -xd[..., j + 1] if j % 2 == 0 else xd[..., j - 1]
        out[..., j] = xd[..., j] * c[..., j] + partner * s[..., j]
    return out


def test_rotary_mul_hand_computed_pairs():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    # Pair 0 turns by 90 degrees (cos 0, sin 1), pair 1 stays (cos 1, sin 0).
    half_r1, half_r2 = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = npu_rotary_mul(x, half_r1.view(1, 1, 1, 4), half_r2.view(1, 1, 1, 4))
    assert out.flatten().tolist() == [-3.0, 2.0, 1.0, 4.0]  # pairs (0, 2), (1, 3)
    inter_r1, inter_r2 = torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    out = npu_rotary_mul(
        x, inter_r1.view(1, 1, 1, 4), inter_r2.view(1, 1, 1, 4), rotary_mode="interleave"
    )
    assert out.flatten().tolist() == [-2.0, 1.0, 3.0, 4.0]  # pairs (0, 1), (2, 3)


# (x shape, r shape) per documented broadcast; x dims named by the layout.
HALF_ONLY = [
    ((2, 3, 5, 8), (2, 1, 5, 8)),  # BNSD, r B1SD
    ((2, 3, 5, 8), (2, 3, 5, 8)),  # BNSD, r BNSD
    ((2, 5, 3, 8), (2, 5, 1, 8)),  # BSND, r BS1D
    ((5, 2, 3, 8), (5, 2, 1, 8)),  # SBND, r SB1D
    ((5, 3, 8), (5, 3, 8)),  # TND, r TND
]
BOTH_MODES = [
    ((2, 3, 5, 8), (1, 1, 5, 8)),  # BNSD, r 11SD
    ((2, 5, 3, 8), (1, 5, 1, 8)),  # BSND, r 1S1D
    ((5, 2, 3, 8), (5, 1, 1, 8)),  # SBND, r S11D
    ((5, 3, 8), (5, 1, 8)),  # TND, r T1D
]


@pytest.mark.parametrize("dtype", (torch.float32, *HALF_DTYPES))
@pytest.mark.parametrize(
    ("mode", "shapes"),
    [("half", s) for s in HALF_ONLY + BOTH_MODES] + [("interleave", s) for s in BOTH_MODES],
)
def test_rotary_mul_documented_broadcasts(mode, shapes, dtype):
    x_shape, r_shape = shapes
    g = gen(3)
    x = torch.randn(x_shape, generator=g).to(dtype)
    ang = torch.rand(r_shape, generator=g) * 6
    r1, r2 = ang.cos().to(dtype), ang.sin().to(dtype)
    out = npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    assert out.shape == x.shape and out.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert rel_err(out, rotary_expected(x, r1, r2, mode)) < tol


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rotary_mul_casts_r1_r2_to_the_input_dtype(dtype):
    # torch_npu casts mixed-dtype r1 / r2 to input's dtype before the kernel.
    g = gen(4)
    x = torch.randn(1, 4, 2, 16, generator=g).to(dtype)
    ang = torch.rand(1, 4, 1, 16, generator=g) * 6
    mixed = npu_rotary_mul(x, ang.cos(), ang.sin(), rotary_mode="interleave")
    same = npu_rotary_mul(x, ang.cos().to(dtype), ang.sin().to(dtype), rotary_mode="interleave")
    assert torch.equal(mixed, same)


def test_rotary_mul_takes_strided_input():
    g = gen(5)
    x = torch.randn(1, 3, 4, 40, generator=g)[..., 8:32]
    r1, r2 = torch.rand(2, 1, 3, 1, 24, generator=g)
    out = npu_rotary_mul(x, r1, r2)
    assert rel_err(out, rotary_expected(x, r1, r2, "half")) < 1e-6


def test_rotary_mul_head_limits_are_per_mode():
    r = torch.ones(1, 2, 1, 2)
    # BSND read from r1 = 1S1D: B = x's dim 0, N = its dim 2.
    npu_rotary_mul(torch.ones(1, 2, 999, 2), r, r)  # half: N < 1000
    npu_rotary_mul(torch.ones(1, 2, 999, 2), r, r, rotary_mode="interleave")  # B * N < 1000
    npu_rotary_mul(torch.ones(4, 2, 250, 2), r, r)  # half: B and N each < 1000
    with pytest.raises(NpuContractError, match="'interleave' needs B \\* N < 1000"):
        npu_rotary_mul(torch.ones(4, 2, 250, 2), r, r, rotary_mode="interleave")


ONES = torch.ones(1, 2, 1, 8)
X = torch.ones(1, 2, 3, 8)


@pytest.mark.parametrize(
    ("args", "kwargs", "names"),
    [
        ((X, ONES, ONES), {"rotary_mode": "quarter"}, "rotary_mode must be 'half' or 'interleave'"),
        ((X, ONES, ONES), {"rotary_mode": "interleave-half"}, "rotary_mode must be 'half'"),
        ((X.double(), ONES, ONES), {}, "input must be float16"),
        ((X, ONES.double(), ONES), {}, "r1 must be float16"),
        ((X, ONES, ONES.int()), {}, "r2 must be float16"),
        ((X[0, 0], ONES[0, 0], ONES[0, 0]), {}, "input must be 4-D"),
        ((X[None], ONES[None], ONES[None]), {}, "input must be 4-D"),
        ((X, ONES[0], ONES[0]), {}, "r1 and r2 must have input's 4 dims"),
        ((X, ONES, torch.ones(1, 2, 3, 8)), {}, "r1 and r2 must have one shape"),
        ((torch.ones(1, 2, 3, 7), ONES[..., :7], ONES[..., :7]), {}, "D must be even and < 896"),
        ((torch.ones(1, 2, 1, 896), torch.ones(1, 2, 1, 896), torch.ones(1, 2, 1, 896)), {},
         "D must be even and < 896"),
        ((X, ONES[..., :4], ONES[..., :4]), {}, "last dim must be input's D = 8"),
        ((X, torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8)), {}, "not a supported broadcast"),
        ((X, torch.ones(2, 2, 1, 8), torch.ones(2, 2, 1, 8)), {}, "not a supported broadcast"),
        # B1SD / BS1D / full shapes are half-mode only.
        ((X, X, X), {"rotary_mode": "interleave"}, "not a supported broadcast"),
        ((torch.ones(2, 3, 5, 8), torch.ones(2, 1, 5, 8), torch.ones(2, 1, 5, 8)),
         {"rotary_mode": "interleave"}, "not a supported broadcast"),
        ((torch.ones(5, 3, 8), torch.ones(5, 3, 8), torch.ones(5, 3, 8)),
         {"rotary_mode": "interleave"}, "not a supported broadcast"),
        ((torch.ones(1, 2, 1000, 2), torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2)), {},
         "'half' needs B < 1000 and N < 1000"),
        ((torch.ones(1000, 2, 1, 2), torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2)), {},
         "'half' needs B < 1000 and N < 1000"),
        ((torch.ones(2, 1000, 2), torch.ones(2, 1, 2), torch.ones(2, 1, 2)), {},
         "'half' needs B < 1000 and N < 1000"),
    ],
)  # fmt: skip
def test_rotary_mul_documented_constraints_raise(args, kwargs, names):
    with pytest.raises(NpuContractError, match=f"npu_rotary_mul: .*{names}"):
        npu_rotary_mul(*args, **kwargs)


def test_rotary_mul_rotate_matrix_is_not_emulated():
    with pytest.raises(NotImplementedError, match="rotate"):
        npu_rotary_mul(X, ONES, ONES, rotary_mode="half", rotate=torch.eye(8))
