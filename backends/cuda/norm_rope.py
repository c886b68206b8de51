"""RMSNorm and rotary position embedding as Triton kernels.

Both are memory-bound elementwise passes: one read and one write of ``x``, the math in
float32 and one rounding to ``x``'s dtype at the store, as the reference does.

- ``rms_norm``: ``x`` is viewed as rows ``[R, D]`` (any leading shape, any strides);
  a program normalises ``BLOCK_R`` rows. A row that fits ``BLOCK_D`` stays in
  registers (one read); a wider one takes two passes over column chunks (sum of
  squares, then scale).
- ``rope``: ``x [T, ..., D]`` is viewed as ``[T, H, D]`` (the middle dims merged); a
  program rotates ``BLOCK_H`` heads of one token, ``BLOCK_HALF`` pairs at a time, each
  chunk of the token's ``cos`` / ``sin`` row loaded once for all its heads. The layout
  only changes which two columns form pair ``i``: ``(2i, 2i+1)`` interleaved,
  ``(i, i + D/2)`` half-split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreter_plan, next_pow2, rounded_to, tuned


def _limits() -> tuple[int, int, int]:
    """(x elements a program holds, the widest row rms_norm keeps whole in registers
    (and its column chunk beyond that), rotary pairs per head a rope program handles at
    once (more take a loop)): a register budget on a GPU; large under the interpreter,
    whose time grows with the number of programs, not with their size."""
    return (1 << 16, 1 << 16, 4096) if interpreter_plan() else (4096, 8192, 256)


def _view(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``x`` reshaped to ``shape`` without a copy when its strides allow it (a slice of
    the last dim, a transposed leading dim do), else a contiguous copy."""
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


# -- rms_norm -----------------------------------------------------------------------


@triton.jit
def _rms_scale_store(x, rstd, w_ptr, stride_w, out_rows, cols, col_mask, mask):
    """Store ``x * rstd * weight`` (float32 ``[BLOCK_R, BLOCK_D]``) rounded to the output
    dtype, multiplying in the reference's order."""
    w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_rows + cols[None, :], rounded_to(y, out_rows.dtype.element_ty), mask=mask)


@tuned(
    configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8)],
    key=["n_cols", "BLOCK_R", "BLOCK_D"],
    interpreter={},
)
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_xr,
    stride_xc,
    stride_w,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows[:, None] * stride_xr
    out_rows = out_ptr + rows[:, None] * n_cols
    cols = tl.arange(0, BLOCK_D)
    if ONE_PASS:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        _rms_scale_store(x, rstd, w_ptr, stride_w, out_rows, cols, col_mask, mask)
    else:
        sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK_D):
            mask = row_mask[:, None] & (c0 + cols < n_cols)[None, :]
            x = tl.load(x_rows + (c0 + cols)[None, :] * stride_xc, mask=mask, other=0.0)
            x = x.to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        for c0 in range(0, n_cols, BLOCK_D):
            col_mask = c0 + cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + (c0 + cols)[None, :] * stride_xc, mask=mask, other=0.0)
            _rms_scale_store(
                x.to(tl.float32), rstd, w_ptr, stride_w, out_rows, c0 + cols, col_mask, mask
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` in float32.

    Args:
        x: ``[..., D]`` fp32 | bf16 | fp16, any strides.
        weight: ``[D]`` fp32 | bf16 | fp16.
        eps: ``> 0``.

    Returns:
        A new contiguous ``[..., D]`` tensor in ``x``'s dtype.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    d = x.shape[-1]
    rows = _view(x, (-1, d))
    n_rows = rows.shape[0]
    tile, max_row_block, _ = _limits()
    block_d = min(next_pow2(d), max_row_block)
    block_r = min(max(1, tile // block_d), next_pow2(n_rows, floor=1))
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        rows,
        weight,
        out,
        n_rows,
        d,
        rows.stride(0),
        rows.stride(1),
        weight.stride(0),
        eps,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        ONE_PASS=block_d >= d,
    )
    return out


# -- rope ---------------------------------------------------------------------------


@tuned(
    configs=[triton.Config({"BLOCK_H": bh}, num_warps=w) for bh, w in ((1, 1), (4, 2), (16, 4))],
    key=["n_heads", "half", "INTERLEAVED"],
    interpreter={"BLOCK_H": 64},
)
@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_heads,
    half,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_ct,
    stride_ci,
    stride_st,
    stride_si,
    INTERLEAVED: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = (heads < n_heads)[:, None]
    x_heads = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    out_heads = out_ptr + (t * n_heads + heads[:, None]) * (2 * half)
    dtype = out_ptr.dtype.element_ty
    for i0 in range(0, half, BLOCK_HALF):
        i = i0 + tl.arange(0, BLOCK_HALF)
        i_mask = i < half
        c = tl.load(cos_ptr + t * stride_ct + i * stride_ci, mask=i_mask, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * stride_st + i * stride_si, mask=i_mask, other=0.0)[None, :]
        if INTERLEAVED:
            first = 2 * i
            second = 2 * i + 1
        else:
            first = i
            second = i + half
        mask = head_mask & i_mask[None, :]
        a = tl.load(x_heads + first[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_heads + second[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_heads + first[None, :], rounded_to(a * c - b * s, dtype), mask=mask)
        tl.store(out_heads + second[None, :], rounded_to(a * s + b * c, dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dim by per-token angles, in float32.

    Pair ``i`` is ``(x[2i], x[2i+1])`` when ``interleaved``, else ``(x[i], x[i + D/2])``;
    it becomes ``(a cos_i - b sin_i, a sin_i + b cos_i)`` in the same positions.

    Args:
        x: ``[T, ..., D]`` fp32 | bf16 | fp16, ``D`` even, any strides.
        cos, sin: ``[T, D/2]`` fp32.
        interleaved: the pair layout.

    Returns:
        A new contiguous ``[T, ..., D]`` tensor in ``x``'s dtype.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    t, d = x.shape[0], x.shape[-1]
    heads = _view(x, (t, -1, d))
    n_heads, half = heads.shape[1], d // 2
    _rope_kernel[lambda meta: (t, triton.cdiv(n_heads, meta["BLOCK_H"]))](
        heads,
        cos,
        sin,
        out,
        n_heads,
        half,
        *heads.stride(),
        *cos.stride(),
        *sin.stride(),
        INTERLEAVED=interleaved,
        BLOCK_HALF=min(next_pow2(half, floor=1), _limits()[2]),
    )
    return out
