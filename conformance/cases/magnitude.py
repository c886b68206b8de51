"""Family ``magnitude``: small calls of every op with arguments at 1e30, 1e-30 or the
edge of float32's range.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from glmport.core.formats import FP8_DTYPE
from glmport.core.specs import SPECS

from .base import Builder, Case
from .layout import LAYOUT_QUICK_DTYPES

# Family ``magnitude``: small calls of every op with arguments at 1e30 or 1e-30, each
# set of arguments chosen so that the float64 reference and the op's float32
# intermediates stay finite and normal (products meet at about 1, outputs are 1e30 or
# 1e-30), which float16 cannot hold: bf16 and float32 only. A kernel staging values
# through float16, or without an epsilon, an amax floor or a masked max, fails here.
# ``moe_gate`` has none: a sigmoid of 1e30 is 1 for every expert, which leaves only ties.
MAGNITUDES: dict[str, tuple[dict[str, float], ...]] = {
    "sparse_attention": ({"q": 1e-30, "k": 1e30, "v": 1e30}, {"q": 1e-30, "v": 1e-30}),
    "lightning_indexer": (
        {"q": 1e-30, "k": 1e30},
        {"weights": 1e-30},
        {"q_scale": 1e-30, "k_scale": 1e30},
    ),
    "indexer_logits": ({"q": 1e30, "k": 1e-30}, {"weights": 1e-30}, {"k_scale": 1e-30}),
    "moe_dispatch": ({"x": 1e30}, {"x": 1e-30}),
    "moe_combine": ({"y_sorted": 1e30}, {"y_sorted": 1e-30}),
    "grouped_gemm": ({"x": 1e30}, {"x": 1e-30}, {"x": 1e-30, "w": 1e30}, {"w_scale": 1e30}),
    "quant_gemm": ({"x": 1e30}, {"x": 1e-30}, {"x": 1e-30, "w": 1e30}, {"w_scale": 1e30}),
    "quantize": ({"x": 1e30}, {"x": 1e-30}),
    "rms_norm": ({"x": 1e-30}, {"weight": 1e30}),
    "rope": ({"x": 1e30}, {"x": 1e-30}),
    "token_logprobs": ({"hidden": 1e-30, "lm_head": 1e30}, {"hidden": 1e-30}),
    # Tiny rows (the norms' eps dominates), and gains far from 1 on both norms. (A huge
    # x is refused: its projected rows' sums of squares leave float32.)
    "mla_prolog": ({"x": 1e-30}, {"gamma_cq": 1e30, "gamma_ckv": 1e-30}),
}


# And at the edge of float32's range: the argument scaled so that its largest entry is
# FLOAT32_EDGE, where each output is a copy, a weighted sum, a rotation or a code of it
# and so still fits float32 (a kernel whose intermediate product overflows, such as
# x * qmax / amax in quantize, turns it into inf or NaN). Arguments whose bounds glmport
# refuses by design (attention's K * max|v|, scores, GEMM partial sums: the overflow
# refusal of docs/reliability.md) have none.
FLOAT32_EDGE = 3e38


EDGES: dict[str, tuple[str, ...]] = {
    "moe_dispatch": ("x",),
    "moe_combine": ("y_sorted",),
    "quantize": ("x",),
    "rope": ("x",),
}


MAGNITUDE_BASES = (
    ("sparse_attention", "tiny"),
    ("lightning_indexer", "tiny"),
    ("indexer_logits", "tiny"),
    ("moe_dispatch", "tiny"),
    ("moe_combine", "tiny"),
    ("grouped_gemm", "tiny"),
    ("quantize", "tiny"),
    ("quant_gemm", "tiny"),
    ("quant_gemm", "qat"),
    ("rms_norm", "tiny"),
    ("rope", "tiny_half"),
    ("token_logprobs", "tiny"),
    ("mla_prolog", "tiny"),
)


def _times(build: Builder, positions: dict[int, float]) -> Builder:
    """``build`` with the tensor arguments at ``positions`` multiplied (in float64,
    then back to their dtype) by their factors."""

    def scaled(gen):
        args = list(build(gen))
        for pos, factor in positions.items():
            args[pos] = (args[pos].double() * factor).to(args[pos].dtype)
        return tuple(args)

    return scaled


def _at_edge(build: Builder, pos: int) -> Builder:
    """``build`` with tensor argument ``pos`` scaled (in float64) so that its largest
    magnitude is :data:`FLOAT32_EDGE`."""

    def scaled(gen):
        args = list(build(gen))
        a = args[pos].double()
        args[pos] = (a * (FLOAT32_EDGE / a.abs().max())).to(args[pos].dtype)
        return tuple(args)

    return scaled


def _magnitude_label(factors: dict[str, float]) -> str:
    return "_".join(f"{arg}{factor:.0e}".replace("+", "") for arg, factor in factors.items())


def magnitude_cases(cases: list[Case], *, full: bool = False) -> list[Case]:
    """Family ``magnitude``: each base (:data:`MAGNITUDE_BASES` among ``cases``, bf16
    and float32; fp8 indexer inputs through their scales) once per factor set of
    :data:`MAGNITUDES` whose arguments are all bf16 / float32 tensors of the call, named
    ``<base>_<arg><factor>...`` (``rope-tiny_half_x1e30-bfloat16``). Quick mode takes
    bf16 and fp8 (float32 where a case has no other), ``--full`` float32 too."""
    out = []
    fp32_only = {(c.op, c.name, c.scheme) for c in cases if c.dtype == torch.float32} - {
        (c.op, c.name, c.scheme) for c in cases if c.dtype in LAYOUT_QUICK_DTYPES
    }
    for base in cases:
        if (base.op, base.name) not in MAGNITUDE_BASES or base.layout is not None:
            continue
        if base.dtype not in (torch.float32, torch.bfloat16, FP8_DTYPE):
            continue
        quick = base.dtype != torch.float32 or (base.op, base.name, base.scheme) in fp32_only
        if not (quick or full):
            continue
        args = base.args()
        names = SPECS[base.op].arg_names

        def scalable(pos, args=args):
            a = args[pos]
            return isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.bfloat16)

        variants = []
        for factors in MAGNITUDES[base.op]:
            pos = {names.index(arg): f for arg, f in factors.items()}
            if all(scalable(i) for i in pos):
                variants.append((_magnitude_label(factors), _times(base.build, pos)))
        for arg in EDGES.get(base.op, ()):
            if scalable(names.index(arg)) and args[names.index(arg)].abs().max() > 0:
                variants.append((f"{arg}_edge3e38", _at_edge(base.build, names.index(arg))))
        out += [
            replace(
                base, name=f"{base.name}_{label}", family="magnitude", build=b, full_only=not quick
            )
            for label, b in variants
        ]
    return out
