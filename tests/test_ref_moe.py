"""The cpu reference of the MoE ops (moe_gate, moe_dispatch, moe_combine, grouped_gemm)
against independent definitions written here: explicit per-token / per-row loops in
float64, permutation matrices, and float64 autograd of our own formulas for gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

ops = glmport.ops


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# -- moe_gate ------------------------------------------------------------------------


def ref_group_score(values, with_bias):
    """DeepSeek-V3's gate: a group's best choice score without a bias, the sum of its
    best two with one."""
    best = sorted(values, reverse=True)
    return sum(best[:2]) if with_bias else best[0]


def ref_gate(
    logits, bias, top_k, n_group, topk_group, rsf, norm, score_func, group_rule=ref_group_score
):
    """Per-token loops in float64: (weights [T, k], ids [T, k], chosen groups per token)."""
    lg = logits.double().numpy()
    t_count, e_count = lg.shape
    if score_func == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-lg))
    else:
        z = np.exp(lg - lg.max(axis=1, keepdims=True))
        s = z / z.sum(axis=1, keepdims=True)
    choice = s + (0.0 if bias is None else bias.double().numpy())
    per = e_count // n_group
    all_w, all_ids, all_groups = [], [], []
    for t in range(t_count):
        group_score = [
            group_rule(list(choice[t, gi * per : (gi + 1) * per]), bias is not None)
            for gi in range(n_group)
        ]
        kept = sorted(range(n_group), key=lambda gi: (-group_score[gi], gi))[:topk_group]
        cand = [e for e in range(e_count) if e // per in kept]
        ids = sorted(cand, key=lambda e: (-choice[t, e], e))[:top_k]
        w = s[t, ids]
        if norm:
            w = w / (w.sum() + 1e-20)
        all_w.append(w * rsf)
        all_ids.append(ids)
        all_groups.append(set(kept))
    return np.array(all_w), np.array(all_ids), all_groups


GATE_CASES = [
    # T, E, top_k, n_group, topk_group, score_func, norm, rsf, with_bias
    (6, 16, 4, 4, 2, "sigmoid", True, 2.5, True),
    (6, 16, 4, 1, 1, "sigmoid", True, 1.0, True),
    (5, 8, 2, 8, 3, "sigmoid", False, 1.0, True),  # one expert per group
    (5, 12, 3, 1, 1, "softmax", False, 1.0, False),
    (5, 16, 6, 4, 3, "softmax", True, 1.5, True),
    (4, 32, 8, 8, 4, "sigmoid", True, 2.5, True),
    (1, 8, 1, 2, 1, "sigmoid", False, 3.0, False),
    (6, 16, 4, 4, 2, "sigmoid", True, 2.5, False),
    (5, 16, 6, 4, 3, "softmax", True, 1.5, False),
    (4, 32, 8, 8, 4, "sigmoid", False, 1.0, False),
]


@pytest.mark.parametrize("f64", [False, True])
@pytest.mark.parametrize(("t", "e", "k", "ng", "tg", "fn", "norm", "rsf", "with_bias"), GATE_CASES)
def test_moe_gate_matches_per_token_reference(t, e, k, ng, tg, fn, norm, rsf, with_bias, f64):
    logits = randn(t, e, seed=t * e + k) * 2
    bias = randn(e, seed=e) * 0.3 if with_bias else None
    want_w, want_ids, kept = ref_gate(logits, bias, k, ng, tg, rsf, norm, fn)
    if f64:
        with float64_reference():
            w, ids = ops.moe_gate(logits, bias, k, ng, tg, rsf, norm, fn)
        assert w.dtype == torch.float64
    else:
        w, ids = ops.moe_gate(logits, bias, k, ng, tg, rsf, norm, fn)
        assert w.dtype == torch.float32
    assert ids.dtype == torch.int32 and ids.shape == w.shape == (t, k)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(w.double().numpy(), want_w, rtol=1e-12 if f64 else 2e-6)
    per = e // ng
    for row, groups in zip(ids.tolist(), kept, strict=True):
        assert {i // per for i in row} <= groups  # chosen only from kept groups
        assert len(set(row)) == k


def test_moe_gate_bias_changes_the_choice_but_weights_use_unbiased_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    w, ids = ops.moe_gate(logits, bias, 2, norm_topk_prob=False)
    assert ids.tolist() == [[2, 0]]  # 0.5 + 5 beats sigmoid(2): best choice first
    sig = [1 / (1 + math.exp(-v)) for v in (0.0, 2.0)]
    np.testing.assert_allclose(w[0].numpy(), sig, rtol=1e-6)  # not 5.5, not sorted
    _, ids_nb = ops.moe_gate(logits, None, 2, norm_topk_prob=False)
    assert ids_nb.tolist() == [[0, 1]]


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize(("norm", "rsf"), [(True, 1.0), (True, 2.5), (False, 1.0), (False, 2.5)])
def test_moe_gate_normalisation_and_routed_scaling(score_func, norm, rsf):
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.7, -0.1, 1.1]])
    l64 = logits.double()[0]
    s = torch.sigmoid(l64) if score_func == "sigmoid" else torch.softmax(l64, 0)
    w, ids = ops.moe_gate(logits, None, 3, 1, 1, rsf, norm, score_func)
    assert ids.tolist() == [[2, 5, 3]]
    want = s[[2, 5, 3]]
    if norm:
        want = want / want.sum()
        np.testing.assert_allclose(float(w.sum()), rsf, rtol=1e-6)
    np.testing.assert_allclose(w[0].double().numpy(), (want * rsf).numpy(), rtol=1e-6)


def test_moe_gate_group_score_is_sum_of_best_two_in_the_group():
    # choice scores (sigmoid(0) = 0.5 plus bias). Group 0's best two sum to 1.7; group 1
    # has the larger total (2.8) but its best two sum to 1.4, so group 0 is kept.
    choice = torch.tensor([0.9, 0.8, 0.0, 0.0, 0.7, 0.7, 0.7, 0.7])
    w, ids = ops.moe_gate(torch.zeros(1, 8), choice - 0.5, 2, 2, 1, 1.0, False)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w.numpy(), [[0.5, 0.5]])


def test_moe_gate_group_score_without_bias_is_the_group_maximum():
    # sigmoid scores: group 0 = [0.95, 0.05, 0.05, 0.05] (max 0.95, best two 1.0),
    # group 1 = [0.73] * 4 (max 0.73, best two 1.46). The maximum keeps group 0; then
    # experts 1..3 tie and the lower id (1) wins.
    logits = torch.tensor([[3.0, -3.0, -3.0, -3.0, 1.0, 1.0, 1.0, 1.0]])
    w, ids = ops.moe_gate(logits, None, 2, 2, 1, 1.0, False)
    assert ids.tolist() == [[0, 1]]
    want = [1 / (1 + math.exp(-3.0)), 1 / (1 + math.exp(3.0))]
    np.testing.assert_allclose(w[0].double().numpy(), want, rtol=1e-6)


def old_sum_of_best_two(values, with_bias):
    """The rule this op used before: best two even without a bias."""
    return sum(sorted(values, reverse=True)[:2])


@pytest.mark.parametrize("backend", ["cpu", "generic"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_gate_groups_match_float64_loop(backend, with_bias, score_func):
    t, e, k, ng, tg = 64, 32, 6, 8, 3
    logits = randn(t, e, seed=80) * 2
    bias = randn(e, seed=81) * 0.3 if with_bias else None
    with glmport.use_backend(backend):
        w, ids = ops.moe_gate(logits, bias, k, ng, tg, 2.5, True, score_func)
    want_w, want_ids, kept = ref_gate(logits, bias, k, ng, tg, 2.5, True, score_func)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(w.double().numpy(), want_w, rtol=2e-6)
    if not with_bias:  # the data tell the two group rules apart
        _, _, old_kept = ref_gate(
            logits, bias, k, ng, tg, 2.5, True, score_func, old_sum_of_best_two
        )
        assert kept != old_kept


@pytest.mark.parametrize("backend", ["cpu", "generic"])
@pytest.mark.parametrize(
    ("logits", "bias", "want"),
    [
        # no bias: every group's maximum is sigmoid(2); the lower group (0) wins even
        # though group 2's best two are larger; in it expert 1 beats expert 0.
        ([0.0, 2.0, -1.0, -1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], None, [1, 0]),
        # bias: best-two sums 0.75 + 0.75 and 1.0 + 0.5 tie exactly; group 0 wins.
        ([0.0] * 8, [0.25, 0.25, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0], [0, 1]),
        # bias: group 1 alone has the best sum (1.0 + 0.5 > 0.75 + 0.5).
        ([0.0] * 8, [0.25, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0], [4, 5]),
    ],
)
def test_moe_gate_group_ties_keep_the_lower_group(backend, logits, bias, want):
    lg = torch.tensor([logits])
    b = None if bias is None else torch.tensor(bias)
    ng = len(logits) // 4
    with glmport.use_backend(backend):
        _, ids = ops.moe_gate(lg, b, 2, ng, 1, 1.0, False)
    _, want_ids, _ = ref_gate(lg, b, 2, ng, 1, 1.0, False, "sigmoid")
    assert ids.tolist() == [want] == want_ids.tolist()


def test_moe_gate_drops_the_globally_best_expert_when_its_group_is_dropped():
    # groups of two: sums 0.96, 1.2, 1.0, 0.2 -> keep groups 1 and 2, so the single
    # best expert (0, 0.95) is never chosen; a max-per-group rule would keep group 0.
    choice = torch.tensor([0.95, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1])
    _, ids = ops.moe_gate(torch.zeros(1, 8), choice - 0.5, 3, 4, 2)
    assert ids.tolist() == [[2, 3, 4]]


@pytest.mark.parametrize(
    ("logits", "top_k", "n_group", "topk_group", "want"),
    [
        ([0.0] * 8, 3, 1, 1, [0, 1, 2]),
        ([1.0, 3.0, 3.0, 0.0, 3.0], 2, 1, 1, [1, 2]),
        ([1.0, 3.0, 3.0, 0.0, 3.0], 3, 1, 1, [1, 2, 4]),
        ([0.0] * 8, 4, 4, 2, [0, 1, 2, 3]),  # tied groups: the lower groups are kept
        ([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 2, 4, 1, [2, 3]),
    ],
)
def test_moe_gate_ties_go_to_the_lower_expert_and_group(logits, top_k, n_group, topk_group, want):
    _, ids = ops.moe_gate(torch.tensor([logits]), None, top_k, n_group, topk_group)
    assert ids.tolist() == [want]


@pytest.mark.parametrize(
    ("fn", "norm", "rsf", "ng", "tg"),
    [
        ("sigmoid", True, 2.5, 4, 2),
        ("sigmoid", False, 1.0, 1, 1),
        ("softmax", True, 1.0, 2, 1),
        ("softmax", False, 1.5, 1, 1),
    ],
)
def test_moe_gate_grad_wrt_logits_matches_autograd_of_own_formula(fn, norm, rsf, ng, tg):
    t, e, k = 5, 16, 4
    logits = (randn(t, e, seed=70) * 2).requires_grad_(True)
    bias = randn(e, seed=71) * 0.3
    gw = randn(t, k, seed=72)
    w, ids = ops.moe_gate(logits, bias, k, ng, tg, rsf, norm, fn)
    (w * gw).sum().backward()
    _, want_ids, _ = ref_gate(logits.detach(), bias, k, ng, tg, rsf, norm, fn)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    l64 = logits.detach().double().requires_grad_(True)
    s = torch.sigmoid(l64) if fn == "sigmoid" else torch.softmax(l64, dim=1)
    rows = torch.arange(t)[:, None]
    ww = s[rows, torch.as_tensor(want_ids)]
    if norm:
        ww = ww / (ww.sum(dim=1, keepdim=True) + 1e-20)
    (ww * rsf * gw.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), l64.grad, rtol=1e-5, atol=1e-6)


# -- moe_dispatch / moe_combine ------------------------------------------------------


def ref_dispatch(x, ids, num_experts):
    """Loop over experts, then tokens in ``t * k + j`` order."""
    t_count, k = ids.shape
    idl = ids.tolist()
    src, offsets = [], [0]
    for e in range(num_experts):
        for t in range(t_count):
            for j in range(k):
                if idl[t][j] == e:
                    src.append(t * k + j)
        offsets.append(len(src))
    xs = x.double().numpy()[[r // k for r in src]] if src else np.zeros((0, x.shape[1]))
    return xs, offsets, src


def ref_combine(y_sorted, src_row, weights):
    t_count, k = weights.shape
    y = y_sorted.double().numpy()
    w = weights.double().numpy()
    out = np.zeros((t_count, y.shape[1]))
    for r, flat in enumerate(src_row.tolist()):
        t, j = divmod(flat, k)
        out[t] += w[t, j] * y[r]
    return out


def permutation_matrix(src_row, weights):
    """``P[t, r] = weights[t, j]`` where ``src_row[r] = t * k + j`` (float64)."""
    t_count, k = weights.shape
    src = torch.as_tensor(src_row).long()
    p = torch.zeros(t_count, t_count * k, dtype=torch.float64)
    p[src // k, torch.arange(t_count * k)] = 1.0
    return p * weights.double().reshape(-1)[src][None, :]


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("t", "k", "num_experts", "used"),
    [
        (7, 2, 6, [1, 2, 4]),  # experts 0, 3, 5 get no rows
        (5, 3, 8, list(range(8))),
        (6, 1, 4, [0, 3]),
        (1, 4, 4, [0, 1, 2, 3]),
    ],
)
def test_moe_dispatch_groups_rows_by_expert_stably(t, k, num_experts, used, ids_dtype):
    g = torch.Generator().manual_seed(t * k)
    ids = torch.tensor(used)[torch.randint(0, len(used), (t, k), generator=g)].to(ids_dtype)
    x = randn(t, 6, seed=k)
    xs, offsets, src = ops.moe_dispatch(x, ids, num_experts)
    want_xs, want_off, want_src = ref_dispatch(x, ids, num_experts)
    assert offsets.dtype == src.dtype == torch.int32
    assert offsets.tolist() == want_off and len(want_off) == num_experts + 1
    assert src.tolist() == want_src
    np.testing.assert_array_equal(xs.double().numpy(), want_xs)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)
    assert torch.equal(offsets.diff().long(), counts)
    for r in range(t * k):  # x_sorted[r] == x[src_row[r] // k], owned by its expert
        assert torch.equal(xs[r], x[src[r] // k])
        flat = int(src[r])
        e = int(ids[flat // k, flat % k])
        assert offsets[e] <= r < offsets[e + 1]


def test_moe_dispatch_keeps_half_precision_rows_bitwise():
    x = randn(4, 8, seed=1, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 1]])
    xs, offsets, src = ops.moe_dispatch(x, ids, 2)
    assert xs.dtype == torch.bfloat16
    assert offsets.tolist() == [0, 4, 8]
    assert src.tolist() == [1, 2, 5, 6, 0, 3, 4, 7]
    assert torch.equal(xs, x[torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])])


def test_moe_dispatch_grad_wrt_x_sums_the_copies():
    t, k, d = 5, 3, 4
    ids = torch.tensor([[0, 2, 1], [2, 2, 0], [1, 0, 3], [3, 1, 2], [0, 1, 2]])
    x = randn(t, d, seed=2).requires_grad_(True)
    gy = randn(t * k, d, seed=3)
    xs, _, src = ops.moe_dispatch(x, ids, 4)
    xs.backward(gy)
    gather = (src.long()[:, None] // k == torch.arange(t)[None, :]).double()  # [T*k, T]
    torch.testing.assert_close(x.grad.double(), gather.T @ gy.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("t", "k", "d"), [(6, 2, 5), (4, 4, 3), (3, 1, 7)])
def test_moe_combine_is_weighted_sum_of_each_tokens_rows(t, k, d, src_dtype):
    g = torch.Generator().manual_seed(t + k)
    src = torch.randperm(t * k, generator=g).to(src_dtype)
    y = randn(t * k, d, seed=4)
    w = torch.rand(t, k, generator=g)
    out = ops.moe_combine(y, src, w)
    assert out.shape == (t, d) and out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), ref_combine(y, src, w), rtol=1e-6, atol=1e-6)
    with float64_reference():
        out64 = ops.moe_combine(y, src, w)
    np.testing.assert_allclose(out64.numpy(), ref_combine(y, src, w), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_combine_half_precision_accumulates_in_float32(dtype):
    t, k, d = 4, 8, 16
    src = torch.randperm(t * k, generator=torch.Generator().manual_seed(0))
    y = randn(t * k, d, seed=5, dtype=dtype)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(1))
    out = ops.moe_combine(y, src, w)
    assert out.dtype == dtype
    want = ref_combine(y, src, w)
    terms = ref_combine(y.abs(), src, w.abs())
    # one rounding to the output dtype (at most half its ulp) after a float32 sum
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    err = np.abs(out.double().numpy() - want)
    assert np.all(err <= half_ulp * np.abs(want) + 1e-6 * terms)


def test_dispatch_identity_combine_round_trip_returns_x():
    t, e, k, d = 9, 8, 3, 16
    logits = randn(t, e, seed=6)
    w, ids = ops.moe_gate(logits, None, k, norm_topk_prob=True)
    np.testing.assert_allclose(w.sum(1).numpy(), 1.0, rtol=1e-6)
    x = randn(t, d, seed=7)
    xs, _, src = ops.moe_dispatch(x, ids, e)
    out = ops.moe_combine(xs, src, w)
    torch.testing.assert_close(out, x, rtol=1e-6, atol=1e-6)


def test_moe_combine_grads_wrt_y_sorted_and_weights():
    t, k, d = 5, 3, 4
    src = torch.randperm(t * k, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    y = randn(t * k, d, seed=8).requires_grad_(True)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    gout = randn(t, d, seed=9)
    ops.moe_combine(y, src, w).backward(gout)
    y64 = y.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    (permutation_matrix(src, w64) @ y64).backward(gout.double())
    torch.testing.assert_close(y.grad.double(), y64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)


# -- grouped_gemm: float ---------------------------------------------------------------


def ref_grouped(x, w, offsets):
    xd, wd = x.double().numpy(), w.double().numpy()
    out = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        for r in range(int(offsets[e]), int(offsets[e + 1])):
            out[r] = wd[e] @ xd[r]
    return out


OFFSET_CASES = [
    [0, 3, 5, 9, 10],
    [0, 0, 4, 4, 9, 9],  # experts 0, 2, 4 empty
    [0, 6],
    [0, 0, 0, 0],  # no rows at all
]


@pytest.mark.parametrize("off_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets", OFFSET_CASES)
def test_grouped_gemm_float_is_a_matmul_per_expert(offsets, off_dtype):
    e, n, k = len(offsets) - 1, 6, 10
    m = offsets[-1]
    x = randn(m, k, seed=m)
    w = randn(e, n, k, seed=e)
    off = torch.tensor(offsets, dtype=off_dtype)
    y = ops.grouped_gemm(x, w, off)
    assert y.shape == (m, n) and y.dtype == torch.float32
    np.testing.assert_allclose(y.double().numpy(), ref_grouped(x, w, offsets), rtol=1e-5, atol=1e-5)
    with float64_reference():
        y64 = ops.grouped_gemm(x, w, off)
    np.testing.assert_allclose(y64.numpy(), ref_grouped(x, w, offsets), rtol=1e-12, atol=1e-12)


def test_grouped_gemm_bf16_returns_bf16():
    offsets = [0, 2, 2, 7]
    x = randn(7, 16, seed=1, dtype=torch.bfloat16)
    w = randn(3, 8, 16, seed=2, dtype=torch.bfloat16)
    y = ops.grouped_gemm(x, w, torch.tensor(offsets))
    assert y.dtype == torch.bfloat16
    want = torch.from_numpy(ref_grouped(x, w, offsets))
    torch.testing.assert_close(y.double(), want, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("offsets", [[0, 3, 5, 9, 10], [0, 0, 4, 4, 9, 9]])
def test_grouped_gemm_float_grads_match_autograd_of_per_expert_formula(offsets):
    e, n, k = len(offsets) - 1, 6, 10
    m = offsets[-1]
    x = randn(m, k, seed=11).requires_grad_(True)
    w = randn(e, n, k, seed=12).requires_grad_(True)
    dy = randn(m, n, seed=13)
    ops.grouped_gemm(x, w, torch.tensor(offsets, dtype=torch.int32)).backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    y64 = torch.cat([x64[offsets[i] : offsets[i + 1]] @ w64[i].T for i in range(e)])
    y64.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    for i in range(e):  # empty experts get zero gradient
        if offsets[i] == offsets[i + 1]:
            assert not w.grad[i].any()


# -- grouped_gemm: quantised -----------------------------------------------------------

E4M3_GRID = np.array(
    [
        (c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
        for c in range(127)
    ]
)
W_FMT = {
    "w8a8": "int8_row",
    "w4a8": "int4_group",
    "w4a16": "int4_group",
    "fp8_block": "fp8_block",
    "fp8_block_ue8m0": "fp8_block_pow2",
}
A_FMT = {
    "w8a8": "int8",
    "w4a8": "int8",
    "w4a16": None,
    "fp8_block": "fp8",
    "fp8_block_ue8m0": "fp8",
}


def round_e4m3(v):
    a = np.abs(v)
    hi = np.clip(np.searchsorted(E4M3_GRID, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - E4M3_GRID[lo], E4M3_GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * np.where(pick_hi, E4M3_GRID[hi], E4M3_GRID[lo])


def quant_rows(x, scheme):
    """Per-token activation quantisation: (values float64 [M, K], float32 scales [M, G])."""
    xf = x.detach().float().numpy()
    m, k = xf.shape
    if A_FMT[scheme] == "int8":
        s = np.maximum(np.abs(xf).max(axis=1, keepdims=True), np.float32(1e-12)) / np.float32(127)
        return np.clip(np.rint(xf / s), -127, 127).astype(np.float64), s
    vals, scales = np.zeros((m, k)), []
    for kb in range(-(-k // 128)):
        cols = slice(kb * 128, (kb + 1) * 128)
        s = np.maximum(np.abs(xf[:, cols]).max(axis=1), np.float32(1e-4)) / np.float32(448)
        if scheme.endswith("ue8m0"):
            up = [v if math.frexp(v)[0] == 0.5 else 2.0 ** math.frexp(v)[1] for v in s]
            s = np.array(up, np.float32)
        vals[:, cols] = round_e4m3(np.clip(xf[:, cols] / s[:, None], -448, 448))
        scales.append(s)
    return vals, np.stack(scales, axis=1)


def weight_values(wq, scheme):
    """One expert's stored weight values, decoded by hand."""
    if W_FMT[scheme] == "int4_group":
        b = wq.numpy().astype(np.int64)
        nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
        return np.where(nib >= 8, nib - 16, nib).astype(np.float64)
    if scheme.startswith("fp8"):
        c = wq.view(torch.uint8).numpy().astype(np.int64)
        return np.where(c & 0x80, -1.0, 1.0) * E4M3_GRID[c & 0x7F]
    return wq.numpy().astype(np.float64)


