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

__all__ = ["int_gemm", "prepare_weight", "quant_gemm", "quant_gemm_prepared", "quantize"]


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


# The fast kernels read a matrix through its strides as a BLAS leading dimension, and
# each has size and alignment minimums (cuBLASLt: int8 GEMMs need K and N multiples of
# 8 and M > 16, fp8 GEMMs K and N multiples of 16). A size-1 dimension may carry any
# stride (``is_contiguous()`` ignores it), which a BLAS still reads; K = 1, N = 1 and
# M = 1 are exactly the calls where this happens. Outside these bounds the exact
# portable path runs.
_INT_MM_ALIGN = 8
_INT_MM_MIN_ROWS = {"cpu": 1}  # other devices: cuBLASLt's M > 16
_SCALED_MM_ALIGN = 16
# int8 x int8 products are at most 127^2: fp32 sums stay exact integers below 2^24
# for up to this many products, whatever the summation order.
_EXACT_FP32_TERMS = (1 << 24) // (127 * 127)


def canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly row-major strides, size-1 dimensions included (a copy only
    when they differ)."""
    want, step = [], 1
    for size in reversed(t.shape):
        want.append(step)
        step *= size
    if t.stride() == tuple(reversed(want)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _int_mm_fits(a: torch.Tensor, b_t: torch.Tensor) -> bool:
    """Whether ``torch._int_mm`` is trusted with ``a [M, K] @ b_t [K, N]`` (row-major)."""
    (m, k), n = a.shape, b_t.shape[1]
    min_rows = _INT_MM_MIN_ROWS.get(a.device.type, 17)
    aligned = k % _INT_MM_ALIGN == 0 and n % _INT_MM_ALIGN == 0
    return m >= min_rows and k > 0 and n > 0 and aligned


def _int_dot(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``a @ b_t`` for int8 ``a [M, g]`` and int8 ``b_t [g, N]``."""
    a, b_t = canonical(a), canonical(b_t)
    if _int_mm_fits(a, b_t) and _has(a.device.type, "int_mm"):
        return torch._int_mm(a, b_t)
    # Portable and exact on any device (integer matmul is CPU-only): fp32 GEMMs over
    # chunks of K short enough that every partial sum is an exactly representable
    # integer (TF32 too: int8 needs 7 of its 10 mantissa bits), accumulated in int32.
    out = torch.zeros(a.shape[0], b_t.shape[1], dtype=torch.int32, device=a.device)
    for k0 in range(0, a.shape[1], _EXACT_FP32_TERMS):
        k1 = k0 + _EXACT_FP32_TERMS
        out += (a[:, k0:k1].float() @ b_t[k0:k1].float()).to(torch.int32)
    return out


def _scaled_mm_fits(xa: torch.Tensor, n: int) -> bool:
    """Whether ``torch._scaled_mm`` is trusted with ``xa [M, bk]`` times ``[bk, N]``."""
    return xa.shape[1] % _SCALED_MM_ALIGN == 0 and n % _SCALED_MM_ALIGN == 0 and n > 0


def int8_transposed(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """An int8 / int4 packed weight ``[..., N, K']`` as contiguous int8 ``[..., K, N]``:
    the layout the integer GEMM multiplies by (int4 unpacked, one byte a value)."""
    qw = unpack_int4(w) if SCHEMES[scheme].weight.storage == torch.uint8 else w
    return qw.transpose(-1, -2).contiguous()


def prepare_weight(op, w, w_scale, scheme, emulate):
    """The generic backend's native layout: W8A8 / W4A8 weights unpacked and
    transposed once (``{"w_t": int8 [..., K, N]}``), so a call skips the int4 unpack
    and the per-call transposed copy. Int4 weights then take a byte a value (twice
    the packed size) while prepared. Other schemes keep the canonical layout."""
    act = SCHEMES[scheme].activation
    if act is None or act.storage != torch.int8:
        return None
    return {"w_t": int8_transposed(w, scheme)}


def quant_gemm(x, w, w_scale, scheme, group_size=128):
    s = SCHEMES[scheme]
    if x.shape[0] == 0:
        return x.new_empty((0, w.shape[0]))
    if w_scale is None or s.activation is None:
        xf = fake_quant_activation(x, scheme) if w_scale is None else x.float()
        return (xf @ dequantize_weight(w, w_scale, scheme, group_size).T).to(x.dtype)
    if s.activation.storage == torch.int8:
        return int_gemm(x, int8_transposed(w, scheme), w_scale).to(x.dtype)
    return _fp8_gemm(x, w, w_scale, scheme).to(x.dtype)


def quant_gemm_prepared(x, prepared, w_scale, scheme, group_size=128):
    """``quant_gemm`` on a weight from :func:`prepare_weight`."""
    if x.shape[0] == 0:
        return x.new_empty((0, prepared.w.shape[0]))
    return int_gemm(x, prepared.native["w_t"], w_scale).to(x.dtype)


def int_gemm(x: torch.Tensor, w_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 / W4A8: ``x [M, K]`` quantised per row to int8, times int8 ``w_t [K, N]``
    (see :func:`int8_transposed`) per weight group, exact in int32; fp32 ``[M, N]``."""
    qx, sx = quantize_tensor(x, "int8_row", x.shape[1])
    k, n = w_t.shape
    sw = w_scale.reshape(n, -1)  # [N, G]; per-channel is one group of K
    g = k // sw.shape[1]
    y = torch.zeros(qx.shape[0], n, device=x.device)
    for gi in range(sw.shape[1]):
        part = _int_dot(qx[:, gi * g : (gi + 1) * g], w_t[gi * g : (gi + 1) * g])
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
        if fast and _scaled_mm_fits(xa, wb.shape[0]):
            # b is read column-major: the transpose of an exactly row-major [N, bk].
            y += torch._scaled_mm(canonical(xa), canonical(wb).T, scale_a=sa, scale_b=sb,
                                  out_dtype=torch.float32)  # fmt: skip
        else:
            y += (xa.float() @ wb.float().T) * sa * sb
    return y
