"""glmport.rl.losses against hand-computed closed forms, token by token: GRPO advantages,
the GLM-5 normalisation, IcePop, the PPO clip, double-sided IS, OPD advantages, KL
estimators, and the input checks."""

from __future__ import annotations

import math

import pytest
import torch

from glmport.core.errors import ConfigError
from glmport.rl.losses import (
    double_sided_is_loss,
    group_advantages,
    grpo_icepop_loss,
    icepop_weights,
    kl_penalty,
    masked_sample_mean,
    opd_advantages,
    policy_gradient_loss,
    ppo_clipped_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
NAN = math.nan


def t(rows: list[list[float]], dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def log_ratios(rows: list[list[float]]) -> torch.Tensor:
    """log of each ratio (NaN stays NaN: padding), so exp(log r - 0) is r again."""
    return t([[math.log(v) if v == v else NAN for v in row] for row in rows])


# Two samples of different lengths: 3 and 2 real tokens out of L=4.
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def close(a: torch.Tensor, b: torch.Tensor | list | float) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=1e-12, atol=1e-12)


def test_group_advantages_mean_and_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=F64)
    close(group_advantages(rewards, 4), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    # Population std of [1, 0, 0, 1] is 0.5 (the unbiased one would be sqrt(1/3)); the
    # constant group has std 0 and stays 0 thanks to eps.
    eps = 1e-6
    a = 0.5 / (0.5 + eps)
    close(
        group_advantages(rewards, 4, normalize_std=True, eps=eps),
        [a, -a, -a, a, 0.0, 0.0, 0.0, 0.0],
    )
    # Groups of 2: [1, 0] -> mean 0.5; [0, 1]; [0.5, 0.5].
    close(group_advantages(rewards, 2)[:4], [0.5, -0.5, -0.5, 0.5])
    close(group_advantages(rewards, 1), [0.0] * 8)
    ints = group_advantages(torch.tensor([3, 1, 2, 2]), 2)
    assert ints.dtype == torch.float32
    close(ints, [1.0, -1.0, 0.0, 0.0])


def test_masked_sample_mean_excludes_empty_samples():
    x = t([[1.0, 2.0, 3.0, NAN], [10.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
    x.requires_grad_(True)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])
    out = masked_sample_mean(x, mask)
    close(out, ((1.0 + 2.0 + 3.0) / 3 + 10.0 / 1) / 2)
    out.backward()
    # d/dx = 1 / (|y_i| * non-empty samples); padding and the empty sample get 0, not NaN.
    close(x.grad, [[1 / 6, 1 / 6, 1 / 6, 0.0], [1 / 2, 0.0, 0.0, 0.0], [0.0] * 4])

    y = torch.ones(2, 3, dtype=F64, requires_grad=True)
    empty = masked_sample_mean(y, torch.zeros(2, 3, dtype=torch.bool))
    close(empty, 0.0)
    assert empty.requires_grad
    empty.backward()
    close(y.grad, torch.zeros(2, 3))


def test_icepop_weights_inclusive_band():
    rhos = [0.4, 0.5, 1.3, 2.0, 2.5]
    mask = torch.tensor([[True] * 5 + [False]])
    old = log_ratios([[*rhos, 7.0]]).requires_grad_(True)
    rollout = torch.zeros(1, 6, dtype=F64)
    w = icepop_weights(old, rollout, mask, beta=2.0)
    close(w, [[0.0, 0.5, 1.3, 2.0, 0.0, 0.0]])
    assert not w.requires_grad
    # Same ratios from the rollout side: rho = exp(0 - (-log v)).
    close(icepop_weights(torch.zeros(1, 6, dtype=F64), -old.detach(), mask), w)
    # beta = 2.5: both ends 1/2.5 = 0.4 and 2.5 are kept (inclusive).
    close(icepop_weights(old, rollout, mask, beta=2.5), [[0.4, 0.5, 1.3, 2.0, 2.5, 0.0]])


def ppo_inputs():
    """Sample 0 (A=+1): r = 1.1 (inside), 1.5 (> 1.28: clipped), 0.5 (< 0.8 but A > 0:
    the unclipped branch is the min). Sample 1 (A=-2): r = 0.6 (< 0.8 with A < 0:
    clipped), 1.4 (> 1.28 but A < 0: unclipped). old_logp = 0, padding NaN."""
    logp = log_ratios([[1.1, 1.5, 0.5, NAN], [0.6, 1.4, NAN, NAN]]).requires_grad_(True)
    old = t([[0.0, 0.0, 0.0, NAN], [0.0, 0.0, NAN, NAN]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    return logp, old, adv


def test_ppo_clipped_loss_value_and_gradient():
    logp, old, adv = ppo_inputs()
    loss, stats = ppo_clipped_loss(logp, old, adv, MASK, eps_low=0.2, eps_high=0.28)
    sample0 = -(1.1 * 1 + 1.28 * 1 + 0.5 * 1) / 3
    sample1 = -(0.8 * -2 + 1.4 * -2) / 2
    close(loss, (sample0 + sample1) / 2)
    loss.backward()
    # -(w r A) / (|y_i| * 2) unclipped; exactly 0 where clipped and at padding.
    expected = [[-1.1 * 1 / 6, 0.0, -0.5 * 1 / 6, 0.0], [0.0, -1.4 * -2 / 4, 0.0, 0.0]]
    close(logp.grad, expected)
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[1, 0].item() == 0.0
    close(stats["clip_fraction"], 2 / 5)
    kl = -(math.log(1.1) + math.log(1.5) + math.log(0.5) + math.log(0.6) + math.log(1.4)) / 5
    close(stats["ppo_kl"], kl)
    assert not any(v.requires_grad for v in stats.values())

    # Per-token [B, L] advantages equal to the broadcast ones give the same loss.
    per_token = adv[:, None].expand(2, 4).clone()
    close(ppo_clipped_loss(logp, old, per_token, MASK)[0], loss.detach())


def test_ppo_clipped_loss_fp32():
    logp, old, adv = ppo_inputs()
    loss, _ = ppo_clipped_loss(logp.detach().float(), old.float(), adv.float(), MASK)
    assert loss.dtype == torch.float32
    expected = (-(1.1 + 1.28 + 0.5) / 3 - (0.8 * -2 + 1.4 * -2) / 2) / 2
    assert abs(loss.item() - expected) < 1e-6


def icepop_inputs():
    """r as in ppo_inputs but sample 0 token 1 has r = 1.2 (unclipped) and is popped
    (rho = 3 > beta = 2). rho: sample 0 [1, 3, 1.25], sample 1 [0.5 (kept: inclusive), 1]."""
    logp = log_ratios([[1.1, 1.2, 0.5, NAN], [0.6, 1.4, NAN, NAN]]).requires_grad_(True)
    old = t([[0.0, 0.0, 0.0, NAN], [0.0, 0.0, NAN, NAN]])
    rollout = -log_ratios([[1.0, 3.0, 1.25, NAN], [0.5, 1.0, NAN, NAN]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    return logp, old, rollout, adv


def test_grpo_icepop_loss_pops_but_keeps_denominator():
    logp, old, rollout, adv = icepop_inputs()
    loss, stats = grpo_icepop_loss(logp, old, rollout, adv, MASK, beta=2.0)
    sample0_with_popped = -(1.0 * 1.1 * 1 + 0.0 + 1.25 * 0.5 * 1) / 3
    sample1 = -(0.5 * 0.8 * -2 + 1.0 * 1.4 * -2) / 2
    close(loss, (sample0_with_popped + sample1) / 2)
    # Had the popped token left |y_0|, sample 0 would be divided by 2, not 3.
    shrunk = (-(1.1 + 1.25 * 0.5) / 2 + sample1) / 2
    assert abs(loss.item() - shrunk) > 0.1
    no_popped = MASK.clone()
    no_popped[0, 1] = False
    close(grpo_icepop_loss(logp, old, rollout, adv, no_popped)[0], shrunk)

    loss.backward()
    expected = [
        [-1.0 * 1.1 * 1 / 6, 0.0, -1.25 * 0.5 * 1 / 6, 0.0],
        [0.0, -1.0 * 1.4 * -2 / 4, 0.0, 0.0],
    ]
    close(logp.grad, expected)
    assert logp.grad[0, 1].item() == 0.0  # popped, though its ratio is not clipped

    # The same through ppo_clipped_loss with explicit IcePop weights; weights get no gradient.
    w = icepop_weights(old, rollout, MASK).requires_grad_(True)
    via_ppo, _ = ppo_clipped_loss(logp, old, adv, MASK, token_weights=w)
    close(via_ppo.detach(), loss.detach())
    via_ppo.backward()
    assert w.grad is None

    close(stats["pop_fraction"], 1 / 5)
    close(stats["clip_fraction"], 1 / 5)
    mismatch = [0.0, math.log(3.0), math.log(1.25), math.log(2.0), 0.0]
    close(stats["logp_mismatch_mean"], sum(mismatch) / 5)
    close(stats["logp_mismatch_max"], math.log(3.0))
    # rho sorted [0.5, 1, 1, 1.25, 3]; linear interpolation at q * (n - 1).
    close(stats["rho_p01"], 0.5 + (1.0 - 0.5) * 0.04)
    close(stats["rho_p50"], 1.0)
    close(stats["rho_p99"], 1.25 + (3.0 - 1.25) * 0.96)


def test_grpo_without_icepop_is_plain_ppo():
    logp, old, rollout, adv = icepop_inputs()
    loss, stats = grpo_icepop_loss(logp, old, rollout, adv, MASK, beta=None)
    close(loss, (-(1.1 + 1.2 + 0.5) / 3 - (0.8 * -2 + 1.4 * -2) / 2) / 2)
    close(stats["pop_fraction"], 0.0)
    close(ppo_clipped_loss(logp, old, adv, MASK)[0], loss.detach())


def test_double_sided_is_strict_band():
    # Sample 0 (A=+1): r = 0.8 and 1.28 sit on the band edges (zeroed: strict), 1.0 and
    # 1.2 inside. Sample 1 (A=-0.5): r = 0.7 outside, 0.9 inside.
    logp = log_ratios([[0.8, 1.28, 1.0, 1.2], [0.7, 0.9, NAN, NAN]]).requires_grad_(True)
    rollout = torch.zeros(2, 4, dtype=F64)
    adv = torch.tensor([1.0, -0.5], dtype=F64)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    loss, stats = double_sided_is_loss(logp, rollout, adv, mask, eps_low=0.2, eps_high=0.28)
    sample0 = -(0.0 + 0.0 + 1.0 * 1 + 1.2 * 1) / 4
    sample1 = -(0.0 + 0.9 * -0.5) / 2
    close(loss, (sample0 + sample1) / 2)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -1.0 / 8, -1.2 / 8], [0.0, 0.45 / 4, 0.0, 0.0]])
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    close(stats["zeroed_fraction"], 3 / 6)


def test_policy_gradient_loss_ignores_how_stale_a_sample_is():
    # -A logp per token, the GLM-5 normalisation; NaN at padding is never read.
    logp = t([[-1.0, -2.0, -0.5, NAN], [-3.0, -1.5, NAN, NAN]]).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    loss, stats = policy_gradient_loss(logp, adv, MASK)
    sample0 = -2.0 * (-1.0 - 2.0 - 0.5) / 3
    sample1 = 1.0 * (-3.0 - 1.5) / 2
    close(loss, (sample0 + sample1) / 2)
    assert stats == {}
    loss.backward()
    close(logp.grad, [[-2.0 / 6] * 3 + [0.0], [1.0 / 4] * 2 + [0.0, 0.0]])
    # On fresh samples (logp equal to the rollout's) it has double-sided IS's gradient.
    fresh = logp.detach().nan_to_num(0.0).requires_grad_(True)
    dsis, _ = double_sided_is_loss(fresh, fresh.detach(), adv, MASK)
    dsis.backward()
    close(fresh.grad, logp.grad)


def test_opd_advantages_detached():
    teacher = t([[-1.0, -2.0, NAN], [-0.5, -0.25, -3.0]])
    student = t([[-1.5, -1.0, 0.3], [-0.5, -1.0, -1.0]]).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    a = opd_advantages(teacher, student, mask)
    assert not a.requires_grad
    close(a, [[-1.0 + 1.5, -2.0 + 1.0, 0.0], [0.0, -0.25 + 1.0, -3.0 + 1.0]])


def test_kl_penalty_closed_forms():
    logp = t([[0.0, 0.5, -1.0]]).requires_grad_(True)
    ref = t([[0.0, 0.0, 0.5]])
    d = [0.0, 0.5, -1.5]
    close(kl_penalty(logp, ref, "k1"), [d])
    close(kl_penalty(logp, ref, "k2"), [[0.5 * x * x for x in d]])
    k3 = kl_penalty(logp, ref)
    close(k3, [[math.exp(-x) + x - 1 for x in d]])
    k3.sum().backward()
    close(logp.grad, [[1 - math.exp(-x) for x in d]])

    wide = torch.linspace(-20, 20, 401, dtype=F64)[None]
    assert (kl_penalty(wide, torch.zeros_like(wide), "k3") >= 0).all()
    assert (kl_penalty(wide.float(), torch.zeros_like(wide.float()), "k3") >= 0).all()

    mask = torch.tensor([[True, True, False]])
    close(kl_penalty(logp, t([[0.0, 0.0, NAN]]), "k2", mask=mask), [[0.0, 0.125, 0.0]])


def test_bad_inputs_name_the_argument():
    logp, old, adv = ppo_inputs()
    with pytest.raises(ConfigError, match="'old_logp'"):
        ppo_clipped_loss(logp, old[:, :3], adv, MASK)
    with pytest.raises(ConfigError, match="'mask'"):
        ppo_clipped_loss(logp, old, adv, MASK.to(F64))
    with pytest.raises(ConfigError, match="'advantages'"):
        ppo_clipped_loss(logp, old, adv[:1], MASK)
    nan_at_real = logp.detach().clone()
    nan_at_real[1, 0] = NAN
    with pytest.raises(ConfigError, match=r"'logp'.*finite"):
        ppo_clipped_loss(nan_at_real, old, adv, MASK)
    with pytest.raises(ConfigError, match="'eps_low'"):
        ppo_clipped_loss(logp, old, adv, MASK, eps_low=1.0)
    with pytest.raises(ConfigError, match="'eps_high'"):
        double_sided_is_loss(logp, old, adv, MASK, eps_high=-0.1)
    with pytest.raises(ConfigError, match="'token_weights'"):
        ppo_clipped_loss(logp, old, adv, MASK, token_weights=torch.ones(2, 3, dtype=F64))
    for beta in (1.0, 0.5, math.inf):
        with pytest.raises(ConfigError, match="'beta'"):
            icepop_weights(old, old, MASK, beta=beta)
        with pytest.raises(ConfigError, match="'beta'"):
            grpo_icepop_loss(logp, old, old, adv, MASK, beta=beta)
    with pytest.raises(ConfigError, match=r"'kind'.*k1, k2, k3"):
        kl_penalty(logp, old, "k4")
    with pytest.raises(ConfigError, match="'ref_logp'"):
        kl_penalty(logp, old[:, :2])
    with pytest.raises(ConfigError, match="'teacher_logp'"):
        opd_advantages(old[:1], old, MASK)
    with pytest.raises(ConfigError, match="'group_size'"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ConfigError, match="'group_size'"):
        group_advantages(torch.zeros(8), 0)
    with pytest.raises(ConfigError, match="'rewards'"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ConfigError, match="'rewards'"):
        group_advantages(torch.tensor([1.0, NAN]), 2)
    # NaN at padding is fine (never read): the main tests pass NaN there already.
    assert torch.isfinite(ppo_clipped_loss(logp, old, adv, MASK)[0])
