"""``quant_gemm`` and ``grouped_gemm``: one tiled Triton GEMM kernel family for every
scheme, one launch per call.

Each program computes one ``[BLOCK_M, BLOCK_N]`` output tile of one expert
(``quant_gemm`` is one expert over all rows). Grouped calls get their tile schedule
on the device, with no host sync: the offsets are made a partition of ``[0, M]``
(clamp and running max, in torch), then :func:`_schedule_kernel` counts each
segment's row tiles, takes their cumulative sum and writes every tile's first row,
row bound and expert into a table of ``cdiv(M, BLOCK_M) + E + 2`` entries (an upper
bound on the tile count). Segments are the ``E`` experts plus the rows before
``o[0]`` and from ``o[E]`` on, which belong to no expert: their tiles store zeros, so
the output needs no memset; entries past the real count make their programs exit.

The main loop walks K in steps of ``KS`` columns; per scheme (codes from :mod:`.quant`,
the activation quantised per call, which is the schemes' definition):

======================  =====================  ======================================
scheme                  a x b                  accumulation
======================  =====================  ======================================
``none``                x x w                  float32
``w8a8``                int8 x int8            int32 over all of K, then sw[n] sx[m]
``w4a8``                int8 x int4            per step int32, times sw[n, g]; sx[m]
``w4a16``               x x int4               per step float32, times sw[n, g]
``fp8_block*``          e4m3 x e4m3            per step float32, sx[m, g] sw[n/128, g]
======================  =====================  ======================================

Int4 weights arrive as uint8 pairs, sign-extended and interleaved in registers. A step
lies inside one weight group when ``KS`` divides the group (``KS`` is then a group or
a power-of-two part of one: the integer partial sums stay exact); for other group
sizes (and under the interpreter, whose step is 128 for speed) the int4 weights are
dequantised in registers with their per-column group scales and fed to a float dot.

Weights are read in their canonical packed layout, which already is what the kernel
wants (K-contiguous 8-bit rows, the B operand layout of Hopper's 8-bit MMA; int4 pairs
unpacked in registers), so there is no prepare hook: a native layout would save no
per-call work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmport.core.formats import FLOAT_WEIGHT, FP8_BLOCK, SCHEMES

from . import quant, runtime

_FLOAT, _W8A8, _W4A8, _W4A16, _FP8 = 0, 1, 2, 3, 4
_SCHEME_IDS = {
    FLOAT_WEIGHT: _FLOAT,
    "w8a8": _W8A8,
    "w4a8": _W4A8,
    "w4a16": _W4A16,
    "fp8_block": _FP8,
    "fp8_block_ue8m0": _FP8,
}

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in (
        (64, 128, 4, 4),
        (128, 64, 4, 4),
        (128, 128, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 8, 4),
    )
]


@triton.jit
def _schedule_kernel(
    o_ptr,
    table_ptr,
    M,
    E,
    n_entries,
    BLOCK_M: tl.constexpr,
    SEG_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Fill ``table [n_entries, 3]`` (int32): entry ``t`` is row tile ``t`` of the
    schedule as (first row, row bound, expert), the expert being -1 for rows of no
    expert (zeros) and -2 past the last tile. ``o [E + 1]``: a partition of ``[0, M]``."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Segment s: 0 = rows [0, o[0]), s in 1..E = expert s - 1, E + 1 = rows [o[E], M).
    s = tl.arange(0, SEG_BLOCK)
    lo = tl.load(o_ptr + s - 1, mask=(s >= 1) & (s <= E + 1), other=0)
    hi = tl.where(s == E + 1, M, tl.load(o_ptr + s, mask=s <= E, other=0))
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    seg = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1)
    first = tl.sum(tl.where(s[None, :] < seg[:, None], tiles[None, :], 0), 1)
    valid = seg <= E + 1
    row_lo = tl.load(o_ptr + seg - 1, mask=valid & (seg >= 1), other=0)
    row_hi = tl.where(seg == E + 1, M, tl.load(o_ptr + seg, mask=seg <= E, other=0))
    expert = tl.where(valid, tl.where((seg == 0) | (seg == E + 1), -1, seg - 1), -2)
    out = table_ptr + 3 * t
    keep = t < n_entries
    tl.store(out, row_lo + (t - first) * BLOCK_M, mask=keep)
    tl.store(out + 1, row_hi, mask=keep)
    tl.store(out + 2, expert, mask=keep)


@runtime.tuned(
    configs=_CONFIGS,
    key=["N", "K", "BLOCK_M", "SCHEME", "GROUPED"],
    interpreter={"BLOCK_N": 128, "BLOCK_K": 128},
)
@triton.jit
def _gemm_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    table_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP,
    stride_am,
    stride_ak,
    stride_sam,
    stride_sak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    SCHEME: tl.constexpr,
    GROUPED: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    INT4_K: tl.constexpr,
    W4_DEQUANT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``y [M, N]`` (x's dtype) from activations ``a [M, K]`` (x or its codes; scales
    ``sa``) and weights ``b [E, N, K']`` (scales ``sb [E, ...]``). Program ``(t, j)``:
    row tile ``t`` (GROUPED: entry ``t`` of the schedule table, else rows
    ``[t * BLOCK_M, ...)`` of expert 0), columns ``[j * BLOCK_N, ...)``. ``GROUP``: K
    columns per weight scale group (int4, fp8). Operand loads clamp their row and
    column indices into the tensors instead of masking (rows past the expert's are
    computed and not stored); only a ragged K tail is masked (EVEN_K: none)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Index arithmetic in int64: no 32-bit offset overflow, and the interpreter checks
    # every 32-bit add / mul for overflow, which costs more than the op.
    if GROUPED:
        entry = table_ptr + pid_t.to(tl.int64) * 3
        m0 = tl.load(entry)
        m_hi = tl.load(entry + 1)
        expert = tl.load(entry + 2)
    else:
        m0 = pid_t * BLOCK_M
        m_hi = M
        expert = 0
    if expert == -2:  # past the last tile
        return
    rows = m0 + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    y_ptrs = y_ptr + rows[:, None] * N + cols[None, :]  # y: fresh, contiguous
    y_mask = (rows < m_hi)[:, None] & (cols < N)[None, :]
    if expert == -1:  # rows of no expert
        tl.store(y_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=y_ptr.dtype.element_ty), mask=y_mask)
        return
    if GROUPED:
        b_ptr += expert.to(tl.int64) * stride_be
        sb_ptr += expert.to(tl.int64) * stride_sbe
    rows = tl.minimum(rows + 1, M) - 1
    cols = tl.minimum(cols + 1, N) - 1
    W4: tl.constexpr = SCHEME == 2 or SCHEME == 3
    KS: tl.constexpr = INT4_K if W4 else BLOCK_K
    KB: tl.constexpr = KS // 2 if W4 else KS  # int4 pairs: column 2j low nibble, 2j + 1 high
    offs_k = tl.arange(0, KS).to(tl.int64)
    offs_b = tl.arange(0, KB).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + cols[:, None] * stride_bn + offs_b[None, :] * stride_bk
    a_step = KS * stride_ak
    b_step = KB * stride_bk
    if SCHEME == 4:
        sa_ptrs = sa_ptr + rows * stride_sam
        sb_ptrs = sb_ptr + (cols // 128) * stride_sbn  # 128 x 128 weight blocks
    else:
        sb_ptrs = sb_ptr + cols * stride_sbn
    if W4_DEQUANT:
        last_group = (K - 1) // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCHEME == 1:
        acc_i = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, KS):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k + k0 < K)[None, :], other=0)
            b_cols = 2 * offs_b if W4 else offs_b
            b = tl.load(b_ptrs, mask=(b_cols + k0 < K)[None, :], other=0)
        a_ptrs += a_step
        b_ptrs += b_step
        if SCHEME == 0:
            a = runtime.to_dot(a, DOT_DTYPE)
            b = runtime.to_dot(b, DOT_DTYPE)
            if IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        elif SCHEME == 1:
            acc_i = tl.dot(a, tl.trans(b), acc_i, out_dtype=tl.int32)
        elif SCHEME == 4:
            if FP8_NATIVE:  # e4m3 arrives as bytes: masked loads need other=0
                a = a.to(tl.float8e4nv, bitcast=True)
                b = b.to(tl.float8e4nv, bitcast=True)
                p = tl.dot(a, tl.trans(b))
            else:  # e4m3 values are exact in bf16 (and fp32)
                a = runtime.to_dot(quant.e4m3_value(a), DOT_DTYPE)
                b = runtime.to_dot(quant.e4m3_value(b), DOT_DTYPE)
                if IEEE:
                    p = tl.dot(a, tl.trans(b), input_precision="ieee")
                else:
                    p = tl.dot(a, tl.trans(b))
            kb = (k0 // GROUP).to(tl.int64)  # BLOCK_K divides the 128-wide blocks
            sa = tl.load(sa_ptrs + kb * stride_sak)
            sb = tl.load(sb_ptrs + kb * stride_sbk)
            acc += p * sa[:, None] * sb[None, :]
        else:
            q = b.to(tl.int8, bitcast=True)
            b = tl.reshape(tl.join((q << 4) >> 4, q >> 4), (BLOCK_N, KS))  # sign-extended
            if W4_DEQUANT:  # the step spans groups: scale each weight column
                g = tl.minimum((offs_k + k0) // GROUP, last_group)
                s = tl.load(sb_ptrs[:, None] + g[None, :] * stride_sbk)
                b = runtime.to_dot(b.to(tl.float32) * s, DOT_DTYPE)
                a = runtime.to_dot(a, DOT_DTYPE)
                if IEEE:
                    acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
            else:
                if SCHEME == 2:
                    p = tl.dot(a, tl.trans(b), out_dtype=tl.int32).to(tl.float32)
                elif IEEE:
                    a = runtime.to_dot(a, DOT_DTYPE)
                    b = runtime.to_dot(b, DOT_DTYPE)
                    p = tl.dot(a, tl.trans(b), input_precision="ieee")
                else:
                    p = tl.dot(runtime.to_dot(a, DOT_DTYPE), tl.trans(runtime.to_dot(b, DOT_DTYPE)))
                s = tl.load(sb_ptrs + (k0 // GROUP).to(tl.int64) * stride_sbk)
                acc += p * s[None, :]
    if SCHEME == 1:
        acc = acc_i.to(tl.float32) * tl.load(sb_ptrs)[None, :]
    if SCHEME == 1 or SCHEME == 2:  # the per-token activation scale
        acc = acc * tl.load(sa_ptr + rows * stride_sam)[:, None]
    tl.store(y_ptrs, runtime.rounded_to(acc, y_ptr.dtype.element_ty), mask=y_mask)


def _int4_step(group: int, ieee: bool) -> tuple[int, bool]:
    """K step for int4 weights with ``group``-column scale groups, and whether steps
    span groups (dequantise in registers). On a GPU the largest power of two that
    divides the group (32..128), so each step's integer sum is exact, and 32 for
    float32 activations (``ieee``: FMA dots, which spill kilobytes at 128); under the
    interpreter always 128 (fewer, larger steps are what it is fast at)."""
    if runtime.interpreter_plan():
        step = 128
    else:
        step = min(group & -group, 32 if ieee else 128)  # lowest set bit: divides it
        if step < 32:
            step = 64
    return step, group % step != 0


def _gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int,
) -> torch.Tensor:
    """``y [M, N]`` for ``x [M, K]`` and weights ``w [E, N, K']`` (scales ``[E, ...]``),
    expert ``e`` on rows ``[o[e], o[e+1])`` of ``offsets`` (a partition of ``[0, M]``),
    or expert 0 on every row when ``offsets`` is None."""
    m, k = x.shape
    e, n = w.shape[0], w.shape[1]
    y = x.new_empty((m, n))
    if m == 0 or n == 0:
        return y
    if k == 0 or e == 0:
        return y.zero_()
    sid = _SCHEME_IDS[scheme]
    s = SCHEMES.get(scheme)
    if s is not None and w_scale is None:  # QAT: the float weight on the scheme's grid
        w, w_scale = quant.quantize_batched(w, s.weight.name, s.fixed_group_size or group_size)
    a, sa = x, x.new_empty((1, 1), dtype=torch.float32)  # float activations: no scales
    if s is not None and s.activation is not None:
        a, sa = quant.quantize(x, s.activation.name, s.fixed_group_size or k)
    fp8_native = quant.native_fp8(x.device)
    if sid == _FP8:  # bytes: masked loads fill 0, which float8 loads cannot take everywhere
        a, w = a.view(torch.uint8), w.view(torch.uint8)
        dot_dtype = runtime.dot_dtype(torch.bfloat16)  # e4m3 values are exact in bf16
    else:
        dot_dtype = runtime.dot_dtype(x.dtype)
    sb = sa if w_scale is None else w_scale  # float weights have no scales: never read
    sa2 = sa[:, None] if sa.dim() == 1 else sa
    sb3 = sb[..., None] if sb.dim() == 2 else sb
    group = {_FP8: FP8_BLOCK, _W4A8: k // sb3.shape[-1], _W4A16: k // sb3.shape[-1]}.get(sid, k)
    int4_k, w4_dequant = _int4_step(group, dot_dtype == tl.float32)
    even_k = k % (int4_k if sid in (_W4A8, _W4A16) else 128) == 0
    grouped = offsets is not None
    # BLOCK_M follows the rows per expert (16..128), so small experts waste few MMA rows
    # and the schedule can be built before the launch; the rest is autotuned.
    rows_hint = m // e if grouped else m
    block_m = min(max(triton.next_power_of_2(max(rows_hint, 1)), 16), 128)
    if grouped:
        n_entries = triton.cdiv(m, block_m) + e + 2
        table = torch.empty((n_entries, 3), dtype=torch.int32, device=x.device)
        block_t = 256 if runtime.interpreter_plan() else 16
        _schedule_kernel[(triton.cdiv(n_entries, block_t),)](
            offsets,
            table,
            m,
            e,
            n_entries,
            BLOCK_M=block_m,
            SEG_BLOCK=triton.next_power_of_2(e + 2),
            BLOCK_T=block_t,
        )
    else:
        n_entries = triton.cdiv(m, block_m)
        table = sa  # not read
    _gemm_kernel[lambda meta: (n_entries, triton.cdiv(n, meta["BLOCK_N"]))](
        a,
        sa2,
        w,
        sb3,
        table,
        y,
        m,
        n,
        k,
        group,
        *a.stride(),
        *sa2.stride(),
        *w.stride(),
        *sb3.stride(),
        SCHEME=sid,
        GROUPED=grouped,
        FP8_NATIVE=fp8_native,
        DOT_DTYPE=dot_dtype,
        IEEE=dot_dtype == tl.float32,
        INT4_K=int4_k,
        W4_DEQUANT=w4_dequant,
        EVEN_K=even_k,
        BLOCK_M=block_m,
    )
    return y


def quant_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int = 128,
) -> torch.Tensor:
    """The ``quant_gemm`` op: ``y [M, N] = x [M, K] @ Q(w).T`` in x's dtype, ``w``
    packed for ``scheme`` (``[N, K]`` int8 / e4m3, ``[N, K/2]`` uint8 int4 pairs) with
    float32 ``w_scale``, or float ``[N, K]`` with ``w_scale=None`` (QAT: quantised per
    call with ``group_size`` int4 groups); activations quantised per the scheme."""
    ws = None if w_scale is None else w_scale[None]
    return _gemm(x, w[None], None, ws, scheme, group_size)


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    scheme: str = FLOAT_WEIGHT,
    group_size: int = 128,
) -> torch.Tensor:
    """The ``grouped_gemm`` op: ``y[r] = x[r] @ w[e].T`` for rows ``r`` of expert ``e``
    (``x [M, K]`` sorted by expert, ``w [E, N, K]`` in x's dtype for scheme ``none``,
    else packed ``[E, ...]`` or float QAT weights as in :func:`quant_gemm`); ``[M, N]``
    in x's dtype. Offsets ``[E + 1]`` are read as the running max of their clamp to
    ``[0, M]``; rows of no expert are 0."""
    m = x.shape[0]
    offsets = expert_offsets.clamp(0, m).cummax(0).values.to(torch.int32)
    return _gemm(x, w, offsets, w_scale, scheme, group_size)
