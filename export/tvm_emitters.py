"""One emitter per glmport op: the op built from standard Relax ops (``matmul``,
``take``, ``topk``, ``where``, reductions, ``scatter_elements``...) through a
:class:`~glmport.export.tvm_graph.Graph`, and :func:`emit`, which the entry points of
:mod:`.tvm_ops` call.

Emitters compute in float32 (bf16 / fp16 inputs are cast right after they enter) and
return the reference's dtypes (``backends/cpu`` is the readable reference). float8
inputs and outputs raise :class:`~glmport.core.errors.UnsupportedError`
(:data:`~glmport.export.tvm_graph.FP8_REASON`). Every ``take`` is in "clip" mode: its
indices are in range already, and "fast" mode would read outside the tensor if one
were not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from glmport.core.errors import UnsupportedError
from glmport.core.formats import (
    FLOAT_WEIGHT,
    FORMATS,
    FP8_DTYPE,
    INT4_QMAX,
    INT8_MAX,
    INT_AMAX_FLOOR,
    SCHEMES,
)
from glmport.core.specs import OP_NAMES

from .tvm_graph import FP8_REASON, NEG_INF, Graph, reject_fp8

# ---------------------------------------------------------------- indexer


def _clamped_ranges(g: Graph, k_start: Any, k_end: Any, n: Any) -> tuple[Any, Any]:
    """``[T]`` int64 key ranges cut to ``[0, N]`` (``backends/cpu/indexer.py``)."""
    nn, zero = g.dim(n), g.const(0, "int64")
    start = g.clamp(g.i64(k_start), zero, nn)
    end = g(g.op.maximum(g.clamp(g.i64(k_end), zero, nn), start))
    return start, end


def _paged_keys(g: Graph, k, block_table) -> Any:
    """Each query's keys of a paged pool ``k [blocks, block_size, Di]`` in logical
    order, ``[T, M * block_size, Di]`` fp32 (``core/specs/indexer.paged_slots``)."""
    op = g.op
    blocks, size, di = g.shape(k)
    m = g.shape(block_table)[1]
    pos = g(op.arange(0, m * size, 1, "int64"))
    table = g.clamp(g.i64(block_table), g.const(0, "int64"), g.dim(blocks - 1))
    page = g(op.take(table, op.floor_divide(pos, g.dim(size)), axis=1))  # [T, L]
    rows = g(op.add(op.multiply(page, g.dim(size)), op.floor_mod(pos, g.dim(size))))
    flat = g(op.reshape(g.f32(k), [blocks * size, di]))
    return g(op.take(flat, rows, axis=0))


def _scores(g: Graph, q, k, weights, k_start, k_end, q_scale, k_scale, block_table=None):
    """``[T, N]`` fp32 indexer scores (``[T, M * block_size]`` over logical positions
    when paged), ``-inf`` outside each query's key range, and the clamped ``[T]``
    ranges."""
    op = g.op
    t = g.shape(q)[0]
    if block_table is None:
        n = g.shape(k)[0]
        dots = g.matmul(g.f32(q), g(op.permute_dims(g.f32(k))))  # [T, Hi, N]
    else:  # fp8 is outside TVM's capabilities: no k_scale here
        keys = _paged_keys(g, k, block_table)  # [T, L, Di]
        n = g.shape(keys)[1]
        dots = g.matmul(g.f32(q), g(op.permute_dims(keys, [0, 2, 1])))  # [T, Hi, L]
    if q_scale is not None:
        dots = g(op.multiply(g(op.multiply(dots, op.expand_dims(q_scale, 2))), k_scale))
    # relu that keeps NaN (a dot product whose terms overflowed to +inf and -inf):
    # TVM's relu is max(x, 0), which turns it into a silent 0.
    relu = g(op.where(op.less(dots, g.const(0.0)), g.const(0.0), dots))
    scores = g(op.reshape(g.matmul(g(op.expand_dims(weights, 1)), relu), [t, n]))
    start, end = _clamped_ranges(g, k_start, k_end, n)
    slots = g(op.expand_dims(op.arange(0, n, 1, "int64"), 0))
    valid = g(
        op.logical_and(
            op.greater_equal(slots, op.expand_dims(start, 1)),
            op.less(slots, op.expand_dims(end, 1)),
        )
    )
    return g(op.where(valid, scores, g.const(NEG_INF))), start, end


def lightning_indexer(
    g: Graph,
    q,
    k,
    weights,
    k_start,
    k_end,
    topk,
    q_scale=None,
    k_scale=None,
    block_table=None,
    need_scores=True,
):
    """indices ``[T, topk]`` int32 (best first, ties to the lower slot), scores
    ``[T, topk]`` fp32 (``[0]`` without ``need_scores``); ``-1`` / ``-inf`` past the
    valid keys; a paged pool read through ``block_table`` (logical positions)."""
    reject_fp8("lightning_indexer", g, [q, k])
    op = g.op
    scores, start, end = _scores(g, q, k, weights, k_start, k_end, q_scale, k_scale, block_table)
    # An overflowed score ranks first (docs/ops.md): TVM's topk puts NaN last, so a NaN
    # (from +inf and -inf terms) becomes +inf, which a result check then refuses.
    scores = g(op.where(op.isnan(scores), g.const(float("inf")), scores))
    t = g.shape(scores)[0]
    # -inf columns so topk > N works; TVM's topk is stable (equal scores keep slot order).
    pad = g.neg_inf([t, topk])
    top = g(op.topk(g(op.concat([scores, pad], axis=1)), k=topk, axis=1, dtype="int32"))
    best, slots = g.item(top, 0), g.item(top, 1)
    rank = g(op.expand_dims(op.arange(0, topk, 1, "int64"), 0))
    keep = g(op.less(rank, op.expand_dims(op.subtract(end, start), 1)))
    indices = g(op.where(keep, slots, g.const(-1, "int32")))
    if not need_scores:
        return indices, g(op.zeros([0], "float32"))
    return indices, g(op.where(keep, best, g.const(NEG_INF)))


def indexer_logits(g: Graph, q, k, weights, k_start, k_end, q_scale=None, k_scale=None):
    """``[T, N]`` fp32 scores, ``-inf`` outside each query's key range."""
    reject_fp8("indexer_logits", g, [q, k])
    return _scores(g, q, k, weights, k_start, k_end, q_scale, k_scale)[0]


