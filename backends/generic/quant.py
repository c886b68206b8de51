"""Quantised GEMMs on any device: W8A8 through ``torch._int_mm`` where the device has
it (CPU and CUDA do), W4A8 / W4A16 unpacked per K group, FP8-block through
``torch._scaled_mm`` where supported, else dequantised in tiles. Integer paths stay
exact in int32."""

from __future__ import annotations

import functools

import torch

from glmport.backends.cpu.quant import quantize  # the format definition itself
from glmport.core.formats import (
    FP8_DTYPE,
    SCHEMES,
    dequantize_weight,
    fake_quant_activation,
    quantize_tensor,
    unpack_int4,
)

__all__ = ["quant_gemm", "quantize"]


@functools.cache
def _has(device_type: str, probe: str) -> bool:
    """Whether ``torch._int_mm`` / ``torch._scaled_mm`` runs on this device type."""
    dev = torch.device(device_type)
    try:
        if probe == "int_mm":
            a = torch.ones(32, 32, dtype=torch.int8, device=dev)
            torch._int_mm(a, a)
        else:
            a = torch.ones(32, 32, device=dev).to(FP8_DTYPE)
            one = torch.ones((), device=dev)
            torch._scaled_mm(a, a.T, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _int_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``a @ b.T`` for int8 ``a [M, g]``, ``b [N, g]``."""
    if _has(a.device.type, "int_mm"):
        return torch._int_mm(a, b.T.contiguous())
    return a.to(torch.int32) @ b.to(torch.int32).T


def quant_gemm(x, w, w_scale, scheme, group_size=128):
    s = SCHEMES[scheme]
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[0]))
    if w_scale is None or s.activation is None:
        xf = fake_quant_activation(x, scheme) if w_scale is None else x.float()
        return (xf @ dequantize_weight(w, w_scale, scheme, group_size).T).to(x.dtype)
    if s.activation.storage == torch.int8:
        return _int_gemm(x, w, w_scale, scheme).to(x.dtype)
    return _fp8_gemm(x, w, w_scale, scheme).to(x.dtype)


def _int_gemm(x, w, w_scale, scheme):
    qx, sx = quantize_tensor(x, "int8_row", x.shape[1])
    qw = unpack_int4(w) if SCHEMES[scheme].weight.storage == torch.uint8 else w
    k = qx.shape[1]
    sw = w_scale.reshape(qw.shape[0], -1)  # [N, G]; per-channel is one group of K
    g = k // sw.shape[1]
    y = torch.zeros(qx.shape[0], qw.shape[0], device=x.device)
    for gi in range(sw.shape[1]):
        part = _int_dot(qx[:, gi * g : (gi + 1) * g], qw[:, gi * g : (gi + 1) * g])
        y += part.float() * sw[:, gi][None, :]
    return y * sx[:, None]


def _fp8_gemm(x, w, w_scale, scheme):
    s = SCHEMES[scheme]
    block = s.fixed_group_size
    qx, sx = quantize_tensor(x, s.activation.name, block)
    sw = w_scale.repeat_interleave(block, dim=0)[: w.shape[0]]  # [N, KB]
    fast = _has(x.device.type, "scaled_mm")
    y = torch.zeros(x.shape[0], w.shape[0], device=x.device)
    for kb, k0 in enumerate(range(0, x.shape[1], block)):
        xa, wb = qx[:, k0 : k0 + block], w[:, k0 : k0 + block]
        sa, sb = sx[:, kb : kb + 1].contiguous(), sw[:, kb][None, :].contiguous()
        if fast:
            y += torch._scaled_mm(xa.contiguous(), wb.contiguous().T, scale_a=sa, scale_b=sb,
                                  out_dtype=torch.float32)  # fmt: skip
        else:
            y += (xa.float() @ wb.float().T) * sa * sb
    return y
