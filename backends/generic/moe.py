"""MoE on any device. The gate and the sort-based dispatch are the reference's own
device-neutral code; the combine weights and adds the expert rows in cache-sized row
tiles; the grouped GEMM uses ``torch._grouped_mm`` where it is a fused kernel and the
strides allow, else one GEMM per expert's contiguous rows written in place."""

from __future__ import annotations

import functools

import torch

from glmport.backends.cpu.moe import moe_dispatch, moe_gate, owned_rows
from glmport.core.formats import FLOAT_WEIGHT

from .quant import int_gemm, quant_gemm

__all__ = ["grouped_gemm", "grouped_gemm_prepared", "moe_combine", "moe_dispatch", "moe_gate"]


# Rows of weighted expert output added per step of moe_combine: about 1 MiB of fp32 at
# hidden 1024, so the tile is reused from cache instead of a [T*k, D] product.
_COMBINE_TILE_ELEMENTS = 1 << 18


def moe_combine(
    y_sorted: torch.Tensor, src_row: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The reference's weighted ``index_add`` (same order of additions, fp32), one row
    tile at a time: a whole ``[T*k, D]`` product would be a fresh allocation as large
    as ``y_sorted``, whose first touch costs more than the arithmetic. A ``src_row``
    outside ``[0, T*k)`` (unchecked under ``GLMPORT_VALIDATE=meta``) adds its row to
    a spare output row ``T``, dropped at the end."""
    t, k = weights.shape
    n, d = y_sorted.shape
    rows = src_row.long()
    valid = (rows >= 0) & (rows < t * k)
    rows = torch.where(valid, rows, 0)
    target = torch.where(valid, rows // k, t)
    row_weight = weights.reshape(-1).float()[rows][:, None]
    out = torch.zeros(t + 1, d, dtype=torch.float32, device=y_sorted.device)
    step = max(1, _COMBINE_TILE_ELEMENTS // max(1, d))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        out.index_add_(0, target[r0:r1], y_sorted[r0:r1].float() * row_weight[r0:r1])
    return out[:t].to(y_sorted.dtype)


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


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` is trusted with ``x [M, K]`` times ``w [E, N, K]``
    transposed: both exactly row-major (a size-1 dimension's stride is still read),
    16-byte aligned rows (K and N) and base pointers."""
    row_bytes = x.element_size()
    return (
        x.stride() == (x.shape[1], 1)
        and w.stride() == (w.shape[1] * w.shape[2], w.shape[2], 1)
        and x.shape[1] * row_bytes % 16 == 0
        and w.shape[1] * row_bytes % 16 == 0
        and x.shape[1] > 0
        and w.shape[1] > 0
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    )


def grouped_gemm(x, w, expert_offsets, w_scale=None, scheme=FLOAT_WEIGHT, group_size=128):
    m = x.shape[0]
    offsets = owned_rows(expert_offsets, m)  # a partition even when unchecked (meta mode)
    fused = scheme == FLOAT_WEIGHT and _fused_grouped_mm(x.device.type, x.dtype)
    if fused and _grouped_mm_fits(x, w):
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:].to(torch.int32))
        # _grouped_mm starts expert 0 at row 0 and leaves rows past the last offset
        # unwritten: zero the rows of no expert on the device, without a host sync.
        rows = torch.arange(m, device=x.device)
        return y.masked_fill_(((rows < offsets[0]) | (rows >= offsets[-1]))[:, None], 0)

    def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        if scheme == FLOAT_WEIGHT:
            torch.matmul(rows, w[e].T, out=out)
        else:
            scale = None if w_scale is None else w_scale[e]
            out.copy_(quant_gemm(rows, w[e], scale, scheme, group_size))

    return _per_expert(x, offsets, w.shape[0], w.shape[1], expert)


def grouped_gemm_prepared(x, prepared, expert_offsets, w_scale, scheme, group_size=128):
    """``grouped_gemm`` on weights from :func:`.quant.prepare_weight` (``w_t [E, K, N]``)."""
    w_t = prepared.native["w_t"]
    offsets = owned_rows(expert_offsets, x.shape[0])

    def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(int_gemm(rows, w_t[e], w_scale[e]))

    return _per_expert(x, offsets, w_t.shape[0], w_t.shape[2], expert)


def _per_expert(x, offsets, num_experts: int, n: int, expert) -> torch.Tensor:
    """``[M, n]``: ``expert(e, rows, out)`` writes each expert's rows in place; rows of
    no expert are zero."""
    bounds = offsets.tolist()
    out = x.new_empty((x.shape[0], n))
    out[: bounds[0]] = 0
    out[bounds[-1] :] = 0
    for e in range(num_experts):
        r0, r1 = bounds[e], bounds[e + 1]
        if r1 > r0:
            expert(e, x[r0:r1], out[r0:r1])
    return out