def ref_expert_gemm(x, wq, ws, scheme):
    """One expert's packed quant_gemm by the documented formula, float64."""
    k, n = x.shape[1], wq.shape[0]
    qw = weight_values(wq, scheme)
    sw = ws.numpy().astype(np.float64)
    if A_FMT[scheme] is None:
        g = k // sw.shape[1]
        wd = (qw.astype(np.float32) * np.repeat(sw, g, axis=1).astype(np.float32)).astype(float)
        return x.double().numpy() @ wd.T
    qx, sx = quant_rows(x, scheme)
    if A_FMT[scheme] == "int8":
        sw = sw.reshape(n, -1)
        g = k // sw.shape[1]
        y = np.zeros((x.shape[0], n))
        for j in range(sw.shape[1]):
            cols = slice(j * g, (j + 1) * g)
            y += sw[None, :, j] * (qx[:, cols].astype(np.int64) @ qw[:, cols].astype(np.int64).T)
        return y * sx.astype(np.float64)
    y = np.zeros((x.shape[0], n))
    for kb in range(sx.shape[1]):
        cols = slice(kb * 128, (kb + 1) * 128)
        sw_n = np.repeat(sw[:, kb], 128)[:n]
        y += sx[:, kb, None].astype(np.float64) * sw_n[None, :] * (qx[:, cols] @ qw[:, cols].T)
    return y


