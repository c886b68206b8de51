"""Numerical tolerances: data keyed by op and dtype, never by vendor.

Shared by the shadow checker (``GLMPORT_SHADOW``) and the conformance suite, so a
live mismatch and a failed conformance case mean the same thing. The metric is the
error relative to the signal: ``max|out - ref| / max|ref|`` (and the mean analogue).

Calibration of the bf16 / fp16 bounds, from the error of correct implementations: the
cpu backend computing in the low dtype (float32 accumulation, outputs rounded to the
dtype) and the ``generic`` backend, each against the float64 reference, over every
quick-mode ``value`` and ``gradient`` check in bf16 / fp16 (``conformance/cases.py``;
gradients from ``generic`` only, the cpu backend's are the same code). Worst measured
(``max_rel`` / ``mean_rel``), torch 2.13 on a CPU:

=========  ===================================================  =======================
dtype      worst ``max_rel`` (check)                            worst ``mean_rel``
=========  ===================================================  =======================
bfloat16   4.3e-3 (sparse_attention tiny, gradient); values:    2.7e-3 (moe_dispatch
           3.6e-3 (quant_gemm glm5 fp8_block), 2.9e-3 (sparse   tiny, gradient); values
           attention dense_causal), 2.0e-3 at topk 2048         1.6e-3 (moe_combine)
float16    4.3e-4 (quant_gemm glm5 fp8_block)                   2.1e-4 (moe_combine)
(full)     3.4e-3 bf16 / 4.8e-4 fp16 (sparse_attention glm5 long)  1.4e-3 / 1.8e-4
=========  ===================================================  =======================

That is one rounding to the dtype (unit roundoff 2**-8 for bf16, 2**-11 for fp16)
plus float32 arithmetic. The bounds (bf16 1.5e-2 / 6e-3, fp16 2e-3 / 1e-3) are 3.5x /
2.2x and 4.7x / 4.8x the worst measured: room for one more last-bit difference (an
output one ulp off, as an unordered reduction leaves it: 1.5 ulp of max|ref| at worst,
1.2e-2 bf16 / 1.5e-3 fp16; measured 9.5e-3 / 3.5e-3 bf16, 1.2e-3 / 4.6e-4 fp16 on the
rms_norm cases), for the shadow checker comparing two low-precision outputs, and for
FlashAttention's rounding of the softmax probabilities to the input dtype before
``P @ V`` (3.7e-3 bf16 / 3.7e-4 fp16), but not for a low-precision accumulator: a
sparse attention that sums in bf16 is off by 0.8 at GLM-5's topk 2048, in fp16 by
5e-2 (the limits 0.02 / 4e-3 before this calibration were 4.6x / 9x the worst error).
Measured with ``python tests/test_tolerance_calibration.py`` (prints the table; the
test of the same name keeps the margin at least 2x on the tiny and edge cases).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FP8_DTYPE


@dataclass(frozen=True)
class Tolerance:
    """Bounds on ``max|err| / max|ref|`` and ``mean|err| / mean|ref|``."""

    max_rel: float
    mean_rel: float


# By the dtype the op computes in: roughly a few units in the last place of the
# format, relative to the largest value (bf16 / fp16: calibrated, see above).
BY_DTYPE: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-10, 1e-11),
    torch.float32: Tolerance(2e-5, 2e-6),
    torch.float16: Tolerance(2e-3, 1e-3),
    torch.bfloat16: Tolerance(1.5e-2, 6e-3),
    FP8_DTYPE: Tolerance(6e-2, 2e-2),
}

# Per-op adjustments where the op's own arithmetic needs more room than its dtype.
# mla_prolog: its contract rounds every named intermediate to the dtype, and q_latent
# follows three of them (x @ w_dq.T, q_norm, q) before its own: twice the one-rounding
# bounds (fuzzing small shapes found a correct bf16 composite at mean_rel 6.9e-3).
BY_OP: dict[tuple[str, torch.dtype], Tolerance] = {
    ("mla_prolog", torch.bfloat16): Tolerance(3e-2, 1.2e-2),
    ("mla_prolog", torch.float16): Tolerance(4e-3, 2e-3),
}


# token_logprobs, per token, in nats: a kernel that computes the logits in float32
# (whatever the input dtype: bf16 / fp16 products are exact in float32) errs by about
# eps32 * A / temperature, A = max_v sum_d |h_d w_vd| the largest magnitude a logit
# sums, plus float32 rounding of the log-sum-exp. The judge's bound is
# LOGPROB_ULPS * eps32 * (A / temperature + log V + 1) per token, on logp and on the
# entropy alike; exp(bound) bounds each token's probability ratio. Calibrated on the
# quick suite's token_logprobs cases (the ulps each needs = 64 x its logp/entropy
# bound_frac): float32-logit kernels need at most 2.05 (cpu, temperature 1000), 1.38
# (generic and ascend, which runs generic's), 1.16 (cuda under the interpreter); logits
# rounded to bf16 before the log-softmax need 6030-9260 at LM-sized logits (the
# lm_logits cases), rounded to fp16 700-1210. 64 leaves a margin of 30x above the first
# and fails the second at every lm_logits case by 10x or more.
LOGPROB_ULPS = 64.0


def tolerance(op: str, dtype: torch.dtype) -> Tolerance:
    """The tolerance for ``op`` computing in ``dtype``."""
    return BY_OP.get((op, dtype), BY_DTYPE.get(dtype, BY_DTYPE[torch.float32]))


@dataclass(frozen=True)
class Comparison:
    max_rel: float
    mean_rel: float
    ok: bool


def compare(
    out: torch.Tensor, ref: torch.Tensor, tol: Tolerance, floor: float = 1e-30
) -> Comparison:
    """Relative error of ``out`` against ``ref`` (same shape); ``-inf``/``inf`` entries
    must agree exactly, NaN anywhere fails. Errors are relative to ``max|ref|`` (and
    ``mean|ref|``), or to ``floor`` where that is larger."""
    o, r = out.double().cpu(), ref.double().cpu()
    if o.shape != r.shape:
        return Comparison(float("inf"), float("inf"), False)
    if torch.isnan(o).any() or torch.isnan(r).any():
        return Comparison(float("nan"), float("nan"), False)
    finite = torch.isfinite(r)
    if not torch.equal(finite, torch.isfinite(o)) or not torch.equal(o[~finite], r[~finite]):
        return Comparison(float("inf"), float("inf"), False)
    if not finite.any():
        return Comparison(0.0, 0.0, True)
    err = (o[finite] - r[finite]).abs()
    ref_abs = r[finite].abs()
    max_rel = float(err.max() / ref_abs.max().clamp_min(floor))
    mean_rel = float(err.mean() / ref_abs.mean().clamp_min(floor))
    return Comparison(max_rel, mean_rel, max_rel <= tol.max_rel and mean_rel <= tol.mean_rel)
