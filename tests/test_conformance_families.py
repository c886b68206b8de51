"""Each case family must catch the bug class it was added for: a planted bug wraps the
cpu reference's kernel of one op, and the quick suite, run on that op's cases of the
family only (fast), must fail it on the family's cases, with a reason that names the
problem where the judge can tell (tie order, nats, scales); the same kernel unmutated
passes the same checks."""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.conformance.mutants import LIBRARY
from glmport.conformance.paging import in_packed_form
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.formats import FP8_DTYPE
from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest


def _ref(op):
    return REGISTRY.kernels("cpu", False)[op]


UINT16 = 2**16


def _uint16(ids: torch.Tensor) -> torch.Tensor:
    """Ids staged as uint16: slot ``s`` reads ``s % 65536`` (``-1`` stays ``-1``)."""
    return torch.where(ids >= 0, ids % UINT16, ids).to(ids.dtype)


def _attention_uint16_ids(q, k, v, indices, scale, need_lse=True, k_rope=None):
    return _ref("sparse_attention")(q, k, v, _uint16(indices), scale, need_lse)


@in_packed_form  # a paged call: its packed equivalent
def _indexer_uint16_ids(q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, *_):
    idx, scores = _ref("lightning_indexer")(q, k, weights, k_start, k_end, topk, q_scale, k_scale)
    return _uint16(idx), scores


def _combine_uint16_rows(y_sorted, src_row, weights):
    return _ref("moe_combine")(y_sorted, _uint16(src_row), weights)


CAPACITY = 64


def _dispatch_fixed_capacity(x, ids, num_experts):
    """A 64-row buffer per expert: the copies past an expert's 64th are dropped (zero)."""
    x_sorted, offsets, src_row = _ref("moe_dispatch")(x, ids, num_experts)
    row = torch.arange(x_sorted.shape[0])
    expert = torch.searchsorted(offsets[1:].long(), row, right=True)
    overflow = row - offsets.long()[expert.clamp_max(num_experts - 1)] >= CAPACITY
    return torch.where(overflow[:, None], 0, x_sorted), offsets, src_row


def _gate_always_renormalises(logits, bias, top_k, n_group, topk_group, scaling, norm, func):
    return _ref("moe_gate")(logits, bias, top_k, n_group, topk_group, scaling, True, func)


def _attention_dense_slot_mask(q, k, v, indices, scale, need_lse=True, k_rope=None):
    """A slot listed twice in a row counts once (a mask over slots, not a list)."""
    idx = indices.long()
    earlier = (idx[:, :, None] == idx[:, None, :]).tril(diagonal=-1).any(dim=2)
    idx = torch.where(earlier, -1, indices)
    return _ref("sparse_attention")(q, k, v, idx, scale, need_lse, k_rope)


@in_packed_form  # a paged call: its packed equivalent
def _indexer_higher_slot_ties(q, k, weights, k_start, k_end, topk, q_scale=None, k_scale=None, *_):
    """The reference on the keys in reverse order, ids mapped back: among exactly tied
    scores the higher slot wins and comes first."""
    n = k.shape[0]
    flipped_scale = None if k_scale is None else k_scale.flip(0)
    start, end = (n - k_end).to(k_start.dtype), (n - k_start).to(k_end.dtype)
    idx, scores = _ref("lightning_indexer")(
        q, k.flip(0), weights, start, end, topk, q_scale, flipped_scale
    )
    return torch.where(idx >= 0, n - 1 - idx, idx).to(idx.dtype), scores


def _gate_higher_expert_ties(logits, bias, top_k, *rest):
    """The reference on the experts in reverse order (groups reverse with them)."""
    e = logits.shape[1]
    flipped_bias = None if bias is None else bias.flip(0)
    weights, ids = _ref("moe_gate")(logits.flip(1), flipped_bias, top_k, *rest)
    return weights, (e - 1 - ids).to(ids.dtype)


ROW_TILE = 128


