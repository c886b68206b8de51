"""The ascend backend's ``rms_norm`` and ``rope`` adapters on the emulated torch_npu ops,
against the float64 cpu reference within the dtype's tolerance: any leading shape,
GLM-5's hidden 6144 and rope dim 64, both rope layouts, every weight dtype,
non-contiguous inputs, more heads than ``npu_rotary_mul`` takes at once, and the
layout the adapter hands the op (BSND ``[1, T, H, D]``, r1 / r2 ``[1, T, 1, D]``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from glmport.backends.ascend import norm_rope
from glmport.backends.ascend.emulator import norm_rope as emulated
from glmport.core.registry import REGISTRY
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Many tiny ops: one intra-op thread (see conftest)."""


class Recorder(SimpleNamespace):
    """The emulated ops, each call's arguments recorded (shapes, dtypes, modes)."""

    def __init__(self) -> None:
        super().__init__(calls=[])

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append(("npu_rms_norm", x, gamma, epsilon))
        return emulated.npu_rms_norm(x, gamma, epsilon=epsilon)

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half"):
        self.calls.append(("npu_rotary_mul", x, r1, r2, rotary_mode))
        return emulated.npu_rotary_mul(x, r1, r2, rotary_mode=rotary_mode)


def ref(op: str, *args):
    """The cpu reference computed in float64."""
    with REGISTRY.get("cpu").float64():
        return REGISTRY.kernels("cpu", False)[op](*args)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check(op: str, out: torch.Tensor, x: torch.Tensor, *args) -> None:
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    result = compare(out, ref(op, x, *args), tolerance(op, x.dtype))
    assert result.ok, (op, x.dtype, tuple(x.shape), result)


# -- rms_norm -----------------------------------------------------------------------


def check_rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> Recorder:
    npu = Recorder()
    check("rms_norm", norm_rope.rms_norm(npu, x, weight, eps), x, weight, eps)
    return npu


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_any_leading_shape_and_glm5_hidden(dtype):
    g = gen(0)
    for shape in [(40,), (5, 32), (1, 4, 512), (2, 1, 3, 40), (8, 6144), (3, 1, 1, 1, 1, 7, 24)]:
        x = (3 * torch.randn(shape, generator=g)).to(dtype)
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
        npu = check_rms(x, weight)
        # The rows as one 2-D input, a 1-D gamma, eps by keyword.
        (_, rows, gamma, eps), *more = npu.calls
        assert not more and rows.shape == (math.prod(shape[:-1]), shape[-1])
        assert gamma.shape == (shape[-1],) and gamma.dtype == dtype and eps == 1e-5


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_rms_norm_every_weight_dtype_becomes_a_documented_pair(x_dtype, w_dtype):
    g = gen(1)
    x = torch.randn(6, 64, generator=g).to(x_dtype)
    npu = check_rms(x, (1 + 0.1 * torch.randn(64, generator=g)).to(w_dtype))
    gamma = npu.calls[0][2]
    assert gamma.dtype == (w_dtype if w_dtype == x_dtype else torch.float32)


def test_rms_norm_non_contiguous_inputs():
    g = gen(2)
    for dtype in DTYPES:
        base = torch.randn(6, 4, 50, generator=g).to(dtype)
        weight = torch.randn(72, generator=g)[::2]  # float32, strided
        check_rms(base[..., 7:43], weight[:36])
        check_rms(base.transpose(0, 1), weight[:25].repeat(2))
        check_rms(base[:, 0, :].T.contiguous().T, weight[:25].repeat(2), 1e-3)


def test_rms_norm_empty_rows():
    out = norm_rope.rms_norm(emulated, torch.randn(0, 8), torch.ones(8), 1e-6)
    assert out.shape == (0, 8)
    out = norm_rope.rms_norm(emulated, torch.randn(2, 0, 8).bfloat16(), torch.ones(8), 1e-6)
    assert out.shape == (2, 0, 8) and out.dtype == torch.bfloat16


