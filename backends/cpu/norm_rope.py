"""Reference RMSNorm and rotary embedding."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def rms_norm(x, weight, eps=1e-6):
    xf = x.to(acc_dtype())
    # Rows whose values exceed 1 are divided by their max |x| first: the mean of squares
    # of finite fp32 values beyond ~1e19 overflows, then rsqrt gives 0. Since
    # x * rsqrt(mean(x^2) + eps) = (x/s) * rsqrt(mean((x/s)^2) + eps/s^2), the result
    # is unchanged; s = 1 (no scaling) keeps small rows exact, where eps/s^2 could overflow.
    if x.shape[-1] == 0:  # no features (amax has nothing to reduce): nothing to scale
        return xf.to(out_dtype(x.dtype))
    s = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    xs = xf / s
    inv = torch.rsqrt(xs.pow(2).mean(dim=-1, keepdim=True) + eps / s.pow(2))
    return (xs * inv * weight.to(xf.dtype)).to(out_dtype(x.dtype))


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
