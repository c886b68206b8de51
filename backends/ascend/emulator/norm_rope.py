"""``torch_npu.npu_rms_norm`` and ``torch_npu.npu_rotary_mul`` on the CPU, as their
documentation defines them for Atlas A2 / A3 (Ascend 910B / 910_93).

Both compute in float32 and round once to the input's dtype, as the NPU kernels do
(RmsNorm casts ``x`` and ``gamma`` to fp32, reduces, scales and casts back:
hicann/ops-nn ``norm/rms_norm/op_kernel/rms_norm.h``; RotaryPositionEmbedding keeps
fp16 / bf16 tiles in fp32 buffers: ops-transformer
``posembedding/rotary_position_embedding/op_host/rope_*_tiling.cpp``).
"""

from __future__ import annotations

import torch

from .contract import require

__all__ = ["npu_rms_norm", "npu_rotary_mul"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

# (self, gamma) dtype pairs on Atlas A2 / A3 (the doc's table); y takes self's dtype,
# rstd is always float32.
_RMS_NORM_DTYPES = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
}


def npu_rms_norm(
    self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``.

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_rms_norm.md``
    (gitcode.com/Ascend/op-plugin, master), shapes and outputs as in
    hicann/ops-nn ``norm/rms_norm/docs/aclnnRmsNorm.md``. The parameter names are the
    schema's (``op_plugin/config/op_plugin_functions.yaml``).

    ``y = self * rstd * gamma`` with ``rstd = 1 / sqrt(mean(self**2) + epsilon)``, the
    mean over the trailing ``gamma.dim()`` dims of ``self``.

    Args:
        self: 2-8 dims, fp16 | bf16 | fp32, any strides, may be empty. (aclnnRmsNorm
            takes 1-8 dims; the torch_npu page says 2-8, which is what is enforced.)
        gamma: ``self``'s trailing shape (``gamma_shape = self_shape[n:]``,
            ``n < self.dim()``, usually ``[D]``), 1-8 dims. The torch_npu page says 2-8
            but its own example passes a 1-D gamma; aclnnRmsNorm's 1-8 is enforced.
            Dtype pairs (self, gamma) on A2 / A3: (fp16, fp32), (bf16, fp32),
            (fp16, fp16), (bf16, bf16), (fp32, fp32).
        epsilon: added to the mean square (the kernel takes it as float32).

    Returns:
        ``y``: ``self``'s shape and dtype; ``rstd``: float32 ``self.shape[:n]`` followed
        by ``gamma.dim()`` ones (``[R, 1]`` for a 2-D ``self`` and 1-D ``gamma``).
    """
    op = "npu_rms_norm"
    require(
        self.dtype in _FLOATS, op, f"self must be float16, bfloat16 or float32, got {self.dtype}"
    )
    require(2 <= self.dim() <= 8, op, f"self must have 2 to 8 dims, got {self.dim()}")
    require(
        gamma.dtype in _FLOATS, op, f"gamma must be float16, bfloat16 or float32, got {gamma.dtype}"
    )
    require(
        1 <= gamma.dim() <= self.dim(),
        op,
        f"gamma must have 1 to self.dim() = {self.dim()} dims "
        f"(gamma_shape = self_shape[n:], n < self.dim()), got {gamma.dim()}",
    )
    lead = self.dim() - gamma.dim()
    require(
        tuple(gamma.shape) == tuple(self.shape[lead:]),
        op,
        f"gamma's shape must be self's trailing dims (gamma_shape = self_shape[n:]), got "
        f"gamma {tuple(gamma.shape)} for self {tuple(self.shape)}",
    )
    require(
        (self.dtype, gamma.dtype) in _RMS_NORM_DTYPES,
        op,
        f"(self, gamma) dtypes {self.dtype}, {gamma.dtype} are not a supported pair on "
        "Atlas A2 / A3: (fp16, fp32), (bf16, fp32), (fp16, fp16), (bf16, bf16), (fp32, fp32)",
    )
    dims = tuple(range(lead, self.dim()))
    xf = self.float()
    rstd = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + epsilon)
    y = xf * rstd * gamma.float()
    return y.to(self.dtype), rstd


# x layouts npu_rotary_mul reads (the letters name x's dims) and, per rotary_mode, the
# r1 / r2 shapes it broadcasts over each ("1": a broadcast dim). It tells the layout
# from r1's shape alone; a shape several layouts read is accepted if one of them is.
_ROTARY_LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "BNSD": {"half": ("11SD", "B1SD", "BNSD"), "interleave": ("11SD",)},
    "BSND": {"half": ("1S1D", "BS1D", "BSND"), "interleave": ("1S1D",)},
    "SBND": {"half": ("S11D", "SB1D", "SBND"), "interleave": ("S11D",)},
    "TND": {"half": ("T1D", "TND"), "interleave": ("T1D",)},
}
# D < 896 and even, in both modes (jit_compile=False, Atlas A2 / A3).
_ROTARY_MAX_D = 896
# half: B < 1000 and N < 1000; interleave: B * N < 1000.
_ROTARY_MAX_BN = 1000


def _rotary_layouts(x_shape: tuple[int, ...], r_shape: tuple[int, ...], mode: str) -> list[dict]:
    """The (layout, r pattern, sizes) readings of ``x_shape`` under which ``r_shape``
    is a documented r1 / r2 shape for ``mode``."""
    found = []
    for layout, patterns in _ROTARY_LAYOUTS.items():
        if len(layout) != len(x_shape):
            continue
        sizes = dict(zip(layout, x_shape, strict=True))
        for pattern in patterns[mode]:
            if tuple(1 if c == "1" else sizes[c] for c in pattern) == r_shape:
                found.append({"layout": layout, "r": pattern, **sizes})
    return found


def _within_bn(reading: dict, mode: str) -> bool:
    b, n = reading.get("B", 1), reading["N"]
    if mode == "half":
        return b < _ROTARY_MAX_BN and n < _ROTARY_MAX_BN
    return b * n < _ROTARY_MAX_BN


def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half', rotate=None)``.

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_rotary_mul.md``
    (gitcode.com/Ascend/op-plugin, master; constraints of the ``jit_compile=False``
    path, Atlas A2 / A3 training series), with aclnnRotaryPositionEmbedding's page
    (ops-transformer ``posembedding/rotary_position_embedding/docs/``). ``rotary_mode``
    exists from Ascend Extension for PyTorch 7.0.0 (op-plugin branch 7.0.0, commit
    303f505c; 6.0.0's schema is ``npu_rotary_mul(self, r1, r2)``), ``rotate`` from
    26.0.0. The first parameter is the schema's ``self`` (the page calls it ``input``).

    ``y = self * r1 + rotate(self) * r2`` over the last dim ``D``:

    - ``"half"``: ``rotate(x) = cat(-x[..., D/2:], x[..., :D/2])``;
    - ``"interleave"``: ``rotate(x)[2i] = -x[2i+1]``, ``rotate(x)[2i+1] = x[2i]``.

    Args:
        self: 4-D (BNSD, BSND or SBND) or 3-D (TND), fp16 | bf16 | fp32, any strides.
            ``D < 896`` and even. half: ``B < 1000`` and ``N < 1000``; interleave:
            ``B * N < 1000``.
        r1, r2: the cos / sin factors, one shape, ``self``'s number of dims, fp16 |
            bf16 | fp32 (torch_npu casts them to ``self``'s dtype when they differ:
            op-plugin ``op_plugin/ops/opapi/RotaryMulKernelNpuOpApi.cpp``; aclnn itself
            takes one dtype). Shapes by layout: half: BNSD 11SD / B1SD / BNSD, BSND 1S1D
            / BS1D / BSND, SBND S11D / SB1D / SBND, TND T1D / TND; interleave: 11SD,
            1S1D, S11D, T1D only. Values in [-1, 1] (documented range, not checked).
        rotary_mode: ``"half"`` or ``"interleave"`` (``"quarter"`` and
            ``"interleave-half"`` are Ascend 950 only).
        rotate: a ``[D, D]`` matrix replacing ``rotate(x)``; not emulated.

    Returns:
        ``self``'s shape and dtype, computed in float32.
    """
    op = "npu_rotary_mul"
    if rotate is not None:
        raise NotImplementedError(f"{op}: the emulator does not model the rotate matrix")
    require(
        rotary_mode in ("half", "interleave"),
        op,
        f"rotary_mode must be 'half' or 'interleave' on Atlas A2 / A3, got {rotary_mode!r}",
    )
    for name, t in (("input", self), ("r1", r1), ("r2", r2)):
        require(
            t.dtype in _FLOATS, op, f"{name} must be float16, bfloat16 or float32, got {t.dtype}"
        )
    require(
        self.dim() in (3, 4),
        op,
        f"input must be 4-D (BNSD, BSND, SBND) or 3-D (TND), got {self.dim()} dims",
    )
    require(
        r1.dim() == self.dim() and r2.dim() == self.dim(),
        op,
        f"r1 and r2 must have input's {self.dim()} dims, got {r1.dim()} and {r2.dim()}",
    )
    require(
        r1.shape == r2.shape,
        op,
        f"r1 and r2 must have one shape, got {tuple(r1.shape)} and {tuple(r2.shape)}",
    )
    d = self.shape[-1]
    require(
        d % 2 == 0 and d < _ROTARY_MAX_D,
        op,
        f"input's last dim D must be even and < {_ROTARY_MAX_D}, got {d}",
    )
    require(
        r1.shape[-1] == d, op, f"r1 / r2's last dim must be input's D = {d}, got {r1.shape[-1]}"
    )
    readings = _rotary_layouts(tuple(self.shape), tuple(r1.shape), rotary_mode)
    allowed = {k: v[rotary_mode] for k, v in _ROTARY_LAYOUTS.items() if len(k) == self.dim()}
    require(
        bool(readings),
        op,
        f"r1 / r2 shape {tuple(r1.shape)} is not a supported broadcast of input "
        f"{tuple(self.shape)} in rotary_mode {rotary_mode!r} (by input layout: {allowed})",
    )
    limit = "B < 1000 and N < 1000" if rotary_mode == "half" else "B * N < 1000"
    require(
        any(_within_bn(r, rotary_mode) for r in readings),
        op,
        f"rotary_mode {rotary_mode!r} needs {limit}, got "
        + "; ".join(f"{r['layout']} B={r.get('B', 1)} N={r['N']}" for r in readings),
    )
    x = self.float()
    cos = r1.to(self.dtype).float()
    sin = r2.to(self.dtype).float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * cos + turned * sin).to(self.dtype)
