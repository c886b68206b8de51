"""MoE on any device. Routing (gate, sort-based dispatch, index_add combine) is the
reference's own device-neutral code; the grouped GEMM uses ``torch._grouped_mm`` where
it is a fused kernel and the strides allow, else one GEMM per expert's contiguous rows
written in place."""

from __future__ import annotations

import functools

import torch

from glmport.backends.cpu.moe import moe_combine, moe_dispatch, moe_gate
from glmport.core.formats import FLOAT_WEIGHT

from .quant import quant_gemm

__all__ = ["grouped_gemm", "moe_combine", "moe_dispatch", "moe_gate"]


@functools.cache
def _fused_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether to use ``torch._grouped_mm``: where it runs and is a fused kernel. On the
    CPU it is a loop of GEMMs that measured slower than the loop below (bench/generic.py),
    so the CPU takes the loop."""
    if device_type == "cpu":
        return False
    x = torch.ones(16, 16, dtype=dtype, device=device_type)
    w = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
    try:
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def _aligned(t: torch.Tensor) -> bool:
    return all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def grouped_gemm(x, w, expert_offsets, w_scale=None, scheme=FLOAT_WEIGHT, group_size=128):
    fused = scheme == FLOAT_WEIGHT and _fused_grouped_mm(x.device.type, x.dtype)
    if fused and _aligned(x) and _aligned(w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=expert_offsets[1:].to(torch.int32))
    bounds = expert_offsets.tolist()
    out = x.new_empty((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        r0, r1 = bounds[e], bounds[e + 1]
        if r1 == r0:
            continue
        if scheme == FLOAT_WEIGHT:
            torch.matmul(x[r0:r1], w[e].T, out=out[r0:r1])
        else:
            scale = None if w_scale is None else w_scale[e]
            out[r0:r1] = quant_gemm(x[r0:r1], w[e], scale, scheme, group_size)
    return out
