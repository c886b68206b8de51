"""RMSNorm and rotary position embedding (interleaved GLM-5 and half-split layouts)."""

from __future__ import annotations

import torch

from ..validate import FLOAT_DTYPES, Checker, Level
from .base import OpSpec, invoke, single_output

# -- rms_norm ----------------------------------------------------------------------


def _check_rms(c: Checker, x, weight, eps, *, values):
    c.tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        c.fail("x", "at least 1-D [..., D]", "a 0-D tensor")
    c.tensor("weight", weight, shape=(("D", x.shape[-1]),), dtypes=FLOAT_DTYPES)
    c.positive_float("eps", eps)
    c.same_device(x=x, weight=weight)
    if values:
        # Fused kernels (cuda, npu_rms_norm) sum squares in float32 unscaled.
        c.within_range("x", c.magnitude(x) ** 2 * x.shape[-1], "the sum of squares of a row")


RMS_NORM = OpSpec(
    name="rms_norm",
    schema="(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
    check=_check_rms,
    fake=lambda x, weight, eps=1e-6: torch.empty_like(x),
    features=lambda x, *_: {"dtype": x.dtype, "hidden": x.shape[-1]},
    feature_names=("dtype", "hidden"),
    differentiable=("x", "weight"),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``, computed in fp32.

    Args:
        x: ``[..., D]`` fp32 | bf16 | fp16.
        weight: ``[D]`` fp32 | bf16 | fp16.
        eps: finite, ``> 0``.

    Returns:
        ``[..., D]`` in ``x``'s dtype. Differentiable in ``x`` and ``weight``.
    """
    return invoke(RMS_NORM, x, weight, eps)


# -- rope --------------------------------------------------------------------------


def _check_rope(c: Checker, x, cos, sin, interleaved, *, values):
    c.tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 2:
        c.fail("x", "at least 2-D [T, ..., D]", f"a {x.dim()}-D tensor")
    t, d = x.shape[0], x.shape[-1]
    if d % 2:
        c.fail("x", "an even last dim D (rotary dims come in pairs)", f"D={d}")
    c.tensor("cos", cos, shape=(("T", t), ("D/2", d // 2)), dtypes=(torch.float32,))
    c.tensor("sin", sin, shape=(("T", t), ("D/2", d // 2)), dtypes=(torch.float32,))
    if not isinstance(interleaved, bool):
        c.fail("interleaved", "a bool", repr(interleaved))
    c.same_device(x=x, cos=cos, sin=sin)
    if values >= Level.STRICT:  # a NaN or inf angle makes NaN outputs: loud, not silent
        rotation = c.finite("cos", cos) + c.finite("sin", sin)
        bound = c.magnitude(x) * rotation
        c.within_range("x", bound, "a rotated pair (max|x| * (max|cos| + max|sin|))")


ROPE = OpSpec(
    name="rope",
    schema="(Tensor x, Tensor cos, Tensor sin, bool interleaved=True) -> Tensor",
    check=_check_rope,
    fake=lambda x, cos, sin, interleaved=True: torch.empty_like(x),
    features=lambda x, cos, sin, interleaved=True: {
        "dtype": x.dtype,
        "rope_dim": x.shape[-1],
        "interleaved": interleaved,
    },
    feature_names=("dtype", "rope_dim", "interleaved"),
    differentiable=("x",),
    # A rotated pair reaches sqrt(2) max|x| (more for |cos|, |sin| > 1): in float16
    # from |x| > 46341 on, which no check of x alone would refuse.
    result_guard=single_output("out"),
)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dim by per-token angles.

    Pair ``i`` is ``(x[2i], x[2i+1])`` when ``interleaved`` (GLM-5) or
    ``(x[i], x[i + D/2])`` when half-split (DeepSeek-V3.2's indexer); it becomes
    ``(a cos_i - b sin_i, a sin_i + b cos_i)`` in the same positions. Computed in fp32.

    Args:
        x: ``[T, ..., D]`` fp32 | bf16 | fp16, ``D`` even (pass only the rotary dims).
        cos, sin: ``[T, D/2]`` fp32, already gathered at each token's position.

    Returns:
        ``[T, ..., D]`` in ``x``'s dtype. Differentiable in ``x``.
    """
    return invoke(ROPE, x, cos, sin, interleaved)
