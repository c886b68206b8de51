"""``quantize``: every canonical format (``core/formats.py``) in one Triton kernel
family, bit-exact with the definition.

One program owns a ``BLOCK_R``-row slab of one scale group (``int8_row``: the whole
row; ``int4_group`` / ``fp8_group*``: ``group_size`` columns, the last one possibly
short for fp8) or one ``group_size x group_size`` tile (``fp8_block*``). When one
``BLOCK_R x BLOCK_C`` chunk covers it (up to 16K elements on a GPU: rows of 16K
columns, 128 x 128 tiles) it loads once, takes the amax and stores the codes from
registers; larger ones take two passes over their chunks (amax, then codes, the re-read
served by L2). Scales follow the
definition in float32: floored amax over 127 / 7 / 448 with ``tl.div_rn`` (a GPU's
``/`` is approximate), powers of two rounded up on the bits; codes are
``round_half_even(x / scale)`` clamped, or e4m3 rounded exactly in float32 by
:func:`runtime.round_to_e4m3`.

Float8 storage: GPUs before sm_89 (and ROCm's Triton) have no ``float8e4nv``; there the
kernels read and write the e4m3 codes as raw bytes, encoded and decoded with integer
bit arithmetic (:func:`e4m3_bits`, :func:`e4m3_value`), which gives the same bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from glmport.core.formats import FORMATS

from . import runtime

_INT8, _INT4, _FP8 = 0, 1, 2  # the KIND of a format's codes


@functools.cache
def _sm89_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def native_fp8(device: torch.device) -> bool:
    """Whether Triton kernels on ``device`` may use ``float8e4nv`` (the interpreter and
    NVIDIA sm_89+), else they handle e4m3 codes as bytes."""
    if runtime.interpreting() or device.type != "cuda":
        return True
    if torch.version.hip is not None:
        return False
    return _sm89_or_later(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def e4m3_bits(r):
    """The float8 e4m3fn byte (uint8) of float32 ``r``, an exactly representable e4m3
    value (the output of :func:`runtime.round_to_e4m3`), sign of zero kept."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e + 7) << 3) | ((bits >> 20) & 7)
    subnormal = (tl.abs(r) * 512.0).to(tl.int32)  # m * 2**-9, m < 8
    return (tl.where(e < -6, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def e4m3_value(b):
    """Float32 value of float8 e4m3fn bytes ``b`` (uint8); NaN codes are never made."""
    v = b.to(tl.int32)
    e = (v >> 3) & 0xF
    m = v & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    sign = (v & 0x80) << 24
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, KIND: tl.constexpr, POW2: tl.constexpr):
    """Float32 scale(s) of ``amax`` exactly as ``core.formats.quantize_tensor``."""
    if KIND == 2:
        s = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
        if POW2:  # round up to a power of two: carry any mantissa bit into the exponent
            bits = s.to(tl.int32, bitcast=True)
            s = ((bits + 0x7FFFFF) & -8388608).to(tl.float32, bitcast=True)
    elif KIND == 0:
        s = tl.div_rn(tl.maximum(amax, 1e-12), 127.0)
    else:
        s = tl.div_rn(tl.maximum(amax, 1e-12), 7.0)
    return s


@triton.jit
def _load_chunk(
    x_ptr, rows, c0, r_hi, c_hi, stride_xr, stride_xc, PAIRS: tl.constexpr, BLOCK_C: tl.constexpr
):
    """Float32 ``x[rows, c0 : c0 + BLOCK_C]`` (0 outside ``r_hi`` / ``c_hi``) as
    ``(even, odd)`` columns ``[BLOCK_R, BLOCK_C / 2]`` (PAIRS: int4's low and high
    nibbles), else as ``(chunk, chunk)``."""
    HALF: tl.constexpr = BLOCK_C // 2 if PAIRS else BLOCK_C
    cols = c0 + (2 if PAIRS else 1) * tl.arange(0, HALF)
    rmask = (rows < r_hi)[:, None]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :] * stride_xc
    lo = tl.load(ptrs, mask=rmask & (cols < c_hi)[None, :], other=0.0).to(tl.float32)
    if PAIRS:
        hi = tl.load(ptrs + stride_xc, mask=rmask & (cols + 1 < c_hi)[None, :], other=0.0)
        hi = hi.to(tl.float32)
    else:
        hi = lo
    return lo, hi


