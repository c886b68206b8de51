"""The ascend indexer adapters, run on the emulator of ``torch_npu.npu_lightning_indexer``,
against glmport's float64 cpu reference.

Most cases use sparse small-integer ``q`` / ``k`` and weights of +-1 on a few heads:
every score is then a small integer, exact in bf16 and fp16 (the dtype the op returns
its scores in), so indices and scores must equal the reference bit for bit, ties to the
lower slot included. Random data goes through the conformance judges.
"""

from __future__ import annotations

import pytest
import torch

from glmport.backends.ascend import BACKEND
from glmport.backends.ascend import emulator as emulator_ops
from glmport.backends.ascend import indexer as ascend
from glmport.backends.ascend.emulator import EmulatedBuild, NpuContractError, emulated_build
from glmport.backends.ascend.emulator import indexer as emulator
from glmport.backends.ascend.emulator.build import BEFORE_2026_03
from glmport.backends.ascend.profile import detect_profile
from glmport.conformance.judges import JUDGES
from glmport.core.registry import REGISTRY

DTYPES = (torch.bfloat16, torch.float16)
IDS = ("bf16", "fp16")
D = 128


class Recorder:
    """The emulator, keeping every call's keyword arguments and key tensor."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def npu_lightning_indexer(self, query, key, weights, **kwargs):
        self.calls.append({"key": key, **kwargs})
        return emulator.npu_lightning_indexer(query, key, weights, **kwargs)


def _reference(op: str, *args):
    """The cpu kernel's outputs in float64, floats cast to float32 (exact here)."""
    with REGISTRY.get("cpu").float64():
        out = REGISTRY.kernels("cpu", False)[op](*args)
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.float() if o.is_floating_point() else o for o in outs)


