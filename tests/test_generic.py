"""The generic backend's own promises: tiled ops equal the reference whatever the tile
budget (ties across tile boundaries included), closed-form chunked backward passes
equal autograd of the reference, the fast paths equal the portable ones, and large
ops never allocate a full [T, N] or [T, V]."""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.backends.generic import attention as gattention
from glmport.backends.generic import indexer as gindexer
from glmport.backends.generic import logprobs as glogprobs
from glmport.backends.generic import moe as gmoe
from glmport.backends.generic import quant as gquant
from glmport.core.registry import REGISTRY


def _ref(op):
    return REGISTRY.kernels("cpu", False)[op]


@pytest.fixture
def tiny_tiles(monkeypatch):
    """A budget of ~4 KiB and small key / vocab tiles: every op runs in many tiles."""
    monkeypatch.setenv("GLMPORT_TILE_MB", "0.004")
    monkeypatch.setattr(gindexer, "KEY_TILE", 5)
    monkeypatch.setattr(glogprobs, "VOCAB_TILE", 7)


def _attention_args(gen, t=9, h=4, hkv=2, dk=16, dv=8, n=30, k=12, absorbed=False):
    q = torch.randn(t, h, dk, generator=gen)
    kv = torch.randn(n, hkv, dk, generator=gen)
    v = kv[..., :dv] if absorbed else torch.randn(n, hkv, dv, generator=gen)
    idx = torch.randint(-1, n, (t, k), generator=gen, dtype=torch.int32)
    idx[0] = -1
    return q, kv, v, idx, dk**-0.5


