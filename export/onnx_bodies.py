"""The ``ai.glmport`` ONNX function body of every glmport op, built from standard opset-18
ops: :data:`BODIES` maps an op to its body, ``(body, tensors by name, structural
attributes) -> output names``. An absent optional input is ``None`` in the tensors;
numeric attributes are read by reference (:meth:`~glmport.export.onnx_body.Body.attr`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmport.core.formats import FORMATS, FP8_DTYPE

from .onnx_body import (
    INF,
    INT64_MAX,
    Body,
    arange,
    fake_quant,
    fp8_codes,
    from_fp8,
    gemm,
    pack_int4,
    quant_values,
    transpose,
)

# mla_prolog's quantised projections.
W8A8 = "w8a8"


def _paged_rows(b: Body, table: str, k: str) -> str:
    """``[T, M * block_size]`` int64 rows of a paged pool ``k [blocks, block_size, ...]``
    holding each query's logical positions (``core/specs/indexer.paged_slots``)."""
    size = b.dim(k, 1)
    pos = arange(b, b("Mul", b.dim(table, 1), size))
    last = b("Sub", b.dim(k, 0), b.ints(1))
    blocks = b("Gather", b("Cast", table, to=7), b("Div", pos, size), axis=1)
    blocks = b("Min", b("Max", blocks, b.const(0, "int64")), last)  # unread entries: any id
    return b("Add", b("Mul", blocks, size), b("Mod", pos, size))


def _scores(b: Body, t: dict[str, str | None]) -> str:
    """Indexer scores ``[T, N]`` float32 (``[T, M * block_size]`` over logical positions
    when paged), ``-inf`` outside ``[k_start, k_end)``."""
    fp8 = t["q_scale"] is not None
    table = t.get("block_table")
    q = from_fp8(b, t["q"]) if fp8 else b.f32(t["q"])
    k = from_fp8(b, t["k"]) if fp8 else b.f32(t["k"])
    k_scale = t["k_scale"]
    if table is None:
        dots = b("MatMul", q, transpose(b, k, 1, 0))  # [T, Hi, N]
        if fp8:
            k_scale = b("Unsqueeze", k_scale, b.ints(0, 1))
    else:  # each query's keys gathered in logical order: [T, L, Di]
        rows = _paged_rows(b, table, t["k"])
        flat = b.reshape(k, b("Mul", b.dim(k, 0), b.dim(k, 1)), b.dim(k, 2))
        dots = b("MatMul", q, transpose(b, b("Gather", flat, rows, axis=0), 0, 2, 1))
        if fp8:
            flat_scale = b.reshape(k_scale, b("Mul", b.dim(k_scale, 0), b.dim(k_scale, 1)))
            k_scale = b("Unsqueeze", b("Gather", flat_scale, rows), b.ints(1))
    if fp8:
        dots = b("Mul", b("Mul", dots, b("Unsqueeze", t["q_scale"], b.ints(2))), k_scale)
    w = b("Unsqueeze", t["weights"], b.ints(1))
    scores = b("Squeeze", b("MatMul", w, b("Relu", dots)), b.ints(1))  # [T, N]
    slots = b("Unsqueeze", arange(b, b.dim(scores, 1)), b.ints(0))
    start = b("Unsqueeze", b("Cast", t["k_start"], to=7), b.ints(1))
    end = b("Unsqueeze", b("Cast", t["k_end"], to=7), b.ints(1))
    valid = b("And", b("GreaterOrEqual", slots, start), b("Less", slots, end))
    return b("Where", valid, scores, b.const(-INF))


# -- the op bodies: (body, tensors by name, structural attributes) -> outputs ----------


def _lightning_indexer(b, t, a):
    scores = _scores(b, t)
    n, rows = b.dim(scores, 1), b.dim(t["q"], 0)
    zero = b.ints(0)
    start = b("Min", b("Max", b("Cast", t["k_start"], to=7), zero), n)
    end = b("Max", b("Min", b("Max", b("Cast", t["k_end"], to=7), zero), n), start)
    count = b("Unsqueeze", b("Sub", end, start), b.ints(1))
    topk = b.attr_1d("topk")
    # -inf columns so TopK always has topk entries (N < topk): the tail is masked below.
    padded = b("Concat", scores, b.full(-INF, rows, topk), axis=1)
    values, slots = b("TopK", padded, topk, axis=1, largest=1, sorted=1, outputs=2)
    keep = b("Less", b("Unsqueeze", arange(b, topk), b.ints(0)), count)
    indices = b("Cast", b("Where", keep, slots, b.const(-1, "int64")), to=6)
    if not a["need_scores"]:
        return [indices, b.const([], "float32")]  # [0]: the caller reads no scores
    return [indices, b("Where", keep, values, b.const(-INF))]