QUANT_GROUPED = [
    ("w8a8", 128, 64),
    ("w4a8", 32, 128),
    ("w4a16", 64, 128),
    ("fp8_block", 128, 200),
    ("fp8_block_ue8m0", 128, 256),
]


@pytest.mark.parametrize(("scheme", "g", "k"), QUANT_GROUPED)
def test_quantised_grouped_gemm_is_per_expert_quant_gemm_formula(scheme, g, k):
    offsets = [0, 3, 3, 8, 9]
    e, n, m = 4, 12, 9
    x = randn(m, k, seed=20) * 2
    w = randn(e, n, k, seed=21) * torch.logspace(-1, 1, e)[:, None, None]
    wq, ws = ops.quantize_weight(w, scheme, g)
    off = torch.tensor(offsets, dtype=torch.int32)
    with float64_reference():
        y64 = ops.grouped_gemm(x, wq, off, ws, scheme)
    y = ops.grouped_gemm(x, wq, off, ws, scheme)
    want = np.zeros((m, n))
    for i in range(e):
        rows = slice(offsets[i], offsets[i + 1])
        if offsets[i] < offsets[i + 1]:
            want[rows] = ref_expert_gemm(x[rows], wq[i], ws[i], scheme)
    assert y.dtype == torch.float32 and y64.dtype == torch.float64
    scale = np.abs(want).max()
    np.testing.assert_allclose(y64.numpy(), want, rtol=1e-12, atol=1e-12 * scale)
    np.testing.assert_allclose(y.double().numpy(), want, rtol=1e-5, atol=1e-5 * scale)