@triton.jit
def _store_codes(
    q_ptr,
    rows,
    c0,
    r_hi,
    c_hi,
    stride_qr,
    lo,
    hi,
    scale,
    KIND: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Store the codes of a chunk from :func:`_load_chunk` divided by ``scale``:
    ``round_half_even`` clamped to +-127 / +-7 (int4: packed pairs), or e4m3."""
    rmask = (rows < r_hi)[:, None]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qr
    if KIND == 1:
        lo = runtime.round_half_even(tl.div_rn(lo, scale))
        hi = runtime.round_half_even(tl.div_rn(hi, scale))
        lo = tl.minimum(tl.maximum(lo, -7.0), 7.0).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, -7.0), 7.0).to(tl.int32)
        pcols = c0 // 2 + tl.arange(0, BLOCK_C // 2)
        packed = ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)
        tl.store(q_rows + pcols[None, :], packed, mask=rmask & (2 * pcols < c_hi)[None, :])
    else:
        cols = c0 + tl.arange(0, BLOCK_C)
        if KIND == 0:
            q = runtime.round_half_even(tl.div_rn(lo, scale))
            code = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
        else:
            y = tl.minimum(tl.maximum(tl.div_rn(lo, scale), -448.0), 448.0)
            r = runtime.round_to_e4m3(y)
            code = r.to(tl.float8e4nv) if FP8_NATIVE else e4m3_bits(r)
        tl.store(q_rows + cols[None, :], code, mask=rmask & (cols < c_hi)[None, :])


@runtime.tuned(
    configs=[triton.Config({}, num_warps=w) for w in (4, 8)],
    key=["BLOCK_R", "BLOCK_C", "KIND"],
    interpreter={},
)
@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    R,
    C,
    GROUP,
    row_chunks,
    col_chunks,
    stride_xb,
    stride_xr,
    stride_xc,
    stride_qb,
    stride_qr,
    stride_sb,
    stride_sr,
    stride_sc,
    KIND: tl.constexpr,
    POW2: tl.constexpr,
    TILE: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Quantise ``x [B, R, C]`` into ``q`` (``[B, R, C]``, or ``[B, R, C // 2]`` uint8
    for int4) and ``s`` (``[B, R]`` row, ``[B, R, C/GROUP]`` group, ``[B, R/GROUP,
    C/GROUP]`` tile scales). Program ``(i, g, b)``: columns ``[g * GROUP, ...)`` of
    rows ``[i * BLOCK_R, ...)`` (TILE: rows ``[i * GROUP, ...)``, in ``row_chunks``),
    in ``col_chunks`` chunks of ``BLOCK_C`` columns. ONE_CHUNK (one chunk covers it
    all): one pass, the chunk stays in registers; else amax over every chunk first,
    then a second pass re-reads them (from L2) for the codes."""
    pid_r = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    x_ptr += b * stride_xb
    q_ptr += b * stride_qb
    s_ptr += b * stride_sb
    if TILE:
        r_lo = pid_r * GROUP
        r_hi = tl.minimum(r_lo + GROUP, R)
    else:
        r_lo = pid_r * BLOCK_R
        r_hi = tl.minimum(r_lo + BLOCK_R, R)
    c_lo = g * GROUP
    c_hi = tl.minimum(c_lo + GROUP, C)
    PAIRS: tl.constexpr = KIND == 1
    if ONE_CHUNK:
        rows = r_lo + tl.arange(0, BLOCK_R)
        lo, hi = _load_chunk(x_ptr, rows, c_lo, r_hi, c_hi, stride_xr, stride_xc, PAIRS, BLOCK_C)
        amax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), 1)
    else:
        # Per row (TILE: per row slot of the chunks, reduced below).
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for ri in range(0, row_chunks):
            rows = r_lo + ri * BLOCK_R + tl.arange(0, BLOCK_R)
            for ci in range(0, col_chunks):
                lo, hi = _load_chunk(
                    x_ptr,
                    rows,
                    c_lo + ci * BLOCK_C,
                    r_hi,
                    c_hi,
                    stride_xr,
                    stride_xc,
                    PAIRS,
                    BLOCK_C,
                )
                amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), 1))
    if TILE:
        scale = _scale_of(tl.max(amax, 0), KIND, POW2)
        tl.store(s_ptr + pid_r * stride_sr + g * stride_sc, scale)
    else:
        scale = _scale_of(amax, KIND, POW2)
        srows = r_lo + tl.arange(0, BLOCK_R)
        tl.store(s_ptr + srows * stride_sr + g * stride_sc, scale, mask=srows < r_hi)
        scale = scale[:, None]
    if ONE_CHUNK:
        _store_codes(
            q_ptr, rows, c_lo, r_hi, c_hi, stride_qr, lo, hi, scale, KIND, FP8_NATIVE, BLOCK_C
        )
    else:
        for ri in range(0, row_chunks):
            rows = r_lo + ri * BLOCK_R + tl.arange(0, BLOCK_R)
            for ci in range(0, col_chunks):
                c0 = c_lo + ci * BLOCK_C
                lo, hi = _load_chunk(
                    x_ptr, rows, c0, r_hi, c_hi, stride_xr, stride_xc, PAIRS, BLOCK_C
                )
                _store_codes(
                    q_ptr, rows, c0, r_hi, c_hi, stride_qr, lo, hi, scale, KIND, FP8_NATIVE, BLOCK_C
                )


