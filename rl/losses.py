"""Policy-gradient losses of GLM-5 post-training.

- Reasoning RL: GRPO group advantages and the PPO clipped surrogate with IcePop
  (train/inference mismatch) token weights (:func:`grpo_icepop_loss`).
- Agentic (fully asynchronous) RL: direct double-sided importance sampling against the
  rollout policy (:func:`double_sided_is_loss`).
- Cross-stage on-policy distillation advantages (:func:`opd_advantages`) and per-token
  KL estimators (:func:`kl_penalty`).

Representation: responses are padded batches. Log-probabilities (``logp``, ``old_logp``,
``rollout_logp``, ...) are floating ``[B, L]`` tensors (fp32 or fp64), ``mask`` is a
``[B, L]`` ``torch.bool`` tensor, True at a real response token. Values at padding are
never read (they may be anything, NaN included) and get zero gradient. Advantages are
``[B]`` (broadcast to every token of the response) or ``[B, L]`` (per token).

Only ``logp`` carries gradient: ``old_logp``, ``rollout_logp``, advantages and token
weights are detached inside. Statistics are returned as detached 0-d tensors (no
host sync to build them beyond the input checks).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from glmport.core.errors import ConfigError

__all__ = [
    "KL_KINDS",
    "RHO_QUANTILES",
    "double_sided_is_loss",
    "group_advantages",
    "grpo_icepop_loss",
    "icepop_weights",
    "kl_penalty",
    "masked_sample_mean",
    "mismatch_stats",
    "opd_advantages",
    "policy_gradient_loss",
    "ppo_clipped_loss",
]

KL_KINDS = ("k1", "k2", "k3")
# Quantiles of the train/inference ratio rho reported by grpo_icepop_loss (stat names
# rho_p01, rho_p50, rho_p99).
RHO_QUANTILES = (0.01, 0.5, 0.99)


def _error(fn: str, arg: str, expected: str, got: object) -> ConfigError:
    return ConfigError(f"glmport.rl.losses.{fn}: argument '{arg}' must be {expected}, got {got}")


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"a {t.dtype} tensor of shape {list(t.shape)} on {t.device}"
    return f"{type(t).__name__} {t!r}"


def _check_mask(fn: str, mask: object) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise _error(fn, "mask", "a 2-D [B, L] torch.bool tensor", _describe(mask))
    return mask


def _check_tokens(fn: str, name: str, x: object, mask: Tensor, *, finite: bool = True) -> Tensor:
    """``x`` must be a floating tensor shaped like ``mask``, finite at the real tokens."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise _error(fn, name, "a floating-point tensor", _describe(x))
    if x.shape != mask.shape:
        raise _error(fn, name, f"of the shape of mask {list(mask.shape)}", _describe(x))
    if x.device != mask.device:
        raise _error(fn, name, f"on the device of mask ({mask.device})", _describe(x))
    if finite and not bool(torch.isfinite(x.detach()[mask]).all()):
        raise _error(fn, name, "finite at every real (mask=True) token", "NaN or inf")
    return x


def _check_advantages(fn: str, advantages: object, mask: Tensor) -> Tensor:
    """Returns detached ``[B, L]`` advantages, 0 at padding."""
    b, n = mask.shape
    if (
        not isinstance(advantages, Tensor)
        or not advantages.is_floating_point()
        or advantages.shape not in (torch.Size([b]), torch.Size([b, n]))
    ):
        expected = f"a floating-point tensor of shape [{b}] or [{b}, {n}]"
        raise _error(fn, "advantages", expected, _describe(advantages))
    if advantages.device != mask.device:
        expected = f"on the device of mask ({mask.device})"
        raise _error(fn, "advantages", expected, _describe(advantages))
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv[:, None].expand(b, n)
    if not bool(torch.isfinite(adv[mask]).all()):
        raise _error(fn, "advantages", "finite at every real (mask=True) token", "NaN or inf")
    return torch.where(mask, adv, torch.zeros((), dtype=adv.dtype, device=adv.device))


def _check_eps(fn: str, eps_low: float, eps_high: float) -> None:
    if not (isinstance(eps_low, (int, float)) and 0.0 <= eps_low < 1.0):
        raise _error(fn, "eps_low", "a number in [0, 1)", repr(eps_low))
    if not (isinstance(eps_high, (int, float)) and 0.0 <= eps_high < math.inf):
        raise _error(fn, "eps_high", "a finite number >= 0", repr(eps_high))