def _indexer_logits(b, t, a):
    return [_scores(b, t)]


def _sparse_attention(b, t, a):
    k = t["k"] if t["k_rope"] is None else b("Concat", t["k"], t["k_rope"], axis=2)
    q, k, v = b.f32(t["q"]), b.f32(k), b.f32(t["v"])
    rows, h, dk = b.dim(q, 0), b.dim(q, 1), b.dim(q, 2)
    n, hkv, dv = b.dim(k, 0), b.dim(k, 1), b.dim(v, 2)
    kk = b.dim(t["indices"], 1)
    # One zero slot after the N real ones: invalid entries gather it (also when N = 0).
    kp = b("Concat", k, b.full(0.0, b.ints(1), hkv, dk), axis=0)
    vp = b("Concat", v, b.full(0.0, b.ints(1), hkv, dv), axis=0)
    idx = b("Cast", t["indices"], to=7)
    valid = b("And", b("GreaterOrEqual", idx, b.const(0, "int64")), b("Less", idx, n))
    slots = b("Where", valid, idx, n)
    kg, vg = b("Gather", kp, slots, axis=0), b("Gather", vp, slots, axis=0)  # [T, K, Hkv, D]
    groups = b("Div", h, hkv)
    qg = b.reshape(q, rows, hkv, groups, dk)
    s = b("MatMul", qg, transpose(b, kg, 0, 2, 3, 1))  # [T, Hkv, G, K]
    s = b("Mul", b.reshape(s, rows, h, kk), b.attr("scale", "float"))
    s = b("Where", b("Unsqueeze", valid, b.ints(1)), s, b.const(-INF))
    m = b("ReduceMax", s, b.ints(-1), keepdims=1)
    m = b("Where", b("IsInf", m), b.const(0.0), m)  # all -inf: subtract 0, p = 0 not NaN
    e = b("Exp", b("Sub", s, m))
    total = b("ReduceSum", e, b.ints(-1), keepdims=1)
    p = b("Div", e, b("Where", b("Greater", total, b.const(0.0)), total, b.const(1.0)))
    lse = b("Squeeze", b("Add", m, b("Log", total)), b.ints(-1))
    out = b("MatMul", b.reshape(p, rows, hkv, groups, kk), transpose(b, vg, 0, 2, 1, 3))
    if not a["need_lse"]:
        lse = b.const([], "float32")  # [0]: the caller reads no lse
    return [b("CastLike", b.reshape(out, rows, h, dv), t["q"]), lse]


def _moe_gate(b, t, a):
    lf = b.f32(t["logits"])
    scores = b("Sigmoid", lf) if a["score_func"] == "sigmoid" else b("Softmax", lf, axis=-1)
    bias = t["bias"]
    choice = scores if bias is None else b("Add", scores, bias)
    rows, e = b.dim(lf, 0), b.dim(lf, 1)
    ng = b.attr_1d("n_group")
    per = b("Div", e, ng)
    grouped = b.reshape(choice, rows, ng, per)
    # A group's best score without a bias, the sum of its best two with one (noaux_tc).
    if bias is None:
        group_score = b("ReduceMax", grouped, b.ints(2), keepdims=0)
    else:
        best2 = b("TopK", grouped, b("Min", per, b.ints(2)), axis=2, outputs=2)[0]
        group_score = b("ReduceSum", best2, b.ints(2), keepdims=0)
    # TopK breaks ties to the lower index, as the reference's stable sorts do.
    kept = b("TopK", group_score, b.attr_1d("topk_group"), axis=1, outputs=2)[1]
    hit = b("Equal", b("Unsqueeze", kept, b.ints(2)), b.reshape(arange(b, ng), b.ints(1, 1), ng))
    keep = b("ReduceMax", b("Cast", hit, to=1), b.ints(1), keepdims=0)  # [T, n_group]
    mask = b.reshape(
        b("Expand", b("Unsqueeze", keep, b.ints(2)), b("Concat", rows, ng, per, axis=0)), rows, e
    )
    choice = b("Where", b("Greater", mask, b.const(0.0)), choice, b.const(-INF))
    ids = b("TopK", choice, b.attr_1d("top_k"), axis=1, outputs=2)[1]
    weights = b("GatherElements", scores, ids, axis=1)
    if a["norm_topk_prob"]:
        total = b("Add", b("ReduceSum", weights, b.ints(1), keepdims=1), b.const(1e-20))
        weights = b("Div", weights, total)
    weights = b("Mul", weights, b.attr("routed_scaling_factor", "float"))
    return [weights, b("Cast", ids, to=6)]


