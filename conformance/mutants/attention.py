"""sparse_attention mutants.

(q [T, H, Dk], k [N, Hkv, Dk], v [N, Hkv, Dv], indices [T, K] int32, scale, need_lse,
k_rope [N, Hkv, Dr] or None (then k is [N, Hkv, Dk - Dr])) ->
(out [T, H, Dv], lse [T, H] float32, or [0] without need_lse)

Some reimplement the op in torch with the bug in it (an accumulation in the input
dtype, a softmax without its max) instead of wrapping the base kernel: what they
measure is the suite, not the base.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmport.core.specs.attention import lse_as_asked

from .base import DUPLICATE_SLOTS, IDS_2P16, LN2, add, ids_16bit, mutant, on_args, replace_args

OP = "sparse_attention"


def _scale_from(fn: Callable[[torch.Tensor, torch.Tensor, float], float]):
    """The kernel called with the softmax scale ``fn(q, v, scale)``."""

    def edit(args: list) -> None:
        q, v, scale = args[0], args[2], args[4]
        args[4] = fn(q, v, scale)

    return on_args(edit)


def _minus_one_reads(slot: Callable[[torch.Tensor], int]):
    """Index -1 (no slot) read as slot ``slot(k)``."""

    def edit(args: list) -> None:
        k, indices = args[1], args[3]
        args[3] = torch.where(indices < 0, slot(k), indices)

    return on_args(edit)


def _lse_rewritten(change: Callable[[torch.Tensor], torch.Tensor]):
    def wrap(kernel):
        def mutated(*args):
            out, lse = kernel(*args)
            return out, change(lse)

        return mutated

    return wrap


# (name, kind, what breaks, the family that kills it, the mutation)
_SIMPLE = (
    ("scale_ignored", "scale", "uses 1/sqrt(Dk) whatever scale it is given (YaRN's mscale lost)",
     "sparse_attention with a softmax scale other than 1/sqrt(Dk)",
     _scale_from(lambda q, v, scale: q.shape[-1] ** -0.5)),
    ("scale_from_v_dim", "scale", "uses 1/sqrt(Dv) for the softmax scale",
     "glm5 (absorbed MLA: Dv != Dk)", _scale_from(lambda q, v, scale: v.shape[-1] ** -0.5)),
    ("scale_applied_twice", "scale", "scales q and the scores both (scale squared)", "tiny",
     _scale_from(lambda q, v, scale: scale * scale)),
    ("minus_one_reads_last_slot", "range end",
     "reads index -1 as Python's last slot instead of no slot", "edge: n_lt_topk, ragged",
     _minus_one_reads(lambda k: k.shape[0] - 1)),
    ("minus_one_reads_slot_zero", "range end", "clamps index -1 to slot 0 instead of masking it",
     "edge: n_lt_topk, ragged", _minus_one_reads(lambda k: 0)),
    ("lse_log2", "lse base", "returns the lse in log2 (exp2-based softmax, never converted back)",
     "tiny", _lse_rewritten(lambda lse: lse / LN2)),
    ("lse_is_sum", "lse base", "returns the softmax denominator instead of its log", "tiny",
     _lse_rewritten(torch.exp)),
    ("empty_row_lse_zero", "range end", "a query with no valid slot gets lse 0 instead of -inf",
     "edge: all_minus_one", _lse_rewritten(lambda lse: torch.where(torch.isneginf(lse), 0.0, lse))),
    ("slot_ids_16bit", "ids width", "stages slot ids as uint16 (slot s reads s % 65536)",
     IDS_2P16, replace_args(OP, indices=ids_16bit)),
)  # fmt: skip
for _name, _kind, _breaks, _needs, _wrap in _SIMPLE:
    add(OP, _name, _kind, _breaks, _needs, _wrap)


@mutant(
    OP,
    "empty_row_nan",
    "range end",
    "a query with no valid slot divides 0 by 0 (NaN output)",
    "edge: all_minus_one",
)
def _empty_row_nan(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        out, lse = kernel(q, k, v, indices, scale, need_lse, k_rope)
        empty = ~((indices >= 0) & (indices < k.shape[0])).any(dim=1)
        return out.masked_fill(empty[:, None, None], float("nan")), lse

    return mutated


@mutant(
    OP,
    "v_read_from_k",
    "layout",
    "assumes absorbed MLA (v = k[..., :Dv]) whatever v it is given",
    "tiny (separate k and v)",
)
def _v_from_k(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        return kernel(q, k, k[..., : v.shape[-1]], indices, scale, need_lse, k_rope)

    return mutated


@mutant(
    OP,
    "gqa_head_modulo",
    "layout",
    "query head h reads kv head h % Hkv instead of h // (H / Hkv)",
    "edge: gqa_hkv4",
)
def _gqa_modulo(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        # Permute the heads so that the kernel's grouping does exactly that.
        h, hkv = q.shape[1], k.shape[1]
        heads = torch.arange(h, device=q.device)
        pos = (heads % hkv) * (h // hkv) + heads // hkv
        permuted = torch.empty_like(q)
        permuted[:, pos] = q
        out, lse = kernel(permuted, k, v, indices, scale, need_lse, k_rope)
        return out[:, pos], lse[:, pos] if need_lse else lse

    return mutated


def _scores(q, k, indices, scale, k_rope=None):
    """float32 scores ``[T, H, K]`` (-inf at invalid slots) and the gathered slots
    ``[T, K]`` int64 (0 where invalid)."""
    if k_rope is not None:
        k = torch.cat((k, k_rope), dim=-1)
    t, h, dk = q.shape
    hkv = k.shape[1]
    valid = (indices >= 0) & (indices < k.shape[0])
    slots = torch.where(valid, indices, 0).long()
    qg = q.float().reshape(t, hkv, h // hkv, dk)
    s = torch.einsum("tcgd,tkcd->tcgk", qg, k.float()[slots]).reshape(t, h, -1) * scale
    return s.masked_fill(~valid[:, None, :], float("-inf")), slots


@mutant(
    OP,
    "accumulates_in_low_dtype",
    "low precision",
    "sums the softmax and the weighted values slot by slot in the input dtype",
    "glm5 (2048 slots in bfloat16)",
)
def _low_accumulation(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        acc = q.dtype
        t, h, _ = q.shape
        group = h // k.shape[1]
        s, slots = _scores(q, k, indices, scale, k_rope)
        peak = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(peak), peak, 0.0))
        total = torch.zeros(t, h, dtype=acc, device=q.device)
        out = torch.zeros(t, h, v.shape[-1], dtype=acc, device=q.device)
        for j in range(indices.shape[1]):
            vj = v[slots[:, j]].float().repeat_interleave(group, dim=1)  # [T, H, Dv]
            total = total + p[:, :, j].to(acc)
            out = out + (p[:, :, j, None] * vj).to(acc)
        lse = total.float().log() + peak[..., 0]
        out = (out.float() / total.float().clamp_min(1e-30)[..., None]).to(q.dtype)
        return out, lse_as_asked(lse, need_lse)

    return mutated


@mutant(
    OP,
    "softmax_without_max",
    "low precision",
    "exponentiates the scores without subtracting their maximum (overflows)",
    "sparse_attention with large scores",
)
def _no_max(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        group = q.shape[1] // k.shape[1]
        s, slots = _scores(q, k, indices, scale, k_rope)
        e = torch.exp(s)
        total = e.sum(dim=-1)
        vg = v.float()[slots].repeat_interleave(group, dim=2)  # [T, K, H, Dv]
        out = torch.einsum("thk,tkhd->thd", e, vg) / total[..., None]
        out = torch.where(total[..., None] > 0, out, 0.0)
        return out.to(q.dtype), lse_as_asked(total.log(), need_lse)

    return mutated


@mutant(
    OP,
    "duplicate_slots_once",
    "range end",
    "a dense slot mask: a slot listed twice counts once",
    DUPLICATE_SLOTS,
)
def _dedup(kernel):
    def mutated(q, k, v, indices, scale, need_lse=True, k_rope=None):
        ordered, order = indices.sort(dim=1, stable=True)
        again = torch.zeros_like(ordered, dtype=torch.bool)
        again[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        repeated = torch.zeros_like(again).scatter(1, order, again)
        return kernel(q, k, v, indices.masked_fill(repeated, -1), scale, need_lse, k_rope)

    return mutated
