"""moe_gate, moe_dispatch and moe_combine mutants.

gate: (logits [T, E] float32, bias [E] | None, top_k, n_group, topk_group,
routed_scaling_factor, norm_topk_prob, score_func) -> (weights [T, k], ids [T, k]
int32); dispatch: (x [T, D], ids [T, k] int32, E) -> (x_sorted [T*k, D],
expert_offsets [E + 1] int32, src_row [T*k] int32); combine: (y_sorted [T*k, D],
src_row, weights [T, k]) -> [T, D]
"""

from __future__ import annotations

import torch

from .base import (
    EXACT_TIES,
    IDS_2P16,
    IMBALANCED_ROUTING,
    NORM_TOPK_FALSE,
    add,
    column_major,
    ids_16bit,
    mutant,
    replace_args,
)

CAPACITY = 64  # rows per expert of the capacity-drop mutant's fixed buffer


def _last_choice_dropped(w: torch.Tensor) -> torch.Tensor:
    w = w.clone()
    w[:, -1] = 0
    return w


# (op, name, kind, what breaks, the family that kills it, {argument: old -> new})
_ARGUMENTS = (
    ("moe_gate", "always_renormalises", "normalisation",
     "renormalises the top-k weights even with norm_topk_prob = False", NORM_TOPK_FALSE,
     {"norm_topk_prob": lambda _: True}),
    ("moe_gate", "never_renormalises", "normalisation",
     "leaves the top-k weights unnormalised (norm_topk_prob ignored)", "tiny",
     {"norm_topk_prob": lambda _: False}),
    ("moe_gate", "scaling_factor_ignored", "scale", "ignores routed_scaling_factor", "tiny",
     {"routed_scaling_factor": lambda _: 1.0}),
    ("moe_gate", "groups_ignored", "formula",
     "routes over all experts, ignoring n_group / topk_group", "tiny: grouped",
     {"n_group": lambda _: 1, "topk_group": lambda _: 1}),
    ("moe_gate", "topk_group_off_by_one", "range end", "keeps topk_group + 1 groups",
     "tiny: grouped", {"topk_group": lambda g: g + 1}),
    ("moe_gate", "score_func_ignored", "formula", "always scores with the sigmoid",
     "tiny: softmax_nobias", {"score_func": lambda _: "sigmoid"}),
    ("moe_gate", "bias_ignored", "formula", "chooses without the correction bias", "tiny",
     {"bias": lambda _: None}),
    ("moe_combine", "drops_weights", "formula", "sums the expert outputs unweighted", "tiny",
     {"weights": torch.ones_like}),
    ("moe_combine", "weights_transposed", "layout", "reads weights [T, k] as if stored [k, T]",
     "tiny (T != k)", {"weights": lambda w: column_major(w).contiguous()}),
    ("moe_combine", "last_choice_dropped", "range end",
     "leaves each token's last (k-th) expert out of the sum", "tiny",
     {"weights": _last_choice_dropped}),
    ("moe_combine", "inverse_permutation", "layout",
     "scatters by the inverse of src_row (gather and scatter confused)", "tiny",
     {"src_row": lambda r: torch.argsort(r.long()).to(r.dtype)}),
)  # fmt: skip
for _op, _name, _kind, _breaks, _needs, _changes in _ARGUMENTS:
    add(_op, _name, _kind, _breaks, _needs, replace_args(_op, **_changes))


@mutant(
    "moe_gate",
    "bias_in_weights",
    "formula",
    "adds the correction bias to the returned weights too",
    "tiny",
)
def _gate_bias_in_weights(kernel):
    def mutated(logits, bias, *rest):
        weights, ids = kernel(logits, bias, *rest)
        if bias is not None:
            weights = weights + bias[ids.long()].to(weights.dtype)
        return weights, ids

    return mutated


@mutant(
    "moe_gate",
    "group_sum_two_without_bias",
    "formula",
    "scores a group by its best two experts without a bias too",
    "edge: grouped_nobias",
)
def _gate_sum_two(kernel):
    def mutated(logits, bias, *rest):
        # A zero bias makes the kernel score groups by their best two, changing nothing else.
        if bias is None:
            bias = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
        return kernel(logits, bias, *rest)

    return mutated


