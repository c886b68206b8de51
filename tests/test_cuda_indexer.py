"""The cuda backend's indexer kernels (Triton, interpreted on the CPU) against the
float64 reference.

Most cases use small-integer ``q`` / ``k`` and power-of-two weights and scales: every
score is then exact in float32 (and the inputs exact in every dtype, fp8 included), so
indices and scores must equal the reference bit for bit, ties to the lower slot
included. Random data goes through the conformance judges with their tolerances.
"""

from __future__ import annotations

import pytest
import torch

from glmport.conformance.judges import JUDGES
from glmport.core.formats import FP8_DTYPE
from glmport.core.registry import REGISTRY

DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE)
IDS = ("fp32", "bf16", "fp16", "fp8")


@pytest.fixture(scope="module")
def ix(cuda_module):
    return cuda_module("indexer")


def _reference(op: str, *args):
    """The cpu kernel's outputs in float64, floats cast to float32 (exact here)."""
    with REGISTRY.get("cpu").float64():
        out = REGISTRY.kernels("cpu", False)[op](*args)
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.float() if o.is_floating_point() else o for o in outs)


def _inputs(t, hi, di, n, dtype, *, seed=0, integer=True, k_rows=None):
    """``(q, k, weights, q_scale, k_scale)``; ``k_rows`` picks ``k``'s rows from a
    smaller base (equal rows: equal scores). Integer data: entries in ``[-3, 3]``,
    weights and scales powers of two (some weights negative)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-3, 4, (t, hi, di), generator=g).float()
        k = torch.randint(-3, 4, (n, di), generator=g).float()
        w = torch.randint(-3, 2, (t, hi), generator=g).float().exp2()
        w = w * torch.where(torch.rand(t, hi, generator=g) < 0.2, -1.0, 1.0)
    else:
        q = torch.randn(t, hi, di, generator=g)
        k = torch.randn(n, di, generator=g)
        w = torch.randn(t, hi, generator=g) * (hi * di) ** -0.5
    if k_rows is not None:
        k = k[k_rows]
    if dtype != FP8_DTYPE:
        return q.to(dtype), k.to(dtype), w, None, None
    if integer:
        qs = torch.randint(-2, 2, (t, hi), generator=g).float().exp2()
        ks = torch.randint(-2, 2, (k.shape[0],), generator=g).float().exp2()
    else:
        qs = q.abs().amax(-1).clamp(min=1e-6) / 448
        ks = k.abs().amax(-1).clamp(min=1e-6) / 448
    return (q / qs[..., None]).to(dtype), (k / ks[:, None]).to(dtype), w, qs, ks


def _ranges(*pairs):
    start, end = zip(*pairs, strict=True)
    return torch.tensor(start, dtype=torch.int32), torch.tensor(end, dtype=torch.int32)


def _check_exact(ix, q, k, w, start, end, topk, qs, ks):
    """Both kernels equal to the reference bit for bit."""
    logits = ix.indexer_logits(q, k, w, start, end, qs, ks)
    (ref_logits,) = _reference("indexer_logits", q, k, w, start, end, qs, ks)
    assert logits.dtype == torch.float32 and torch.equal(logits, ref_logits)
    idx, scores = ix.lightning_indexer(q, k, w, start, end, topk, qs, ks)
    ref_idx, ref_scores = _reference("lightning_indexer", q, k, w, start, end, topk, qs, ks)
    assert idx.dtype == torch.int32 and scores.dtype == torch.float32
    assert torch.equal(idx, ref_idx), (idx, ref_idx)
    assert torch.equal(scores, ref_scores)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_ragged_ranges_exact(ix, dtype):
    """Causal, packed, empty and out-of-range ranges (clamped to [0, N], empty when
    start >= end); Hi and Di padded (4 -> 16, 24 -> 32); topk not a power of two."""
    q, k, w, qs, ks = _inputs(7, 4, 24, 40, dtype)
    start, end = _ranges((0, 18), (0, 19), (20, 33), (20, 40), (7, 7), (-5, 99), (30, 10))
    _check_exact(ix, q, k, w, start, end, 5, qs, ks)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fewer_keys_than_topk(ix, dtype):
    """N < topk: the tail is -1 / -inf; so is every slot of an empty range."""
    q, k, w, qs, ks = _inputs(3, 2, 16, 12, dtype, seed=1)
    start, end = _ranges((0, 12), (4, 9), (12, 12))
    _check_exact(ix, q, k, w, start, end, 16, qs, ks)


def test_ties_across_tiles(ix):
    """k repeats with period 700: equal scores in different top-k tiles (1024 keys under
    the interpreter) go to the lower slot; a range starting mid-tile."""
    n = 2100
    q, k, w, qs, ks = _inputs(2, 2, 16, n, torch.float32, seed=2, k_rows=torch.arange(n) % 700)
    start, end = _ranges((0, n), (650, n))
    _check_exact(ix, q, k, w, start, end, 9, qs, ks)


def test_topk_beyond_one_chunk(ix):
    """topk 1500: a 2048-key buffer assembled from several score chunks, a range whose
    last tile is partial, and a range shorter than topk."""
    q, k, w, qs, ks = _inputs(2, 2, 16, 2100, torch.float32, seed=3, k_rows=None)
    start, end = _ranges((0, 2100), (100, 1500))
    _check_exact(ix, q, k, w, start, end, 1500, qs, ks)


def test_tile_that_cannot_improve(ix):
    """Later tiles scoring below the current top-k (skipped merges) leave it intact;
    zero scores tie across tiles too."""
    n = 2100
    q, k, w, qs, ks = _inputs(1, 2, 16, n, torch.float32, seed=4)
    w = w.abs()
    k[1024:] = 0  # scores 0, below the positive best of the first tile
    start, end = _ranges((0, n))
    _check_exact(ix, q, k, w, start, end, 8, qs, ks)
    _check_exact(ix, q, k, w, start, end, 1100, qs, ks)  # here zeros fill the top-k


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_random_data_within_tolerance(ix, dtype):
    """Non-contiguous inputs, random scores: judged as the conformance suite does."""
    t, hi, di, n, topk = 5, 8, 48, 300, 37
    q, k, w, qs, ks = _inputs(t, hi, di, n, dtype, seed=5, integer=False)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strides (di, t * di, 1)
    k = torch.cat((k, k[:, :8]), 1)[:, :di]  # row stride di + 8
    w = w.t().contiguous().t()
    start, end = _ranges((0, 296), (0, 297), (0, 298), (150, 299), (150, 300))
    args = (q, k, w, start, end)
    ref = _reference("indexer_logits", *args, qs, ks)[0]
    out = ix.lightning_indexer(*args, topk, qs, ks)
    verdict = JUDGES["indexer"]("lightning_indexer", dtype, (*args, topk, qs, ks), out, ref)
    assert verdict.ok, verdict.reason
    again = ix.lightning_indexer(*args, topk, qs, ks)
    assert torch.equal(again[0], out[0])
    assert torch.equal(again[1].view(torch.int32), out[1].view(torch.int32))  # bitwise
    logits = ix.indexer_logits(*args, qs, ks)
    verdict = JUDGES["logits"]("indexer_logits", dtype, (*args, qs, ks), logits, ref)
    assert verdict.ok, verdict.reason


@pytest.mark.parametrize(("t", "n"), [(0, 10), (3, 0)])
def test_empty(ix, t, n):
    q, k, w, qs, ks = _inputs(t, 4, 16, n, torch.float32)
    start = torch.zeros(t, dtype=torch.int32)
    end = torch.full((t,), n, dtype=torch.int32)
    logits = ix.indexer_logits(q, k, w, start, end, qs, ks)
    assert logits.shape == (t, n)
    idx, scores = ix.lightning_indexer(q, k, w, start, end, 4, qs, ks)
    assert idx.shape == scores.shape == (t, 4)
    assert (idx == -1).all() and (scores == float("-inf")).all()


@pytest.mark.parametrize("split", [7, 300, 1024])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_split_decode_exact(ix, monkeypatch, dtype, split):
    """The decode path: each query's keys cut into splits of ``split`` keys, every split
    keeping its own best keys, the splits' lists merged. Ragged, empty and clamped
    ranges; equal scores in different splits (to the lower slot); topk beyond a split;
    N < topk."""
    monkeypatch.setattr(ix, "plan_key_split", lambda t, n, width, device: split)
    q, k, w, qs, ks = _inputs(7, 4, 24, 40, dtype)
    start, end = _ranges((0, 18), (0, 19), (20, 33), (20, 40), (7, 7), (-5, 99), (30, 10))
    _check_exact(ix, q, k, w, start, end, 5, qs, ks)
    n = 2100
    q, k, w, qs, ks = _inputs(2, 2, 16, n, dtype, seed=2, k_rows=torch.arange(n) % 700)
    start, end = _ranges((0, n), (650, n))
    _check_exact(ix, q, k, w, start, end, 9, qs, ks)
    _check_exact(ix, q, k, w, start, end, 1500, qs, ks)
    q, k, w, qs, ks = _inputs(3, 2, 16, 12, dtype, seed=1)
    start, end = _ranges((0, 12), (4, 9), (12, 12))
    _check_exact(ix, q, k, w, start, end, 16, qs, ks)


def test_split_decode_merges_in_levels_on_the_gpu_plan(ix, cuda_module, monkeypatch):
    """On a GPU the splits' lists merge ``_MERGE_FAN`` at a time over several levels
    (here 2 at a time: 24 splits, five levels); a batch-1 decode at 65536 keys runs
    at least one program per H200 SM (256 splits of 256 keys)."""
    runtime = cuda_module("runtime")
    with runtime.gpu_plan():
        assert 65536 // ix.plan_key_split(1, 65536, 2048, torch.device("cpu")) == 256
    monkeypatch.setattr(ix, "plan_key_split", lambda t, n, width, device: 90)
    monkeypatch.setattr(ix, "_MERGE_FAN", 2)
    n = 2100
    q, k, w, qs, ks = _inputs(2, 2, 16, n, torch.bfloat16, seed=6, k_rows=torch.arange(n) % 700)
    start, end = _ranges((0, n), (650, 2000))
    with runtime.gpu_plan():
        _check_exact(ix, q, k, w, start, end, 300, qs, ks)


def test_wide_topk_splits_in_query_chunks(ix, monkeypatch):
    """A top-k wider than the widest sort (here 64) always splits, also for many
    queries (prefill), and queries go in chunks when the splits' lists would exceed
    the byte budget (here 4 queries a chunk)."""
    monkeypatch.setattr(ix, "_MAX_SORT", 64)
    assert ix.plan_key_split(1000, 2100, 300, torch.device("cpu")) == 64
    assert ix.plan_key_split(1000, 2100, 64, torch.device("cpu")) == 2100  # fused
    monkeypatch.setattr(ix, "_PART_BYTES", 4 * 33 * 64 * 8)
    n = 2100
    q, k, w, qs, ks = _inputs(9, 2, 16, n, torch.float32, seed=7, k_rows=torch.arange(n) % 700)
    start, end = _ranges(*[(0, n), (650, 2000), (5, 5)] * 3)
    _check_exact(ix, q, k, w, start, end, 300, qs, ks)