@pytest.mark.parametrize("absorbed", [False, True])
def test_chunked_sparse_attention_equals_reference_forward_and_backward(tiny_tiles, absorbed):
    gen = torch.Generator().manual_seed(0)
    q, k, v, idx, scale = _attention_args(gen, hkv=1 if absorbed else 2, absorbed=absorbed)
    with glmport.use_backend("generic"):
        qq = q.clone().requires_grad_()
        kk = k.clone().requires_grad_()
        vv = kk[..., : v.shape[-1]] if absorbed else v.clone().requires_grad_()
        out, lse = glmport.ops.sparse_attention(qq, kk, vv, idx, scale)
    ro, rl = _ref("sparse_attention")(q, k, v, idx, scale)
    torch.testing.assert_close(out, ro, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, rl)
    go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    gl[0] = 1.0  # a gradient arriving on the -inf lse of an empty row must add nothing
    leaves = [qq, kk] if absorbed else [qq, kk, vv]
    got = torch.autograd.grad(
        (out * go).sum() + (torch.where(lse.isfinite(), lse, 0) * gl).sum(), leaves
    )
    rq, rk = q.clone().requires_grad_(), k.clone().requires_grad_()
    rv = rk[..., : v.shape[-1]] if absorbed else v.clone().requires_grad_()
    ro, rl = _ref("sparse_attention")(rq, rk, rv, idx, scale)
    rleaves = [rq, rk] if absorbed else [rq, rk, rv]
    want = torch.autograd.grad(
        (ro * go).sum() + (torch.where(rl.isfinite(), rl, 0) * gl).sum(), rleaves
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert torch.all(got[0][0] == 0)


def test_indexer_running_topk_breaks_ties_across_tiles_toward_the_lower_slot(tiny_tiles):
    gen = torch.Generator().manual_seed(1)
    t, hi, di, n = 6, 3, 8, 23
    q = torch.randn(t, hi, di, generator=gen)
    base = torch.randn(4, di, generator=gen)
    k = base[torch.arange(n) % 4]  # every score appears ~6 times, spread over the tiles
    w = torch.rand(t, hi, generator=gen)
    ks = torch.tensor([0, 0, 3, 5, 7, 11], dtype=torch.int32)
    ke = torch.tensor([1, 23, 9, 23, 7, 20], dtype=torch.int32)
    with glmport.use_backend("generic"):
        idx, sc = glmport.ops.lightning_indexer(q, k, w, ks, ke, 10)
    ridx, rsc = _ref("lightning_indexer")(q, k, w, ks, ke, 10)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(sc, rsc)


def _force_strategy(monkeypatch, strategy: str) -> None:
    """Every chunk takes the dense window (when its slots span any) or the gather."""
    ratio = 1e9 if strategy == "window" else 0.0
    monkeypatch.setattr(gattention, "WINDOW_RATIO_SHARED", (ratio, ratio))
    monkeypatch.setattr(gattention, "WINDOW_RATIO_PER_HEAD", ratio)


def _window_args(gen, t, h, hkv, n, k, absorbed):
    """Causal-prefill-like indices: each query picks k of its earlier slots (fewer
    than k visible: -1 tail), one row lists a slot twice, one row is all -1."""
    dk, dv = 16, 8
    q = torch.randn(t, h, dk, generator=gen)
    kv = torch.randn(n, hkv, dk, generator=gen)
    v = kv[..., :dv] if absorbed else torch.randn(n, hkv, dv, generator=gen)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        seen = n - t + i + 1
        pick = torch.randperm(seen, generator=gen)[: min(k, seen)]
        idx[i, : pick.numel()] = pick.int()
    idx[1, 1] = idx[1, 0]  # a slot listed twice counts twice
    idx[2] = -1
    return q, kv, v, idx, dk**-0.5


@pytest.mark.parametrize("layout", ["absorbed", "gqa", "per_head"])
@pytest.mark.parametrize("strategy", ["window", "gather"])
def test_dense_window_and_gather_equal_the_reference(monkeypatch, layout, strategy):
    """Both chunk strategies, forward and backward, against the float64 reference:
    -1 entries, a duplicate slot, an empty row; absorbed MLA (v a prefix view of k),
    grouped heads, and a kv head per query head."""
    _force_strategy(monkeypatch, strategy)
    monkeypatch.setenv("GLMPORT_TILE_MB", "0.01")  # several query chunks
    gen = torch.Generator().manual_seed(11)
    h, hkv = {"absorbed": (8, 1), "gqa": (4, 2), "per_head": (3, 3)}[layout]
    absorbed = layout == "absorbed"
    q, k, v, idx, scale = _window_args(gen, 12, h, hkv, 20, 6, absorbed)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    vv = kk[..., : v.shape[-1]] if absorbed else v.clone().requires_grad_()
    with glmport.use_backend("generic"):
        out, lse = glmport.ops.sparse_attention(qq, kk, vv, idx, scale)
    rq, rk = q.double().requires_grad_(), k.double().requires_grad_()
    rv = rk[..., : v.shape[-1]] if absorbed else v.double().requires_grad_()
    ro, rl = _ref("sparse_attention")(rq, rk, rv, idx, scale)
    torch.testing.assert_close(out.double(), ro, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), rl.double(), rtol=1e-5, atol=1e-6)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    leaves = [qq, kk] if absorbed else [qq, kk, vv]
    got = torch.autograd.grad(
        (out * go).sum() + (torch.where(lse.isfinite(), lse, 0) * gl).sum(), leaves
    )
    rleaves = [rq, rk] if absorbed else [rq, rk, rv]
    want = torch.autograd.grad(
        (ro * go.double()).sum() + (torch.where(rl.isfinite(), rl, 0) * gl.double()).sum(),
        rleaves,
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)


def test_a_slot_listed_twice_counts_twice_in_the_dense_window(monkeypatch):
    """Listing slot 0 twice beside slot 1 weighs it 2:1, as gathering it twice does."""
    _force_strategy(monkeypatch, "window")
    q = torch.zeros(1, 1, 4)  # equal scores: the weights are the multiplicities
    k = torch.randn(2, 1, 4)
    v = torch.tensor([[[3.0]], [[0.0]]])
    idx = torch.tensor([[0, 0, 1]], dtype=torch.int32)
    with glmport.use_backend("generic"):
        out, lse = glmport.ops.sparse_attention(q, k, v, idx, 1.0)
    torch.testing.assert_close(out, torch.tensor([[[2.0]]]))
    torch.testing.assert_close(lse, torch.log(torch.tensor([[3.0]])))


def test_window_choice_follows_the_span_of_the_selected_slots():
    """Decode with every key selected takes the window; a span far wider than K, the
    gather (no GEMM over unselected keys)."""
    q, k = torch.randn(1, 64, 8), torch.randn(100, 1, 8)
    every = torch.arange(100, dtype=torch.int32)[None]
    assert gattention._Chunk(q, k, k, every, 0.1, 0, 1).window == (0, 100)
    spread = torch.tensor([[0, 50, 99]], dtype=torch.int32)
    assert gattention._Chunk(q, k, k, spread, 0.1, 0, 1).window is None