@mutant(
    "moe_gate",
    "softmax_of_selected",
    "normalisation",
    "weights are a softmax over the chosen experts' logits, whatever score_func says",
    "tiny (sigmoid scores)",
)
def _gate_softmax_selected(kernel):
    def mutated(logits, bias, top_k, n_group, topk_group, scaling, norm, score_func):
        weights, ids = kernel(logits, bias, top_k, n_group, topk_group, scaling, norm, score_func)
        chosen = torch.softmax(logits.float().gather(1, ids.long()), dim=-1)
        return (chosen * scaling).to(weights.dtype), ids

    return mutated


@mutant(
    "moe_gate",
    "ties_to_higher_expert",
    "tie order",
    "gives exact ties to the higher expert and group (the lower wins)",
    EXACT_TIES,
)
def _gate_high_ties(kernel):
    def mutated(logits, bias, *rest):
        e = logits.shape[1]
        flipped = None if bias is None else bias.flip(0)
        weights, ids = kernel(logits.flip(1), flipped, *rest)
        return weights, (e - 1 - ids).to(ids.dtype)

    return mutated


def _copy_experts(offsets: torch.Tensor, copies: int, num_experts: int):
    """``(positions [copies], expert of each [copies], offsets int64)`` of a dispatch's
    output (positions past the last offset get the last expert)."""
    o = offsets.long()
    pos = torch.arange(copies, device=offsets.device)
    return pos, torch.bucketize(pos, o[1:], right=True).clamp_max(num_experts - 1), o


@mutant(
    "moe_dispatch",
    "unstable_within_expert",
    "tie order",
    "orders an expert's copies last token first (an unstable sort)",
    "tiny",
)
def _dispatch_unstable(kernel):
    def mutated(x, ids, num_experts):
        x_sorted, offsets, src_row = kernel(x, ids, num_experts)
        pos, expert, o = _copy_experts(offsets, src_row.shape[0], num_experts)
        mirrored = torch.where(pos < o[-1], o[expert] + o[expert + 1] - 1 - pos, pos)
        return x_sorted[mirrored], offsets, src_row[mirrored]

    return mutated


@mutant(
    "moe_dispatch",
    "capacity_drop",
    "capacity",
    f"a fixed {CAPACITY}-row buffer per expert: overflow copies silently fall outside "
    "every expert's range",
    IMBALANCED_ROUTING,
)
def _dispatch_capacity(kernel):
    def mutated(x, ids, num_experts):
        x_sorted, offsets, src_row = kernel(x, ids, num_experts)
        pos, expert, o = _copy_experts(offsets, src_row.shape[0], num_experts)
        kept = (pos - o[expert] < CAPACITY) & (pos < o[-1])
        order = torch.cat((pos[kept], pos[~kept]))  # kept copies first, in expert order
        counts = (o[1:] - o[:-1]).clamp_max(CAPACITY)
        new = torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(offsets.dtype)
        return x_sorted[order], new, src_row[order]

    return mutated


@mutant(
    "moe_dispatch",
    "offsets_without_leading_zero",
    "range end",
    "returns each expert's end as its offset (offsets shifted by one expert)",
    "tiny",
)
def _dispatch_shifted_offsets(kernel):
    def mutated(x, ids, num_experts):
        x_sorted, offsets, src_row = kernel(x, ids, num_experts)
        return x_sorted, torch.cat((offsets[1:], offsets[-1:])), src_row

    return mutated


@mutant(
    "moe_dispatch",
    "row_ids_16bit",
    "ids width",
    "stages src_row as uint16 (copy r comes back as r % 65536)",
    IDS_2P16,
)
def _dispatch_ids16(kernel):
    def mutated(x, ids, num_experts):
        _, offsets, src_row = kernel(x, ids, num_experts)
        wrapped = ids_16bit(src_row)
        return x[wrapped.long() // ids.shape[1]], offsets, wrapped

    return mutated


@mutant(
    "moe_dispatch",
    "src_row_is_token",
    "formula",
    "returns the source token (row // k) instead of the source copy",
    "tiny",
)
def _dispatch_token_rows(kernel):
    def mutated(x, ids, num_experts):
        x_sorted, offsets, src_row = kernel(x, ids, num_experts)
        return x_sorted, offsets, (src_row // ids.shape[1]).to(src_row.dtype)

    return mutated
