"""Reference RMSNorm and rotary embedding."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def rms_norm(x, weight, eps=1e-6):
    xf = x.to(acc_dtype())
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(xf.dtype)
    return y.to(out_dtype(x.dtype))


def rope(x, cos, sin, interleaved=True):
    xf = x.to(acc_dtype())
    # cos/sin are [T, D/2]; broadcast over any head dims between T and D.
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    c, s = cos.to(xf.dtype).reshape(view), sin.to(xf.dtype).reshape(view)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        y = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return y.to(out_dtype(x.dtype))
