"""The cuda backend's rms_norm, rope and token_logprobs kernels, run through Triton's
interpreter, against the float64 cpu reference within the dtype's tolerance: any
leading shape, non-contiguous inputs, both rope layouts, rms_norm's chunked wide-row
path, token_logprobs' vocabulary splits and tile edges, and its meta-mode rule
(a target outside [0, V) gives logp NaN, V = 0 gives both NaN)."""

from __future__ import annotations

import pytest
import torch

from glmport.core.registry import REGISTRY
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def norm_rope(cuda_module, one_thread):
    return cuda_module("norm_rope")


@pytest.fixture(scope="module")
def logprobs(cuda_module, one_thread):
    return cuda_module("logprobs")


def ref(op: str, *args):
    """The cpu reference computed in float64."""
    with REGISTRY.get("cpu").float64():
        return REGISTRY.kernels("cpu", False)[op](*args)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(out: torch.Tensor, expected: torch.Tensor, op: str, dtype: torch.dtype):
    result = compare(out, expected, tolerance(op, dtype))
    assert result.ok, (op, dtype, result)


# -- rms_norm -----------------------------------------------------------------------


def check_rms(norm_rope, x, weight, eps=1e-5):
    out = norm_rope.rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert_close(out, ref("rms_norm", x, weight, eps), "rms_norm", x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_any_leading_shape(norm_rope, dtype):
    g = gen(0)
    weight = (1 + 0.1 * torch.randn(40, generator=g)).to(dtype)
    for shape in [(40,), (5, 40), (2, 3, 40), (2, 1, 3, 40)]:
        check_rms(norm_rope, (3 * torch.randn(shape, generator=g)).to(dtype), weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_non_contiguous_and_mixed_weight(norm_rope, dtype):
    g = gen(1)
    base = torch.randn(6, 4, 50, generator=g).to(dtype)
    weight = torch.randn(72, generator=g)[::2]  # float32, strided
    check_rms(norm_rope, base[..., 7:43], weight[:36])  # sliced last dim: a strided view
    check_rms(norm_rope, base.transpose(0, 1), weight[:25].repeat(2))  # needs a copy
    check_rms(norm_rope, base[:, 0, :].T.contiguous().T, weight[:25].repeat(2))  # column-major


def test_rms_norm_wide_rows_take_two_passes(norm_rope, monkeypatch):
    monkeypatch.setattr(norm_rope, "_limits", lambda: (1 << 16, 16, 4096))
    g = gen(2)
    for dtype in DTYPES:
        x = torch.randn(3, 2, 45, generator=g).to(dtype)
        check_rms(norm_rope, x, torch.randn(45, generator=g).to(dtype), 1e-3)


def test_rms_norm_empty(norm_rope):
    for shape in [(0, 8), (3, 0)]:
        out = norm_rope.rms_norm(torch.randn(shape), torch.ones(shape[-1]), 1e-6)
        assert out.shape == shape


# -- rope ---------------------------------------------------------------------------


def angles(t: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(t, d // 2, generator=g) * 100
    return ang.cos(), ang.sin()


def check_rope(norm_rope, x, cos, sin, interleaved):
    out = norm_rope.rope(x, cos, sin, interleaved)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert_close(out, ref("rope", x, cos, sin, interleaved), "rope", x.dtype)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_layouts_and_shapes(norm_rope, dtype, interleaved):
    g = gen(3)
    for shape in [(3, 20), (2, 3, 16), (2, 2, 5, 12), (1, 130, 8)]:
        cos, sin = angles(shape[0], shape[-1], g)
        check_rope(norm_rope, torch.randn(shape, generator=g).to(dtype), cos, sin, interleaved)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_non_contiguous(norm_rope, interleaved):
    g = gen(4)
    for dtype in DTYPES:
        base = torch.randn(3, 3, 40, generator=g).to(dtype)
        cos, sin = angles(3, 24, g)
        # A slice of the last dim (GLM-5's rope part of a head), strided cos / sin.
        check_rope(norm_rope, base[..., 8:32], cos.T.contiguous().T, sin, interleaved)
        # Middle dims that do not merge: the kernel gets a copy.
        x4 = torch.randn(3, 4, 2, 24, generator=g).to(dtype).transpose(1, 2)
        check_rope(norm_rope, x4, cos, sin, interleaved)


def test_rope_wide_rotary_dims_loop_over_pairs(norm_rope, monkeypatch):
    monkeypatch.setattr(norm_rope, "_limits", lambda: (1 << 16, 1 << 16, 4))
    g = gen(5)
    cos, sin = angles(2, 20, g)
    for dtype in DTYPES:
        x = torch.randn(2, 5, 20, generator=g).to(dtype)
        check_rope(norm_rope, x, cos, sin, True)
        check_rope(norm_rope, x, cos, sin, False)


def test_rope_rotates_the_right_pairs(norm_rope):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    # Pair 0 turns by 90 degrees, pair 1 stays.
    assert norm_rope.rope(x, cos, sin, True).tolist() == [[-2.0, 1.0, 3.0, 4.0]]
    assert norm_rope.rope(x, cos, sin, False).tolist() == [[-3.0, 2.0, 1.0, 4.0]]


def test_rope_empty(norm_rope):
    cos, sin = torch.zeros(0, 4), torch.zeros(0, 4)
    assert norm_rope.rope(torch.randn(0, 2, 8), cos, sin, True).shape == (0, 2, 8)
    cos, sin = torch.zeros(3, 4), torch.zeros(3, 4)
    assert norm_rope.rope(torch.randn(3, 0, 8), cos, sin, False).shape == (3, 0, 8)


# -- token_logprobs -----------------------------------------------------------------


def lp_args(t, d, v, dtype, seed):
    g = gen(seed)
    hidden = torch.randn(t, d, generator=g).to(dtype)
    lm_head = (torch.randn(v, d, generator=g) * 2 / d**0.5).to(dtype)
    return hidden, lm_head, torch.randint(0, v, (t,), generator=g)


def check_lp(logprobs, hidden, lm_head, targets, temperature):
    logp, ent = logprobs.token_logprobs(hidden, lm_head, targets, temperature)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == targets.shape
    rlogp, rent = ref("token_logprobs", hidden, lm_head, targets, temperature)
    valid = ~rlogp.isnan()
    assert torch.equal(logp.isnan(), ~valid)
    assert_close(logp[valid], rlogp[valid], "token_logprobs", hidden.dtype)
    assert_close(ent, rent, "token_logprobs", hidden.dtype)
    return logp, ent


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_matches_reference(logprobs, dtype):
    check_lp(logprobs, *lp_args(3, 20, 37, dtype, seed=5), 1.3)
    check_lp(logprobs, *lp_args(7, 40, 130, dtype, seed=6), 0.7)


def test_logprobs_several_tiles_and_chunks(logprobs):
    # Past one interpreter tile (4096 columns, 256 of D, 32 tokens) in every direction.
    check_lp(logprobs, *lp_args(35, 300, 4100, torch.float32, seed=7), 0.7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_vocab_splits(logprobs, dtype, monkeypatch):
    # The GPU's split path under the interpreter: 128 columns per split, the last short.
    monkeypatch.setattr(logprobs, "vocab_split", lambda t, v, device: 128)
    hidden, lm_head, targets = lp_args(20, 24, 300, dtype, seed=8)
    targets[:4] = torch.tensor([0, 127, 128, 299])  # at the split edges
    logp, ent = check_lp(logprobs, hidden, lm_head, targets, 0.9)
    again = logprobs.token_logprobs(hidden, lm_head, targets, 0.9)
    assert torch.equal(logp, again[0]) and torch.equal(ent, again[1])


def test_logprobs_non_contiguous_and_int32(logprobs):
    hidden, lm_head, targets = lp_args(9, 48, 70, torch.bfloat16, seed=8)
    check_lp(logprobs, hidden[:, 8:40], lm_head.T.contiguous().T[:, :32], targets.int(), 1.0)


def test_logprobs_out_of_range_targets_give_nan(logprobs):
    hidden, lm_head, targets = lp_args(6, 16, 50, torch.float32, seed=9)
    logp, ent = logprobs.token_logprobs(hidden, lm_head, targets, 1.0)
    bad = targets.clone()
    bad[[1, 3, 4]] = torch.tensor([-1, 50, 2**40])
    blogp, bent = check_lp(logprobs, hidden, lm_head, bad, 1.0)
    assert blogp[[1, 3, 4]].isnan().all()
    keep = [0, 2, 5]
    assert torch.equal(blogp[keep], logp[keep]) and torch.equal(bent, ent)


def test_logprobs_empty_vocab_and_tokens(logprobs):
    hidden, lm_head, targets = lp_args(4, 16, 1, torch.float32, seed=10)
    logp, ent = logprobs.token_logprobs(hidden, lm_head[:0], targets, 1.0)
    assert logp.shape == ent.shape == (4,) and logp.isnan().all() and ent.isnan().all()
    logp, ent = logprobs.token_logprobs(hidden[:0], lm_head, targets[:0], 1.0)
    assert logp.shape == ent.shape == (0,)