def _chunk_elements() -> int:
    """Elements of one chunk: 16K on a GPU (64 float32 a thread at 8 warps; a row of
    up to 16K columns or a 128 x 128 tile in one pass), 64K under the interpreter."""
    return 1 << 16 if runtime.interpreter_plan() else 1 << 14


def quantize_batched(
    x: torch.Tensor, fmt: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each ``x[b]`` of ``x [B, R, C]`` (float, any strides) into ``fmt``:
    codes ``[B, *packed_shape]`` and float32 scales ``[B, *scale_shape]``, exactly as
    :func:`glmport.core.formats.quantize_tensor` on each ``x[b]``."""
    f = FORMATS[fmt]
    nb, rows, cols = x.shape
    kind = {torch.int8: _INT8, torch.uint8: _INT4}.get(f.storage, _FP8)
    q = x.new_empty((nb, *f.packed_shape(rows, cols)), dtype=f.storage)
    scale = x.new_empty((nb, *f.scale_shape(rows, cols, group_size)), dtype=torch.float32)
    if q.numel() == 0 and scale.numel() == 0:
        return q, scale
    fp8_native = native_fp8(x.device)
    q_arg = q if kind != _FP8 or fp8_native else q.view(torch.uint8)
    budget = _chunk_elements()
    group = cols if f.granularity == "row" else group_size
    tile = f.granularity == "block"
    block_c = min(runtime.next_pow2(min(group, max(cols, 1)), floor=2), budget)
    block_r = min(budget // block_c, runtime.next_pow2(group if tile else rows, floor=1))
    col_chunks = triton.cdiv(min(group, cols), block_c)
    row_chunks = triton.cdiv(min(group, rows), block_r) if tile else 1
    n_groups = 1 if f.granularity == "row" else scale.shape[-1]
    s3 = scale[..., None] if f.granularity == "row" else scale
    _quantize_kernel[(triton.cdiv(rows, group if tile else block_r), n_groups, nb)](
        x,
        q_arg,
        s3,
        rows,
        cols,
        group,
        row_chunks,
        col_chunks,
        *x.stride(),
        q.stride(0),
        q.stride(1),
        *s3.stride(),
        KIND=kind,
        POW2=f.pow2_scales,
        TILE=tile,
        ONE_CHUNK=row_chunks == 1 and col_chunks == 1,
        FP8_NATIVE=fp8_native,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    return q, scale


def quantize(x: torch.Tensor, fmt: str, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``quantize`` op: float ``x [R, C]`` (fp32 | bf16 | fp16) -> (codes, float32
    scales) in canonical format ``fmt`` (int8 ``[R, C]``, uint8 ``[R, C // 2]`` int4
    pairs, or float8_e4m3fn ``[R, C]``; scales per row / group / tile)."""
    q, scale = quantize_batched(x[None], fmt, group_size)
    return q[0], scale[0]
