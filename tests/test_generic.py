"""The generic backend's own promises: tiled ops equal the reference whatever the tile
budget (ties across tile boundaries included), closed-form chunked backward passes
equal autograd of the reference, the fast paths equal the portable ones, and large
ops never allocate a full [T, N] or [T, V]."""

from __future__ import annotations

import pytest
import torch

import glmport
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
