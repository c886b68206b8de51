"""Mixture-of-experts ops: router gate, sort-based dispatch / combine, grouped GEMM."""

from __future__ import annotations

import torch

from ..formats import FLOAT_WEIGHT, dequantize_weight, fake_quant_activation
from ..validate import FLOAT_DTYPES, INDEX_DTYPES, Checker, Level
from .base import OpSpec, invoke, invoke_prepared, single_output
from .quant import (
    PRODUCT_GUARD,
    PreparedWeight,
    check_product_bound,
    check_quant_weight,
)

# -- moe_gate ----------------------------------------------------------------------

SCORE_FUNCS = ("sigmoid", "softmax")


def _check_gate(
    c: Checker,
    logits,
    bias,
    top_k,
    n_group,
    topk_group,
    routed_scaling_factor,
    norm_topk_prob,
    score_func,
    *,
    values,
):
    c.tensor("logits", logits, ndim=2, dtypes=(torch.float32,))
    e = logits.shape[1]
    c.int32_count("logits", e, "its E experts (the int32 ids)")
    if bias is not None:
        c.tensor("bias", bias, shape=(("E", e),), dtypes=(torch.float32,))
        c.same_device(logits=logits, bias=bias)
    c.int_in_range("n_group", n_group, 1)
    if e % n_group:
        c.fail("n_group", f"a divisor of the expert count E={e}", repr(n_group))
    c.int_in_range("topk_group", topk_group, 1)
    if topk_group > n_group:
        c.fail("topk_group", f"<= n_group={n_group}", repr(topk_group))
    c.int_in_range("top_k", top_k, 1)
    reachable = e // n_group * topk_group
    if top_k > reachable:
        c.fail("top_k", f"<= the {reachable} experts in the kept groups", repr(top_k))
    c.positive_float("routed_scaling_factor", routed_scaling_factor)
    # Weights are at most 1 before the scaling: the product must stay a float32.
    c.within_range("routed_scaling_factor", routed_scaling_factor, "routed_scaling_factor")
    if not isinstance(norm_topk_prob, bool):
        c.fail("norm_topk_prob", "a bool", repr(norm_topk_prob))
    c.choice("score_func", score_func, SCORE_FUNCS)
    if values:
        c.finite("logits", logits)
        if bias is not None:
            bias_max = c.finite("bias", bias)
            # A group scores the sum of its best two choice scores s + bias, s in [0, 1]:
            # an overflow to inf would tie groups the exact scores tell apart.
            c.within_range("bias", 2 * (1 + bias_max), "a group's score 2 * (1 + max|bias|)")


def _fake_gate(logits, bias, top_k, *_):
    t = logits.shape[0]
    return logits.new_empty((t, top_k)), logits.new_empty((t, top_k), dtype=torch.int32)


MOE_GATE = OpSpec(
    name="moe_gate",
    schema="(Tensor logits, Tensor? bias, int top_k, int n_group=1, int topk_group=1, "
    "float routed_scaling_factor=1.0, bool norm_topk_prob=True, str score_func='sigmoid') "
    "-> (Tensor weights, Tensor ids)",
    check=_check_gate,
    fake=_fake_gate,
    features=lambda logits, bias, top_k, n_group=1, topk_group=1, *_: {
        "dtype": logits.dtype,
        "experts": logits.shape[1],
        "top_k": top_k,
        "n_group": n_group,
        "topk_group": topk_group,
    },
    feature_names=("dtype", "experts", "top_k", "n_group", "topk_group"),
    differentiable=("logits",),
    tie_outputs=(1,),
)


