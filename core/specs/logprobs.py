"""Token log-probabilities and entropies from hidden states: the RL hot path."""

from __future__ import annotations

import torch

from ..validate import FLOAT_DTYPES, FP32_TINY, INDEX_DTYPES, Checker, describe
from .base import OpSpec, invoke


def _check(c: Checker, hidden, lm_head, targets, temperature, *, values):
    c.tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    t, d = hidden.shape
    c.tensor("lm_head", lm_head, shape=(None, ("D", d)), dtypes=(hidden.dtype,))
    c.tensor("targets", targets, shape=(("T", t),), dtypes=INDEX_DTYPES)
    c.positive_float("temperature", temperature)
    if temperature < FP32_TINY:  # kernels divide by it in float32, where it would be 0
        c.fail(
            "temperature",
            f">= {FP32_TINY:.4g}, the smallest normal number of the float32 range "
            "(kernels divide by it)",
            describe(temperature),
        )
    c.same_device(hidden=hidden, lm_head=lm_head, targets=targets)
    if values:
        c.in_range("targets", targets, 0, lm_head.shape[0])
        # |h . w| <= A; the logits z - max z span 2A / temperature, and the entropy sums
        # p * z over the vocabulary: V * max|z| must fit too.
        a = c.magnitude(hidden) * c.magnitude(lm_head) * d
        bound = 2 * a * max(1.0, lm_head.shape[0] / temperature)
        c.within_range(
            "temperature",
            bound,
            "2 * max|h . w| * max(1, V / temperature), h . w / temperature the logits",
            "large",
        )


def _fake(hidden, lm_head, targets, temperature=1.0):
    t = hidden.shape[0]
    return hidden.new_empty((t,), dtype=torch.float32), hidden.new_empty((t,), dtype=torch.float32)


TOKEN_LOGPROBS = OpSpec(
    name="token_logprobs",
    schema="(Tensor hidden, Tensor lm_head, Tensor targets, float temperature=1.0) "
    "-> (Tensor logp, Tensor entropy)",
    check=_check,
    fake=_fake,
    features=lambda hidden, lm_head, *_: {
        "dtype": hidden.dtype,
        "hidden": hidden.shape[1],
        "vocab": lm_head.shape[0],
    },
    feature_names=("dtype", "hidden", "vocab"),
    differentiable=("hidden", "lm_head"),
)


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each distribution.

    ``z = hidden @ lm_head.T / temperature`` in fp32; ``logp[t] = log_softmax(z[t])
    [targets[t]]``; ``entropy[t] = -sum_v p log p``. Backends must not materialise a
    full fp32 ``[T, V]`` for large ``V`` (the reference may).

    Args:
        hidden: ``[T, D]`` fp32 | bf16 | fp16 final hidden states (after the last norm).
        lm_head: ``[V, D]`` same dtype.
        targets: ``[T]`` int32 | int64 in ``[0, V)``.
        temperature: finite, at least the smallest normal float32 (``1.18e-38``; the
            rollout sampling temperature).

    Returns:
        logp: ``[T]`` fp32, never above 0; entropy: ``[T]`` fp32, never below 0.
        Differentiable in ``hidden`` and ``lm_head``. Logits whose spread exceeds
        float32 are refused with an ``OpInputError`` naming ``temperature``.
    """
    return invoke(TOKEN_LOGPROBS, hidden, lm_head, targets, temperature)
