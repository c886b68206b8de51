"""Cases of ``mla_prolog``: tiny, GLM-5's per-head widths (64 heads, nope 192, rope
64, kv_lora 512) on a reduced hidden size, DeepSeek-V3.2's widths (the ones
``npu_mla_prolog_v3`` documents: hidden 7168, q_lora 1536, nope 128), one token, no
token, and widths past the tiles (no power of two, an odd number of rotary pairs);
each with float projections and again as W8A8 (``*_w8a8``: int8 per-channel weights
whose rows' scales differ, as ``quant_gemm``'s cases build them).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import FLOATS, Case, quantized_weight, randn

# The quantised variant's scheme (the op's only one) and its case-name suffix.
W8A8 = "w8a8"

# (name, family, dtypes, T, hidden, q_lora, heads, nope, kv_lora, rope)
_SHAPES = (
    ("tiny", "tiny", FLOATS, 5, 64, 48, 4, 16, 32, 8),
    ("glm5_heads", "glm5", FLOATS, 4, 1024, 512, 64, 192, 512, 64),
    ("dsv32", "glm5", (torch.bfloat16,), 3, 7168, 1536, 8, 128, 512, 64),
    ("t1", "edge", FLOATS, 1, 64, 48, 2, 16, 32, 8),
    ("t0", "edge", FLOATS, 0, 64, 48, 2, 16, 32, 8),
    ("tail", "tail", FLOATS, 3, 96, 200, 3, 24, 72, 6),
)


def _build(
    g: torch.Generator,
    dtype: torch.dtype,
    t: int,
    hidden: int,
    q_lora: int,
    heads: int,
    nope: int,
    kv_lora: int,
    rope: int,
    quantised: bool,
) -> tuple:
    """Arguments in schema order: weights scaled by ``fan_in ** -0.5`` so every
    intermediate stays near unit size, gains near 1, angles of positions past 1000;
    ``quantised``: the three projections packed W8A8, their scales last."""
    x = randn(g, t, hidden, dtype=dtype)
    w_dq = randn(g, q_lora, hidden, dtype=dtype, scale=hidden**-0.5)
    gamma_cq = (1 + randn(g, q_lora, scale=0.1)).to(dtype)
    w_uq = randn(g, heads * (nope + rope), q_lora, dtype=dtype, scale=q_lora**-0.5)
    w_uk = randn(g, heads, nope, kv_lora, dtype=dtype, scale=nope**-0.5)
    w_dkv = randn(g, kv_lora + rope, hidden, dtype=dtype, scale=hidden**-0.5)
    gamma_ckv = (1 + randn(g, kv_lora, scale=0.1)).to(dtype)
    pos = torch.arange(t, dtype=torch.float64)[:, None] + 1000
    angle = pos * 1e4 ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    cos, sin = angle.cos().float(), angle.sin().float()
    if not quantised:
        return x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, 1e-6
    (w_dq, s_dq), (w_uq, s_uq), (w_dkv, s_dkv) = (
        quantized_weight(g, w, W8A8, w.shape[1]) for w in (w_dq, w_uq, w_dkv)
    )
    return x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, 1e-6, s_dq, s_uq, s_dkv


def mla_cases() -> Iterator[Case]:
    keys = ("T", "hidden", "q_lora", "heads", "nope", "kv_lora", "rope")
    for quantised in (False, True):
        for name, family, dtypes, *dims in _SHAPES:
            for dtype in dtypes:
                yield Case(
                    "mla_prolog",
                    f"{name}_{W8A8}" if quantised else name,
                    family,
                    dtype,
                    build=lambda g, dtype=dtype, dims=tuple(dims), q=quantised: _build(
                        g, dtype, *dims, q
                    ),
                    params=(
                        *zip(keys, dims, strict=True),
                        ("scheme", W8A8 if quantised else "none"),
                    ),
                )