def _quant_gemm_whole_row_tiles(x, w, w_scale, scheme, group_size=128):
    """A prefill path (M > 128) that launches M // 128 row tiles: the last partial
    tile's rows stay zero."""
    y = _ref("quant_gemm")(x, w, w_scale, scheme, group_size)
    m = x.shape[0]
    if m > ROW_TILE:
        y = y.clone()
        y[m // ROW_TILE * ROW_TILE :] = 0
    return y


VOCAB_TILE = 4096


def _logprobs(z: torch.Tensor, targets: torch.Tensor, normaliser: torch.Tensor):
    """logp of ``targets`` and the entropy, from float32 logits ``z`` ``[T, V]`` and the
    logits ``normaliser`` ``[T, V']`` the log-sum-exp runs over."""
    lse = torch.logsumexp(normaliser, dim=1)
    logp = normaliser - lse[:, None]
    entropy = -(logp.exp() * logp).sum(dim=1)  # a sum of terms >= 0
    return z.gather(1, targets.long()[:, None])[:, 0] - lse, entropy


def _logprobs_drop_last_vocab_tile(hidden, lm_head, targets, temperature=1.0):
    z = hidden.float() @ lm_head.float().T / temperature
    whole = z.shape[1] // VOCAB_TILE * VOCAB_TILE or z.shape[1]
    return _logprobs(z, targets, z[:, :whole])


def _logprobs_bf16_logits(hidden, lm_head, targets, temperature=1.0):
    z = (hidden.float() @ lm_head.float().T).to(torch.bfloat16).float() / temperature
    return _logprobs(z, targets, z)


def _logprobs_ignore_target_stride(hidden, lm_head, targets, temperature=1.0):
    """Targets read from their storage as if contiguous (the stride ignored)."""
    flat = torch.empty(0, dtype=targets.dtype).set_(targets.untyped_storage())
    read = flat[targets.storage_offset() : targets.storage_offset() + targets.numel()]
    read = torch.cat((read, read.new_zeros(targets.numel() - read.numel())))
    return _ref("token_logprobs")(hidden, lm_head, read, temperature)


def _quantize_without_amax_floor(x, fmt, group_size=128):
    """Scales ``amax / qmax`` without the floor: an all-zero group gets scale 0."""
    q, s = _ref("quantize")(x, fmt, group_size)
    floored = s < 1e-12  # the floor's scale; no N(0, 1) group comes near it
    return q, torch.where(floored, 0.0, s)


ROPE_SPECIALISED = 64


def _rope_64_rotary_dims(x, cos, sin, interleaved=True):
    """A rope specialised to 64 rotary dims: the pairs beyond 32 are not rotated."""
    y = _ref("rope")(x, cos, sin, interleaved).clone()
    d = x.shape[-1]
    if d > ROPE_SPECIALISED:
        pairs = torch.arange(ROPE_SPECIALISED // 2, d // 2)
        dims = (
            torch.cat((2 * pairs, 2 * pairs + 1))
            if interleaved
            else torch.cat((pairs, pairs + d // 2))
        )
        y[..., dims] = x[..., dims].to(y.dtype)
    return y


FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def _quantize_multiplies_first(x, fmt, group_size=128):
    """fp8 codes as ``x * qmax / amax``: the product overflows for |x| > 3.4e38 / 448,
    and e4m3fn has no infinity: NaN codes."""
    q, s = _ref("quantize")(x, fmt, group_size)
    if q.dtype == FP8_DTYPE:
        overflow = torch.isinf(x.float() * FP8_MAX)
        q = torch.where(overflow, torch.tensor(float("nan")).to(FP8_DTYPE), q)
    return q, s


def _attention_softmax_without_max(q, k, v, indices, scale, need_lse=True, k_rope=None):
    """The mutant library's softmax that exponentiates the scores unshifted."""
    mutated = LIBRARY["sparse_attention.softmax_without_max"].wrap(_ref("sparse_attention"))
    return mutated(q, k, v, indices, scale, need_lse, k_rope)


# bug: (op, kernel, the family whose cases must fail it, a case name among the failures,
# words the reason must contain ("" where the judge compares values only))
PLANTED = {
    "attention_uint16_slot_ids": ("sparse_attention", _attention_uint16_ids, "ids", "ids_2e17", ""),
    "indexer_uint16_slot_ids": ("lightning_indexer", _indexer_uint16_ids, "ids", "ids_2e17", ""),
    "combine_uint16_rows": ("moe_combine", _combine_uint16_rows, "ids", "rows_2e16", ""),
    "dispatch_64_row_capacity": (
        "moe_dispatch",
        _dispatch_fixed_capacity,
        "capacity",
        "one_expert",
        "",
    ),
    "gate_ignores_norm_topk_prob_false": (
        "moe_gate",
        _gate_always_renormalises,
        "gate_config",
        "no_norm",
        "",
    ),
    "attention_dense_slot_mask": (
        "sparse_attention",
        _attention_dense_slot_mask,
        "duplicates",
        "repeated",
        "",
    ),
    "attention_softmax_without_max": (
        "sparse_attention",
        _attention_softmax_without_max,
        "sharp",
        "sharp",
        "",
    ),
    "indexer_higher_slot_wins_ties": (
        "lightning_indexer",
        _indexer_higher_slot_ties,
        "ties",
        "relu_zeros",
        "lower slot",
    ),
    "gate_higher_expert_wins_ties": (
        "moe_gate",
        _gate_higher_expert_ties,
        "ties",
        "exact_ties",
        "lower id",
    ),
    "quant_gemm_whole_row_tiles": ("quant_gemm", _quant_gemm_whole_row_tiles, "tail", "tail", ""),
    "logprobs_drop_last_vocab_tile": (
        "token_logprobs",
        _logprobs_drop_last_vocab_tile,
        "tail",
        "tail_vocab",
        "nats",
    ),
    "logprobs_bf16_logits": (
        "token_logprobs",
        _logprobs_bf16_logits,
        "lm_logits",
        "lm_logits",
        "logits rounded",
    ),
    "logprobs_ignore_target_stride": (
        "token_logprobs",
        _logprobs_ignore_target_stride,
        "layout",
        "targets-broadcast",
        "nats",
    ),
    "quantize_without_amax_floor": (
        "quantize",
        _quantize_without_amax_floor,
        "zeros",
        "zero_groups",
        "scales differ",
    ),
    "rope_64_rotary_dims": ("rope", _rope_64_rotary_dims, "rotary", "rotary_128", ""),
    "quantize_nan_at_3e38": (
        "quantize",
        _quantize_multiplies_first,
        "magnitude",
        "x_edge3e38",
        "codes differ",
    ),
}


class _Planted(Backend):
    def __init__(self, name, kernels):
        self.manifest = BackendManifest(
            name=name, device_type="cpu", description="a planted bug", ops=tuple(kernels)
        )
        self.kernels = kernels

    def probe(self, emulate):
        return Availability(True)

    def load_kernels(self, emulate):
        return self.kernels


def _run(name: str, op: str, kernel, family: str):
    """The quick suite's value checks of ``op`` in ``family`` on ``kernel``."""
    checks = [c for c in suite_checks(ops=(op,)) if c.kind == "value" and c.case.family == family]
    assert checks, f"no quick {family} case for {op}"
    glmport.register_backend(_Planted(name, {op: kernel}))
    try:
        return [run_check(c, name) for c in checks]
    finally:
        glmport.unregister_backend(name)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_family_fails_its_planted_bug_and_passes_the_honest_kernel(bug):
    op, kernel, family, case_name, words = PLANTED[bug]
    records = _run(f"planted_{bug}", op, kernel, family)
    failed = [r for r in records if r.outcome == "fail"]
    assert failed, f"the {family} cases of {op} passed a kernel with bug {bug!r}"
    assert any(case_name in r.id for r in failed), [r.id for r in failed]
    assert all(words in r.reason for r in failed if case_name in r.id), [r.reason for r in failed]
    errors = [(r.id, r.reason) for r in records if r.outcome == "error"]
    assert not errors, errors
    honest = _run(f"honest_{bug}", op, _ref(op), family)
    assert [r.id for r in honest] == [r.id for r in records]
    assert all(r.outcome == "pass" for r in honest), [
        (r.id, r.reason) for r in honest if r.outcome != "pass"
    ]
