"""Cases of ``quantize`` (every format) and ``quant_gemm`` (every scheme, QAT, tails
and degenerate sizes).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from glmport.core.formats import SCHEMES

from .base import (
    DEGENERATE,
    FLOATS,
    Case,
    quantized_weight,
    randn,
    scaled_tiles,
    smallest_k,
    zero_every,
)


def quant_cases() -> Iterator[Case]:
    from glmport.core.formats import FORMATS

    for fmt in FORMATS:
        for name, family, (r, c), gs in [
            ("tiny", "tiny", (8, 64), 32),
            ("ragged_groups", "edge", (5, 200), 128),
            ("glm5", "glm5", (256, 2048), 128),
            # An all-zero row (padding), group and tile (pruned channels), and a tensor
            # of zeros: amax 0, the scale the format's floor.
            ("zero_groups", "zeros", (8, 256), 64),
            ("all_zero", "zeros", (4, 64), 32),
            # Past the tiles: 131 rows, 300 columns (int4: 384), a partial last group.
            ("tail", "tail", (131, 300), 128),
        ]:
            if fmt == "int4_group" and c % gs:  # int4 groups divide the row
                if family != "tail":
                    continue
                c = -(-c // gs) * gs
            for dtype in FLOATS:
                yield Case(
                    "quantize",
                    name,
                    family,
                    dtype,
                    build=lambda g, r=r, c=c, dtype=dtype, fmt=fmt, gs=gs, name=name: (
                        _quantize_input(g, r, c, gs, dtype, name),
                        fmt,
                        gs,
                    ),
                    params=(("cols", c), ("group_size", gs), ("rows", r)),
                    judge="quantize",
                    scheme=fmt,
                )
    for scheme in SCHEMES:
        for name, family, (m, n, k), gs in [
            ("tiny", "tiny", (4, 16, 64), 32),
            ("m1", "edge", (1, 32, 256), 64),
            ("k_not_128", "edge", (3, 24, 192), 64),
            ("multi_block", "edge", (4, 256, 384), 64),  # NB 2 x KB 3 FP8 blocks
            ("glm5", "glm5", (16, 512, 2048), 128),
        ]:
            # Scale indexing does not depend on x's dtype: one is enough for multi_block.
            for dtype in (torch.bfloat16,) if name == "multi_block" else FLOATS:
                yield Case(
                    "quant_gemm",
                    name,
                    family,
                    dtype,
                    build=_quant_gemm(m, n, k, scheme, gs, dtype),
                    params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                    judge="gemm",
                    scheme=scheme,
                )
        for name, (m, n, k) in DEGENERATE.items():
            k, gs = smallest_k(scheme, k)
            yield Case(
                "quant_gemm",
                name,
                "edge",
                torch.bfloat16,
                build=_quant_gemm(m, n, k, scheme, gs, torch.bfloat16),
                params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                judge="gemm",
                scheme=scheme,
            )
        yield Case(
            "quant_gemm",
            "qat",
            "tiny",
            torch.float32,
            build=_quant_gemm(4, 16, 128, scheme, 32, torch.float32, qat=True),
            params=(("group_size", 32), ("k", 128), ("m", 4), ("n", 16)),
            judge="gemm",
            scheme=scheme,
        )
        # Zero rows of x (padding tokens), and zero weight groups under QAT: the formats'
        # amax floors; past the tiles: M 200 (prefill row tiles of 128), N 200, K 320.
        for name, family, (m, n, k), gs, qat, dtypes, quick in [
            ("zero_rows", "zeros", (8, 16, 128), 32, False, FLOATS, FLOATS),
            ("qat_zero_groups", "zeros", (6, 16, 128), 32, True, (torch.float32,), FLOATS),
            ("tail", "tail", (200, 200, 320), 64, False, FLOATS, (torch.bfloat16,)),
        ]:
            for dtype in dtypes:
                yield Case(
                    "quant_gemm",
                    name,
                    family,
                    dtype,
                    build=_quant_gemm(m, n, k, scheme, gs, dtype, qat=qat, zeros=family == "zeros"),
                    params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                    judge="gemm",
                    scheme=scheme,
                    full_only=dtype not in quick,
                )


def _quantize_input(gen, r: int, c: int, gs: int, dtype, name: str) -> torch.Tensor:
    """``quantize``'s ``x`` ``[R, C]``: N(0, 1), with zeros for the ``zeros`` cases
    (``zero_groups``: row 2, and columns ``[gs, 2 gs)`` of every row; ``all_zero``)."""
    x = randn(gen, r, c, dtype=dtype)
    if name == "all_zero":
        return torch.zeros_like(x)
    if name == "zero_groups":
        x[2] = 0
        x[:, gs : 2 * gs] = 0
    return x


def _quant_gemm(m, n, k, scheme, gs, dtype, qat=False, zeros=False):
    """``quant_gemm`` arguments; ``zeros``: every third row of ``x`` zero (padding
    tokens) and, for QAT, weight row 1 and the first group of every row zero."""

    def build(gen):
        x = zero_every(randn(gen, m, k, dtype=dtype), 3 if zeros else 0)
        w = randn(gen, n, k, scale=k**-0.5)
        if zeros and qat:
            w[1] = 0
            w[:, :gs] = 0
        if qat:
            return x, w.to(dtype), None, scheme, gs
        # Activation groups (1 x 128 for FP8) of different magnitudes too.
        x = scaled_tiles(gen, x, 1, 128)
        wq, ws = quantized_weight(gen, w, scheme, gs)
        return x, wq, ws, scheme, gs

    return build
