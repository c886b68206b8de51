"""Cases of ``rms_norm`` and ``rope`` (interleaved and half rotation): tiny, GLM-5's
widths, T=1, rows and rotary widths past the tiles.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import FLOATS, Case, randn


def norm_rope_cases() -> Iterator[Case]:
    for name, family, shape in [
        ("tiny", "tiny", (5, 32)),
        ("glm5", "glm5", (8, 6144)),
        ("t1_3d", "edge", (1, 4, 512)),
        # Past the tiles: 130 rows of 200, and rows of 8200 (past a GPU's 8192 per block).
        ("tail_rows", "tail", (130, 200)),
        ("tail_width", "tail", (3, 8200)),
    ]:
        for dtype in FLOATS:
            yield Case(
                "rms_norm",
                name,
                family,
                dtype,
                build=lambda g, shape=shape, dtype=dtype: (
                    randn(g, *shape, dtype=dtype),
                    (1 + randn(g, shape[-1], scale=0.1)).to(dtype),
                    1e-5,
                ),
                params=(("shape", shape),),
            )
    for interleaved in (True, False):
        for name, family, shape in [
            ("tiny", "tiny", (6, 2, 16)),
            ("glm5", "glm5", (16, 64, 64)),
            ("t1_2d", "edge", (1, 64)),
            # Rotary widths past 64 (pairs beyond 32), 96 pairs (no power of two), and
            # 17 heads past the head blocks.
            ("rotary_128", "rotary", (4, 2, 128)),
            ("rotary_192", "rotary", (5, 17, 192)),
        ]:
            for dtype in FLOATS:

                def build(g, shape=shape, dtype=dtype, interleaved=interleaved):
                    t, d = shape[0], shape[-1]
                    pos = torch.arange(t, dtype=torch.float64)[:, None] + 1000
                    freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
                    ang = pos * freq
                    return (
                        randn(g, *shape, dtype=dtype),
                        ang.cos().float(),
                        ang.sin().float(),
                        interleaved,
                    )

                yield Case(
                    "rope",
                    f"{name}_{'interleaved' if interleaved else 'half'}",
                    family,
                    dtype,
                    build=build,
                    params=(("interleaved", interleaved), ("shape", shape)),
                )
