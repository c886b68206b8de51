"""Sparse attention over gathered key slots: flash attention with the gather inside.

A program owns one query token, one kv head and a block of ``BLOCK_H`` of that kv head's
``G = H / Hkv`` query heads, so the heads sharing a kv head share one gather of the
selected slots. Absorbed MLA (``v`` is ``k[..., :Dv]``, GLM-5's 64 heads over one
576-wide latent) takes the latent path on a GPU: all 64 heads in one program, each
tile of latent rows gathered once as ``[BLOCK_K, 512]`` for the scores and the values
alike (plus the 64-wide rope tail), so a query token reads its selected rows once and
its dots are M = 64 wgmma (sm_90) / tcgen05 (sm_100) tiles.

A program walks the token's index row ``BLOCK_K`` slots at a time: it loads the
indices, masks the invalid ones (``-1`` and anything outside ``[0, N)``), loads the key
rows through them (``BLOCK_D`` columns at a time outside the latent path),
scores them with ``[BLOCK_H, BLOCK_D] x [BLOCK_D, BLOCK_K]`` dots, and keeps an online
softmax (running max and sum, rescaled ``[BLOCK_H, Dv]`` accumulator) in base 2.

Two paths, chosen by :func:`plan_split_len`:

- prefill: one program per (token, kv head, head block) streams all ``K`` slots and
  writes ``out`` and ``lse`` itself.
- decode (flash-decoding): few tokens would leave most SMs idle, so the ``K`` slots are
  cut into splits of ``split_len``; each program writes a partial (max, sum,
  accumulator) in float32 and :func:`_combine_kernel` merges the splits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from glmport.core.selection import log_fallback_once
from glmport.core.specs.attention import lse_as_asked

from ..generic.attention import sparse_attention as generic_sparse_attention
from .runtime import dot_dtype, interpreter_plan, next_pow2, rounded_to, sm_count, to_dot, tuned

_LOG2E = 1.4426950408889634
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # read inside kernels

# The decode heuristic: split when fewer (token, kv head, head block) programs than SMs
# would run, into splits of at least MIN_SPLIT slots (a multiple of every BLOCK_K).
_MIN_SPLIT = 128
# Under the interpreter: a small stand-in SM count and longer splits (fewer programs),
# so that only few-token calls with long index rows (GLM-5 decode) take the decode path.
_INTERPRETER_SMS = 4
_INTERPRETER_MIN_SPLIT = 512

# Fp32 accumulator elements per program on a GPU outside the latent path: BLOCK_H *
# BLOCK_DV stays within this (64 heads x 256 or 32 x 512: 64 registers a thread at 8 warps).
_GPU_ACC_ELEMENTS = 16384


@tuned(
    # First (32, 8 warps, 1 stage): the latent path's [64, 512] accumulator needs 8
    # warps, and a pipelined gather spills it (sm_90). 4 warps suit small head blocks.
    configs=[
        triton.Config({"BLOCK_K": bk, "BLOCK_D": 64}, num_warps=w, num_stages=s)
        for bk, w, s in ((32, 8, 1), (64, 8, 1), (32, 4, 2), (64, 4, 2))
    ],
    key=["DK", "DV", "BLOCK_H", "PARTIAL", "SHARED_V"],
    interpreter={"BLOCK_K": 512, "BLOCK_D": 128},
)
@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    r_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    N,
    K,
    H,
    G,
    DK,
    DV,
    SPLIT_LEN,
    NUM_SPLITS,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_rn,
    stride_rh,
    stride_rd,
    stride_it,
    stride_ik,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    PARTIAL: tl.constexpr,
    SHARED_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(T, Hkv * HEAD_BLOCKS, NUM_SPLITS)``: token ``t``, kv head ``c``, query heads
    ``c * G + [hb * BLOCK_H, (hb + 1) * BLOCK_H)`` over slots
    ``[split * SPLIT_LEN, (split + 1) * SPLIT_LEN)`` of the index row.

    ``SHARED_V``: ``v`` is ``k[..., :DV]`` (absorbed MLA): each tile of latent rows is
    gathered once, ``[BLOCK_K, DV]`` for the scores and the values alike, and the
    ``BLOCK_R``-wide tail (the key's columns ``[DV, DK)``, read from ``r_ptr``: a view
    of ``k`` or a rope key stored apart) for the scores only; else keys ``BLOCK_D``
    columns at a time and values separately (``r_ptr`` unused).

    ``PARTIAL``: write the unnormalised split (max and sum in base 2 ``[T, H, S]``,
    accumulator ``[T, H, S, DV]``, float32) for the combine; otherwise ``out [T, H, DV]``
    (q's dtype) and ``lse [T, H]`` (float32, natural log).
    """
    t = tl.program_id(0)
    c = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    t64 = t.to(tl.int64)

    g = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = g < G
    heads = c * G + g  # query heads of kv head c
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    q_rows = q_ptr + t64 * stride_qt + heads[:, None] * stride_qh
    k_head = k_ptr + c * stride_kh
    v_head = v_ptr + c * stride_vh
    r_head = r_ptr + c * stride_rh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if SHARED_V:  # the rope tail: q's columns [DV, DK), r's [0, DK - DV)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < DK - DV

    k_lo = split * SPLIT_LEN
    k_hi = tl.minimum(k_lo + SPLIT_LEN, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_row = offs_k < k_hi
        idx = tl.load(idx_ptr + t64 * stride_it + offs_k * stride_ik, mask=in_row, other=-1)
        valid = in_row & (idx >= 0) & (idx < N)  # out of range counts as -1 (FlashMLA)
        slot = tl.where(valid, idx, 0).to(tl.int64)

        if SHARED_V:
            # One gather of the latent rows [BLOCK_K, DV]: the keys' first DV columns
            # for the scores and the values for the output; the tail only scores.
            kv = tl.load(
                k_head + slot[:, None] * stride_kn + offs_v[None, :] * stride_kd,
                mask=valid[:, None] & v_ok[None, :],
                other=0.0,
            )
            kr = tl.load(
                r_head + slot[:, None] * stride_rn + offs_r[None, :] * stride_rd,
                mask=valid[:, None] & r_ok[None, :],
                other=0.0,
            )
            qv = tl.load(
                q_rows + offs_v[None, :] * stride_qd,
                mask=head_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            qr = tl.load(
                q_rows + (DV + offs_r)[None, :] * stride_qd,
                mask=head_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            kv = to_dot(kv, DOT_DTYPE)
            if IEEE:
                s = tl.dot(to_dot(qv, DOT_DTYPE), tl.trans(kv), input_precision="ieee")
                s = tl.dot(
                    to_dot(qr, DOT_DTYPE),
                    tl.trans(to_dot(kr, DOT_DTYPE)),
                    s,
                    input_precision="ieee",
                )
            else:
                s = tl.dot(to_dot(qv, DOT_DTYPE), tl.trans(kv))
                s = tl.dot(to_dot(qr, DOT_DTYPE), tl.trans(to_dot(kr, DOT_DTYPE)), s)
        else:
            s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
            for d0 in range(0, DK, BLOCK_D):
                d = d0 + offs_d
                d_ok = d < DK
                qc = tl.load(
                    q_rows + d[None, :] * stride_qd,
                    mask=head_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                kc = tl.load(
                    k_head + slot[None, :] * stride_kn + d[:, None] * stride_kd,
                    mask=d_ok[:, None] & valid[None, :],
                    other=0.0,
                )  # [BLOCK_D, BLOCK_K]: the key rows, gathered and transposed
                # Inline, not a helper: each jitted call costs ~10 ms under the interpreter.
                if IEEE:  # float32: exact products, no TF32
                    s = tl.dot(
                        to_dot(qc, DOT_DTYPE), to_dot(kc, DOT_DTYPE), s, input_precision="ieee"
                    )
                else:
                    s = tl.dot(to_dot(qc, DOT_DTYPE), to_dot(kc, DOT_DTYPE), s)
            kv = to_dot(
                tl.load(
                    v_head + slot[:, None] * stride_vn + offs_v[None, :] * stride_vd,
                    mask=valid[:, None] & v_ok[None, :],
                    other=0.0,
                ),
                DOT_DTYPE,
            )  # [BLOCK_K, BLOCK_DV]
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no valid slot yet keeps max -inf: subtract 0 so that p and alpha
        # are 0 instead of NaN (-inf - -inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(to_dot(p, DOT_DTYPE), kv, acc, input_precision="ieee")
        else:
            acc = tl.dot(to_dot(p, DOT_DTYPE), kv, acc)
        m_i = m_new

    th = t64 * H + heads  # row of [T, H]
    if PARTIAL:
        row = th * NUM_SPLITS + split  # row of [T, H, S]
        tl.store(part_m_ptr + row, m_i, mask=head_ok)
        tl.store(part_l_ptr + row, l_i, mask=head_ok)
        tl.store(
            part_acc_ptr + row[:, None] * DV + offs_v[None, :],
            acc,
            mask=head_ok[:, None] & v_ok[None, :],
        )
    else:
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
        tl.store(lse_ptr + th, lse, mask=head_ok)
        tl.store(
            out_ptr + th[:, None] * DV + offs_v[None, :],
            rounded_to(out, out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & v_ok[None, :],
        )


@tuned(
    configs=[
        triton.Config({"BLOCK_HC": bh, "BLOCK_DC": bd}, num_warps=4)
        for bh, bd in ((4, 64), (4, 128), (8, 128))
    ],
    key=["DV", "NUM_SPLITS"],
    interpreter={"BLOCK_HC": 64, "BLOCK_DC": 512},
)
@triton.jit
def _combine_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    lse_ptr,
    H,
    DV,
    NUM_SPLITS,
    BLOCK_HC: tl.constexpr,
    BLOCK_DC: tl.constexpr,
):
    """Grid ``(T, cdiv(H, BLOCK_HC), cdiv(DV, BLOCK_DC))``: merge the ``NUM_SPLITS``
    partials of ``BLOCK_HC`` heads of token ``t`` into ``BLOCK_DC`` columns of
    ``out [T, H, DV]`` (q's dtype) and into ``lse [T, H]`` (float32, natural log):
    ``m = max_s m_s``, ``l = sum_s 2^(m_s - m) l_s``, ``out = sum_s 2^(m_s - m) acc_s / l``,
    summed in split order (deterministic)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    h_ok = heads < H
    d = tl.program_id(2) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    ok = h_ok[:, None] & (d < DV)[None, :]
    th = t.to(tl.int64) * H + heads
    rows = th * NUM_SPLITS  # first split's row of [T, H, S]

    m = tl.full([BLOCK_HC], float("-inf"), tl.float32)
    for s in range(0, NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + rows + s, mask=h_ok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, not NaN
    l_tot = tl.zeros([BLOCK_HC], tl.float32)
    acc = tl.zeros([BLOCK_HC, BLOCK_DC], tl.float32)
    for s in range(0, NUM_SPLITS):
        w = tl.exp2(tl.load(part_m_ptr + rows + s, mask=h_ok, other=float("-inf")) - m_ref)
        l_tot += w * tl.load(part_l_ptr + rows + s, mask=h_ok, other=0.0)
        part = tl.load(part_acc_ptr + (rows + s)[:, None] * DV + d[None, :], mask=ok, other=0.0)
        acc += w[:, None] * part

    empty = l_tot == 0.0
    out = acc / tl.where(empty, 1.0, l_tot)[:, None]
    tl.store(
        out_ptr + th[:, None] * DV + d[None, :], rounded_to(out, out_ptr.dtype.element_ty), mask=ok
    )
    if tl.program_id(2) == 0:
        lse = tl.where(empty, float("-inf"), (m_ref + tl.log2(tl.where(empty, 1.0, l_tot))) * _LN2)
        tl.store(lse_ptr + th, lse, mask=h_ok)


def values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``v`` is ``k[..., :Dv]`` (absorbed MLA's latent rows): same storage,
    rows, heads and strides, ``Dv <= Dk``."""
    return (
        v.data_ptr() == k.data_ptr()
        and v.stride() == k.stride()
        and v.shape[:2] == k.shape[:2]
        and v.shape[2] <= k.shape[2]
    )


def latent_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel gathers each latent row once for keys and values
    (``SHARED_V``): ``v`` in ``k``, and on a GPU 16-bit (float32 dots are FMA, whose
    operand tiles would spill; they take the chunked path)."""
    return values_in_keys(k, v) and (q.dtype != torch.float32 or interpreter_plan())


def head_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Query heads per program. Under the interpreter the whole group (fewest programs).
    On a GPU, for 16-bit absorbed MLA (``v`` in ``k``) up to 64: one gather of each
    latent row serves all of them, the dots are M = 64 wgmma / tcgen05 tiles and the
    ``[64, 512]`` float32 accumulator spreads over 8 warps (128 registers a thread);
    otherwise at most 64 and few enough that the accumulator fits in registers."""
    g = q.shape[1] // max(k.shape[1], 1)
    if interpreter_plan():
        return next_pow2(g)
    if latent_path(q, k, v):
        return min(next_pow2(g), 64)
    return min(next_pow2(g), 64, max(16, _GPU_ACC_ELEMENTS // next_pow2(v.shape[2])))


def plan_split_len(t: int, hkv: int, head_blocks: int, k: int, device: torch.device) -> int:
    """Slots per program along the index row: ``k`` (one split, the prefill path) unless
    the ``t * hkv * head_blocks`` programs would leave SMs idle (decode), then the
    row is cut into at most ``SMs / programs`` splits of at least ``_MIN_SPLIT`` slots,
    each a multiple of ``_MIN_SPLIT`` long. Under the interpreter a stand-in of
    ``_INTERPRETER_SMS`` SMs and ``_INTERPRETER_MIN_SPLIT`` slots."""
    if interpreter_plan():
        sms, granule = _INTERPRETER_SMS, _INTERPRETER_MIN_SPLIT
    else:
        sms, granule = sm_count(device), _MIN_SPLIT
    programs = t * hkv * head_blocks
    splits = min(triton.cdiv(sms, max(programs, 1)), k // granule)
    if programs >= sms or splits < 2:
        return k
    return triton.cdiv(triton.cdiv(k, splits), granule) * granule


def sparse_attention_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    split_len: int,
    k_rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_attention` with ``split_len`` slots of each index row per program:
    ``split_len >= K`` is the prefill path, a shorter one the decode path (partials and a
    combine). Shapes and dtypes as there; a ``k_rope`` only on the latent path."""
    t, h, dk = q.shape
    n, hkv = k.shape[0], k.shape[1]
    dv = v.shape[2]
    kk = indices.shape[1]
    if t == 0 or h == 0 or n == 0 or kk == 0:  # no slot anywhere: every row is empty
        out = torch.zeros((t, h, dv), dtype=q.dtype, device=q.device)
        return out, torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device)
    out = torch.empty((t, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    g = h // hkv
    shared = latent_path(q, k, v)
    # The tail the latent path scores: the rope key apart, or k's columns past Dv (a view).
    tail = k_rope if k_rope is not None else k[..., dv:] if shared else k
    block_h = head_block(q, k, v)
    head_blocks = triton.cdiv(g, block_h)
    split_len = max(1, min(split_len, kk))
    splits = triton.cdiv(kk, split_len)
    partial = splits > 1
    if partial:
        part_m = torch.empty((t, h, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((t, h, splits, dv), dtype=torch.float32, device=q.device)
    else:  # unused by the prefill path: any pointer will do
        part_m = part_l = part_acc = lse
    _attention_kernel[(t, hkv * head_blocks, splits)](
        q,
        k,
        v,
        tail,
        indices,
        out,
        lse,
        part_m,
        part_l,
        part_acc,
        float(scale) * _LOG2E,
        n,
        kk,
        h,
        g,
        dk,
        dv,
        split_len,
        splits,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *tail.stride(),
        *indices.stride(),
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_DV=next_pow2(dv),
        DOT_DTYPE=dot_dtype(q.dtype),
        IEEE=q.dtype == torch.float32,
        PARTIAL=partial,
        SHARED_V=shared,
        BLOCK_R=next_pow2(dk - dv) if shared else 16,
    )
    if partial:
        grid = lambda meta: (  # noqa: E731
            t,
            triton.cdiv(h, meta["BLOCK_HC"]),
            triton.cdiv(max(dv, 1), meta["BLOCK_DC"]),
        )
        _combine_kernel[grid](
            part_m,
            part_l,
            part_acc,
            out,
            lse,
            h,
            dv,
            splits,
        )
    return out, lse


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    need_lse: bool = True,
    k_rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its selected key slots.

    Args:
        q: ``[T, H, Dk]`` fp32 | bf16 | fp16, any strides.
        k: ``[N, Hkv, Dk]`` same dtype, ``H % Hkv == 0``.
        v: ``[N, Hkv, Dv]`` same dtype; may be a view of ``k`` (``k[..., :512]``).
        indices: ``[T, K]`` int32 | int64; entries outside ``[0, N)`` are ignored.
        scale: softmax scale.
        need_lse: whether to return ``lse`` (the kernels write it either way: a
            ``[T, H]`` float32 store is negligible beside the gathers).
        k_rope: ``[N, Hkv, Dk - Dv]`` or None: the rope key stored apart, read in place
            by the latent path (``v`` is ``k``); anywhere else the generic composite
            runs it (logged), which gathers only the selected rows.

    Returns:
        ``out [T, H, Dv]`` in q's dtype (0 for a row with no valid slot) and
        ``lse [T, H]`` float32, natural log (``-inf`` for such a row); ``[0]`` without
        ``need_lse``.
    """
    if k_rope is not None and not (latent_path(q, k, v) and v.shape[2] == k.shape[2]):
        log_fallback_once(
            "cuda",
            "sparse_attention",
            "generic",
            "reads a rope key apart only on the latent path in",
        )
        return generic_sparse_attention(q, k, v, indices, scale, need_lse, k_rope)
    g = q.shape[1] // max(k.shape[1], 1)
    head_blocks = math.ceil(g / head_block(q, k, v)) if g else 0
    split_len = plan_split_len(q.shape[0], k.shape[1], head_blocks, indices.shape[1], q.device)
    out, lse = sparse_attention_split(q, k, v, indices, scale, split_len, k_rope)
    return out, lse_as_asked(lse, need_lse)
