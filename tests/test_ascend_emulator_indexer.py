"""The emulator of ``torch_npu.npu_lightning_indexer`` against its documentation
(``torch_npu-npu_lightning_indexer.md`` in Ascend/op-plugin, ``aclnnLightningIndexer.md``
in cann/ops-transformer), in the vendor's layouts.

Inputs are small integers and weights powers of two: every score is exact in float32,
so indices must equal the float64 loops below, ties included (the emulator breaks ties
to the lower key position, as CANN's golden does; the pages do not fix the order within
a row), and values must equal the float64 scores rounded to the query's dtype.
"""

from __future__ import annotations

import pytest
import torch

from glmport.backends.ascend.emulator.contract import NpuContractError
from glmport.backends.ascend.emulator.indexer import npu_lightning_indexer

D = 128
INF = float("-inf")


def _ints(*shape: int, seed: int, low: int = -2, high: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float()


def _weights(*shape: int, seed: int) -> torch.Tensor:
    """Powers of two in ``[1/4, 2]``, a fifth of them negative."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-2, 2, shape, generator=g).float().exp2()
    return w * torch.where(torch.rand(shape, generator=g) < 0.2, -1.0, 1.0)


def _expected(q, w, keys, causal: bool, sparse_count: int):
    """Float64 loops for one batch: ``q [S1, N1, D]``, ``w [S1, N1]``, ``keys [S2, D]``
    -> (indices [S1, sparse_count], values [S1, sparse_count]) best first, ties to the
    lower position, ``-1`` / ``-inf`` after the visible keys."""
    s1, s2 = q.shape[0], keys.shape[0]
    q, w, keys = q.double(), w.double(), keys.double()
    idx = torch.full((s1, sparse_count), -1, dtype=torch.int32)
    val = torch.full((s1, sparse_count), INF, dtype=torch.float64)
    for i in range(s1):
        last = i + s2 - s1 if causal else s2 - 1  # right-down causal: j <= i + S2 - S1
        scored = []
        for j in range(min(last + 1, s2)):
            score = sum(
                float(w[i, g]) * max(0.0, float(q[i, g] @ keys[j])) for g in range(q.shape[1])
            )
            scored.append((-score, j))
        for slot, (neg, j) in enumerate(sorted(scored)[:sparse_count]):
            idx[i, slot], val[i, slot] = j, -neg
    return idx, val


def _tnd(t1, n1, t2, seed=0, dtype=torch.bfloat16):
    q = _ints(t1, n1, D, seed=seed).to(dtype)
    k = _ints(t2, 1, D, seed=seed + 1).to(dtype)
    w = _weights(t1, n1, seed=seed + 2).to(dtype)
    return q, k, w


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("sparse_mode", [0, 3])
def test_tnd_two_batches_causal_and_default_mask(sparse_mode):
    """TND: batch 0 has 3 queries over 5 keys, batch 1 has 4 queries over 4 keys
    (cumulative lengths [3, 7] / [5, 9]); indices are positions within each batch's
    own keys; mode 3 hides keys past i + S2 - S1, mode 0 none; [T1, N2, 4] outputs."""
    q, k, w = _tnd(7, 4, 9)
    idx, val = npu_lightning_indexer(
        q,
        k,
        w,
        actual_seq_lengths_query=_i32(3, 7),
        actual_seq_lengths_key=_i32(5, 9),
        layout_query="TND",
        layout_key="TND",
        sparse_count=4,
        sparse_mode=sparse_mode,
        return_value=True,
    )
    assert idx.shape == val.shape == (7, 1, 4)
    assert idx.dtype == torch.int32 and val.dtype == torch.bfloat16
    causal = sparse_mode == 3
    for (q0, q1), (k0, k1) in (((0, 3), (0, 5)), ((3, 7), (5, 9))):
        want_idx, want_val = _expected(q[q0:q1], w[q0:q1], k[k0:k1, 0], causal, 4)
        assert torch.equal(idx[q0:q1, 0], want_idx)
        assert torch.equal(val[q0:q1, 0], want_val.to(val.dtype))
    if causal:
        # Batch 1 (S1 = S2 = 4): query 0 sees key 0 only, the rest is padding.
        assert idx[3, 0].tolist() == [0, -1, -1, -1]
        assert val[3, 0, 1:].eq(INF).all()


def test_causal_with_fewer_keys_than_queries_hides_whole_rows():
    """S2 < S1 under sparse_mode 3: query i sees j <= i + S2 - S1 < 0 for the first
    S1 - S2 queries, whose rows are all -1."""
    q, k, w = _tnd(5, 2, 2, seed=3)
    idx, val = npu_lightning_indexer(
        q,
        k,
        w,
        actual_seq_lengths_query=_i32(5),
        actual_seq_lengths_key=_i32(2),
        layout_query="TND",
        layout_key="TND",
        sparse_count=3,
        return_value=True,
    )
    assert (idx[:3] == -1).all() and (val[:3] == INF).all()
    assert idx[3, 0].tolist() == [0, -1, -1]
    assert sorted(idx[4, 0, :2].tolist()) == [0, 1] and idx[4, 0, 2] == -1


def test_bsnd_actual_lengths_and_float32_weights():
    """BSND: per-batch (not cumulative) actual lengths, rows past
    actual_seq_lengths_query all -1, the causal diagonal placed by the ACTUAL lengths;
    float32 weights with a bf16 query; [B, S1, N2, sparse_count] outputs."""
    b, s1, s2, n1 = 2, 4, 6, 3
    q = _ints(b, s1, n1, D, seed=4).bfloat16()
    k = _ints(b, s2, 1, D, seed=5).bfloat16()
    w = _weights(b, s1, n1, seed=6)
    act_q, act_k = (4, 2), (5, 6)
    idx, val = npu_lightning_indexer(
        q,
        k,
        w,
        actual_seq_lengths_query=_i32(*act_q),
        actual_seq_lengths_key=_i32(*act_k),
        sparse_count=8,
        sparse_mode=3,
        return_value=True,
    )
    assert idx.shape == val.shape == (b, s1, 1, 8)
    for i in range(b):
        rows, keys = slice(0, act_q[i]), k[i, : act_k[i], 0]
        want_idx, want_val = _expected(q[i, rows], w[i, rows], keys, True, 8)
        assert torch.equal(idx[i, rows, 0], want_idx)
        assert torch.equal(val[i, rows, 0], want_val.to(val.dtype))
    assert (idx[1, 2:] == -1).all()
    # Batch 1, query 0: 2 queries over 6 keys, so keys 0..4 are visible.
    assert (idx[1, 0, 0, :5] >= 0).all() and (idx[1, 0, 0, 5:] == -1).all()


def test_paged_keys_read_through_block_table():
    """PA_BSND: key [block_count, 16, 1, D]; batch b's position p is
    key[block_table[b, p // 16], p % 16]; indices are logical positions. A TND query
    with two batches (cumulative [2, 3]) and per-batch key lengths [20, 9]."""
    block = 16
    logical = [_ints(20, D, seed=7), _ints(9, D, seed=8)]
    table = _i32(3, 0, 2, 1).reshape(2, 2)  # batch 0: blocks 3, 0; batch 1: block 2
    pool = torch.zeros(4, block, 1, D)
    for b, keys in enumerate(logical):
        for p in range(keys.shape[0]):
            pool[table[b, p // block], p % block, 0] = keys[p]
    q = _ints(3, 2, D, seed=9).half()
    w = _weights(3, 2, seed=10).half()
    idx, values = npu_lightning_indexer(
        q,
        pool.half(),
        w,
        actual_seq_lengths_query=_i32(2, 3),
        actual_seq_lengths_key=_i32(20, 9),
        block_table=table,
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=6,
        sparse_mode=3,
    )
    assert values.shape == (0,) and values.dtype == torch.float16  # return_value=False
    for (q0, q1), keys in zip(((0, 2), (2, 3)), logical, strict=True):
        want, _ = _expected(q[q0:q1], w[q0:q1], keys, True, 6)
        assert torch.equal(idx[q0:q1, 0], want)


def test_large_sparse_count_pads_short_rows():
    """sparse_count 3072 (a documented value above 2048) over 10 keys: 10 indices,
    then -1 / -inf."""
    q, k, w = _tnd(1, 1, 10, seed=11)
    idx, val = npu_lightning_indexer(
        q,
        k,
        w,
        actual_seq_lengths_query=_i32(1),
        actual_seq_lengths_key=_i32(10),
        layout_query="TND",
        layout_key="TND",
        sparse_count=3072,
        sparse_mode=0,
        return_value=True,
    )
    assert idx.shape == (1, 1, 3072)
    assert sorted(idx[0, 0, :10].tolist()) == list(range(10))
    assert (idx[0, 0, 10:] == -1).all() and (val[0, 0, 10:] == INF).all()


def _call(**overrides):
    """A valid TND call (2 queries, 64 heads, 3 keys), with ``overrides`` applied."""
    args = {
        "query": torch.zeros(2, 64, D, dtype=torch.bfloat16),
        "key": torch.zeros(3, 1, D, dtype=torch.bfloat16),
        "weights": torch.zeros(2, 64, dtype=torch.bfloat16),
        "actual_seq_lengths_query": _i32(2),
        "actual_seq_lengths_key": _i32(3),
        "layout_query": "TND",
        "layout_key": "TND",
        "sparse_count": 2,
        "sparse_mode": 3,
    }
    args.update(overrides)
    return npu_lightning_indexer(args.pop("query"), args.pop("key"), args.pop("weights"), **args)


def test_valid_call_passes():
    idx, _ = _call()
    assert idx.shape == (2, 1, 2)


PA_KEY = torch.zeros(2, 16, 1, D, dtype=torch.bfloat16)
CONSTRAINTS = {
    "query float32": ({"query": torch.zeros(2, 64, D)}, "query must be bfloat16 or float16"),
    "key dtype": ({"key": torch.zeros(3, 1, D, dtype=torch.float16)}, "key must have query's"),
    "weights dtype": (
        {"weights": torch.zeros(2, 64, dtype=torch.float16)},
        "weights must be float32 or query's",
    ),
    "65 query heads": (
        {
            "query": torch.zeros(2, 65, D, dtype=torch.bfloat16),
            "weights": torch.zeros(2, 65, dtype=torch.bfloat16),
        },
        "N1 must be at most 64",
    ),
    "2 key heads": ({"key": torch.zeros(3, 2, D, dtype=torch.bfloat16)}, "N2 must be 1"),
    "head dim 64": (
        {
            "query": torch.zeros(2, 64, 64, dtype=torch.bfloat16),
            "key": torch.zeros(3, 1, 64, dtype=torch.bfloat16),
        },
        "D must be 128",
    ),
    "weights shape": ({"weights": torch.zeros(2, 32, dtype=torch.bfloat16)}, "weights must be"),
    "sparse_count 0": ({"sparse_count": 0}, "sparse_count must be in [1, 2048]"),
    "sparse_count 2049": ({"sparse_count": 2049}, "sparse_count must be in [1, 2048]"),
    "sparse_count 9216": ({"sparse_count": 9216}, "sparse_count must be in [1, 2048]"),
    "sparse_mode 1": ({"sparse_mode": 1}, "sparse_mode must be 0 or 3"),
    "sparse_mode 2": ({"sparse_mode": 2}, "sparse_mode must be 0 or 3"),
    "pre_tokens": ({"pre_tokens": 128}, "pre_tokens supports only its default"),
    "next_tokens": ({"next_tokens": 0}, "next_tokens supports only its default"),
    "layout_query BNSD": ({"layout_query": "BNSD"}, "layout_query must be"),
    "layout_key mismatch": ({"layout_key": "BSND"}, "layout_key must equal layout_query"),
    "TND without query lengths": (
        {"actual_seq_lengths_query": None},
        "actual_seq_lengths_query is required",
    ),
    "TND without key lengths": (
        {"actual_seq_lengths_key": None},
        "actual_seq_lengths_key is required",
    ),
    "lengths int64": (
        {"actual_seq_lengths_query": torch.tensor([2])},
        "actual_seq_lengths_query must be a 1-D int32 tensor",
    ),
    "decreasing prefix sums": (
        {"actual_seq_lengths_key": _i32(3, 2, 3)},
        "actual_seq_lengths_key is cumulative",
    ),
    "prefix sums short of T": (
        {"actual_seq_lengths_query": _i32(1)},
        "actual_seq_lengths_query is cumulative",
    ),
    "batch counts differ": (
        {"actual_seq_lengths_key": _i32(1, 3)},
        "actual_seq_lengths_key must hold B=1",
    ),
    "non-contiguous query": (
        {"query": torch.zeros(64, 2, D, dtype=torch.bfloat16).transpose(0, 1)},
        "query must be contiguous",
    ),
    "empty key": (
        {"key": torch.zeros(0, 1, D, dtype=torch.bfloat16), "actual_seq_lengths_key": _i32(0)},
        "key must not be an empty tensor",
    ),
    "block_size 8": (
        {
            "key": torch.zeros(2, 8, 1, D, dtype=torch.bfloat16),
            "layout_key": "PA_BSND",
            "block_table": _i32(0).reshape(1, 1),
        },
        "block_size (key.shape[1]) must be a multiple of 16",
    ),
    "block_size 2048": (
        {
            "key": torch.zeros(1, 2048, 1, D, dtype=torch.bfloat16),
            "layout_key": "PA_BSND",
            "block_table": _i32(0).reshape(1, 1),
        },
        "block_size (key.shape[1]) must be a multiple of 16 up to 1024",
    ),
    "PA without block_table": (
        {"key": PA_KEY, "layout_key": "PA_BSND"},
        "block_table is required",
    ),
    "block_table too narrow": (
        {
            "key": PA_KEY,
            "layout_key": "PA_BSND",
            "actual_seq_lengths_key": _i32(20),
            "block_table": _i32(0).reshape(1, 1),
        },
        "block_table must be [B=1, >= 2]",
    ),
    "PA with return_value": (
        {
            "key": PA_KEY,
            "layout_key": "PA_BSND",
            "block_table": _i32(0).reshape(1, 1),
            "return_value": True,
        },
        "return_value=True is supported only when layout_key is not 'PA_BSND'",
    ),
}


@pytest.mark.parametrize(("overrides", "message"), CONSTRAINTS.values(), ids=CONSTRAINTS.keys())
def test_documented_constraint_raises(overrides, message):
    with pytest.raises(NpuContractError, match="npu_lightning_indexer") as err:
        _call(**overrides)
    assert message in str(err.value)


def test_bsnd_query_lengths_beyond_s1_raise():
    """BSND actual lengths are per batch and at most S1."""
    q = torch.zeros(1, 2, 4, D, dtype=torch.float16)
    with pytest.raises(NpuContractError, match=r"entries must lie in \[0, 2\]"):
        npu_lightning_indexer(
            q,
            torch.zeros(1, 3, 1, D, dtype=torch.float16),
            torch.zeros(1, 2, 4, dtype=torch.float16),
            actual_seq_lengths_query=_i32(3),
        )
