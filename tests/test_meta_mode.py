"""Out-of-range index values under ``GLMPORT_VALIDATE=meta``: the value checks are
skipped, so the values reach the kernels, and the cpu and generic backends, and the
exported ops (onnxruntime, tvm: each op exported alone), must give the results
docs/ops.md documents ("What a kernel may assume under GLMPORT_VALIDATE=meta") instead
of an IndexError, a runtime's error or an out-of-bounds read. Every expectation is a
float64 formula or loop written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.core.selection import clear_cache

ops = glmport.ops
BACKENDS = ["cpu", "generic", "onnxruntime", "tvm"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _meta_mode(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    clear_cache()
    yield
    clear_cache()


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- sparse_attention ------------------------------------------------------------------


def ref_attention(q, k, v, indices, scale):
    """float64 loops: softmax over the listed slots in ``[0, N)`` (a repeat counts twice);
    a row without one is 0 with lse -inf."""
    t_count, h_count, _ = q.shape
    n, hkv = k.shape[0], k.shape[1]
    out = np.zeros((t_count, h_count, v.shape[-1]))
    lse = np.full((t_count, h_count), -np.inf)
    qd, kd, vd = q.double().numpy(), k.double().numpy(), v.double().numpy()
    for t in range(t_count):
        slots = [s for s in indices[t].tolist() if 0 <= s < n]
        if not slots:
            continue
        for h in range(h_count):
            c = h // (h_count // hkv)
            s = np.array([scale * qd[t, h] @ kd[j, c] for j in slots])
            lse[t, h] = s.max() + math.log(np.exp(s - s.max()).sum())
            p = np.exp(s - lse[t, h])
            out[t, h] = sum(p[i] * vd[j, c] for i, j in enumerate(slots))
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_sparse_attention_ignores_slots_outside_0_n_like_minus_one(backend, idx_dtype):
    t, h, hkv, n, dk, dv = 4, 4, 2, 6, 8, 5
    q, k, v = randn(t, h, dk, seed=1), randn(n, hkv, dk, seed=2), randn(n, hkv, dv, seed=3)
    indices = torch.tensor(
        [
            [0, n, 3, -1],  # N: one past the end
            [n + 7, 2, -5, 2],  # far past the end, below -1, a repeat
            [n, n + 1, -2, -1],  # nothing valid: 0 and -inf
            [5, 4, 1, 0],  # all valid
        ],
        dtype=idx_dtype,
    )
    with glmport.use_backend(backend):
        out, lse = ops.sparse_attention(q, k, v, indices, 0.3)
    want_out, want_lse = ref_attention(q, k, v, indices, 0.3)
    np.testing.assert_allclose(out.double().numpy(), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(h, dv)) and bool((lse[2] == -math.inf).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_without_key_slots_gives_empty_rows(backend):
    q, k = randn(3, 2, 4, seed=4), torch.zeros(0, 1, 4)
    indices = torch.tensor([[-1, 0], [1, -1], [5, 9]], dtype=torch.int32)
    with glmport.use_backend(backend):
        out, lse = ops.sparse_attention(q, k, k, indices, 0.5)
    assert torch.equal(out, torch.zeros(3, 2, 4))
    assert torch.equal(lse, torch.full((3, 2), -math.inf))


# -- lightning_indexer / indexer_logits ------------------------------------------------

# (k_start, k_end) per query, N = 7: below 0, past N, start > end, start >= N, valid.
RANGES = [(-3, 4), (2, 12), (5, 1), (9, 11), (-8, -2), (0, 7), (3, 3), (1, 6)]


def ref_index_scores(q, k, weights, ranges):
    """float64 ``[T, N]`` scores over ``[start, end)`` cut to ``[0, N)``, -inf elsewhere."""
    qd, kd, wd = q.double().numpy(), k.double().numpy(), weights.double().numpy()
    n = kd.shape[0]
    out = np.full((qd.shape[0], n), -np.inf)
    for t, (a, b) in enumerate(ranges):
        for s in range(max(a, 0), min(b, n)):
            out[t, s] = sum(wd[t, h] * max(qd[t, h] @ kd[s], 0.0) for h in range(qd.shape[1]))
    return out


def _indexer_inputs():
    t, hi, di, n = len(RANGES), 3, 8, 7
    q, k, w = randn(t, hi, di, seed=5), randn(n, di, seed=6), randn(t, hi, seed=7).abs()
    start = torch.tensor([a for a, _ in RANGES], dtype=torch.int32)
    end = torch.tensor([b for _, b in RANGES], dtype=torch.int32)
    return q, k, w, start, end


@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_logits_clamp_key_ranges_to_0_n(backend):
    q, k, w, start, end = _indexer_inputs()
    with glmport.use_backend(backend):
        logits = ops.indexer_logits(q, k, w, start, end)
    want = ref_index_scores(q, k, w, RANGES)
    assert np.array_equal(np.isinf(logits.numpy()), np.isinf(want))
    np.testing.assert_allclose(logits.double().numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", [3, 10])
def test_lightning_indexer_clamps_key_ranges_to_0_n(backend, topk):
    q, k, w, start, end = _indexer_inputs()
    with glmport.use_backend(backend):
        indices, scores = ops.lightning_indexer(q, k, w, start, end, topk)
    full = ref_index_scores(q, k, w, RANGES)
    for t in range(len(RANGES)):
        valid = [s for s in range(full.shape[1]) if np.isfinite(full[t, s])]
        best = sorted(valid, key=lambda s: (-full[t, s], s))[:topk]
        want = best + [-1] * (topk - len(best))
        assert indices[t].tolist() == want, t
        want_scores = [full[t, s] for s in best] + [-np.inf] * (topk - len(best))
        np.testing.assert_allclose(scores[t].double().numpy(), want_scores, rtol=1e-5, atol=1e-6)


# -- token_logprobs --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tgt_dtype", [torch.int32, torch.int64])
def test_token_logprobs_target_outside_vocabulary_is_nan(backend, tgt_dtype):
    t, d, v = 5, 6, 9
    hidden, head = randn(t, d, seed=8), randn(v, d, seed=9)
    targets = torch.tensor([3, v, -1, v + 100, 0], dtype=tgt_dtype)
    with glmport.use_backend(backend):
        logp, entropy = ops.token_logprobs(hidden, head, targets, 0.7)
    z = hidden.double().numpy() @ head.double().numpy().T / 0.7
    lsm = z - z.max(1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(1, keepdims=True))
    want = [lsm[i, s] if 0 <= s < v else np.nan for i, s in enumerate(targets.tolist())]
    np.testing.assert_allclose(logp.double().numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        entropy.double().numpy(), -(np.exp(lsm) * lsm).sum(1), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_without_vocabulary_is_nan(backend):
    hidden, head = randn(3, 4, seed=10), torch.zeros(0, 4)
    with glmport.use_backend(backend):
        logp, entropy = ops.token_logprobs(hidden, head, torch.tensor([0, 1, -1]))
    assert logp.shape == entropy.shape == (3,)
    assert bool(logp.isnan().all()) and bool(entropy.isnan().all())


# -- moe_dispatch / moe_combine / grouped_gemm -----------------------------------------


def ref_dispatch(ids, num_experts):
    """Copies by expert in ``t * k + j`` order, then every copy with an id outside
    ``[0, E)`` in the same order; offsets count only the valid copies."""
    k = ids.shape[1]
    flat = ids.reshape(-1).tolist()
    src, offsets = [], [0]
    for e in range(num_experts):
        src += [r for r, i in enumerate(flat) if i == e]
        offsets.append(len(src))
    src += [r for r, i in enumerate(flat) if not 0 <= i < num_experts]
    return src, offsets, [r // k for r in src]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_dispatch_sends_ids_outside_0_e_to_no_expert(backend, ids_dtype):
    e = 4
    ids = torch.tensor([[1, e], [-1, 0], [3, 1], [e + 9, -6], [2, 1]], dtype=ids_dtype)
    x = randn(5, 3, seed=11)
    with glmport.use_backend(backend):
        xs, offsets, src = ops.moe_dispatch(x, ids, e)
    want_src, want_off, rows = ref_dispatch(ids, e)
    assert src.tolist() == want_src and offsets.tolist() == want_off
    assert offsets[-1] == 6  # four of the ten copies go nowhere
    assert torch.equal(xs, x[torch.tensor(rows)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
def test_moe_combine_skips_src_rows_outside_0_tk(backend, src_dtype):
    t, k, d = 3, 2, 4
    y, w = randn(t * k, d, seed=12), randn(t, k, seed=13)
    src = torch.tensor([4, t * k, 0, -1, 0, t * k + 50], dtype=src_dtype)  # 0 twice
    with glmport.use_backend(backend):
        out = ops.moe_combine(y, src, w)
    want = np.zeros((t, d))
    wd, yd = w.double().numpy(), y.double().numpy()
    for r, flat in enumerate(src.tolist()):
        if 0 <= flat < t * k:
            want[flat // k] += wd[flat // k, flat % k] * yd[r]
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-6, atol=1e-6)


def ref_grouped(x, w, offsets):
    """float64: offsets clamped to ``[0, M]`` and made non-decreasing by a running
    maximum; expert ``e`` owns ``[o[e], o[e + 1])``, every other row is 0."""
    m = x.shape[0]
    o, high = [], 0
    for v in offsets:
        high = max(high, min(max(v, 0), m))
        o.append(high)
    out = np.zeros((m, w.shape[1]))
    xd, wd = x.double().numpy(), w.double().numpy()
    for e in range(w.shape[0]):
        for r in range(o[e], o[e + 1]):
            out[r] = wd[e] @ xd[r]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "offsets",
    [
        [0, 3, 5],  # ends before M: rows 5.. belong to no expert
        [2, 5, 8],  # starts after 0
        [-3, 4, 20],  # outside [0, M]
        [0, 6, 2, 8],  # decreasing: expert 1 owns nothing, expert 2 rows 6..7
        [9, 9, 9],  # every offset past M
    ],
)
def test_grouped_gemm_offsets_become_a_partition_of_the_rows(backend, offsets):
    m, kd, n = 8, 5, 3
    x, w = randn(m, kd, seed=14), randn(len(offsets) - 1, n, kd, seed=15)
    with glmport.use_backend(backend):
        y = ops.grouped_gemm(x, w, torch.tensor(offsets, dtype=torch.int32))
    np.testing.assert_allclose(y.double().numpy(), ref_grouped(x, w, offsets), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_without_experts_gives_zero_rows(backend):
    x, w = randn(4, 5, seed=21), torch.zeros(0, 3, 5)
    with glmport.use_backend(backend):
        y = ops.grouped_gemm(x, w, torch.tensor([2], dtype=torch.int32))
    assert torch.equal(y, torch.zeros(4, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantised_grouped_gemm_leaves_rows_of_no_expert_zero(backend):
    m, kd, n = 8, 64, 4
    x = randn(m, kd, seed=16)
    wq, ws = ops.quantize_weight(randn(2, n, kd, seed=17), "w8a8")
    with glmport.use_backend(backend):
        y = ops.grouped_gemm(x, wq, torch.tensor([0, 2, 5]), ws, "w8a8")
        head = ops.grouped_gemm(x[:5], wq, torch.tensor([0, 2, 5]), ws, "w8a8")
    assert torch.equal(y[:5], head)  # per-row quantisation: the owned rows are unchanged
    assert torch.equal(y[5:], torch.zeros(3, n))


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_drops_only_the_copies_with_bad_ids(backend):
    """dispatch -> grouped_gemm -> combine with invalid ids: a token's output is the
    weighted sum over its valid experts alone."""
    t, e, d, n = 4, 3, 5, 6
    x, w_exp = randn(t, d, seed=18), randn(e, n, d, seed=19)
    ids = torch.tensor([[0, 2], [e, 1], [-1, 7], [2, 0]])
    weights = randn(t, 2, seed=20)
    with glmport.use_backend(backend):
        xs, offsets, src = ops.moe_dispatch(x, ids, e)
        ys = ops.grouped_gemm(xs, w_exp, offsets)
        out = ops.moe_combine(ys, src, weights)
    want = np.zeros((t, n))
    xd, wd = x.double().numpy(), w_exp.double().numpy()
    for i in range(t):
        for j, ex in enumerate(ids[i].tolist()):
            if 0 <= ex < e:
                want[i] += float(weights[i, j]) * (wd[ex] @ xd[i])
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)
    assert not out[2].any()