def _check_beta(fn: str, beta: float) -> None:
    if isinstance(beta, bool) or not (isinstance(beta, (int, float)) and 1.0 < beta < math.inf):
        raise _error(fn, "beta", "a finite number > 1", repr(beta))


def _zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with 0 at padding; keeps NaN/inf padding out of values and gradients."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Detached mean of ``x`` over all real tokens of the batch (0 when there are none)."""
    x = _zero_pad(x.detach(), mask)
    return x.sum() / mask.sum().clamp(min=1).to(x.dtype)


def _quantiles(values: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """Linear-interpolation quantiles of a 1-D tensor (as ``torch.quantile``, which
    refuses more than 2**24 elements); NaN for an empty tensor."""
    n = values.numel()
    if n == 0:
        return [torch.full((), math.nan, dtype=values.dtype, device=values.device) for _ in qs]
    s = values.sort().values
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = False, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: each reward minus its prompt group's mean.

    Args:
        rewards: ``[B]`` finite rewards laid out group after group
            (``B = prompts * group_size``, the samples of one prompt contiguous).
            Integer or bool rewards are converted to fp32.
        group_size: samples per prompt (G >= 1); must divide ``B``.
        normalize_std: also divide by ``(group std + eps)``, the population std
            (``unbiased=False``: divide by G, not G - 1). GLM-5's CI config leaves it off.
        eps: added to the std so a group of equal rewards gives 0, not NaN.

    Returns:
        ``[B]`` advantages, dtype of ``rewards`` (fp32 for integer input), detached.

    Raises:
        ConfigError: ``rewards`` not 1-D or not finite, ``group_size`` < 1 or not
            dividing ``B``, ``eps`` negative.
    """
    fn = "group_advantages"
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or rewards.is_complex():
        raise _error(fn, "rewards", "a 1-D real tensor [B]", _describe(rewards))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise _error(fn, "group_size", "an int >= 1", repr(group_size))
    if rewards.numel() % group_size:
        raise _error(
            fn, "group_size", f"a divisor of the batch size B={rewards.numel()}", repr(group_size)
        )
    if not (isinstance(eps, (int, float)) and 0.0 <= eps < math.inf):
        raise _error(fn, "eps", "a finite number >= 0", repr(eps))
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise _error(fn, "rewards", "finite", "NaN or inf")
    groups = r.view(-1, group_size)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.reshape(-1)


def advantage_rows(advantages: Tensor, part: Tensor, width: int) -> Tensor:
    """The advantages of sample rows ``part`` (int64 ``[b]``): ``[b]`` from per-sample
    ``advantages [B]``, or ``[b, width]`` from per-token ones ``[B, L]`` (``width <= L``),
    in their dtype."""
    return advantages[part] if advantages.dim() == 1 else advantages[part, :width]


def masked_sample_mean(x: Tensor, mask: Tensor) -> Tensor:
    """GLM-5 normalisation: the mean over samples of each sample's per-token mean.

    ``1/G' sum_i 1/|y_i| sum_{t in y_i} x_it`` with ``|y_i|`` the number of real tokens of
    sample i. Samples with no real token are left out of the sample mean (G' counts
    only non-empty samples); if every sample is empty the result is 0, still attached
    to ``x``'s graph (zero gradient). Padding values of ``x`` are never read.

    Args:
        x: ``[B, L]`` floating tensor.
        mask: ``[B, L]`` torch.bool, True at real tokens.

    Returns:
        0-d tensor, dtype of ``x``, differentiable in ``x``.
    """
    fn = "masked_sample_mean"
    mask = _check_mask(fn, mask)
    x = _check_tokens(fn, "x", x, mask, finite=False)
    counts = mask.sum(dim=1)
    per_sample = _zero_pad(x, mask).sum(dim=1) / counts.clamp(min=1).to(x.dtype)
    non_empty = counts > 0
    return (per_sample * non_empty).sum() / non_empty.sum().clamp(min=1).to(x.dtype)


def icepop_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, beta: float = 2.0
) -> Tensor:
    """IcePop token weights from the train/inference mismatch.

    ``rho = exp(old_logp - rollout_logp)`` = pi_train(theta_old) / pi_infer(theta_old);
    the weight is ``rho`` itself inside the inclusive band ``[1/beta, beta]`` and 0
    outside ("popped").

    Args:
        old_logp: ``[B, L]`` log-probs of the sampled tokens by the training engine at
            the rollout weights.
        rollout_logp: ``[B, L]`` log-probs reported by the inference engine.
        mask: ``[B, L]`` torch.bool, True at real tokens.
        beta: band half-width in ratio space, finite and > 1 (GLM-5: 2).

    Returns:
        ``[B, L]`` detached weights, dtype of ``old_logp``, 0 at padding.
    """
    fn = "icepop_weights"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "old_logp", old_logp, mask)
    _check_tokens(fn, "rollout_logp", rollout_logp, mask)
    _check_beta(fn, beta)
    return _icepop(old_logp, rollout_logp, mask, beta)[0]


def _icepop(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """(weights, rho), both detached and 0 at padding; inputs already checked."""
    rho = torch.exp(_zero_pad(old_logp.detach() - rollout_logp.detach(), mask))
    keep = mask & (rho >= 1.0 / beta) & (rho <= beta)
    return _zero_pad(rho, keep), _zero_pad(rho, mask)


def ppo_clipped_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (asymmetric clip), normalised with :func:`masked_sample_mean`.

    Per token ``r = exp(logp - old_logp)``,
    ``surrogate = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` and
    ``loss_t = -w_t * surrogate`` with ``w = token_weights`` (1 when None). Tokens with
    ``w = 0`` stay in each sample's token count ``|y_i|``. Where the clipped branch is
    selected (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low) the token's
    gradient is exactly 0.

    Args:
        logp: ``[B, L]`` current-policy log-probs of the sampled tokens (carries gradient).
        old_logp: ``[B, L]`` log-probs at the weights that sampled (theta_old), detached.
        advantages: ``[B]`` or ``[B, L]``, detached.
        mask: ``[B, L]`` torch.bool, True at real tokens.
        eps_low: lower clip, in [0, 1).
        eps_high: upper clip, >= 0.
        token_weights: optional ``[B, L]`` per-token weights (e.g. IcePop), detached.

    Returns:
        ``(loss, stats)``: 0-d loss, dtype of ``logp``; stats of detached 0-d tensors:
        ``clip_fraction`` (fraction of real tokens whose gradient the clip zeroes) and
        ``ppo_kl`` (mean of ``old_logp - logp`` over real tokens).
    """
    fn = "ppo_clipped_loss"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "logp", logp, mask)
    _check_tokens(fn, "old_logp", old_logp, mask)
    adv = _check_advantages(fn, advantages, mask)
    _check_eps(fn, eps_low, eps_high)
    if token_weights is not None:
        _check_tokens(fn, "token_weights", token_weights, mask)
    return _ppo(logp, old_logp, adv, mask, eps_low, eps_high, token_weights)


