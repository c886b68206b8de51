"""token_logprobs on the cpu reference against an independent float64 formula: one
token at a time, logits as explicit dot products, log-sum-exp with math.exp / math.log."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import glmport
from glmport.backends.cpu import float64_reference

pytestmark = pytest.mark.usefixtures("reference_backend")

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(seed, t, v, d, dtype, index_dtype=torch.int64):
    g = _gen(seed)
    hidden = torch.randn(t, d, generator=g).to(dtype)
    lm_head = (torch.randn(v, d, generator=g) * d**-0.5).to(dtype)
    targets = torch.randint(0, v, (t,), generator=g).to(index_dtype)
    return hidden, lm_head, targets


def loop_logprobs(hidden, lm_head, targets, temperature):
    """Float64 ``(logp, entropy)``, token by token."""
    h = hidden.detach().double().numpy()
    w = lm_head.detach().double().numpy()
    logp, entropy = [], []
    for ti in range(h.shape[0]):
        z = [float(np.dot(h[ti], w[vi])) / temperature for vi in range(w.shape[0])]
        m = max(z)
        lse = m + math.log(math.fsum(math.exp(zi - m) for zi in z))
        logp.append(z[int(targets[ti])] - lse)
        entropy.append(-math.fsum(math.exp(zi - lse) * (zi - lse) for zi in z))
    return torch.tensor(logp, dtype=torch.float64), torch.tensor(entropy, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
@pytest.mark.parametrize("dtype", FLOATS)
def test_token_logprobs_match_loop_reference(dtype, temperature):
    hidden, lm_head, targets = _inputs(1, t=6, v=50, d=16, dtype=dtype)
    logp, entropy = glmport.ops.token_logprobs(hidden, lm_head, targets, temperature)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert logp.shape == (6,) and entropy.shape == (6,)
    ref_logp, ref_ent = loop_logprobs(hidden, lm_head, targets, temperature)
    # Computed in fp32 from the exactly upcast inputs: tight in every input dtype.
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_token_logprobs_accept_int32_and_int64_targets(index_dtype):
    hidden, lm_head, targets = _inputs(2, t=5, v=20, d=8, dtype=torch.float32)
    with float64_reference():
        logp, entropy = glmport.ops.token_logprobs(hidden, lm_head, targets.to(index_dtype), 0.8)
    assert logp.dtype == torch.float64 and entropy.dtype == torch.float64
    ref_logp, ref_ent = loop_logprobs(hidden, lm_head, targets, 0.8)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-10, atol=1e-12)


def test_token_logprobs_default_temperature_is_one():
    hidden, lm_head, targets = _inputs(3, t=4, v=12, d=8, dtype=torch.float32)
    hidden = hidden * 3  # peaked enough that temperature matters
    with float64_reference():
        logp, entropy = glmport.ops.token_logprobs(hidden, lm_head, targets)
    ref_logp, ref_ent = loop_logprobs(hidden, lm_head, targets, 1.0)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(entropy, ref_ent, rtol=1e-10, atol=1e-12)


def test_token_logprobs_temperature_divides_the_logits():
    hidden, lm_head, targets = _inputs(4, t=4, v=16, d=8, dtype=torch.float32)
    with float64_reference():
        hot = glmport.ops.token_logprobs(hidden, lm_head, targets, 4.0)
    ref_hot = loop_logprobs(hidden / 4.0, lm_head, targets, 1.0)
    ref_cold = loop_logprobs(hidden, lm_head, targets, 1.0)
    for got, want, other in zip(hot, ref_hot, ref_cold, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(got, other, rtol=1e-3, atol=1e-3)
    # A higher temperature flattens the distribution: higher entropy.
    assert (hot[1] > ref_cold[1]).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_token_logprobs_uniform_logits_give_minus_log_v_and_entropy_log_v(dtype):
    v = 37
    hidden = torch.randn(3, 8, generator=_gen(5)).to(dtype)
    lm_head = torch.zeros(v, 8, dtype=dtype)
    targets = torch.tensor([0, 17, 36])
    logp, entropy = glmport.ops.token_logprobs(hidden, lm_head, targets, 0.7)
    torch.testing.assert_close(logp, torch.full((3,), -math.log(v)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, torch.full((3,), math.log(v)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", FLOATS)
def test_token_logprobs_are_nonpositive_and_exp_sums_to_one_over_all_targets(dtype):
    v = 24
    hidden, lm_head, _ = _inputs(6, t=2, v=v, d=8, dtype=dtype)
    hidden = hidden * 4
    # Every vocabulary entry as the target of a copy of each hidden row.
    rows = hidden.repeat_interleave(v, dim=0)
    targets = torch.arange(v).repeat(2)
    logp, entropy = glmport.ops.token_logprobs(rows, lm_head, targets, 1.0)
    assert (logp <= 0).all()
    total = logp.double().exp().view(2, v).sum(dim=1)
    torch.testing.assert_close(total, torch.ones(2, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert ((entropy >= 0) & (entropy <= math.log(v) + 1e-5)).all()
    # The entropy is the expectation of -logp under the distribution itself.
    p = logp.double().exp().view(2, v)
    expected_entropy = -(p * logp.double().view(2, v)).sum(dim=1)
    torch.testing.assert_close(
        entropy.double().view(2, v), expected_entropy[:, None].expand(2, v), rtol=1e-5, atol=1e-5
    )


def torch_logprobs(hidden, lm_head, targets, temperature):
    """Differentiable float64 formula, one token at a time."""
    logps, ents = [], []
    for ti in range(hidden.shape[0]):
        z = (lm_head * hidden[ti]).sum(dim=1) / temperature  # [V]
        m = z.max().detach()
        lse = m + torch.log(torch.exp(z - m).sum())
        lp = z - lse
        logps.append(lp[int(targets[ti])])
        ents.append(-(torch.exp(lp) * lp).sum())
    return torch.stack(logps), torch.stack(ents)


def _grads(fn, hidden, lm_head, targets, temperature, a, b):
    hidden = hidden.detach().clone().requires_grad_(True)
    lm_head = lm_head.detach().clone().requires_grad_(True)
    logp, entropy = fn(hidden, lm_head, targets, temperature)
    loss = (logp.double() * a).sum() + (entropy.double() * b).sum()
    return torch.autograd.grad(loss, (hidden, lm_head))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_token_logprobs_grads_wrt_hidden_and_lm_head_match_reference(temperature, index_dtype):
    hidden, lm_head, targets = _inputs(7, t=4, v=10, d=8, dtype=torch.float32)
    targets = targets.to(index_dtype)
    g = _gen(8)
    a = torch.randn(4, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    got = _grads(glmport.ops.token_logprobs, hidden, lm_head, targets, temperature, a, b)
    want = _grads(torch_logprobs, hidden.double(), lm_head.double(), targets, temperature, a, b)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-4)


def test_token_logprobs_grads_through_entropy_alone_match_reference():
    hidden, lm_head, targets = _inputs(9, t=3, v=9, d=6, dtype=torch.float32)
    a = torch.zeros(3, dtype=torch.float64)
    b = torch.randn(3, generator=_gen(10), dtype=torch.float64)
    got = _grads(glmport.ops.token_logprobs, hidden, lm_head, targets, 1.3, a, b)
    want = _grads(torch_logprobs, hidden.double(), lm_head.double(), targets, 1.3, a, b)
    for x, y in zip(got, want, strict=True):
        assert x.abs().sum() > 0
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-4)
