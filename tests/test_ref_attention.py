"""sparse_attention on the cpu reference against an independent float64 formula.

The expected values are computed here with explicit Python loops over tokens, heads and
selected slots (math.exp / math.log), never with glmport code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

# Output tolerances per dtype: the reference computes in fp32 and rounds the output once.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(seed, t, h, hkv, n, dk, dv, k_sel, dtype, *, index_dtype=torch.int32):
    g = _gen(seed)
    q = torch.randn(t, h, dk, generator=g).to(dtype)
    k = torch.randn(n, hkv, dk, generator=g).to(dtype)
    v = torch.randn(n, hkv, dv, generator=g).to(dtype)
    indices = torch.randint(0, n, (t, k_sel), generator=g, dtype=torch.int64)
    drop = torch.rand(t, k_sel, generator=g) < 0.3
    indices = indices.masked_fill(drop, -1)
    indices[:, 0] = torch.randint(0, n, (t,), generator=g)  # at least one valid slot per row
    return q, k, v, indices.to(index_dtype)


def loop_reference(q, k, v, indices, scale):
    """Float64 softmax attention, one (token, head) row at a time over listed slots."""
    qn, kn, vn = (x.detach().double().numpy() for x in (q, k, v))
    idx = indices.tolist()
    t, h, _ = qn.shape
    hkv, dv = kn.shape[1], vn.shape[-1]
    group = h // hkv
    out = np.zeros((t, h, dv))
    lse = np.full((t, h), -math.inf)
    for ti in range(t):
        slots = [j for j in idx[ti] if j >= 0]
        if not slots:
            continue
        for hi in range(h):
            kh = hi // group
            scores = [scale * float(np.dot(qn[ti, hi], kn[j, kh])) for j in slots]
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            z = math.fsum(w)
            lse[ti, hi] = m + math.log(z)
            for wi, j in zip(w, slots, strict=True):
                out[ti, hi] += (wi / z) * vn[j, kh]
    return torch.from_numpy(out), torch.from_numpy(lse)


def torch_reference(q, k, v, indices, scale):
    """Differentiable float64 version of the same formula, one token at a time."""
    t, h, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = h // hkv
    outs, lses = [], []
    for ti in range(t):
        slots = [j for j in indices[ti].tolist() if j >= 0]
        if not slots:
            outs.append(q.new_zeros(h, dv))
            lses.append(q.new_full((h,), -math.inf))
            continue
        sel = torch.tensor(slots)
        kk = k[sel].repeat_interleave(group, dim=1)  # [S, H, Dk]
        vv = v[sel].repeat_interleave(group, dim=1)  # [S, H, Dv]
        s = scale * (q[ti][None] * kk).sum(-1)  # [S, H]
        m = s.max(dim=0).values.detach()
        e = torch.exp(s - m)
        z = e.sum(dim=0)
        lses.append(m + torch.log(z))
        outs.append(((e / z)[..., None] * vv).sum(dim=0))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("h", "hkv"), [(4, 1), (4, 2), (4, 4)])
def test_sparse_attention_matches_loop_reference(dtype, h, hkv):
    q, k, v, idx = _inputs(1, t=5, h=h, hkv=hkv, n=9, dk=16, dv=8, k_sel=6, dtype=dtype)
    scale = 16**-0.5
    out, lse = glmport.ops.sparse_attention(q, k, v, idx, scale)
    assert out.dtype == dtype and out.shape == (5, h, 8)
    assert lse.dtype == torch.float32 and lse.shape == (5, h)
    ref_out, ref_lse = loop_reference(q, k, v, idx, scale)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    # lse is fp32 computed from the (exactly upcast) inputs: tight in every dtype.
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("h", "hkv"), [(2, 1), (6, 3)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sparse_attention_float64_reference_mode_is_tight(h, hkv, index_dtype):
    q, k, v, idx = _inputs(
        2, t=4, h=h, hkv=hkv, n=7, dk=8, dv=8, k_sel=5, dtype=torch.float32, index_dtype=index_dtype
    )
    with float64_reference():
        out, lse = glmport.ops.sparse_attention(q, k, v, idx, 0.7)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    ref_out, ref_lse = loop_reference(q, k, v, idx, 0.7)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sparse_attention_ignores_minus_one_entries(index_dtype):
    q, k, v, _ = _inputs(3, t=3, h=2, hkv=1, n=6, dk=8, dv=4, k_sel=1, dtype=torch.float32)
    with_pads = torch.tensor([[-1, 2, -1, 4, -1], [0, -1, -1, -1, 5], [-1, -1, -1, -1, 3]])
    compact = torch.tensor([[2, 4], [0, 5], [3, 3]])
    with float64_reference():
        out_p, lse_p = glmport.ops.sparse_attention(q, k, v, with_pads.to(index_dtype), 0.5)
        out_c, lse_c = glmport.ops.sparse_attention(q, k, v, compact.to(index_dtype), 0.5)
    torch.testing.assert_close(out_p, out_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p[:2], lse_c[:2], rtol=1e-12, atol=1e-12)
    # Row 2 of the compact form lists slot 3 twice: the same softmax, lse + log(2).
    torch.testing.assert_close(lse_p[2] + math.log(2.0), lse_c[2], rtol=1e-12, atol=1e-12)
    ref_out, ref_lse = loop_reference(q, k, v, with_pads, 0.5)
    torch.testing.assert_close(out_p, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_p, ref_lse, rtol=1e-10, atol=1e-10)


def test_sparse_attention_counts_a_slot_listed_twice_twice():
    g = _gen(4)
    q = torch.randn(1, 1, 4, generator=g)
    k = torch.randn(3, 1, 4, generator=g)
    v = torch.randn(3, 1, 2, generator=g)
    with float64_reference():
        out, lse = glmport.ops.sparse_attention(q, k, v, torch.tensor([[0, 1, 1]]), 1.0)
    s0 = float(q[0, 0].double() @ k[0, 0].double())
    s1 = float(q[0, 0].double() @ k[1, 0].double())
    z = math.exp(s0) + 2 * math.exp(s1)
    expected = (math.exp(s0) * v[0, 0].double() + 2 * math.exp(s1) * v[1, 0].double()) / z
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-12, atol=1e-12)
    assert float(lse[0, 0]) == pytest.approx(math.log(z), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_attention_row_without_valid_slot_gives_zero_out_and_minus_inf_lse(dtype):
    q, k, v, idx = _inputs(5, t=3, h=4, hkv=2, n=5, dk=8, dv=8, k_sel=4, dtype=dtype)
    idx[1] = -1
    out, lse = glmport.ops.sparse_attention(q, k, v, idx, 0.3)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(lse[1], torch.full_like(lse[1], -math.inf))
    assert torch.isfinite(out).all() and torch.isfinite(lse[[0, 2]]).all()
    ref_out, ref_lse = loop_reference(q, k, v, idx, 0.3)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_sparse_attention_lse_is_natural_log_of_uniform_scores():
    # Every selected key is the same row, so all n scores equal s and lse = log(n) + s.
    g = _gen(6)
    q = torch.randn(2, 3, 8, generator=g)
    row = torch.randn(8, generator=g)
    k = row.expand(6, 1, 8).clone()
    v = torch.randn(6, 1, 4, generator=g)
    idx = torch.tensor([[0, 1, 2, 3, 4, -1], [5, -1, -1, -1, -1, -1]])
    scale = 0.25
    with float64_reference():
        out, lse = glmport.ops.sparse_attention(q, k, v, idx, scale)
    for t, n in ((0, 5), (1, 1)):
        slots = [j for j in idx[t].tolist() if j >= 0]
        for h in range(3):
            s = scale * float(q[t, h].double() @ row.double())
            assert float(lse[t, h]) == pytest.approx(math.log(n) + s, rel=1e-12, abs=1e-12)
            torch.testing.assert_close(
                out[t, h], v[slots, 0].double().mean(dim=0), rtol=1e-12, atol=1e-12
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_accepts_v_as_view_of_k_absorbed_mla(dtype):
    g = _gen(7)
    k = torch.randn(10, 1, 24, generator=g).to(dtype)
    v = k[..., :16]  # latent part of the absorbed key, a non-contiguous view
    q = torch.randn(4, 8, 24, generator=g).to(dtype)
    idx = torch.tensor([[0, 3, 9, -1], [1, 1, 2, 8], [-1, -1, 5, -1], [7, 6, 4, 0]])
    out, lse = glmport.ops.sparse_attention(q, k, v, idx, 24**-0.5)
    assert out.shape == (4, 8, 16)
    ref_out, ref_lse = loop_reference(q, k, v, idx, 24**-0.5)
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_sparse_attention_single_query_token():
    q, k, v, idx = _inputs(8, t=1, h=2, hkv=1, n=4, dk=8, dv=8, k_sel=3, dtype=torch.float32)
    with float64_reference():
        out, lse = glmport.ops.sparse_attention(q, k, v, idx, 0.4)
    ref_out, ref_lse = loop_reference(q, k, v, idx, 0.4)
    assert out.shape == (1, 2, 8) and lse.shape == (1, 2)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("h", "hkv"), [(2, 1), (4, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_sparse_attention_with_all_earlier_slots_equals_dense_causal_attention(h, hkv, index_dtype):
    t, dk = 6, 8
    g = _gen(9)
    q = torch.randn(t, h, dk, generator=g)
    k = torch.randn(t, hkv, dk, generator=g)
    v = torch.randn(t, hkv, dk, generator=g)
    # Row i lists slots 0..i, padded with -1.
    idx = torch.tensor([[j if j <= i else -1 for j in range(t)] for i in range(t)])
    scale = 0.5
    with float64_reference():
        out, lse = glmport.ops.sparse_attention(q, k, v, idx.to(index_dtype), scale)
    # Ordinary causal attention in float64 from torch's own SDPA ([B, H, T, D] layout).
    group = h // hkv
    qd = q.double().permute(1, 0, 2)[None]
    kd = k.double().repeat_interleave(group, dim=1).permute(1, 0, 2)[None]
    vd = v.double().repeat_interleave(group, dim=1).permute(1, 0, 2)[None]
    dense = torch.nn.functional.scaled_dot_product_attention(
        qd, kd, vd, is_causal=True, scale=scale
    )[0].permute(1, 0, 2)
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-10)
    logits = scale * torch.einsum("ihd,jhd->hij", qd[0].permute(1, 0, 2), kd[0].permute(1, 0, 2))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    dense_lse = logits.masked_fill(~causal, -math.inf).logsumexp(-1).T  # [T, H]
    torch.testing.assert_close(lse, dense_lse, rtol=1e-10, atol=1e-10)


def _grads_of_loss(fn, q, k, v, idx, scale, go, gl, *, v_from_k=None):
    """Grads wrt (q, k[, v]) of sum(out * go) + sum(finite lse * gl)."""
    q = q.detach().clone().requires_grad_(True)
    k = k.detach().clone().requires_grad_(True)
    leaves = [q, k]
    if v_from_k is None:
        v = v.detach().clone().requires_grad_(True)
        leaves.append(v)
    else:
        v = k[..., :v_from_k]
    out, lse = fn(q, k, v, idx, scale)
    lse_finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    loss = (out.double() * go).sum() + (lse_finite.double() * gl).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(("h", "hkv"), [(2, 1), (4, 2), (3, 3)])
def test_sparse_attention_grads_wrt_q_k_v_through_out_and_lse_match_reference(h, hkv):
    q, k, v, idx = _inputs(10, t=4, h=h, hkv=hkv, n=6, dk=8, dv=4, k_sel=5, dtype=torch.float32)
    g = _gen(11)
    go = torch.randn(4, h, 4, generator=g, dtype=torch.float64)
    gl = torch.randn(4, h, generator=g, dtype=torch.float64)
    got = _grads_of_loss(glmport.ops.sparse_attention, q, k, v, idx, 0.4, go, gl)
    want = _grads_of_loss(torch_reference, q.double(), k.double(), v.double(), idx, 0.4, go, gl)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_sparse_attention_grads_through_v_view_of_k_match_reference():
    g = _gen(12)
    q = torch.randn(3, 4, 12, generator=g)
    k = torch.randn(5, 1, 12, generator=g)
    idx = torch.tensor([[0, 1, 2], [4, -1, 1], [3, 3, 0]])
    go = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    gl = torch.randn(3, 4, generator=g, dtype=torch.float64)
    got = _grads_of_loss(glmport.ops.sparse_attention, q, k, None, idx, 0.3, go, gl, v_from_k=8)
    want = _grads_of_loss(
        torch_reference, q.double(), k.double(), None, idx, 0.3, go, gl, v_from_k=8
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_sparse_attention_row_without_valid_slot_gets_zero_finite_grads():
    q, k, v, idx = _inputs(13, t=3, h=2, hkv=1, n=5, dk=8, dv=4, k_sel=3, dtype=torch.float32)
    idx[0] = -1
    idx[1] = torch.tensor([0, 1, -1])
    idx[2] = torch.tensor([1, -1, 2])  # slots 3 and 4 are never selected
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out, lse = glmport.ops.sparse_attention(q, k, v, idx, 0.5)
    g = _gen(14)
    # Nonzero upstream gradient even on the -inf lse entries: lse there is a constant.
    gq, gk, gv = torch.autograd.grad(
        (out, lse),
        (q, k, v),
        (torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)),
    )
    for grad in (gq, gk, gv):
        assert torch.isfinite(grad).all()
    assert torch.equal(gq[0], torch.zeros_like(gq[0]))
    assert torch.equal(gk[3:], torch.zeros_like(gk[3:]))
    assert torch.equal(gv[3:], torch.zeros_like(gv[3:]))
    assert gq[1:].abs().sum() > 0 and gk[:3].abs().sum() > 0 and gv[:3].abs().sum() > 0
