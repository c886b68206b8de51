"""rms_norm and rope mutants.

rms_norm: (x [..., D], weight [D], eps) -> [..., D]; rope: (x [T, ..., D], cos
[T, D/2] float32, sin [T, D/2] float32, interleaved) -> [T, ..., D]
"""

from __future__ import annotations

import math

import torch

from .base import ROPE_WIDE, add, chunks, mutant, on_args, replace_args


def _unrotated_from(pair: int):
    """cos 1 / sin 0 for pairs ``pair`` and up: those pass through unrotated."""

    def table(t: torch.Tensor, value: float) -> torch.Tensor:
        t = t.clone()
        t[:, pair:] = value
        return t

    return replace_args("rope", cos=lambda c: table(c, 1.0), sin=lambda s: table(s, 0.0))


def _previous_position(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[:1], t[:-1]))


def _cos_sin_swapped(args: list) -> None:
    args[1], args[2] = args[2], args[1]


# (op, name, kind, what breaks, the family that kills it, the mutation, only)
_SIMPLE = (
    ("rms_norm", "eps_ignored", "formula", "leaves eps out (a zero row divides 0 by 0)",
     "rms_norm with zero and tiny rows", replace_args("rms_norm", eps=lambda _: 0.0), {}),
    ("rms_norm", "weight_ignored", "formula", "never multiplies by the weight", "tiny",
     replace_args("rms_norm", weight=torch.ones_like), {}),
    ("rms_norm", "one_plus_weight", "formula", "multiplies by 1 + weight (Gemma's convention)",
     "tiny", replace_args("rms_norm", weight=lambda w: w + 1), {}),
    ("rope", "rotation_reversed", "formula", "rotates the other way (sin negated)", "tiny",
     replace_args("rope", sin=torch.neg), {}),
    ("rope", "cos_sin_swapped", "formula", "takes cos for sin and sin for cos", "tiny",
     on_args(_cos_sin_swapped), {}),
    ("rope", "position_off_by_one", "range end", "token t takes the angles of position t - 1",
     "tiny", replace_args("rope", cos=_previous_position, sin=_previous_position), {}),
    ("rope", "last_pair_unrotated", "range end", "leaves the last rotary pair unrotated", "tiny",
     _unrotated_from(-1), {}),
    ("rope", "rotary_dims_capped_64", "range end",
     "specialised to 64 rotary dims: pairs beyond 32 are not rotated", ROPE_WIDE,
     _unrotated_from(32), {"rope_dim": (128,)}),
    ("rope", "layout_swapped", "layout", "interleaved pairs read as halves and the other way round",
     "tiny", replace_args("rope", interleaved=lambda i: not i), {}),
)  # fmt: skip
for _op, _name, _kind, _breaks, _needs, _wrap, _only in _SIMPLE:
    add(_op, _name, _kind, _breaks, _needs, _wrap, **_only)


@mutant(
    "rms_norm",
    "eps_outside_sqrt",
    "formula",
    "adds eps after the rsqrt: x * (rsqrt(mean(x^2)) + eps)",
    "rms_norm with zero and tiny rows",
)
def _eps_outside(kernel):
    def mutated(x, weight, eps):
        y = kernel(x, weight, 0.0)
        return (y.float() + eps * x.float() * weight.float()).to(y.dtype)

    return mutated


@mutant(
    "rms_norm",
    "mean_over_d_minus_1",
    "range end",
    "divides the sum of squares by D - 1",
    "tiny (D = 32)",
)
def _d_minus_1(kernel):
    def mutated(x, weight, eps):
        y = kernel(x, weight, eps)
        d = x.shape[-1]
        return y if d < 2 else (y.float() * math.sqrt((d - 1) / d)).to(y.dtype)

    return mutated


@mutant(
    "rms_norm",
    "centred_like_layer_norm",
    "formula",
    "subtracts the row mean first (LayerNorm's variance)",
    "tiny",
)
def _centred(kernel):
    def mutated(x, weight, eps):
        centred = (x.float() - x.float().mean(dim=-1, keepdim=True)).to(x.dtype)
        return kernel(centred, weight, eps)

    return mutated


@mutant(
    "rms_norm",
    "accumulates_in_low_dtype",
    "low precision",
    "adds the squares (32 at a time) into a running sum in the input dtype",
    "glm5 (D = 6144, bfloat16)",
)
def _low_accumulation(kernel):
    def mutated(x, weight, eps):
        d = x.shape[-1]
        total = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        for cols in chunks(d, 32):
            total = (total.float() + x[..., cols].float().square().sum(dim=-1)).to(x.dtype)
        inv = torch.rsqrt(total.float() / max(d, 1) + eps)
        return (x.float() * inv[..., None] * weight.float()).to(x.dtype)

    return mutated