def _moe_dispatch(b, t, a):
    ids = t["ids"]
    e = b.attr_1d("num_experts")
    flat = b("Cast", b.reshape(ids, b("Reshape", b("Size", ids), b.ints(1))), to=7)
    key = b(
        "Where",
        b("And", b("GreaterOrEqual", flat, b.const(0, "int64")), b("Less", flat, e)),
        flat,
        e,
    )
    # An ascending TopK over every row is a stable sort: ties keep the lower row first.
    src = b("TopK", b.f32(key), b.dim(key, 0), axis=0, largest=0, sorted=1, outputs=2)[1]
    below = b(
        "Less",
        b("Unsqueeze", key, b.ints(0)),
        b("Unsqueeze", arange(b, b("Add", e, b.ints(1))), b.ints(1)),
    )
    offsets = b("ReduceSum", b("Cast", below, to=7), b.ints(1), keepdims=0)
    x_sorted = b("Gather", t["x"], b("Div", src, b.dim(ids, 1)), axis=0)
    return [x_sorted, b("Cast", offsets, to=6), b("Cast", src, to=6)]


def _moe_combine(b, t, a):
    y = b.f32(t["y_sorted"])
    w = t["weights"]
    rows, k, d = b.dim(w, 0), b.dim(w, 1), b.dim(y, 1)
    total = b("Mul", rows, k)
    src = b("Cast", t["src_row"], to=7)
    valid = b("And", b("GreaterOrEqual", src, b.const(0, "int64")), b("Less", src, total))
    src = b("Where", valid, src, b.const(0, "int64"))
    # A src_row naming no token adds into a spare row T, dropped below.
    target = b("Where", valid, b("Div", src, k), rows)
    flat_w = b("Gather", b.reshape(w, total), src, axis=0)
    contrib = b("Mul", y, b("Unsqueeze", flat_w, b.ints(1)))
    acc = b.full(0.0, b("Add", rows, b.ints(1)), d)
    out = b("ScatterND", acc, b("Unsqueeze", target, b.ints(1)), contrib, reduction="add")
    return [b("CastLike", b("Slice", out, b.ints(0), rows, b.ints(0)), t["y_sorted"])]


def _grouped_gemm(b, t, a):
    x, w, sw = t["x"], t["w"], t["w_scale"]
    m = b.dim(x, 0)
    # Offsets made a partition of [0, M]: clamped, then a running maximum.
    off = b("Min", b("Max", b("Cast", t["expert_offsets"], to=7), b.ints(0)), m)
    e1 = b.dim(off, 0)
    pos = arange(b, e1)
    upto = b("LessOrEqual", b("Unsqueeze", pos, b.ints(0)), b("Unsqueeze", pos, b.ints(1)))
    spread = b("Where", upto, b("Unsqueeze", off, b.ints(0)), b.const(-1, "int64"))
    bounds = b("ReduceMax", spread, b.ints(1), keepdims=0)
    rows = arange(b, m)
    upper = b("Slice", bounds, b.ints(1), e1, b.ints(0))
    expert = b(
        "ReduceSum",
        b(
            "Cast",
            b("LessOrEqual", b("Unsqueeze", upper, b.ints(0)), b("Unsqueeze", rows, b.ints(1))),
            to=7,
        ),
        b.ints(1),
        keepdims=0,
    )
    first = b("Slice", bounds, b.ints(0), b.ints(1), b.ints(0))
    owned = b("And", b("GreaterOrEqual", rows, first), b("Less", expert, b("Sub", e1, b.ints(1))))
    expert = b("Where", owned, expert, b.const(0, "int64"))
    # Each row with its expert's weight: one batched GEMM of row-sized batches.
    wr = b("Gather", w, expert, axis=0)
    swr = None if sw is None else b("Gather", sw, expert, axis=0)
    x3 = b("Unsqueeze", b.f32(x), b.ints(1))
    gs = b.attr_1d("group_size")
    y = b("Squeeze", gemm(b, x3, wr, swr, a["scheme"], gs), b.ints(1))
    y = b("Where", b("Unsqueeze", owned, b.ints(1)), y, b.const(0.0))
    return [b("CastLike", y, x)]


