"""quantize mutants: (x [R, C], fmt, group_size) -> (codes, scales float32)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from glmport.core.formats import (
    FORMATS,
    FP8_DTYPE,
    FP8_MAX,
    INT4_QMAX,
    INT8_MAX,
    expand_scale,
    pack_int4,
    quantize_tensor,
)

from .base import EXACT_SCALES, ZERO_GROUPS, add, mutant, swap_nibbles

OP = "quantize"
FP8_FORMATS = tuple(f for f in FORMATS if FORMATS[f].storage == FP8_DTYPE)
INT_FORMATS = tuple(f for f in FORMATS if FORMATS[f].storage != FP8_DTYPE)
POW2_FORMATS = tuple(f for f in FORMATS if FORMATS[f].pow2_scales)
INT4_FORMATS = tuple(f for f in FORMATS if FORMATS[f].storage == torch.uint8)
PLAIN_FORMATS = tuple(f for f in FORMATS if not FORMATS[f].pow2_scales)


def _scaled(x: torch.Tensor, fmt: str, group_size: int, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in float32, each element over its group's scale."""
    rows, cols = x.shape
    return x.float() / expand_scale(scale, FORMATS[fmt], rows, cols, group_size)


def _codes(x: torch.Tensor, fmt: str, group_size: int, scale: torch.Tensor, rounding=torch.round):
    """``x``'s codes in format ``fmt`` with the given ``scale`` (as the format encodes,
    but for the scale and, for integer formats, the ``rounding``)."""
    storage = FORMATS[fmt].storage
    scaled = _scaled(x, fmt, group_size, scale)
    if storage == FP8_DTYPE:
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    qmax = INT8_MAX if storage == torch.int8 else INT4_QMAX
    q = rounding(scaled).clamp(-qmax, qmax).to(torch.int8)
    return pack_int4(q) if storage == torch.uint8 else q


def _requantised(change: Callable[[torch.Tensor, torch.Tensor, str, int], torch.Tensor]):
    """A mutation of the scales, ``change(scales, x, fmt, group_size)``, with the codes
    encoded on the changed scales."""

    def wrap(kernel):
        def mutated(x, fmt, group_size):
            _, scale = kernel(x, fmt, group_size)
            scale = change(scale, x, fmt, group_size)
            return _codes(x, fmt, group_size, scale), scale

        return mutated

    return wrap


def _floor_scale(fmt: str, group_size: int) -> float:
    """The scale the format gives an all-zero group (its amax floor's)."""
    return float(quantize_tensor(torch.zeros(1, group_size), fmt, group_size)[1].reshape(-1)[0])


def _no_floor(scale, x, fmt, group_size):
    return torch.where(scale == _floor_scale(fmt, group_size), 0.0, scale)


def _one_ulp_up(scale, x, fmt, group_size):
    return torch.nextafter(scale, torch.full_like(scale, math.inf))


def _in_input_dtype(scale, x, fmt, group_size):
    return scale.to(x.dtype).float()


def _last_group_scale(scale, x, fmt, group_size):
    """The last short group (columns not a multiple of the group) takes the scale of
    the group before it."""
    if FORMATS[fmt].granularity == "row" or x.shape[1] % group_size == 0 or scale.shape[1] < 2:
        return scale
    scale = scale.clone()
    scale[:, -1] = scale[:, -2]
    return scale


# (name, kind, what breaks, the family that kills it, the scale change, the formats
# it applies to)
_SCALES = (
    ("no_amax_floor", "range end",
     "no amax floor: an all-zero group gets scale 0 (and NaN fp8 codes)", ZERO_GROUPS,
     _no_floor, tuple(FORMATS)),
    ("scale_one_ulp_high", "scale",
     "computes the scale as amax * (1 / qmax): one ulp off amax / qmax", EXACT_SCALES,
     _one_ulp_up, PLAIN_FORMATS),
    ("scale_in_input_dtype", "low precision",
     "computes the scale in the input dtype (bfloat16 / float16)", "tiny (bfloat16)",
     _in_input_dtype, PLAIN_FORMATS),
    ("short_group_reuses_scale", "range end",
     "the last, short group takes the scale of the group before it", "edge: ragged_groups",
     _last_group_scale, FP8_FORMATS),
)  # fmt: skip


