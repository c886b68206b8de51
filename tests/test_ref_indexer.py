"""lightning_indexer and indexer_logits on the cpu reference against an independent
float64 formula: explicit loops over tokens, slots and heads, and a Python sort with an
explicit (score descending, slot ascending) key for the expected top-k."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

FP8 = torch.float8_e4m3fn
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ranges(pairs):
    k_start = torch.tensor([a for a, _ in pairs], dtype=torch.int32)
    k_end = torch.tensor([b for _, b in pairs], dtype=torch.int32)
    return k_start, k_end


def _random_inputs(seed, t, hi, n, di, dtype):
    g = _gen(seed)
    q = torch.randn(t, hi, di, generator=g).to(dtype)
    k = torch.randn(n, di, generator=g).to(dtype)
    weights = torch.randn(t, hi, generator=g)  # negative weights are legal
    return q, k, weights


def loop_scores(q, k, weights, k_start, k_end):
    """Float64 ``[T, N]`` score table (``-inf`` outside each range), loop by loop."""
    qn, kn, wn = (x.detach().double().numpy() for x in (q, k, weights))
    t, hi, _ = qn.shape
    out = np.full((t, kn.shape[0]), -math.inf)
    for ti in range(t):
        for s in range(int(k_start[ti]), int(k_end[ti])):
            total = 0.0
            for h in range(hi):
                total += wn[ti, h] * max(float(np.dot(qn[ti, h], kn[s])), 0.0)
            out[ti, s] = total
    return torch.from_numpy(out)


def expected_topk(scores, k_start, k_end, topk):
    """Best ``topk`` slots per row by (score desc, slot asc), ``-1`` padded."""
    rows = []
    for ti in range(scores.shape[0]):
        slots = range(int(k_start[ti]), int(k_end[ti]))
        best = sorted(slots, key=lambda s, ti=ti: (-float(scores[ti, s]), s))[:topk]
        rows.append(best + [-1] * (topk - len(best)))
    return torch.tensor(rows, dtype=torch.int64)


def _integer_inputs(seed, t, hi, n, di, dtype):
    """Small integer q / k and power-of-two weights: every score is exact in any dtype,
    so equal scores are exactly equal."""
    g = _gen(seed)
    q = torch.randint(-2, 3, (t, hi, di), generator=g).to(dtype)
    k = torch.randint(-2, 3, (n, di), generator=g).to(dtype)
    weights = 2.0 ** torch.randint(-1, 2, (t, hi), generator=g).float()
    return q, k, weights


def _fp8_inputs(seed, t, hi, n, di):
    g = _gen(seed)
    q = (torch.randn(t, hi, di, generator=g) * 20).to(FP8)
    k = (torch.randn(n, di, generator=g) * 20).to(FP8)
    weights = torch.rand(t, hi, generator=g) + 0.1
    q_scale = torch.rand(t, hi, generator=g) * 0.1 + 0.01
    k_scale = torch.rand(n, generator=g) * 0.1 + 0.01
    return q, k, weights, q_scale, k_scale


# -- indexer_logits -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_indexer_logits_match_loop_reference_inside_range_and_minus_inf_outside(dtype):
    q, k, w = _random_inputs(1, t=5, hi=3, n=9, di=16, dtype=dtype)
    k_start, k_end = _ranges([(0, 9), (2, 5), (4, 4), (0, 1), (8, 9)])
    logits = glmport.ops.indexer_logits(q, k, w, k_start, k_end)
    assert logits.dtype == torch.float32 and logits.shape == (5, 9)
    ref = loop_scores(q, k, w, k_start, k_end)
    outside = torch.isinf(ref)
    assert torch.equal(torch.isneginf(logits), outside)
    assert torch.isfinite(logits[~outside]).all()
    torch.testing.assert_close(logits.double()[~outside], ref[~outside], rtol=1e-5, atol=1e-5)


def test_indexer_logits_float64_reference_mode_is_tight():
    q, k, w = _random_inputs(2, t=4, hi=4, n=7, di=8, dtype=torch.float32)
    k_start, k_end = _ranges([(0, 7), (1, 6), (3, 3), (6, 7)])
    with float64_reference():
        logits = glmport.ops.indexer_logits(q, k, w, k_start, k_end)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, loop_scores(q, k, w, k_start, k_end), rtol=1e-10, atol=0)


def test_indexer_logits_fp8_apply_q_and_k_scales_to_the_dot_product():
    q, k, w, q_scale, k_scale = _fp8_inputs(3, t=4, hi=3, n=8, di=16)
    k_start, k_end = _ranges([(0, 8), (2, 6), (5, 5), (7, 8)])
    logits = glmport.ops.indexer_logits(q, k, w, k_start, k_end, q_scale, k_scale)
    assert logits.dtype == torch.float32
    # Independent formula on the dequantised values.
    q_deq = q.double() * q_scale.double()[:, :, None]
    k_deq = k.double() * k_scale.double()[:, None]
    ref = loop_scores(q_deq, k_deq, w, k_start, k_end)
    assert torch.equal(torch.isneginf(logits), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(logits.double()[fin], ref[fin], rtol=1e-5, atol=1e-6)


def _logits_loss_grads(fn, q, k, w, k_start, k_end, r):
    q, k, w = (x.detach().clone().requires_grad_(True) for x in (q, k, w))
    logits = fn(q, k, w, k_start, k_end)
    # Finite loss: mask the -inf entries before weighting and summing.
    fin = torch.isfinite(logits)
    loss = (torch.where(fin, logits, torch.zeros_like(logits)).double() * r).sum()
    return torch.autograd.grad(loss, (q, k, w))


def torch_scores(q, k, w, k_start, k_end):
    """Differentiable float64 scores, one query row and one range at a time."""
    rows = []
    for ti in range(q.shape[0]):
        a, b = int(k_start[ti]), int(k_end[ti])
        dots = q[ti] @ k[a:b].T  # [Hi, S]
        inside = (w[ti][:, None] * torch.relu(dots)).sum(0)
        row = torch.cat(
            [q.new_full((a,), -math.inf), inside, q.new_full((k.shape[0] - b,), -math.inf)]
        )
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("seed", [4, 5])
def test_indexer_logits_grads_wrt_q_k_weights_match_reference(seed):
    q, k, w = _random_inputs(seed, t=4, hi=3, n=7, di=8, dtype=torch.float32)
    k_start, k_end = _ranges([(0, 7), (1, 5), (3, 3), (2, 7)])
    r = torch.randn(4, 7, generator=_gen(seed + 100), dtype=torch.float64)
    got = _logits_loss_grads(glmport.ops.indexer_logits, q, k, w, k_start, k_end, r)
    want = _logits_loss_grads(torch_scores, q.double(), k.double(), w.double(), k_start, k_end, r)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    # The empty-range query (row 2) gets no gradient.
    assert torch.equal(got[0][2], torch.zeros_like(got[0][2]))


# -- lightning_indexer --------------------------------------------------------------


def _assert_valid_topk_output(indices, scores, k_start, k_end, topk):
    t = indices.shape[0]
    assert indices.dtype == torch.int32 and indices.shape == (t, topk)
    for ti in range(t):
        count = min(topk, int(k_end[ti]) - int(k_start[ti]))
        row = indices[ti].tolist()
        assert row[count:] == [-1] * (topk - count)
        assert torch.isneginf(scores[ti, count:]).all()
        assert all(int(k_start[ti]) <= s < int(k_end[ti]) for s in row[:count])
        assert len(set(row[:count])) == count
        assert torch.isfinite(scores[ti, :count]).all()
        best = scores[ti, :count]
        assert (best[:-1] >= best[1:]).all()  # best first


@pytest.mark.parametrize("dtype", FLOATS)
def test_indexer_selects_exact_top_k_best_first_with_matching_scores(dtype):
    q, k, w = _random_inputs(6, t=6, hi=4, n=12, di=16, dtype=dtype)
    pairs = [(0, 12), (3, 11), (0, 4), (5, 5), (2, 9), (11, 12)]  # ragged, some short
    k_start, k_end = _ranges(pairs)
    topk = 5
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, topk)
    assert scores.dtype == torch.float32
    _assert_valid_topk_output(indices, scores, k_start, k_end, topk)
    ref = loop_scores(q, k, w, k_start, k_end)
    # Well-posed data: no two candidates for the top-k within 1e-4 of each other.
    for ti, (a, b) in enumerate(pairs):
        ordered = sorted(ref[ti, a:b].tolist(), reverse=True)[: topk + 1]
        assert all(x - y > 1e-4 for x, y in itertools.pairwise(ordered))
    want = expected_topk(ref, k_start, k_end, topk)
    assert torch.equal(indices.long(), want)
    valid = want >= 0
    got_at = ref.gather(1, want.clamp_min(0))
    torch.testing.assert_close(scores.double()[valid], got_at[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("topk", [1, 3, 7])
def test_indexer_float64_reference_mode_matches_loop_reference(topk):
    q, k, w = _random_inputs(7, t=5, hi=2, n=10, di=8, dtype=torch.float32)
    k_start, k_end = _ranges([(0, 10), (4, 9), (0, 2), (7, 7), (1, 10)])
    with float64_reference():
        indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, topk)
    assert indices.dtype == torch.int32 and scores.dtype == torch.float64
    ref = loop_scores(q, k, w, k_start, k_end)
    want = expected_topk(ref, k_start, k_end, topk)
    assert torch.equal(indices.long(), want)
    expected_scores = torch.where(want >= 0, ref.gather(1, want.clamp_min(0)), -math.inf)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-10, atol=0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_indexer_pads_with_minus_one_when_range_short(dtype):
    q, k, w = _random_inputs(8, t=4, hi=2, n=10, di=8, dtype=dtype)
    # Range lengths 2, 3, 4 (== topk: no padding) and 10.
    k_start, k_end = _ranges([(3, 5), (7, 10), (1, 5), (0, 10)])
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, 4)
    assert indices[0, 2:].tolist() == [-1, -1] and torch.isneginf(scores[0, 2:]).all()
    assert indices[1, 3:].tolist() == [-1] and torch.isneginf(scores[1, 3:]).all()
    assert (indices[2:] >= 0).all() and torch.isfinite(scores[2:]).all()
    assert sorted(indices[0, :2].tolist()) == [3, 4]
    assert sorted(indices[1, :3].tolist()) == [7, 8, 9]
    assert sorted(indices[2].tolist()) == [1, 2, 3, 4]
    _assert_valid_topk_output(indices, scores, k_start, k_end, 4)


def test_indexer_pads_tail_when_topk_exceeds_n():
    q, k, w = _random_inputs(9, t=3, hi=2, n=4, di=8, dtype=torch.float32)
    k_start, k_end = _ranges([(0, 4), (1, 3), (2, 2)])
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, 7)
    assert indices.shape == (3, 7) and scores.shape == (3, 7)
    _assert_valid_topk_output(indices, scores, k_start, k_end, 7)
    ref = loop_scores(q, k, w, k_start, k_end)
    assert torch.equal(indices.long(), expected_topk(ref, k_start, k_end, 7))


@pytest.mark.parametrize("dtype", [*FLOATS, FP8])
def test_indexer_empty_range_gives_all_minus_one(dtype):
    if dtype == FP8:
        q, k, w, qs, ks = _fp8_inputs(10, t=3, hi=2, n=5, di=8)
    else:
        q, k, w = _random_inputs(10, t=3, hi=2, n=5, di=8, dtype=dtype)
        qs = ks = None
    k_start, k_end = _ranges([(0, 0), (3, 3), (5, 5)])
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, 3, qs, ks)
    assert torch.equal(indices, torch.full((3, 3), -1, dtype=torch.int32))
    assert torch.isneginf(scores).all()
    logits = glmport.ops.indexer_logits(q, k, w, k_start, k_end, qs, ks)
    assert torch.isneginf(logits).all()


@pytest.mark.parametrize("dtype", [*FLOATS, FP8])
def test_indexer_breaks_ties_toward_lower_slot(dtype):
    q, k, w = _integer_inputs(11, t=4, hi=3, n=12, di=6, dtype=torch.float32)
    k[7] = k[2]  # exact duplicates: equal scores for every query
    k[9] = k[2]
    k[10] = k[4]
    k[5] = 0.0  # score 0 ...
    k[11] = 0.0  # ... twice
    q, k = q.to(dtype), k.to(dtype)
    qs = torch.ones(4, 3) if dtype == FP8 else None
    ks = torch.ones(12) if dtype == FP8 else None
    k_start, k_end = _ranges([(0, 12), (2, 12), (0, 12), (4, 11)])
    topk = 10
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, topk, qs, ks)
    ref = loop_scores(q, k, w, k_start, k_end)
    assert torch.equal(indices.long(), expected_topk(ref, k_start, k_end, topk))
    expected_scores = torch.where(indices >= 0, ref.gather(1, indices.long().clamp_min(0)), -1)
    torch.testing.assert_close(
        torch.where(indices >= 0, scores.double(), -1), expected_scores, rtol=0, atol=0
    )
    # The data really has ties inside the returned prefix, and they come lowest slot first.
    n_ties = 0
    for ti in range(4):
        row = [s for s in indices[ti].tolist() if s >= 0]
        for a, b in itertools.pairwise(row):
            if ref[ti, a] == ref[ti, b]:
                n_ties += 1
                assert a < b
    assert n_ties >= 4


def test_indexer_fp8_path_matches_dequantised_formula():
    q, k, w, q_scale, k_scale = _fp8_inputs(12, t=5, hi=4, n=10, di=16)
    pairs = [(0, 10), (2, 8), (0, 3), (6, 6), (1, 10)]
    k_start, k_end = _ranges(pairs)
    topk = 4
    indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, topk, q_scale, k_scale)
    _assert_valid_topk_output(indices, scores, k_start, k_end, topk)
    q_deq = q.double() * q_scale.double()[:, :, None]
    k_deq = k.double() * k_scale.double()[:, None]
    ref = loop_scores(q_deq, k_deq, w, k_start, k_end)
    for ti, (a, b) in enumerate(pairs):
        ordered = sorted(ref[ti, a:b].tolist(), reverse=True)[: topk + 1]
        assert all(x - y > 1e-4 for x, y in itertools.pairwise(ordered))
    want = expected_topk(ref, k_start, k_end, topk)
    assert torch.equal(indices.long(), want)
    valid = want >= 0
    torch.testing.assert_close(
        scores.double()[valid], ref.gather(1, want.clamp_min(0))[valid], rtol=1e-5, atol=1e-6
    )


def test_indexer_negative_scores_inside_range_are_still_selected():
    # All weights negative: every in-range score is <= 0, yet none is padding.
    g = _gen(13)
    q = torch.randn(2, 2, 8, generator=g)
    k = torch.randn(6, 8, generator=g)
    w = -torch.rand(2, 2, generator=g) - 0.5
    k_start, k_end = _ranges([(0, 6), (1, 4)])
    with float64_reference():
        indices, scores = glmport.ops.lightning_indexer(q, k, w, k_start, k_end, 3)
    ref = loop_scores(q, k, w, k_start, k_end)
    assert (indices >= 0).all()
    assert torch.equal(indices.long(), expected_topk(ref, k_start, k_end, 3))
    assert (scores <= 0).all() and torch.isfinite(scores).all()
