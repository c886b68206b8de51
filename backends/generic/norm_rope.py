"""RMSNorm and RoPE. RMSNorm is torch's fused ``rms_norm`` computed in float32 (one
kernel where the reference's overflow-proof form takes eight: it matters at decode,
where rows are short and every call is paid per token); inputs whose sum of squares
leaves the float32 range are refused by the op's value checks. RoPE is the
reference's code, already device-neutral, elementwise and memory-light."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmport.backends.cpu.norm_rope import rope

__all__ = ["rms_norm", "rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x [..., D] * rsqrt(mean(x**2) + eps) * weight [D]`` in float32, returned in
    ``x``'s dtype."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(x.dtype)