def _for_formats(formats: tuple, mutation: Callable):
    """``mutation`` on the calls in one of ``formats``, the kernel itself on others."""

    def wrap(kernel):
        mutated = mutation(kernel)
        return lambda x, fmt, group_size: (mutated if fmt in formats else kernel)(
            x, fmt, group_size
        )

    return wrap


for _name, _kind, _breaks, _needs, _change, _formats in _SCALES:
    add(
        OP,
        _name,
        _kind,
        _breaks,
        _needs,
        _for_formats(_formats, _requantised(_change)),
        format=_formats,
    )


def _codes_rewritten(change: Callable[[torch.Tensor, torch.Tensor, str, int, tuple], object]):
    """A mutation of the codes on the kernel's scales: ``change(codes, x, fmt,
    group_size, scale) -> codes``."""

    def wrap(kernel):
        def mutated(x, fmt, group_size):
            q, scale = kernel(x, fmt, group_size)
            return change(q, x, fmt, group_size, scale), scale

        return mutated

    return wrap


def _half_away_from_zero(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _rounded_half_away(q, x, fmt, group_size, scale):
    return _codes(x, fmt, group_size, scale, rounding=_half_away_from_zero)


def _fp8_truncated(q, x, fmt, group_size, scale):
    """The fp8 codes one step toward zero wherever round-to-nearest rounded up."""
    exact = _scaled(x, fmt, group_size, scale).clamp(-FP8_MAX, FP8_MAX)
    bits = q.view(torch.uint8)
    magnitude = bits & 0x7F
    over = (q.float().abs() > exact.abs()) & (magnitude > 0)
    down = torch.where(over, magnitude - 1, magnitude).to(torch.uint8)
    return ((bits & 0x80) | down).view(FP8_DTYPE)


_CODES = (
    ("int4_nibbles_swapped", "layout", "packs int4 with the nibbles swapped (odd column low)",
     "tiny", lambda q, *_: swap_nibbles(q), INT4_FORMATS),
    ("rounds_half_away", "rounding",
     "rounds halves away from zero, not to even (the formats round half to even)",
     "quantize at exact rounding ties", _rounded_half_away, INT_FORMATS),
    ("fp8_rounds_toward_zero", "rounding",
     "converts to fp8 by truncation, not round-to-nearest-even", "tiny", _fp8_truncated,
     FP8_FORMATS),
)  # fmt: skip
for _name, _kind, _breaks, _needs, _change, _formats in _CODES:
    add(
        OP,
        _name,
        _kind,
        _breaks,
        _needs,
        _for_formats(_formats, _codes_rewritten(_change)),
        format=_formats,
    )


def _plain(fmt: str) -> str:
    """The format ``fmt`` is the power-of-two-scale variant of (itself if none)."""
    return fmt.removesuffix("_pow2")


@mutant(
    OP,
    "pow2_ignored",
    "scale",
    "ue8m0 formats: scales not rounded up to a power of two",
    "tiny",
    format=POW2_FORMATS,
)
def _pow2_ignored(kernel):
    return lambda x, fmt, group_size: kernel(x, _plain(fmt), group_size)


@mutant(
    OP,
    "pow2_rounds_down",
    "rounding",
    "ue8m0 formats: scales rounded down to a power of two (codes then saturate)",
    "tiny",
    format=POW2_FORMATS,
)
def _pow2_down(kernel):
    def mutated(x, fmt, group_size):
        _, plain = kernel(x, _plain(fmt), group_size)
        scale = torch.exp2(torch.floor(torch.log2(plain)))
        return _codes(x, fmt, group_size, scale), scale

    return _for_formats(POW2_FORMATS, lambda _: mutated)(kernel)