# ---------------------------------------------------------------- attention


def _softmax_with_lse(g: Graph, s: Any) -> tuple[Any, Any]:
    """Row softmax over the last axis and its lse (keepdims); an all ``-inf`` row gives
    ``p = 0`` and ``lse = -inf`` (``backends/cpu/attention.py``)."""
    op = g.op
    m = g.max(s, -1, keepdims=True)
    m = g(op.where(op.isfinite(m), m, g.const(0.0)))
    e = g(op.exp(op.subtract(s, m)))
    total = g.sum(e, -1, keepdims=True)
    p = g(op.divide(e, op.where(op.greater(total, g.const(0.0)), total, g.const(1.0))))
    return p, g(op.add(m, op.log(total)))


def sparse_attention(g: Graph, q, k, v, indices, scale, need_lse=True, k_rope=None):
    """out ``[T, H, Dv]`` in q's dtype, lse ``[T, H]`` fp32 (``[0]`` without
    ``need_lse``); slots outside ``[0, N)`` are ignored, an empty row gives 0 /
    ``-inf``. A ``k_rope`` joins ``k`` as its last columns."""
    reject_fp8("sparse_attention", g, [q, k, v])
    op = g.op
    if k_rope is not None:
        k = g(op.concat([k, k_rope], axis=2))
    t, h, dk = g.shape(q)
    n, hkv = g.shape(k)[:2]
    dv = g.shape(v)[2]
    idx = g.i64(indices)
    valid = g(op.logical_and(op.greater_equal(idx, g.const(0, "int64")), op.less(idx, g.dim(n))))
    slots = g(op.where(valid, idx, g.const(0, "int64")))  # [T, K]
    kg = g.f32(g(op.take(k, slots, axis=0, mode="clip")))  # [T, K, Hkv, Dk], then upcast
    vg = g.f32(g(op.take(v, slots, axis=0, mode="clip")))
    qg = g(op.reshape(g.f32(q), [t, hkv, h // hkv, dk]))
    s = g.matmul(qg, g(op.permute_dims(kg, [0, 2, 3, 1])))  # [T, Hkv, G, K]
    s = g(op.multiply(s, g.const(scale)))
    s = g(op.where(op.expand_dims(valid, [1, 2]), s, g.const(NEG_INF)))
    p, lse = _softmax_with_lse(g, s)
    out = g.matmul(p, g(op.permute_dims(vg, [0, 2, 1, 3])))  # [T, Hkv, G, Dv]
    out = g(op.astype(op.reshape(out, [t, h, dv]), g.dtype(q)))
    if not need_lse:
        return out, g(op.zeros([0], "float32"))
    return out, g(op.reshape(lse, [t, h]))


# ---------------------------------------------------------------- MoE


def moe_gate(
    g: Graph,
    logits,
    bias,
    top_k,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    score_func="sigmoid",
):
    """weights ``[T, top_k]`` fp32, ids ``[T, top_k]`` int32 (group-limited choice on
    ``scores + bias``; ties to the lower group / expert, as ``backends/cpu/moe.py``)."""
    op = g.op
    lf = g.f32(logits)
    scores = g(op.sigmoid(lf) if score_func == "sigmoid" else op.nn.softmax(lf, axis=-1))
    choice = scores if bias is None else g(op.add(scores, g.f32(bias)))
    if n_group > 1:
        t, e = g.shape(choice)
        per_group = g(op.reshape(choice, [t, n_group, e // n_group]))
        if bias is None:
            group_score = g.max(per_group, -1)
        else:  # the sum of the best two; a -inf column stands in for a missing second
            pad = g.neg_inf([t, n_group, 1])
            padded = g(op.concat([per_group, pad], axis=2))
            two = g(op.topk(padded, k=2, axis=2, ret_type="values"))
            two = g(op.where(op.isinf(two), g.const(0.0), two))
            group_score = g.sum(two, -1)
        kept = g(op.topk(group_score, k=topk_group, axis=1, ret_type="indices", dtype="int64"))
        groups = g(op.reshape(op.arange(0, n_group, 1, "int64"), [1, 1, n_group]))
        hit = g(op.astype(op.equal(op.expand_dims(kept, 2), groups), "int32"))
        keep = g(op.greater(g.max(hit, 1), g.const(0, "int32")))  # [T, G]
        masked = g(op.where(op.expand_dims(keep, 2), per_group, g.const(NEG_INF)))
        choice = g(op.reshape(masked, [t, e]))
    ids = g(op.topk(choice, k=top_k, axis=1, ret_type="indices", dtype="int64"))
    weights = g(op.gather_elements(scores, ids, axis=1))
    if norm_topk_prob:
        total = g(op.add(g.sum(weights, -1, keepdims=True), g.const(1e-20)))
        weights = g(op.divide(weights, total))
    weights = g(op.multiply(weights, g.const(routed_scaling_factor)))
    return weights, g(op.astype(ids, "int32"))


def _token_of_row(g: Graph, t: Any, k: Any) -> Any:
    """``[T*k]`` int64: the token ``r // k`` of each flat row ``r = t * k + j``."""
    op = g.op
    tok = op.broadcast_to(op.expand_dims(op.arange(0, t, 1, "int64"), 1), [t, k])
    return g(op.reshape(tok, [t * k]))


def moe_dispatch(g: Graph, x, ids, num_experts):
    """x_sorted ``[T*k, D]``, expert_offsets ``[E+1]`` int32, src_row ``[T*k]`` int32: a
    stable sort by expert; copies with an id outside ``[0, E)`` come last, uncounted."""
    op = g.op
    t, k = g.shape(ids)
    rows = t * k
    flat = g(op.reshape(g.i64(ids), [rows]))
    e = g.const(num_experts, "int64")
    valid = g(op.logical_and(op.greater_equal(flat, g.const(0, "int64")), op.less(flat, e)))
    key = g(op.where(valid, flat, e))
    # key * rows + position is unique, so any sort of it is the stable sort of key.
    unique = g(op.add(op.multiply(key, g.dim(rows)), op.arange(0, rows, 1, "int64")))
    src_row = g(op.argsort(unique, axis=0, dtype="int64"))
    experts = g(op.expand_dims(op.arange(0, num_experts + 1, 1, "int64"), 1))
    below = g(op.astype(op.less(op.expand_dims(key, 0), experts), "int32"))  # [E+1, T*k]
    offsets = g.sum(below, 1)  # offsets[e] = copies with key < e
    token = g(op.take(_token_of_row(g, t, k), src_row, axis=0, mode="clip"))
    x_sorted = g(op.take(x, token, axis=0, mode="clip"))
    return x_sorted, offsets, g(op.astype(src_row, "int32"))


def moe_combine(g: Graph, y_sorted, src_row, weights):
    """``[T, D]`` in y_sorted's dtype: ``out[t] += weights[t, j] * y_sorted[r]`` for each
    ``src_row[r] = t*k + j``; rows outside ``[0, T*k)`` are skipped."""
    op = g.op
    t, k = g.shape(weights)
    r, d = g.shape(y_sorted)
    # A sentinel slot T*k (token T, weight 0) takes every row outside [0, T*k): negative
    # rows are sent past the end and take(mode="clip") brings them all to it.
    tokens = g(op.concat([_token_of_row(g, t, k), g.dim(t)], axis=0))
    flat_w = g(op.concat([op.reshape(weights, [t * k]), op.zeros([1], "float32")], axis=0))
    rows = g.i64(src_row)
    rows = g(op.where(op.less(rows, g.const(0, "int64")), g.dim(t * k), rows))
    target = g(op.take(tokens, rows, axis=0, mode="clip"))
    w = g(op.take(flat_w, rows, axis=0, mode="clip"))
    contrib = g(op.multiply(g.f32(y_sorted), op.expand_dims(w, 1)))
    where_to = g(op.broadcast_to(op.expand_dims(target, 1), [r, d]))
    summed = g(
        op.scatter_elements(
            op.zeros([t + 1, d], "float32"), where_to, contrib, axis=0, reduction="add"
        )
    )
    # In bounds by construction; saying so keeps the shape ``[t, d]`` (a checked slice
    # of a symbolic size gives a clamped expression that spreads through broadcasts).
    out = g(op.strided_slice(summed, axes=[0], begin=[0], end=[t], assume_inbound=True))
    return g(op.astype(out, g.dtype(y_sorted)))


def grouped_gemm(g: Graph, x, w, expert_offsets, w_scale=None, scheme=FLOAT_WEIGHT, group_size=128):
    """``[M, N]`` in x's dtype: row ``m`` times its expert's weight; rows of no expert
    (offsets clamped to ``[0, M]``, running maximum) are 0."""
    _reject_scheme("grouped_gemm", scheme)
    op = g.op
    m = g.shape(x)[0]
    e, e1 = g.shape(w)[0], g.shape(expert_offsets)[0]
    zero = g.const(0, "int64")
    off = g.clamp(g.i64(expert_offsets), zero, g.dim(m))
    # Running maximum as a masked max over the prefix (E is small).
    pos = g(op.arange(0, e1, 1, "int64"))
    prefix = g(op.less_equal(op.expand_dims(pos, 0), op.expand_dims(pos, 1)))  # [E+1, E+1]
    bounds = g.max(g(op.where(prefix, op.expand_dims(off, 0), zero)), 1)
    row = g(op.expand_dims(op.arange(0, m, 1, "int64"), 1))
    started = g.sum(g(op.astype(op.less_equal(op.expand_dims(bounds, 0), row), "int64")), 1)
    owner = g(op.subtract(started, g.const(1, "int64")))  # [M]; -1 or E: no expert
    owned = g(op.logical_and(op.greater_equal(owner, zero), op.less(owner, g.dim(e))))
    w_rows = g(op.take(w, owner, axis=0, mode="clip"))  # [M, N, K']: each row's weight
    s_rows = None if w_scale is None else g(op.take(w_scale, owner, axis=0, mode="clip"))
    y = _batched_gemm(g, g(op.expand_dims(x, 1)), w_rows, s_rows, scheme, group_size)
    y = g(op.reshape(y, [m, g.shape(w)[1]]))
    y = g(op.where(op.expand_dims(owned, 1), y, g.const(0.0)))
    return g(op.astype(y, g.dtype(x)))


# ---------------------------------------------------------------- quantisation


def _reject_scheme(op_name: str, scheme: str) -> None:
    if scheme != FLOAT_WEIGHT and SCHEMES[scheme].weight.storage == FP8_DTYPE:
        raise UnsupportedError(f"{op_name}: scheme {scheme} uses float8 operands ({FP8_REASON})")


def _quant_groups(g: Graph, xf: Any, qmax: int, group: int | None) -> tuple[Any, Any]:
    """Symmetric integer quantisation of fp32 ``[R, C]`` (``core/formats.py``):
    integer-valued fp32 ``q`` ``[R, G, g]`` and scales ``[R, G, 1]`` (``group=None``: one
    group per row)."""
    op = g.op
    r, c = g.shape(xf)
    groups = g(op.reshape(xf, [r, 1, c] if group is None else [r, c // group, group]))
    amax = g.max(g(op.abs(groups)), 2, keepdims=True)
    scale = g(op.divide(op.maximum(amax, g.const(INT_AMAX_FLOOR)), g.const(float(qmax))))
    q = g(op.round(op.divide(groups, scale)))
    return g.clamp(q, g.const(-float(qmax)), g.const(float(qmax))), scale


def _fake_quant(g: Graph, xf: Any, fmt: str, group_size: int) -> Any:
    """fp32 ``[R, C]`` put on ``fmt``'s grid (quantise, then dequantise)."""
    qmax, group = (INT8_MAX, None) if fmt == "int8_row" else (INT4_QMAX, group_size)
    q, scale = _quant_groups(g, xf, qmax, group)
    return g(g.op.reshape(g.op.multiply(q, scale), g.shape(xf)))


def _pack_int4(g: Graph, q: Any) -> Any:
    """int4 values ``[R, C]`` -> uint8 ``[R, C/2]``: column 2j low nibble, 2j+1 high."""
    op = g.op
    r, c = g.shape(q)
    nib = g(op.floor_mod(op.reshape(op.astype(q, "int32"), [r, c // 2, 2]), g.const(16, "int32")))
    low, high = g.split2(nib, axis=2)
    return g(op.astype(op.add(low, op.multiply(high, g.const(16, "int32"))), "uint8"))


def _unpack_int4(g: Graph, packed: Any) -> Any:
    """uint8 ``[..., C/2]`` -> int32 ``[..., C]`` in ``[-8, 7]``."""
    op = g.op
    p = g(op.astype(packed, "int32"))
    sixteen = g.const(16, "int32")
    nib = g.stack2(g(op.floor_mod(p, sixteen)), g(op.floor_divide(p, sixteen)), axis=-1)
    shape = g.shape(packed)
    nib = g(op.reshape(nib, [*shape[:-1], shape[-1] * 2]))
    return g(op.where(op.greater_equal(nib, g.const(8, "int32")), op.subtract(nib, sixteen), nib))


def quantize(g: Graph, x, fmt, group_size=128):
    """int8_row: int8 ``[R, C]`` and ``[R]`` scales; int4_group: uint8 ``[R, C/2]`` and
    ``[R, C/g]`` scales (fp32, ``core/formats.py``)."""
    if FORMATS[fmt].storage == FP8_DTYPE:
        raise UnsupportedError(f"quantize: format {fmt} returns float8 ({FP8_REASON})")
    op = g.op
    xf = g.f32(x)
    r, c = g.shape(xf)
    if fmt == "int8_row":
        q, scale = _quant_groups(g, xf, INT8_MAX, None)
        return g(op.astype(op.reshape(q, [r, c]), "int8")), g(op.reshape(scale, [r]))
    q, scale = _quant_groups(g, xf, INT4_QMAX, group_size)
    return _pack_int4(g, g(op.reshape(q, [r, c]))), g(op.reshape(scale, [r, c // group_size]))


def _batched_gemm(g: Graph, x, w, w_scale, scheme: str, group_size: int) -> Any:
    """fp32 ``[B, Mb, N]``: ``x`` ``[B, Mb, K]`` float times batch ``b``'s weight ``w[b]``
    (``[N, K]`` float, or packed per ``scheme`` with ``w_scale[b]``), as
    ``backends/cpu/quant.py`` computes it (integer schemes exact in int32 per group)."""
    op = g.op
    b, mb, k = g.shape(x)
    n = g.shape(w)[1]
    tokens = g(op.reshape(g.f32(x), [b * mb, k]))

    def float_gemm(wf: Any) -> Any:  # the tokens times a float weight [B, N, K]
        return g.matmul(g(op.reshape(tokens, [b, mb, k])), g(op.permute_dims(wf, [0, 2, 1])))

    if scheme == FLOAT_WEIGHT:
        wf = g.f32(w)
        return float_gemm(wf)
    s = SCHEMES[scheme]
    if w_scale is None or s.activation is None:  # QAT fake-quant, or W4A16
        if w_scale is None:
            if s.activation is not None:
                tokens = _fake_quant(g, tokens, s.activation.name, group_size)
            wf = _fake_quant(g, g(op.reshape(g.f32(w), [b * n, k])), s.weight.name, group_size)
        else:
            wv = g(op.astype(_unpack_int4(g, w), "float32"))  # [B, N, K]
            groups = g.shape(w_scale)[-1]
            wv = g(op.reshape(wv, [b, n, groups, k // groups]))
            wf = g(op.multiply(wv, op.expand_dims(w_scale, 3)))
        wf = g(op.reshape(wf, [b, n, k]))
        return float_gemm(wf)
    q, sx = _quant_groups(g, tokens, INT8_MAX, None)  # per-token int8
    qw = _unpack_int4(g, w) if s.weight.storage == torch.uint8 else g(op.astype(w, "int32"))
    groups = g.shape(w_scale)[2] if len(g.shape(w_scale)) == 3 else 1
    sw = g(op.reshape(w_scale, [b, n, groups]))
    gs = k // groups
    qx = g(op.permute_dims(op.reshape(op.astype(q, "int32"), [b, mb, groups, gs]), [0, 2, 1, 3]))
    qw = g(op.permute_dims(op.reshape(qw, [b, n, groups, gs]), [0, 2, 3, 1]))  # [B, G, g, N]
    partial = g(op.astype(g.matmul(qx, qw, out_dtype="int32"), "float32"))  # [B, G, Mb, N]
    y = g.sum(g(op.multiply(partial, op.expand_dims(op.permute_dims(sw, [0, 2, 1]), 2))), 1)
    return g(op.multiply(y, op.reshape(sx, [b, mb, 1])))


def quant_gemm(g: Graph, x, w, w_scale, scheme, group_size=128):
    """``[M, N]`` in x's dtype: ``x [M, K] @ W.T`` for a packed ``w`` with ``w_scale``, or
    a float ``w`` fake-quantised (QAT) when ``w_scale`` is None."""
    _reject_scheme("quant_gemm", scheme)
    op = g.op
    m, n = g.shape(x)[0], g.shape(w)[0]
    scale = None if w_scale is None else g(op.expand_dims(w_scale, 0))
    y = _batched_gemm(
        g, g(op.expand_dims(x, 0)), g(op.expand_dims(w, 0)), scale, scheme, group_size
    )
    return g(op.astype(op.reshape(y, [m, n]), g.dtype(x)))


# ---------------------------------------------------------------- norm, rope, logprobs


def rms_norm(g: Graph, x, weight, eps=1e-6):
    """x's shape and dtype; rows beyond 1 are divided by their max first (no overflow)."""
    op = g.op
    xf = g.f32(x)
    s = g(op.maximum(g.max(g(op.abs(xf)), -1, keepdims=True), g.const(1.0)))
    xs = g(op.divide(xf, s))
    mean = g.mean(g(op.multiply(xs, xs)), -1, keepdims=True)
    inv = g(op.rsqrt(op.add(mean, op.divide(g.const(eps), op.multiply(s, s)))))
    return g(op.astype(op.multiply(op.multiply(xs, inv), g.f32(weight)), g.dtype(x)))


def rope(g: Graph, x, cos, sin, interleaved=True):
    """x's shape and dtype; pairs ``(2j, 2j+1)`` (interleaved) or ``(j, j + D/2)``."""
    op = g.op
    shape = g.shape(x)
    half = g.shape(cos)[1]
    view = [shape[0], *([1] * (len(shape) - 2)), half]
    c, s = g(op.reshape(cos, view)), g(op.reshape(sin, view))
    pair = [half, 2] if interleaved else [2, half]
    axis = -1 if interleaved else -2
    a, b = g.split2(g(op.reshape(g.f32(x), [*shape[:-1], *pair])), axis=axis)
    ya = g(op.subtract(op.multiply(a, c), op.multiply(b, s)))
    yb = g(op.add(op.multiply(a, s), op.multiply(b, c)))
    y = g(op.reshape(g.stack2(ya, yb, axis=axis), shape))
    return g(op.astype(y, g.dtype(x)))


def mla_prolog(
    g: Graph,
    x,
    w_dq,
    gamma_cq,
    w_uq,
    w_uk,
    w_dkv,
    gamma_ckv,
    cos,
    sin,
    eps=1e-6,
    w_dq_scale=None,
    w_uq_scale=None,
    w_dkv_scale=None,
):
    """The five outputs in x's dtype, each named intermediate rounded to it as the
    reference (``backends/cpu/mla.py``) rounds; W8A8 projections where scales are given."""
    op = g.op
    t = g.shape(x)[0]
    heads, nope, kv_lora = g.shape(w_uk)
    dtype = g.dtype(x)

    def linear(a, w, w_scale):
        if w_scale is not None:
            return quant_gemm(g, a, w, w_scale, "w8a8")
        return g(op.astype(g.matmul(g.f32(a), g(op.permute_dims(g.f32(w)))), dtype))

    q_norm = rms_norm(g, linear(x, w_dq, w_dq_scale), gamma_cq, eps)
    if w_uq_scale is not None:  # as the W8A8 up-projection reads it
        q_norm = g(op.astype(_fake_quant(g, g.f32(q_norm), "int8_row", 0), dtype))
    width = nope + 2 * g.shape(cos)[1]
    q = g(op.reshape(linear(q_norm, w_uq, w_uq_scale), [t, heads, width]))
    q_nope = g(op.strided_slice(q, axes=[2], begin=[0], end=[nope]))
    q_pe = g(op.strided_slice(q, axes=[2], begin=[nope], end=[width]))
    per_head = g.matmul(g(op.permute_dims(g.f32(q_nope), [1, 0, 2])), g.f32(w_uk))
    q_latent = g(op.astype(op.permute_dims(per_head, [1, 0, 2]), dtype))
    kv = linear(x, w_dkv, w_dkv_scale)
    latent = g(op.strided_slice(kv, axes=[1], begin=[0], end=[kv_lora]))
    k_pe = g(op.strided_slice(kv, axes=[1], begin=[kv_lora], end=[kv_lora + 2 * g.shape(cos)[1]]))
    return (
        q_latent,
        rope(g, q_pe, cos, sin),
        q_norm,
        rms_norm(g, latent, gamma_ckv, eps),
        rope(g, k_pe, cos, sin),
    )


def token_logprobs(g: Graph, hidden, lm_head, targets, temperature=1.0):
    """logp ``[T]`` fp32 (NaN for a target outside ``[0, V)``), entropy ``[T]`` fp32 (both
    NaN when ``V = 0``)."""
    op = g.op
    t, v = g.shape(hidden)[0], g.shape(lm_head)[0]
    logits = g.matmul(g.f32(hidden), g(op.permute_dims(g.f32(lm_head))))
    logits = g(op.divide(logits, g.const(temperature)))
    z = g(op.subtract(logits, g.max(logits, 1, keepdims=True)))
    # Sums over the vocabulary accumulate in float64: a float32 running sum over V terms
    # (TVM's reduction is sequential) loses ~sqrt(V) ulps.
    total = g.sum(g(op.astype(op.exp(z), "float64")), 1, keepdims=True)
    logp_all = g(op.subtract(z, op.astype(op.log(total), "float32")))
    nan = g.const(math.nan)
    # A NaN column V: a target outside [0, V) picks it (also when V = 0: no read past
    # the end).
    padded = g(op.concat([logp_all, op.broadcast_to(nan, [t, 1])], axis=1))
    tgt = g.i64(targets)
    valid = g(op.logical_and(op.greater_equal(tgt, g.const(0, "int64")), op.less(tgt, g.dim(v))))
    pick = g(op.expand_dims(op.where(valid, tgt, g.dim(v)), 1))
    logp = g(op.reshape(op.gather_elements(padded, pick, axis=1), [t]))
    terms = g(op.astype(op.multiply(op.exp(logp_all), logp_all), "float64"))
    entropy = g(op.astype(op.negative(g.sum(terms, 1)), "float32"))
    no_vocab = g(op.equal(op.reshape(g.dim(v), []), g.const(0, "int64")))
    return logp, g(op.where(no_vocab, nan, entropy))  # nothing to normalise: NaN


EMITTERS: dict[str, Callable[..., Any]] = {
    "lightning_indexer": lightning_indexer,
    "indexer_logits": indexer_logits,
    "sparse_attention": sparse_attention,
    "moe_gate": moe_gate,
    "moe_dispatch": moe_dispatch,
    "moe_combine": moe_combine,
    "grouped_gemm": grouped_gemm,
    "quantize": quantize,
    "quant_gemm": quant_gemm,
    "rms_norm": rms_norm,
    "rope": rope,
    "token_logprobs": token_logprobs,
    "mla_prolog": mla_prolog,
}
assert set(EMITTERS) == set(OP_NAMES)


def emit(op: str, bb: Any, args: list) -> Any:
    """Emit ``op`` on ``args`` (schema order) into ``bb``: a relax expression, or a
    ``relax.Tuple`` for ops with several outputs."""
    g = Graph(bb)
    out = EMITTERS[op](g, *args)
    return g.relax.Tuple(list(out)) if isinstance(out, tuple) else out