def _quantize(b, t, a):
    fmt = FORMATS[a["fmt"]]
    x3 = b("Unsqueeze", b.f32(t["x"]), b.ints(0))
    q, scale, _ = quant_values(b, x3, fmt, b.attr_1d("group_size"))
    q = b("Squeeze", q, b.ints(0))
    if fmt.storage == FP8_DTYPE:
        codes = fp8_codes(b, q)
    elif fmt.storage == torch.uint8:
        codes = pack_int4(b, q)
    else:
        codes = b("Cast", q, to=3)
    return [codes, b("Squeeze", scale, b.ints(0))]


def _quant_gemm(b, t, a):
    x3 = b("Unsqueeze", b.f32(t["x"]), b.ints(0))
    w3 = b("Unsqueeze", t["w"], b.ints(0))
    sw = t["w_scale"]
    sw3 = None if sw is None else b("Unsqueeze", sw, b.ints(0))
    y = gemm(b, x3, w3, sw3, a["scheme"], b.attr_1d("group_size"))
    return [b("CastLike", b("Squeeze", y, b.ints(0)), t["x"])]


def _rms_norm(b, t, a):
    return [_normalised(b, t["x"], t["weight"])]


def _normalised(b: Body, x_in: str, weight: str) -> str:
    """``rms_norm`` of ``x_in`` (``[..., D]``) with gain ``weight`` and the op's ``eps``
    attribute, in ``x_in``'s dtype."""
    x = b.f32(x_in)
    # Rows beyond 1 are divided by their max |x| first (no overflow), as the reference.
    s = b("Max", b("ReduceMax", b("Abs", x), b.ints(-1), keepdims=1), b.const(1.0))
    xs = b("Div", x, s)
    ms = b("ReduceMean", b("Mul", xs, xs), b.ints(-1), keepdims=1)
    eps = b("Div", b.attr("eps", "float"), b("Mul", s, s))
    inv = b("Reciprocal", b("Sqrt", b("Add", ms, eps)))
    return b("CastLike", b("Mul", b("Mul", xs, inv), b.f32(weight)), x_in)


def _rope(b, t, a):
    return [_rotated(b, t["x"], t["cos"], t["sin"], a["interleaved"])]


def _rotated(b: Body, x_in: str, cos: str, sin: str, interleaved: bool) -> str:
    """``rope`` of ``x_in`` (``[T, ..., D]``) by ``cos`` / ``sin`` ``[T, D/2]``, in
    ``x_in``'s dtype."""
    x = b.f32(x_in)
    shape = b("Shape", x)
    # cos / sin [T, D/2] viewed as [T, 1, ..., 1, D/2] to broadcast over head dims.
    middle = b("Reshape", b("Sub", b("Size", shape), b.const(2, "int64")), b.ints(1))
    ones = b("ConstantOfShape", middle, value=_int64_one())
    c = b.reshape(b.f32(cos), b.dim(cos, 0), ones, b.dim(cos, 1))
    s = b.reshape(b.f32(sin), b.dim(sin, 0), ones, b.dim(sin, 1))
    if interleaved:
        big = b.ints(INT64_MAX)
        x1 = b("Slice", x, b.ints(0), big, b.ints(-1), b.ints(2))
        x2 = b("Slice", x, b.ints(1), big, b.ints(-1), b.ints(2))
    else:
        x1, x2 = b("Split", x, axis=-1, num_outputs=2, outputs=2)
    y1 = b("Sub", b("Mul", x1, c), b("Mul", x2, s))
    y2 = b("Add", b("Mul", x1, s), b("Mul", x2, c))
    if interleaved:
        pair = b("Concat", b("Unsqueeze", y1, b.ints(-1)), b("Unsqueeze", y2, b.ints(-1)), axis=-1)
        y = b("Reshape", pair, shape, allowzero=1)
    else:
        y = b("Concat", y1, y2, axis=-1)
    return b("CastLike", y, x_in)