def _ppo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    token_weights: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    log_ratio = _zero_pad(logp - old_logp.detach(), mask)
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    clipped = mask & (((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low)))
    # Select the clipped branch explicitly (a constant) so its gradient is exactly 0,
    # instead of relying on how torch.minimum splits gradients on ties.
    clipped_value = r.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    surrogate = torch.where(clipped, clipped_value, ratio * adv)
    if token_weights is not None:
        surrogate = surrogate * _zero_pad(token_weights.detach(), mask)
    loss = masked_sample_mean(-surrogate, mask)
    stats = {
        "clip_fraction": _token_mean(clipped.to(r.dtype), mask),
        "ppo_kl": _token_mean(-log_ratio, mask),
    }
    return loss, stats


def grpo_icepop_loss(
    logp: Tensor,
    old_logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float | None = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GLM-5 reasoning-RL loss: :func:`ppo_clipped_loss` weighted by
    :func:`icepop_weights` (``beta=None``: no IcePop, every weight 1).

    Args:
        logp: ``[B, L]`` current-policy log-probs (carries gradient).
        old_logp: ``[B, L]`` training-engine log-probs at theta_old.
        rollout_logp: ``[B, L]`` inference-engine log-probs at theta_old.
        advantages: ``[B]`` or ``[B, L]``.
        mask: ``[B, L]`` torch.bool, True at real tokens.
        eps_low, eps_high: PPO clip (GLM-5: 0.2, 0.28).
        beta: IcePop band ``[1/beta, beta]`` (GLM-5: 2), or None.

    Returns:
        ``(loss, stats)``: the stats of :func:`ppo_clipped_loss` plus, over real tokens,
        ``pop_fraction`` (fraction popped; 0 when ``beta`` is None),
        ``logp_mismatch_mean`` and ``logp_mismatch_max`` (of
        ``|old_logp - rollout_logp|``) and ``rho_p01``, ``rho_p50``, ``rho_p99``
        (quantiles of rho, linear interpolation; NaN when there is no real token).
    """
    fn = "grpo_icepop_loss"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "logp", logp, mask)
    _check_tokens(fn, "old_logp", old_logp, mask)
    _check_tokens(fn, "rollout_logp", rollout_logp, mask)
    adv = _check_advantages(fn, advantages, mask)
    _check_eps(fn, eps_low, eps_high)
    if beta is not None:
        _check_beta(fn, beta)
    weights, _ = _icepop(old_logp, rollout_logp, mask, math.inf if beta is None else beta)
    loss, stats = _ppo(
        logp, old_logp, adv, mask, eps_low, eps_high, None if beta is None else weights
    )
    stats.update(_mismatch(old_logp, rollout_logp, mask, beta))
    return loss, stats


def mismatch_stats(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, beta: float | None = 2.0
) -> dict[str, Tensor]:
    """The train/inference mismatch of a rollout, over its real tokens.

    Args:
        old_logp: ``[B, L]`` training-engine log-probs at theta_old.
        rollout_logp: ``[B, L]`` inference-engine log-probs of the same tokens.
        mask: ``[B, L]`` torch.bool, True at real tokens.
        beta: the IcePop band ``[1/beta, beta]`` the pop fraction is counted for
            (None: no band, pop fraction 0).

    Returns:
        Detached 0-d tensors: ``pop_fraction``, ``logp_mismatch_mean`` and
        ``logp_mismatch_max`` of ``|old_logp - rollout_logp|``, and ``rho_p01``,
        ``rho_p50``, ``rho_p99`` (quantiles of rho; NaN when there is no real token).
    """
    fn = "mismatch_stats"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "old_logp", old_logp, mask)
    _check_tokens(fn, "rollout_logp", rollout_logp, mask)
    if beta is not None:
        _check_beta(fn, beta)
    return _mismatch(old_logp, rollout_logp, mask, beta)


def _mismatch(old_logp, rollout_logp, mask, beta) -> dict[str, Tensor]:
    weights, rho = _icepop(old_logp, rollout_logp, mask, math.inf if beta is None else beta)
    popped = torch.zeros_like(mask) if beta is None else mask & (weights == 0)
    mismatch = _zero_pad((old_logp.detach() - rollout_logp.detach()).abs(), mask)
    stats = {
        "pop_fraction": _token_mean(popped.to(rho.dtype), mask),
        "logp_mismatch_mean": _token_mean(mismatch, mask),
        "logp_mismatch_max": mismatch.max() if mismatch.numel() else mismatch.sum(),
    }
    for q, value in zip(RHO_QUANTILES, _quantiles(rho[mask], RHO_QUANTILES), strict=True):
        stats[f"rho_p{round(q * 100):02d}"] = value
    return stats


def double_sided_is_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Asynchronous-RL loss: direct double-sided importance sampling.

    ``r = exp(logp - rollout_logp)`` against the policy that sampled (no recomputed
    theta_old); ``f(r) = r`` strictly inside ``(1 - eps_low, 1 + eps_high)``, else 0
    (value and gradient); token loss ``-f(r) A``, normalised with
    :func:`masked_sample_mean` (zeroed tokens stay in ``|y_i|``).

    Args:
        logp: ``[B, L]`` current-policy log-probs (carries gradient).
        rollout_logp: ``[B, L]`` log-probs reported by the rollout engine, detached.
        advantages: ``[B]`` or ``[B, L]``, detached.
        mask: ``[B, L]`` torch.bool, True at real tokens.
        eps_low: in [0, 1); eps_high: >= 0.

    Returns:
        ``(loss, stats)``: 0-d loss, dtype of ``logp``; stats ``zeroed_fraction``
        (fraction of real tokens outside the band) and ``is_kl`` (mean of
        ``rollout_logp - logp`` over real tokens), detached.
    """
    fn = "double_sided_is_loss"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "logp", logp, mask)
    _check_tokens(fn, "rollout_logp", rollout_logp, mask)
    adv = _check_advantages(fn, advantages, mask)
    _check_eps(fn, eps_low, eps_high)
    log_ratio = _zero_pad(logp - rollout_logp.detach(), mask)
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    inside = mask & (r > 1.0 - eps_low) & (r < 1.0 + eps_high)
    loss = masked_sample_mean(-_zero_pad(ratio, inside) * adv, mask)
    stats = {
        "zeroed_fraction": _token_mean((mask & ~inside).to(r.dtype), mask),
        "is_kl": _token_mean(-log_ratio, mask),
    }
    return loss, stats