def test_fast_selection_equals_the_exact_one_on_ties():
    """Many equal scores, at the k-th value and inside the chosen set, with -inf
    entries: the topk-first selection returns the exact selection's slots and order."""
    gen = torch.Generator().manual_seed(12)
    for width, k in ((50, 10), (50, 50), (7, 10), (300, 64)):
        v = torch.randint(0, 4, (9, width), generator=gen).float()
        v[0] = 1.0  # one value everywhere
        v[1, ::2] = float("-inf")
        v[2] = torch.arange(width).float()  # no tie: the fast path alone
        slots = torch.arange(width).expand(9, -1)
        fast = gindexer._select(v, slots, k)
        exact = gindexer._select_exact(v, slots, k)
        finite = torch.isfinite(exact[0])
        assert torch.equal(fast[0], exact[0])
        assert torch.equal(fast[1][finite], exact[1][finite])


def test_causal_indexer_equals_the_unrestricted_scoring(monkeypatch):
    """Query chunks score only the keys they can see: the indices equal those of the
    reference, which scores every key, for causal ranges with ties and tiny tiles."""
    monkeypatch.setenv("GLMPORT_TILE_MB", "0.002")
    monkeypatch.setattr(gindexer, "KEY_TILE", 16)
    gen = torch.Generator().manual_seed(13)
    t, n = 40, 60
    q = torch.randint(-2, 3, (t, 2, 4), generator=gen).float()  # integer scores: ties
    k = torch.randint(-2, 3, (n, 4), generator=gen).float()
    w = torch.rand(t, 2, generator=gen)
    ks = torch.clamp(torch.arange(n - t, n, dtype=torch.int32) - 30, min=0)  # a sliding window
    ke = torch.arange(n - t + 1, n + 1, dtype=torch.int32)
    for start in (torch.zeros(t, dtype=torch.int32), ks):
        with glmport.use_backend("generic"):
            idx, sc = glmport.ops.lightning_indexer(q, k, w, start, ke, 12)
        ridx, rsc = _ref("lightning_indexer")(q, k, w, start, ke, 12)
        assert torch.equal(idx, ridx)
        torch.testing.assert_close(sc, rsc)


def test_indexer_logits_in_query_chunks_equals_reference(tiny_tiles):
    gen = torch.Generator().manual_seed(2)
    q, k, w = (
        torch.randn(7, 2, 8, generator=gen),
        torch.randn(13, 8, generator=gen),
        torch.randn(7, 2, generator=gen),
    )
    ks = torch.zeros(7, dtype=torch.int32)
    ke = torch.arange(7, 14, dtype=torch.int32)
    with glmport.use_backend("generic"):
        got = glmport.ops.indexer_logits(q, k, w, ks, ke)
    torch.testing.assert_close(got, _ref("indexer_logits")(q, k, w, ks, ke))