def fake_quant_weight(w, scheme, g):
    """Float64 of the fake-quantised (QAT) weight, per documented format, float32 products."""
    wf = w.detach().float().numpy()
    n, k = wf.shape
    out = np.zeros((n, k), np.float32)
    if scheme.startswith("fp8"):
        for i in range(-(-n // 128)):
            for j in range(-(-k // 128)):
                rs, cs = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
                s = np.maximum(np.abs(wf[rs, cs]).max(), np.float32(1e-4)) / np.float32(448)
                vals = round_e4m3(np.clip(wf[rs, cs] / s, -448, 448))
                out[rs, cs] = vals.astype(np.float32) * s
        return out.astype(np.float64)
    qmax, g = (127, k) if scheme == "w8a8" else (7, g)
    for j in range(k // g):
        cs = slice(j * g, (j + 1) * g)
        s = np.maximum(np.abs(wf[:, cs]).max(axis=1, keepdims=True), np.float32(1e-12))
        s = s / np.float32(qmax)
        out[:, cs] = np.clip(np.rint(wf[:, cs] / s), -qmax, qmax) * s
    return out.astype(np.float64)


def fake_quant_x(x, scheme):
    vals, s = quant_rows(x, scheme)
    if A_FMT[scheme] == "int8":
        return (vals.astype(np.float32) * s).astype(np.float64)
    rep = np.repeat(s, 128, axis=1)[:, : x.shape[1]]
    return (vals.astype(np.float32) * rep).astype(np.float64)


@pytest.mark.parametrize(
    ("scheme", "g", "k"), [("w8a8", 128, 64), ("w4a8", 32, 64), ("fp8_block", 128, 160)]
)
def test_qat_grouped_gemm_forward_and_straight_through_grads(scheme, g, k):
    offsets = [0, 4, 4, 7]
    e, n, m = 3, 5, 7
    x = (randn(m, k, seed=30) * 2).requires_grad_(True)
    w = (randn(e, n, k, seed=31) * 0.5).requires_grad_(True)
    dy = randn(m, n, seed=32)
    y = ops.grouped_gemm(x, w, torch.tensor(offsets), None, scheme, g)
    y.backward(dy)
    qx = torch.from_numpy(fake_quant_x(x, scheme))
    qw = torch.stack([torch.from_numpy(fake_quant_weight(w[i], scheme, g)) for i in range(e)])
    # straight through: y = Q(x) @ Q(w).T forward, Q taken as identity backward
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    xs = x64 + (qx - x64).detach()
    ws = w64 + (qw - w64).detach()
    y64 = torch.cat([xs[offsets[i] : offsets[i + 1]] @ ws[i].T for i in range(e)])
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    assert not w.grad[1].any()  # expert 1 has no rows


@pytest.mark.parametrize("scheme", ["w4a8", "fp8_block"])
def test_packed_grouped_gemm_grad_wrt_x_uses_each_rows_dequantised_expert(scheme):
    offsets = [0, 2, 6, 6, 9]
    e, n, m, k = 4, 8, 9, 128
    x = randn(m, k, seed=40).requires_grad_(True)
    wq, ws = ops.quantize_weight(randn(e, n, k, seed=41), scheme, 32)
    dy = randn(m, n, seed=42)
    ops.grouped_gemm(x, wq, torch.tensor(offsets), ws, scheme).backward(dy)
    want = np.zeros((m, k))
    for i in range(e):
        vals = weight_values(wq[i], scheme)
        s = ws[i].numpy()
        if scheme == "w4a8":
            full = np.repeat(s, k // s.shape[1], axis=1)
        else:
            full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:n, :k]
        wd = (vals.astype(np.float32) * full.astype(np.float32)).astype(np.float64)
        rows = slice(offsets[i], offsets[i + 1])
        want[rows] = dy[rows].double().numpy() @ wd
    np.testing.assert_allclose(x.grad.double().numpy(), want, rtol=1e-5, atol=1e-5)