def policy_gradient_loss(
    logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient (REINFORCE): token loss ``-A logp``, normalised with
    :func:`masked_sample_mean`, treating every sample as on-policy however stale.

    The control for :func:`double_sided_is_loss`: on fresh samples (``logp`` equal to
    the rollout's) both have the same gradient ``-A grad(logp)``; on stale samples this
    one neither reweights nor drops anything.

    Args:
        logp: ``[B, L]`` current-policy log-probs (carries gradient).
        advantages: ``[B]`` or ``[B, L]``, detached.
        mask: ``[B, L]`` torch.bool, True at real tokens.

    Returns:
        ``(loss, stats)``: 0-d loss, dtype of ``logp``; no stats.
    """
    fn = "policy_gradient_loss"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "logp", logp, mask)
    adv = _check_advantages(fn, advantages, mask)
    return masked_sample_mean(-_zero_pad(logp, mask) * adv, mask), {}


def opd_advantages(teacher_logp: Tensor, student_logp: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation advantages ``sg[log pi_teacher - log pi_train]``.

    Args:
        teacher_logp: ``[B, L]`` teacher log-probs of the student's sampled tokens.
        student_logp: ``[B, L]`` student (training) log-probs of the same tokens.
        mask: ``[B, L]`` torch.bool, True at real tokens.

    Returns:
        ``[B, L]`` detached per-token advantages, dtype of the promoted inputs, 0 at
        padding.
    """
    fn = "opd_advantages"
    mask = _check_mask(fn, mask)
    _check_tokens(fn, "teacher_logp", teacher_logp, mask)
    _check_tokens(fn, "student_logp", student_logp, mask)
    return _zero_pad(teacher_logp.detach() - student_logp.detach(), mask)


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, kind: str = "k3", *, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

    With ``d = logp - ref_logp``: ``k1 = d``; ``k2 = d**2 / 2``;
    ``k3 = exp(-d) + d - 1`` (Schulman; unbiased and >= 0, computed as
    ``expm1(-d) + d`` for accuracy at small d).

    Args:
        logp: ``[B, L]`` policy log-probs (carries gradient).
        ref_logp: ``[B, L]`` reference log-probs, same shape (any shape when ``mask``
            is None), detached.
        kind: one of ``KL_KINDS``.
        mask: optional ``[B, L]`` torch.bool; then padding gives 0 (and zero gradient)
            and real tokens must be finite.

    Returns:
        Per-token estimates, the shape of ``logp``, differentiable in ``logp``.
    """
    fn = "kl_penalty"
    if kind not in KL_KINDS:
        raise _error(fn, "kind", f"one of {', '.join(KL_KINDS)}", repr(kind))
    if mask is not None:
        mask = _check_mask(fn, mask)
        _check_tokens(fn, "logp", logp, mask)
        _check_tokens(fn, "ref_logp", ref_logp, mask)
    else:
        if not isinstance(logp, Tensor) or not logp.is_floating_point():
            raise _error(fn, "logp", "a floating-point tensor", _describe(logp))
        if not isinstance(ref_logp, Tensor) or ref_logp.shape != logp.shape:
            expected = f"a tensor of shape {list(logp.shape)}"
            raise _error(fn, "ref_logp", expected, _describe(ref_logp))
    d = logp - ref_logp.detach()
    if mask is not None:
        d = _zero_pad(d, mask)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d