def test_online_logprobs_and_chunked_backward_equal_reference(tiny_tiles):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(11, 6, generator=gen, requires_grad=True)
    lm = torch.randn(40, 6, generator=gen, requires_grad=True)
    tgt = torch.randint(0, 40, (11,), generator=gen)
    with glmport.use_backend("generic"):
        logp, ent = glmport.ops.token_logprobs(h, lm, tgt, 0.7)
    rh, rlm = h.detach().clone().requires_grad_(), lm.detach().clone().requires_grad_()
    rlogp, rent = _ref("token_logprobs")(rh, rlm, tgt, 0.7)
    torch.testing.assert_close(logp, rlogp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    a, b = torch.randn(11, generator=gen), torch.randn(11, generator=gen)
    got = torch.autograd.grad((logp * a + ent * b).sum(), [h, lm])
    want = torch.autograd.grad((rlogp * a + rent * b).sum(), [rh, rlm])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _largest_allocation(fn) -> int:
    """Bytes of the largest single CPU allocation any op made while running ``fn``."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_logprobs_never_allocate_a_full_t_by_v_matrix(monkeypatch):
    monkeypatch.setenv("GLMPORT_TILE_MB", "1")
    gen = torch.Generator().manual_seed(4)
    t, d, v = 64, 16, 60000
    h, lm = torch.randn(t, d, generator=gen), torch.randn(v, d, generator=gen)
    tgt = torch.randint(0, v, (t,), generator=gen)
    full = t * v * 4
    with glmport.use_backend("generic"):
        peak = _largest_allocation(lambda: glmport.ops.token_logprobs(h, lm, tgt))
    assert peak < full / 4, (peak, full)
    with glmport.use_backend("cpu"):  # the reference does materialise it: the probe works
        assert _largest_allocation(lambda: glmport.ops.token_logprobs(h, lm, tgt)) >= full


def test_sparse_attention_never_allocates_t_by_n(monkeypatch):
    monkeypatch.setenv("GLMPORT_TILE_MB", "1")
    gen = torch.Generator().manual_seed(5)
    t, n, h, d, kk = 256, 20000, 4, 32, 16
    q, k = torch.randn(t, h, d, generator=gen), torch.randn(n, 1, d, generator=gen)
    idx = torch.randint(0, n, (t, kk), generator=gen, dtype=torch.int32)
    with glmport.use_backend("generic"):
        peak = _largest_allocation(lambda: glmport.ops.sparse_attention(q, k, k, idx, 0.1))
    assert peak < t * n * 4 / 16


def test_indexer_holds_no_full_score_matrix_when_n_is_large(monkeypatch):
    monkeypatch.setenv("GLMPORT_TILE_MB", "1")
    gen = torch.Generator().manual_seed(6)
    t, n, hi, di = 128, 40000, 2, 16
    q, k, w = (
        torch.randn(t, hi, di, generator=gen),
        torch.randn(n, di, generator=gen),
        torch.rand(t, hi, generator=gen),
    )
    ks, ke = torch.zeros(t, dtype=torch.int32), torch.full((t,), n, dtype=torch.int32)
    with glmport.use_backend("generic"):
        peak = _largest_allocation(lambda: glmport.ops.lightning_indexer(q, k, w, ks, ke, 64))
    assert peak < t * n * 4 / 4


@pytest.mark.parametrize("fused", [True, False])  # the CPU takes the loop; force the other
@pytest.mark.parametrize("k", [64, 6])  # 6: rows of 24 bytes, too unaligned for _grouped_mm
def test_grouped_gemm_fused_and_loop_paths_agree(monkeypatch, fused, k):
    monkeypatch.setattr(gmoe, "_fused_grouped_mm", lambda device_type, dtype: fused)
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(20, k, generator=gen), torch.randn(4, 8, k, generator=gen)
    offs = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    with glmport.use_backend("generic"):
        got = glmport.ops.grouped_gemm(x, w, offs)
    bounds = offs.tolist()
    want = torch.cat([x[bounds[e] : bounds[e + 1]] @ w[e].T for e in range(4)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "fp8_block"])
def test_quant_fast_paths_equal_the_portable_paths(monkeypatch, scheme):
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(9, 256, generator=gen), torch.randn(24, 256, generator=gen)
    wq, ws = glmport.ops.quantize_weight(w, scheme, 64)
    with glmport.use_backend("generic"):
        fast = glmport.ops.quant_gemm(x, wq, ws, scheme, 64)
        monkeypatch.setattr(gquant, "_has", lambda device_type, probe: False)
        portable = glmport.ops.quant_gemm(x, wq, ws, scheme, 64)
    if scheme.startswith("w"):
        assert torch.equal(fast, portable)  # int32 accumulation is exact either way
    else:  # torch._scaled_mm accumulates in its own order: float32-level agreement
        err = (fast - portable).abs().max() / portable.abs().max()
        assert err < 2e-5


def test_tile_budget_must_be_positive(monkeypatch):
    monkeypatch.setenv("GLMPORT_TILE_MB", "zero")
    with (
        glmport.use_backend("generic"),
        pytest.raises(glmport.ConfigError, match="GLMPORT_TILE_MB"),
    ):
        glmport.ops.sparse_attention(*_attention_args(torch.Generator().manual_seed(0)))


def test_generic_moe_reuses_the_device_neutral_routing():
    assert gmoe.moe_dispatch is REGISTRY.kernels("cpu", False)["moe_dispatch"]