def moe_gate(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
    score_func: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to ``top_k`` experts (DeepSeek-V3 / GLM-5 router).

    ``s = sigmoid(logits)`` (or softmax); the choice uses ``c = s + bias`` (``c = s``
    without a bias). With ``n_group > 1`` the experts are split into ``n_group``
    contiguous groups of ``E / n_group``, each scored as DeepSeek-V3's gate and vLLM's
    ``grouped_topk`` do: without a bias by its best ``c``; with a bias ("noaux_tc") by
    the sum of its best two ``c`` (its best one if a group has one expert). The best
    ``topk_group`` groups are kept (equal group scores: the lower group index wins)
    and the ``top_k`` best experts inside them chosen by ``c`` (equal scores: the
    lower expert id wins). The weights use the unbiased ``s``: ``w = s[ids]``,
    divided by ``sum(w) + 1e-20`` if ``norm_topk_prob``, times
    ``routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` fp32 router logits.
        bias: ``[E]`` fp32 score-correction bias (affects only the choice), or None.

    Returns:
        weights: ``[T, top_k]`` fp32; ids: ``[T, top_k]`` int32, best choice score
        first, ties to the lower expert id. Differentiable in ``logits``.
    """
    return invoke(
        MOE_GATE,
        logits,
        bias,
        top_k,
        n_group,
        topk_group,
        routed_scaling_factor,
        norm_topk_prob,
        score_func,
    )


# -- moe_dispatch ------------------------------------------------------------------


def _check_dispatch(c: Checker, x, ids, num_experts, *, values):
    c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    c.tensor("ids", ids, shape=(("T", x.shape[0]), None), dtypes=INDEX_DTYPES)
    c.int_in_range("num_experts", num_experts, 1)
    c.int32_count("ids", ids.shape[0] * ids.shape[1], "its T*k copies (src_row, expert_offsets)")
    c.same_device(x=x, ids=ids)
    if values:
        c.in_range("ids", ids, 0, num_experts)


def _fake_dispatch(x, ids, num_experts):
    rows = ids.shape[0] * ids.shape[1]
    return (
        x.new_empty((rows, x.shape[1])),
        x.new_empty((num_experts + 1,), dtype=torch.int32),
        x.new_empty((rows,), dtype=torch.int32),
    )


MOE_DISPATCH = OpSpec(
    name="moe_dispatch",
    schema="(Tensor x, Tensor ids, int num_experts) "
    "-> (Tensor x_sorted, Tensor expert_offsets, Tensor src_row)",
    check=_check_dispatch,
    fake=_fake_dispatch,
    features=lambda x, ids, num_experts: {
        "dtype": x.dtype,
        "hidden": x.shape[1],
        "top_k": ids.shape[1],
        "experts": num_experts,
    },
    feature_names=("dtype", "hidden", "top_k", "experts"),
    differentiable=("x",),
)


def moe_dispatch(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute token copies so each expert's rows are contiguous.

    Args:
        x: ``[T, D]`` fp32 | bf16 | fp16 token activations.
        ids: ``[T, k]`` int32 | int64 expert ids in ``[0, E)``.
        num_experts: ``E``.

    Returns:
        x_sorted: ``[T*k, D]``, ``x_sorted[r] = x[src_row[r] // k]``, rows ordered by
        expert and, within an expert, by ``t * k + j`` (a stable sort).
        expert_offsets: ``[E + 1]`` int32, expert ``e`` owns rows
        ``[expert_offsets[e], expert_offsets[e + 1])``.
        src_row: ``[T*k]`` int32, the flat ``t * k + j`` each sorted row came from.
    """
    return invoke(MOE_DISPATCH, x, ids, num_experts)


# -- moe_combine -------------------------------------------------------------------


def _check_combine(c: Checker, y_sorted, src_row, weights, *, values):
    c.tensor("y_sorted", y_sorted, ndim=2, dtypes=FLOAT_DTYPES)
    c.tensor("weights", weights, ndim=2, dtypes=(torch.float32,))
    rows = weights.shape[0] * weights.shape[1]
    c.tensor("y_sorted", y_sorted, shape=(("T*k", rows), None))
    c.tensor("src_row", src_row, shape=(("T*k", rows),), dtypes=INDEX_DTYPES)
    c.int32_count("weights", rows, "its T*k slots (src_row's values, as dispatch returns them)")
    c.same_device(y_sorted=y_sorted, src_row=src_row, weights=weights)
    if values:
        c.in_range("src_row", src_row, 0, rows)
        if rows:  # in range and sorted onto 0..rows-1: each row id exactly once
            every = torch.arange(rows, device=src_row.device).to(src_row.dtype)
            ok = (src_row.sort().values == every).all()
            c.require(ok, "src_row", f"a permutation of 0..{rows - 1}", lambda: "a repeated row id")
        w_max = c.finite("weights", weights)
        if values >= Level.STRICT:  # y_sorted: as large as the op's whole input
            bound = weights.shape[1] * w_max * c.magnitude(y_sorted)
            c.within_range("weights", bound, "a weighted sum (k * max|weights| * max|y_sorted|)")


def _fake_combine(y_sorted, src_row, weights):
    return y_sorted.new_empty((weights.shape[0], y_sorted.shape[1]))


MOE_COMBINE = OpSpec(
    name="moe_combine",
    schema="(Tensor y_sorted, Tensor src_row, Tensor weights) -> Tensor",
    check=_check_combine,
    fake=_fake_combine,
    features=lambda y_sorted, src_row, weights: {
        "dtype": y_sorted.dtype,
        "hidden": y_sorted.shape[1],
        "top_k": weights.shape[1],
    },
    feature_names=("dtype", "hidden", "top_k"),
    differentiable=("y_sorted", "weights"),
    result_guard=single_output("out"),
)


def moe_combine(
    y_sorted: torch.Tensor, src_row: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted inverse of :func:`moe_dispatch`.

    ``out[t] = sum_j weights[t, j] * y_sorted[r]`` where ``src_row[r] = t * k + j``,
    accumulated in fp32.

    Args:
        y_sorted: ``[T*k, D]`` fp32 | bf16 | fp16 expert outputs in dispatch order.
        src_row: ``[T*k]`` int32 | int64 from :func:`moe_dispatch` (a permutation).
        weights: ``[T, k]`` fp32 routing weights.

    Returns:
        ``[T, D]`` in ``y_sorted``'s dtype. Differentiable in ``y_sorted`` and ``weights``.
    """
    return invoke(MOE_COMBINE, y_sorted, src_row, weights)


# -- grouped_gemm ------------------------------------------------------------------


def _check_grouped(c: Checker, x, w, expert_offsets, w_scale, scheme, group_size, *, values):
    c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    c.tensor("w", w, ndim=3)
    e = w.shape[0]
    c.tensor("expert_offsets", expert_offsets, shape=(("E+1", e + 1),), dtypes=INDEX_DTYPES)
    c.same_device(x=x, w=w, expert_offsets=expert_offsets)
    c.int_in_range("group_size", group_size, 1)  # float weights ignore it, but typed
    if scheme == FLOAT_WEIGHT:
        c.tensor("w", w, shape=(("E", e), None, ("K", x.shape[1])), dtypes=(x.dtype,))
        if w_scale is not None:
            c.fail("w_scale", f"None with scheme={FLOAT_WEIGHT!r}", "a scale tensor")
        if values:
            check_product_bound(c, x, w, values)
    else:
        check_quant_weight(c, x, w, w_scale, scheme, group_size, values=values, experts=e)
    if values:
        off = expert_offsets
        ok = (off[0] == 0) & (off[-1] == x.shape[0]) & (off[1:] >= off[:-1]).all()
        c.require(
            ok,
            "expert_offsets",
            f"non-decreasing from 0 to M={x.shape[0]}",
            lambda: f"{off.tolist()[:8]}{'...' if off.numel() > 8 else ''}",
        )


def _fake_grouped(x, w, expert_offsets, w_scale=None, scheme=FLOAT_WEIGHT, group_size=128):
    return x.new_empty((x.shape[0], w.shape[1]))


def _grouped_backward(inputs, grads):
    """Closed form (straight-through for quantised weights), written without reading
    ``expert_offsets`` on the host so it traces: ``dx[r] = dy[r] @ W[e(r)]`` and
    ``dW[e] = sum_{r in e} dy[r]^T Q(x[r])``, through a one-hot row-to-expert map
    (``E`` times the work of a grouped kernel; backends may ship a faster one)."""
    x, w, offsets, w_scale, scheme, group_size = inputs
    (gy,) = grads
    gy32 = gy.float()
    e = w.shape[0]
    if scheme == FLOAT_WEIGHT:
        wf, xq = w.float(), x.float()
    else:
        scales = [None] * e if w_scale is None else list(w_scale.unbind(0))
        wf = torch.stack([dequantize_weight(w[i], scales[i], scheme, group_size) for i in range(e)])
        xq = fake_quant_activation(x, scheme)
    rows = torch.arange(x.shape[0], device=x.device)
    row_expert = torch.searchsorted(offsets[1:].contiguous(), rows.to(offsets.dtype), right=True)
    onehot = (row_expert[:, None] == torch.arange(e, device=x.device)).float()
    gx = torch.einsum("me,mn,enk->mk", onehot, gy32, wf).to(x.dtype)
    gw = None
    if w_scale is None:  # a float weight: plain, or fake-quantised (QAT)
        gw = torch.einsum("me,mn,mk->enk", onehot, gy32, xq).to(w.dtype)
    return gx, gw, None, None, None, None


GROUPED_GEMM = OpSpec(
    name="grouped_gemm",
    schema="(Tensor x, Tensor w, Tensor expert_offsets, Tensor? w_scale=None, "
    "str scheme='none', int group_size=128) -> Tensor",
    check=_check_grouped,
    fake=_fake_grouped,
    features=lambda x, w, o, w_scale=None, scheme=FLOAT_WEIGHT, *_: {
        "dtype": x.dtype,
        "scheme": None if scheme == FLOAT_WEIGHT else scheme,
        "experts": w.shape[0],
        "out_features": w.shape[1],
        "in_features": x.shape[1],
    },
    feature_names=("dtype", "scheme", "experts", "out_features", "in_features"),
    differentiable=("x", "w"),
    backward=_grouped_backward,
    result_guard=PRODUCT_GUARD,
)


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor | PreparedWeight,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    scheme: str = FLOAT_WEIGHT,
    group_size: int = 128,
) -> torch.Tensor:
    """One GEMM per expert over its contiguous rows: ``y[r] = x[r] @ w[e].T``.

    Args:
        x: ``[M, K]`` fp32 | bf16 | fp16, rows sorted by expert (see :func:`moe_dispatch`).
        w: ``[E, N, K]`` in ``x``'s dtype with ``scheme='none'``; otherwise per-expert
            weights in ``scheme``'s packed layout (``[E, ...]``) or float for QAT, as
            in :func:`quant_gemm`; or a :class:`PreparedWeight` of ``[E, ...]`` packed
            weights from :func:`glmport.prepare_weight` (it carries the scales).
        expert_offsets: ``[E + 1]`` int32 | int64, non-decreasing, ``0`` to ``M``.
        w_scale: ``[E, ...]`` float32 scales for packed weights, else None.
        scheme: ``'none'`` or a :func:`quant_gemm` scheme.
        group_size: int4 group size in QAT mode.

    Returns:
        ``[M, N]`` in ``x``'s dtype. Differentiable in ``x`` and float ``w``.
    """
    if isinstance(w, PreparedWeight):
        args = (x, w, expert_offsets, w.w_scale, w.scheme, w.group_size)
        return invoke_prepared(GROUPED_GEMM, args)
    return invoke(GROUPED_GEMM, x, w, expert_offsets, w_scale, scheme, group_size)