def _mla_prolog(b, t, a):
    x, w_uk = t["x"], t["w_uk"]
    quantised = t["w_uq_scale"] is not None

    def batched(v: str) -> str:
        return b("Unsqueeze", v, b.ints(0))

    def linear(inp: str, w: str) -> str:
        scale = t[w + "_scale"]
        if scale is None:
            y = b("MatMul", b.f32(inp), transpose(b, b.f32(t[w]), 1, 0))
        else:  # W8A8 (the group size is unused by a per-channel weight)
            y = b(
                "Squeeze",
                gemm(b, batched(b.f32(inp)), batched(t[w]), batched(scale), W8A8, b.dim(inp, 1)),
                b.ints(0),
            )
        return b("CastLike", y, x)

    big = b.ints(INT64_MAX)
    heads, nope, kv_lora = b.dim(w_uk, 0), b.dim(w_uk, 1), b.dim(w_uk, 2)
    q_norm = _normalised(b, linear(x, "w_dq"), t["gamma_cq"])
    if quantised:  # as the W8A8 up-projection reads it
        grid = fake_quant(b, batched(b.f32(q_norm)), FORMATS["int8_row"], b.dim(q_norm, 1))
        q_norm = b("CastLike", b("Squeeze", grid, b.ints(0)), x)
    per_head_width = b("Div", b.dim(t["w_uq"], 0), heads)
    q = b.reshape(linear(q_norm, "w_uq"), b.dim(x, 0), heads, per_head_width)
    q_nope = b("Slice", q, b.ints(0), nope, b.ints(2))
    q_pe = b("Slice", q, nope, big, b.ints(2))
    per_head = b("MatMul", b("Transpose", b.f32(q_nope), perm=[1, 0, 2]), b.f32(w_uk))
    q_latent = b("CastLike", b("Transpose", per_head, perm=[1, 0, 2]), x)
    kv = linear(x, "w_dkv")
    latent = b("Slice", kv, b.ints(0), kv_lora, b.ints(1))
    k_pe = b("Slice", kv, kv_lora, big, b.ints(1))
    cos, sin = t["cos"], t["sin"]
    return [
        q_latent,
        _rotated(b, q_pe, cos, sin, True),
        q_norm,
        _normalised(b, latent, t["gamma_ckv"]),
        _rotated(b, k_pe, cos, sin, True),
    ]


def _int64_one():
    from onnx import helper

    return helper.make_tensor("one", 7, [1], [1])


def _token_logprobs(b, t, a):
    h, w = b.f32(t["hidden"]), b.f32(t["lm_head"])
    logits = b("Div", b("MatMul", h, transpose(b, w, 1, 0)), b.attr("temperature", "float"))
    lp = b("LogSoftmax", logits, axis=-1)
    targets = t["targets"]
    v = b.dim(w, 0)
    tg = b("Cast", targets, to=7)
    valid = b("And", b("GreaterOrEqual", tg, b.const(0, "int64")), b("Less", tg, v))
    # A NaN column V: a target outside [0, V) picks it (also when V = 0).
    nan = float("nan")
    lp_nan = b("Concat", lp, b.full(nan, b.dim(lp, 0), b.ints(1)), axis=1)
    pick = b("Unsqueeze", b("Where", valid, tg, v), b.ints(1))
    logp = b("Squeeze", b("GatherElements", lp_nan, pick, axis=1), b.ints(1))
    entropy = b("Neg", b("ReduceSum", b("Mul", b("Exp", lp), lp), b.ints(-1), keepdims=0))
    no_vocab = b("Equal", v, b.const(0, "int64"))  # nothing to normalise: NaN, as the reference
    return [logp, b("Where", no_vocab, b.const(nan), entropy)]


BODIES: dict[str, Callable] = {
    "lightning_indexer": _lightning_indexer,
    "indexer_logits": _indexer_logits,
    "sparse_attention": _sparse_attention,
    "moe_gate": _moe_gate,
    "moe_dispatch": _moe_dispatch,
    "moe_combine": _moe_combine,
    "grouped_gemm": _grouped_gemm,
    "quantize": _quantize,
    "quant_gemm": _quant_gemm,
    "rms_norm": _rms_norm,
    "rope": _rope,
    "token_logprobs": _token_logprobs,
    "mla_prolog": _mla_prolog,
}