# -- rope ---------------------------------------------------------------------------


def angles(t: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5-like angles: positions past 1000, base 1e6 frequencies, fp32."""
    pos = torch.randint(0, 5000, (t, 1), generator=g).double() + 1000
    ang = pos * 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return ang.cos().float(), ang.sin().float()


def check_rope(x, cos, sin, interleaved) -> Recorder:
    npu = Recorder()
    check("rope", norm_rope.rope(npu, x, cos, sin, interleaved), x, cos, sin, interleaved)
    return npu


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_layouts_shapes_and_glm5_rope_dim(dtype, interleaved):
    g = gen(3)
    for shape in [(3, 20), (1, 64), (2, 3, 16), (2, 2, 5, 12), (16, 64, 64), (7, 5, 2), (9, 3, 94)]:
        cos, sin = angles(shape[0], shape[-1], g)
        x = torch.randn(shape, generator=g).to(dtype)
        npu = check_rope(x, cos, sin, interleaved)
        (_, xb, r1, r2, mode), *more = npu.calls
        t, d = shape[0], shape[-1]
        assert not more and mode == ("interleave" if interleaved else "half")
        assert xb.shape == (1, t, math.prod(shape[1:-1]), d)
        # float32 angles and input whatever x is: the op would round the angles to its dtype
        assert r1.shape == r2.shape == (1, t, 1, d)
        assert xb.dtype == r1.dtype == r2.dtype == torch.float32


def test_rope_full_d_factors_in_each_mode_order():
    # cos / sin [T, D/2] expand to D: repeated in place (interleave), as halves (half).
    x = torch.zeros(2, 1, 6)
    cos = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    sin = -cos
    for interleaved, expand in [
        (True, lambda c: c.repeat_interleave(2, dim=-1)),
        (False, lambda c: torch.cat((c, c), dim=-1)),
    ]:
        npu = Recorder()
        norm_rope.rope(npu, x, cos, sin, interleaved)
        _, _, r1, r2, _ = npu.calls[0]
        assert torch.equal(r1.view(2, 6), expand(cos)) and torch.equal(r2.view(2, 6), expand(sin))


def test_rope_rotates_the_right_pairs():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    # Pair 0 turns by 90 degrees, pair 1 stays.
    assert norm_rope.rope(emulated, x, cos, sin, True).tolist() == [[-2.0, 1.0, 3.0, 4.0]]
    assert norm_rope.rope(emulated, x, cos, sin, False).tolist() == [[-3.0, 2.0, 1.0, 4.0]]


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_non_contiguous(interleaved):
    g = gen(4)
    for dtype in DTYPES:
        base = torch.randn(3, 3, 40, generator=g).to(dtype)
        cos, sin = angles(3, 24, g)
        # A slice of the last dim (GLM-5's rope part of a head), strided cos / sin.
        check_rope(base[..., 8:32], cos.T.contiguous().T, sin, interleaved)
        # Middle dims that do not merge into one: a copy.
        x4 = torch.randn(3, 4, 2, 24, generator=g).to(dtype).transpose(1, 2)
        check_rope(x4, cos, sin, interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_more_heads_than_the_op_takes_go_in_slices(interleaved):
    g = gen(5)
    cos, sin = angles(2, 4, g)
    x = torch.randn(2, 2100, 4, generator=g).bfloat16()
    npu = check_rope(x, cos, sin, interleaved)
    assert [c[1].shape[2] for c in npu.calls] == [999, 999, 102]


def test_rope_empty_inputs_make_no_call():
    npu = Recorder()
    cos, sin = torch.zeros(0, 4), torch.zeros(0, 4)
    assert norm_rope.rope(npu, torch.randn(0, 2, 8), cos, sin, True).shape == (0, 2, 8)
    cos, sin = torch.zeros(3, 4), torch.zeros(3, 4)
    assert norm_rope.rope(npu, torch.randn(3, 0, 8), cos, sin, False).shape == (3, 0, 8)
    assert npu.calls == []