def _inputs(t, hi, n, dtype, *, seed=0, integer=True):
    """``(q [T, Hi, 128], k [N, 128], weights [T, Hi] fp32)``. Integer data: an eighth
    of the entries of ``q`` and ``k`` in ``{-1, 1}``, the rest 0; weights +-1 on three
    heads per query, 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    if integer:

        def sparse(*shape):
            signs = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
            return signs * (torch.rand(shape, generator=g) < 0.125)

        q, k = sparse(t, hi, D), sparse(n, D)
        w = torch.zeros(t, hi)
        heads = torch.rand(t, hi, generator=g).argsort(dim=1)[:, :3]
        w.scatter_(1, heads, torch.randint(0, 2, (t, 3), generator=g).float() * 2 - 1)
    else:
        q = torch.randn(t, hi, D, generator=g)
        k = torch.randn(n, D, generator=g)
        w = torch.randn(t, hi, generator=g) * (hi * D) ** -0.5
    return q.to(dtype), k.to(dtype), w


def _ranges(*pairs):
    start, end = zip(*pairs, strict=True)
    return torch.tensor(start, dtype=torch.int32), torch.tensor(end, dtype=torch.int32)


def _check_exact(npu, q, k, w, start, end, topk):
    """Both adapters equal to the reference bit for bit."""
    idx, scores = ascend.lightning_indexer(npu, q, k, w, start, end, topk)
    ref_idx, ref_scores = _reference("lightning_indexer", q, k, w, start, end, topk, None, None)
    assert idx.dtype == torch.int32 and scores.dtype == torch.float32
    assert torch.equal(idx, ref_idx), (idx, ref_idx)
    assert torch.equal(scores, ref_scores)
    logits = ascend.indexer_logits(npu, q, k, w, start, end)
    (ref_logits,) = _reference("indexer_logits", q, k, w, start, end, None, None)
    assert logits.dtype == torch.float32 and torch.equal(logits, ref_logits)


def _packed(lengths, new):
    """Ranges of ``new[b]`` new tokens of sequences holding ``lengths[b]`` keys in all,
    their keys packed one sequence after the other (the model's layout)."""
    pairs, offset = [], 0
    for total, count in zip(lengths, new, strict=True):
        pairs += [(offset, offset + total - count + i + 1) for i in range(count)]
        offset += total
    return _ranges(*pairs)


@pytest.mark.parametrize("hi", [32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_ragged_ranges_exact(dtype, hi):
    """Causal, packed, empty and out-of-range ranges (GLMPORT_VALIDATE=meta leaves them
    unchecked: clamped to [0, N], empty when start >= end)."""
    q, k, w = _inputs(7, hi, 40, dtype)
    start, end = _ranges((0, 18), (0, 19), (20, 33), (20, 40), (7, 7), (-5, 99), (30, 10))
    _check_exact(emulator, q, k, w, start, end, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_packed_prefill_of_two_sequences_is_one_causal_call(dtype):
    """Two prompts of 5 and 7 tokens: one sparse_mode 3 call, one batch per sequence,
    the key tensor ``k`` itself (no copy)."""
    q, k, w = _inputs(12, 32, 12, dtype, seed=1)
    start, end = _packed([5, 7], [5, 7])
    npu = Recorder()
    _check_exact(npu, q, k, w, start, end, 4)
    (call,) = npu.calls[:1]
    assert len(npu.calls) == 2  # lightning_indexer, then indexer_logits
    assert call["sparse_mode"] == 3 and call["layout_query"] == call["layout_key"] == "TND"
    assert call["actual_seq_lengths_query"].tolist() == [5, 12]
    assert call["actual_seq_lengths_key"].tolist() == [5, 12]
    assert call["key"].data_ptr() == k.data_ptr() and call["key"].shape == (12, 1, D)
    assert call["return_value"] is True


def test_decode_step_of_three_sequences_is_one_call():
    """One new token for each of three cached sequences (4, 9 and 6 keys, packed):
    one call of three single-query batches over ``k`` itself."""
    q, k, w = _inputs(3, 32, 19, torch.bfloat16, seed=2)
    start, end = _packed([4, 9, 6], [1, 1, 1])
    npu = Recorder()
    _check_exact(npu, q, k, w, start, end, 8)
    call = npu.calls[0]
    assert len(npu.calls) == 2
    assert call["actual_seq_lengths_query"].tolist() == [1, 2, 3]
    assert call["actual_seq_lengths_key"].tolist() == [4, 13, 19]
    assert call["key"].data_ptr() == k.data_ptr()


def test_single_query_with_fewer_keys_than_topk():
    """T = 1, N = 30 < topk = 2048: the op is asked for 30 (the longest range), the
    rest is -1 / -inf."""
    q, k, w = _inputs(1, 64, 30, torch.bfloat16, seed=3)
    start, end = _ranges((0, 30))
    npu = Recorder()
    _check_exact(npu, q, k, w, start, end, 2048)
    assert npu.calls[0]["sparse_count"] == 30


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_shared_and_unordered_ranges(dtype):
    """Equal ranges go to a sparse_mode 0 call; overlapping, unordered ranges gather
    a copy of the keys; the rest (a causal run, lone queries) to sparse_mode 3."""
    q, k, w = _inputs(9, 32, 30, dtype, seed=4)
    start, end = _ranges(
        (0, 10), (0, 10), (0, 10), (5, 25), (5, 25), (0, 1), (0, 2), (20, 30), (3, 9)
    )
    npu = Recorder()
    _check_exact(npu, q, k, w, start, end, 6)
    causal, shared = npu.calls[:2]
    assert (causal["sparse_mode"], shared["sparse_mode"]) == (3, 0)
    assert shared["actual_seq_lengths_query"].tolist() == [3, 5]
    assert causal["actual_seq_lengths_query"].tolist() == [2, 3, 4]
    assert causal["key"].data_ptr() != k.data_ptr()  # [0, 2), [20, 30), [3, 9): gathered


def test_random_ranges_exact():
    """Arbitrary ranges, one per query, any order."""
    g = torch.Generator().manual_seed(5)
    n = 50
    a = torch.randint(0, n + 1, (16,), generator=g)
    b = torch.randint(0, n + 1, (16,), generator=g)
    start, end = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    q, k, w = _inputs(16, 32, n, torch.float16, seed=6)
    _check_exact(emulator, q, k, w, start, end, 7)


def test_topk_between_allowed_sparse_counts_is_rounded_up_and_trimmed():
    """topk 2500 is not a documented sparse_count: 3072 is requested, the best 2500
    kept (and a shorter range padded)."""
    q, k, w = _inputs(2, 32, 2600, torch.bfloat16, seed=7)
    start, end = _ranges((0, 2600), (100, 1500))
    npu = Recorder()
    idx, scores = ascend.lightning_indexer(npu, q, k, w, start, end, 2500)
    ref = _reference("lightning_indexer", q, k, w, start, end, 2500, None, None)
    assert torch.equal(idx, ref[0]) and torch.equal(scores, ref[1])
    assert npu.calls[0]["sparse_count"] == 3072


class Scrambler:
    """The emulator with each row's order shuffled and NaN at its -1 slots: neither
    is documented, so the adapters must not depend on them."""

    def npu_lightning_indexer(self, query, key, weights, **kwargs):
        idx, val = emulator.npu_lightning_indexer(query, key, weights, **kwargs)
        g = torch.Generator().manual_seed(8)
        perm = torch.rand(idx.shape, generator=g).argsort(dim=-1)
        idx, val = idx.gather(-1, perm), val.gather(-1, perm)
        return idx, val.masked_fill(idx < 0, float("nan"))


def test_op_row_order_and_padding_values_are_not_relied_on():
    q, k, w = _inputs(6, 32, 25, torch.bfloat16, seed=9)
    start, end = _ranges((0, 20), (0, 21), (0, 22), (3, 3), (4, 25), (10, 12))
    _check_exact(Scrambler(), q, k, w, start, end, 9)


def test_fp16_scores_beyond_the_fp16_range():
    """Scores near 2**17 overflow fp16 (65504), the dtype of the op's values: the
    adapters scale the weights down by a power of two and the scores back up."""
    g = torch.Generator().manual_seed(10)
    q = torch.randint(0, 5, (3, 64, D), generator=g).half()
    k = torch.randint(0, 5, (40, D), generator=g).half()
    w = torch.full((3, 64), 4.0)
    start, end = _ranges((0, 40), (0, 30), (10, 40))
    args = (q, k, w, start, end)
    (ref,) = _reference("indexer_logits", *args, None, None)
    assert ref[torch.isfinite(ref)].max() > 65504
    out = ascend.lightning_indexer(emulator, *args, 12)
    assert torch.isfinite(out[1]).all()
    verdict = JUDGES["indexer"](
        "lightning_indexer", torch.float16, (*args, 12, None, None), out, ref
    )
    assert verdict.ok, verdict.reason
    logits = ascend.indexer_logits(emulator, *args)
    verdict = JUDGES["logits"]("indexer_logits", torch.float16, (*args, None, None), logits, ref)
    assert verdict.ok, verdict.reason


@pytest.mark.parametrize("hi", [32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_random_data_within_tolerance(dtype, hi):
    """Non-contiguous inputs, random scores: judged as the conformance suite does."""
    t, n, topk = 6, 300, 37
    q, k, w = _inputs(t, hi, n, dtype, seed=11, integer=False)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strides (D, t * D, 1)
    k = torch.cat((k, k[:, :8]), 1)[:, :D]  # row stride D + 8
    w = w.t().contiguous().t()
    start, end = _ranges((0, 296), (0, 297), (0, 298), (150, 299), (150, 300), (7, 20))
    args = (q, k, w, start, end)
    (ref,) = _reference("indexer_logits", *args, None, None)
    out = ascend.lightning_indexer(emulator, *args, topk)
    verdict = JUDGES["indexer"]("lightning_indexer", dtype, (*args, topk, None, None), out, ref)
    assert verdict.ok, verdict.reason
    logits = ascend.indexer_logits(emulator, *args)
    verdict = JUDGES["logits"]("indexer_logits", dtype, (*args, None, None), logits, ref)
    assert verdict.ok, verdict.reason


class Refuse:
    def npu_lightning_indexer(self, *args, **kwargs):
        raise AssertionError("the op takes no empty tensor: it must not be called")


@pytest.mark.parametrize(("t", "n"), [(0, 10), (3, 0)])
def test_empty_inputs_do_not_call_the_op(t, n):
    q, k, w = _inputs(t, 32, n, torch.bfloat16)
    start = torch.zeros(t, dtype=torch.int32)
    end = torch.full((t,), n, dtype=torch.int32)
    idx, scores = ascend.lightning_indexer(Refuse(), q, k, w, start, end, 4)
    assert idx.shape == scores.shape == (t, 4)
    assert (idx == -1).all() and (scores == float("-inf")).all()
    logits = ascend.indexer_logits(Refuse(), q, k, w, start, end)
    assert logits.shape == (t, n)


def test_all_ranges_empty_do_not_call_the_op():
    q, k, w = _inputs(2, 32, 10, torch.bfloat16)
    start, end = _ranges((3, 3), (12, 4))
    idx, scores = ascend.lightning_indexer(Refuse(), q, k, w, start, end, 4)
    assert (idx == -1).all() and (scores == float("-inf")).all()


@pytest.mark.parametrize(
    ("width", "expected"), [(1, 1), (2048, 2048), (2049, 3072), (3072, 3072), (8000, 8192)]
)
def test_sparse_count_for_takes_the_next_documented_value(width, expected):
    assert ascend.sparse_count_for(width) == expected


# -- builds with other conventions: older pages, global indices ----------------------

BUILDS = {
    "newest": EmulatedBuild(),
    "newest-global": EmulatedBuild(indexer_positions="global"),
    "before-2026-03": EmulatedBuild(BEFORE_2026_03),
    "before-2026-03-global": EmulatedBuild(BEFORE_2026_03, indexer_positions="global"),
}


def test_a_build_before_2026_03_refuses_fewer_than_64_heads_and_fp32_weights():
    q, k, w = _inputs(2, 32, 8, torch.bfloat16)
    lengths = torch.tensor([2], dtype=torch.int32)
    kwargs = dict(
        actual_seq_lengths_query=lengths,
        actual_seq_lengths_key=torch.tensor([8], dtype=torch.int32),
        layout_query="TND",
        layout_key="TND",
        sparse_count=4,
    )
    key = k.unsqueeze(1)
    with emulated_build(BUILDS["before-2026-03"]):
        with pytest.raises(NpuContractError, match="N1 must be 64"):
            emulator.npu_lightning_indexer(q, key, w.to(q.dtype), **kwargs)
        q64, w64 = _inputs(2, 64, 8, torch.bfloat16)[::2]
        with pytest.raises(NpuContractError, match="weights must have query's dtype"):
            emulator.npu_lightning_indexer(q64, key, w64, **kwargs)
        emulator.npu_lightning_indexer(q64, key, w64.to(q.dtype), **kwargs)


@pytest.mark.parametrize("build", BUILDS, ids=list(BUILDS))
def test_the_start_up_check_measures_the_emulated_build(build):
    with emulated_build(BUILDS[build]):
        profile = detect_profile(emulator_ops, torch.device("cpu"))
    assert profile.indexer_any_heads == (not build.startswith("before"))
    assert profile.indexer_positions == ("global" if build.endswith("global") else "batch")
    assert profile.version == BUILDS[build].version


@pytest.mark.parametrize("build", BUILDS, ids=list(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_adapters_take_every_build_with_the_profile_it_measures(build, dtype):
    """32 heads with fp32 weights (GLM-5's indexer) on every build: padded to 64
    zero-weight heads with weights in q's dtype on the older pages, global positions
    shifted back to slots, multi-batch calls in both modes and a gathered key copy."""
    q, k, w = _inputs(9, 32, 40, dtype, seed=12)
    # Three decode queries (one causal call of three batches), then a shared run and
    # unordered ranges (mode 0, keys gathered).
    start, end = _ranges(
        (0, 4), (4, 13), (13, 19), (20, 35), (20, 35), (30, 40), (0, 12), (25, 33), (25, 33)
    )
    with emulated_build(BUILDS[build]):
        profile = detect_profile(emulator_ops, torch.device("cpu"))
        idx, scores = ascend.lightning_indexer(emulator, q, k, w, start, end, 6, profile=profile)
        logits = ascend.indexer_logits(emulator, q, k, w, start, end, profile=profile)
    ref_idx, ref_scores = _reference("lightning_indexer", q, k, w, start, end, 6, None, None)
    (ref_logits,) = _reference("indexer_logits", q, k, w, start, end, None, None)
    assert torch.equal(idx, ref_idx), (idx, ref_idx)
    assert torch.equal(scores, ref_scores) and torch.equal(logits, ref_logits)


def test_global_positions_read_as_batch_relative_would_be_wrong():
    """The conversion matters: the default profile on a global build picks wrong slots."""
    q, k, w = _inputs(3, 32, 19, torch.bfloat16, seed=2)
    start, end = _packed([4, 9, 6], [1, 1, 1])
    with emulated_build(BUILDS["newest-global"]):
        idx, _ = ascend.lightning_indexer(emulator, q, k, w, start, end, 8)
    ref_idx, _ = _reference("lightning_indexer", q, k, w, start, end, 8, None, None)
    assert not torch.equal(idx, ref_idx)


def test_backend_kernels_bind_the_profile_of_the_emulated_build():
    q, k, w = _inputs(3, 32, 19, torch.float16, seed=3)
    start, end = _packed([4, 9, 6], [1, 1, 1])
    with emulated_build(BUILDS["before-2026-03-global"]):
        kernels = BACKEND.load_kernels(True)
        idx, scores = kernels["lightning_indexer"](q, k, w, start, end, 5, None, None)
    ref_idx, ref_scores = _reference("lightning_indexer", q, k, w, start, end, 5, None, None)
    assert torch.equal(idx, ref_idx) and torch.equal(scores, ref_scores)
