"""Numerical tolerances: data keyed by op and dtype, never by vendor.

Shared by the shadow checker (``GLMPORT_SHADOW``) and the conformance suite, so a
live mismatch and a failed conformance case mean the same thing. The metric is the
error relative to the signal: ``max|out - ref| / max|ref|`` (and the mean analogue).
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
# format, relative to the largest value.
BY_DTYPE: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-10, 1e-11),
    torch.float32: Tolerance(2e-5, 2e-6),
    torch.float16: Tolerance(4e-3, 1e-3),
    torch.bfloat16: Tolerance(2e-2, 8e-3),
    FP8_DTYPE: Tolerance(6e-2, 2e-2),
}

# Per-op adjustments where the op's own arithmetic needs more room than its dtype.
BY_OP: dict[tuple[str, torch.dtype], Tolerance] = {}


def tolerance(op: str, dtype: torch.dtype) -> Tolerance:
    """The tolerance for ``op`` computing in ``dtype``."""
    return BY_OP.get((op, dtype), BY_DTYPE.get(dtype, BY_DTYPE[torch.float32]))


@dataclass(frozen=True)
class Comparison:
    max_rel: float
    mean_rel: float
    ok: bool


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Relative error of ``out`` against ``ref`` (same shape); ``-inf``/``inf`` entries
    must agree exactly, NaN anywhere fails."""
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
    max_rel = float(err.max() / ref_abs.max().clamp_min(1e-30))
    mean_rel = float(err.mean() / ref_abs.mean().clamp_min(1e-30))
    return Comparison(max_rel, mean_rel, max_rel <= tol.max_rel and mean_rel <= tol.mean_rel)
