"""The cuda backend's MoE routing kernels (moe_gate, moe_dispatch, moe_combine), run
through Triton's interpreter, against the cpu reference: the gate's ids exactly and its
weights closely, dispatch bit for bit, combine within the dtype's tolerance, including
the meta-mode rules for out-of-range ids and src_row values."""

from __future__ import annotations

import pytest
import torch

from glmport.backends.cpu import float64_reference
from glmport.core.registry import REGISTRY
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def moe(cuda_module, one_thread):
    return cuda_module("moe")


def ref(op: str):
    return REGISTRY.kernels("cpu", False)[op]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- moe_gate ------------------------------------------------------------------------


def gate_args(t, e, top_k, n_group=1, topk_group=1, *, bias=True, seed=0, ties=False):
    g = gen(seed)
    logits = torch.randn(t, e, generator=g) * 2
    if ties:  # experts in identical pairs
        logits = logits[:, torch.arange(e) // 2]
    b = torch.randn(e, generator=g) * 0.1 if bias else None
    return logits, b, top_k, n_group, topk_group


def check_gate(moe, logits, bias, top_k, n_group, topk_group, scaling, norm, score_func):
    args = (logits, bias, top_k, n_group, topk_group, scaling, norm, score_func)
    w, ids = moe.moe_gate(*args)
    rw, rids = ref("moe_gate")(*args)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grouping", [(1, 1), (4, 2), (8, 3)])
def test_gate_matches_reference(moe, score_func, bias, grouping):
    n_group, topk_group = grouping
    logits, b, *_ = gate_args(9, 32, 6, bias=bias, seed=n_group)
    for norm in (True, False):
        check_gate(moe, logits, b, 6, n_group, topk_group, 2.5, norm, score_func)


def test_gate_glm5_shape(moe):
    logits, b, *_ = gate_args(16, 256, 8, seed=3)
    check_gate(moe, logits, b, 8, 8, 4, 2.5, True, "sigmoid")


def test_gate_single_expert_groups(moe):
    # A group of one expert scores that expert alone, also with a bias (no second best).
    logits, b, *_ = gate_args(5, 8, 3, seed=4)
    check_gate(moe, logits, b, 3, 8, 4, 1.0, True, "sigmoid")


@pytest.mark.parametrize("bias", [True, False])
def test_gate_ties(moe, bias):
    # Expert ties: the lower id first.
    logits, b, *_ = gate_args(8, 16, 5, bias=False, seed=5, ties=True)
    check_gate(moe, logits, b, 5, 1, 1, 1.0, True, "sigmoid")
    # Group ties: every group's best two equal, so the lower groups must be kept.
    e, n_group = 32, 4
    logits, b, *_ = gate_args(8, e, 6, bias=bias, seed=6)
    best = torch.arange(n_group)[:, None] * (e // n_group) + torch.arange(2)
    logits[:, best] = logits.amax(dim=1)[:, None, None] + torch.tensor([1.0, 0.5])
    if b is not None:
        b[best] = b.amax() + 0.05
    check_gate(moe, logits, b, 6, n_group, 2, 2.5, True, "sigmoid")


def test_gate_token_blocks_and_strides(moe, monkeypatch):
    # Several programs with a partial last block (the GPU tiling), transposed logits.
    monkeypatch.setattr(moe, "_GATE_INTERPRETER_TILE", 64)
    logits, b, *_ = gate_args(7, 32, 4, seed=7)
    check_gate(moe, logits.T.contiguous().T, b, 4, 4, 2, 1.5, True, "softmax")
    check_gate(moe, logits, b, 4, 4, 2, 1.5, False, "sigmoid")


def test_gate_nan_logits_give_distinct_ids_in_range(moe):
    logits, b, *_ = gate_args(4, 32, 6, seed=8)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    _, ids = moe.moe_gate(logits, b, 6, 4, 2, 1.0, True, "sigmoid")
    assert ((ids >= 0) & (ids < 32)).all()
    assert all(row.unique().numel() == 6 for row in ids)


def test_gate_empty(moe):
    w, ids = moe.moe_gate(torch.empty(0, 16), None, 4, 1, 1, 1.0, True, "sigmoid")
    assert w.shape == (0, 4) and ids.shape == (0, 4) and ids.dtype == torch.int32


# -- moe_dispatch --------------------------------------------------------------------


def route(t, k, e, seed, id_dtype=torch.int32):
    g = gen(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(id_dtype)


def check_dispatch(moe, x, ids, e):
    got = moe.moe_dispatch(x, ids, e)
    want = ref("moe_dispatch")(x, ids, e)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_exact(moe, dtype):
    x = torch.randn(40, 24, generator=gen(10)).to(dtype)
    check_dispatch(moe, x, route(40, 4, 16, seed=11), 16)
    # Many copies per expert (a stable order inside each), strided x and ids.
    wide = torch.randn(30, 48, generator=gen(12)).to(dtype)
    ids = torch.randint(0, 3, (30, 6), generator=gen(13)).T.contiguous().T
    check_dispatch(moe, wide[:, 5:29], ids, 3)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_dispatch_out_of_range_ids(moe, id_dtype):
    e = 8
    ids = route(12, 3, e, seed=14, id_dtype=id_dtype)
    ids[0, 1], ids[3, 0], ids[3, 2], ids[7, 1] = -1, e, -5, e + 100
    if id_dtype == torch.int64:
        ids[9, 0] = 1 << 40  # past int32
    x = torch.randn(12, 16, generator=gen(15))
    _, offsets, src_row = check_dispatch(moe, x, ids, e)
    assert int(offsets[-1]) == ids.numel() - (5 if id_dtype == torch.int64 else 4)
    assert torch.equal(src_row.sort().values, torch.arange(ids.numel(), dtype=torch.int32))


def test_dispatch_chunks(moe, monkeypatch):
    # The GPU's chunked counting: bucket starts carried across chunks (13 copies each).
    monkeypatch.setattr(moe, "_DISPATCH_CHUNK_INTERPRETED", 13)
    ids = torch.randint(-1, 6, (20, 3), generator=gen(16))
    check_dispatch(moe, torch.randn(20, 8, generator=gen(17)), ids, 5)


def test_dispatch_empty(moe):
    x_sorted, offsets, src_row = moe.moe_dispatch(
        torch.empty(0, 16), torch.empty(0, 4, dtype=torch.int32), 6
    )
    assert x_sorted.shape == (0, 16) and src_row.shape == (0,)
    assert torch.equal(offsets, torch.zeros(7, dtype=torch.int32))
    x = torch.randn(5, 0)
    check_dispatch(moe, x, route(5, 2, 4, seed=18), 4)


# -- moe_combine ---------------------------------------------------------------------


def check_combine(moe, y, src_row, weights):
    out = moe.moe_combine(y, src_row, weights)
    with float64_reference():
        want = ref("moe_combine")(y.double(), src_row, weights.double())
    assert out.dtype == y.dtype and out.shape == want.shape
    cmp = compare(out, want, tolerance("moe_combine", y.dtype))
    assert cmp.ok, cmp
    return out


def combine_args(t, k, d, dtype, seed):
    g = gen(seed)
    y = torch.randn(t * k, d, generator=g).to(dtype)
    return y, torch.randperm(t * k, generator=g).to(torch.int32), torch.rand(t, k, generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_permutation(moe, dtype):
    check_combine(moe, *combine_args(10, 4, 40, dtype, seed=20))


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_repeats_and_out_of_range(moe, dtype):
    y, src, w = combine_args(9, 3, 24, dtype, seed=21)
    src = src.long()
    src[0] = src[1]  # slot src[1] adds two rows, slot src[0] none
    src[2], src[3], src[4] = -1, 27, 1 << 40  # skipped
    src[5] = src[6] = src[7] = src[8]
    out = check_combine(moe, y, src, w)
    assert torch.equal(out, moe.moe_combine(y, src, w))  # deterministic with repeats


def test_combine_blocks_and_strides(moe):
    # More tokens and hidden columns than one interpreted program covers; strided
    # y_sorted (a column slice) and weights (a transposed copy).
    t, k, d = 260, 1, 140
    y, src, w = combine_args(t, k, d + 6, torch.float32, seed=22)
    check_combine(moe, y[:, 3 : 3 + d], src, w.T.contiguous().T)


def test_combine_empty(moe):
    no_rows = torch.empty(0, dtype=torch.int32)
    assert moe.moe_combine(torch.empty(0, 8), no_rows, torch.empty(0, 2)).shape == (0, 8)
    out = moe.moe_combine(torch.empty(0, 8), no_rows, torch.empty(3, 0))  # k = 0
    assert torch.equal(out, torch.zeros(3, 8))
