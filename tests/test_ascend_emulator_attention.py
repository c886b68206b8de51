"""The emulated ``torch_npu.npu_sparse_flash_attention`` against its documented contract
(Ascend/op-plugin ``torch_npu-npu_sparse_flash_attention.md``, CANN ops-transformer
``attention/sparse_flash_attention``), in the vendor's layouts: TND with cumulative
lengths over two batches, BSND with per-batch valid lengths, PA_BSND through a block
table, sparse_mode 0 (selection only) against 3 (rightDownCausal crop on top), ``-1``
padding, repeated slots, block-wise selection, the all-zero and the undefined rows,
``softmax_max`` / ``softmax_sum``, and one test per documented constraint.

Which kv tokens each row reads is written out by hand from the docs; the attention over
them is recomputed in float64 here."""

from __future__ import annotations

import pytest
import torch

from glmport.backends.ascend.emulator.attention import npu_sparse_flash_attention as sfa
from glmport.backends.ascend.emulator.contract import NpuContractError
from glmport.core.tolerance import compare, tolerance

MAX64 = 2**63 - 1
SCALE = 576**-0.5


def rand(gen: torch.Generator, *shape: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def i32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def attend(q, qr, kn, kr, tokens):
    """float64 MLA-absorb attention of one query row ``q [N1, 512]``, ``qr [N1, 64]``
    over the kv rows ``tokens`` of ``kn [S, 512]`` / ``kr [S, 64]`` (value = kn).
    Returns ``out [N1, 512]``, the max of the scaled scores and ``sum exp(s - max)``."""
    k, r = kn.double()[tokens], kr.double()[tokens]
    s = (q.double() @ k.T + qr.double() @ r.T) * SCALE
    m = s.max(dim=-1).values
    e = torch.exp(s - m[:, None])
    return (e @ k) / e.sum(-1)[:, None], m, e.sum(-1)


def check_row(got, want, dtype):
    """``got = (out [N1, 512], max [N1], sum [N1])`` of one row against :func:`attend`."""
    assert compare(got[0], want[0], tolerance("sparse_attention", dtype)).ok
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2].double(), want[2], rtol=1e-5, atol=1e-5)


def tnd_case(gen, dtype=torch.float16):
    """Two TND batches: queries 2 + 3 (cumulative [2, 5]), kv 5 + 7 (cumulative
    [5, 12]); N1 = 4 query heads on one latent kv head."""
    q, qr = rand(gen, 5, 4, 512, dtype=dtype), rand(gen, 5, 4, 64, dtype=dtype)
    kn, kr = rand(gen, 12, 1, 512, dtype=dtype), rand(gen, 12, 1, 64, dtype=dtype)
    indices = i32(
        [
            [[4, 0, 2, -1]],  # batch 0 (kv rows 0..4), query 0
            [[1, 3, -1, -1]],  # batch 0, query 1
            [[6, 0, 5, 2]],  # batch 1 (kv rows 5..11), query 0
            [[3, 3, -1, -1]],  # batch 1, query 1: slot 3 twice
            [[0, 6, 1, -1]],  # batch 1, query 2
        ]
    )
    kwargs = dict(
        actual_seq_lengths_query=i32([2, 5]),
        actual_seq_lengths_kv=i32([5, 12]),
        query_rope=qr,
        key_rope=kr,
        layout_query="TND",
        layout_kv="TND",
        attention_mode=2,
        return_softmax_lse=True,
    )
    return q, kn, indices, kwargs


def test_tnd_two_batches_sparse_mode_0_reads_exactly_the_selected_tokens():
    """Indices are relative to each batch's kv sequence (batch 1 starts at kv row 5),
    ``-1`` ends a row, a repeated slot counts twice, no causal crop in mode 0."""
    q, kn, indices, kw = tnd_case(torch.Generator().manual_seed(0))
    out, smax, ssum = sfa(q, kn, kn, indices, SCALE, sparse_mode=0, **kw)
    assert out.shape == (5, 4, 512) and out.dtype == torch.float16
    assert smax.shape == ssum.shape == (1, 5, 4)  # [N2, T1, N1 / N2]
    assert smax.dtype == ssum.dtype == torch.float32
    rows = [[4, 0, 2], [1, 3], [11, 5, 10, 7], [8, 8], [5, 11, 6]]  # global kv rows
    kr = kw["key_rope"]
    for t, tokens in enumerate(rows):
        want = attend(q[t], kw["query_rope"][t], kn[:, 0], kr[:, 0], tokens)
        check_row((out[t], smax[0, t], ssum[0, t]), want, torch.float16)


def test_sparse_mode_3_crops_causally_on_top_of_the_indices():
    """Row ``i`` of a batch reads tokens ``j <= Lkv - Lq + i`` and only the first
    ``min(K, Lkv - Lq + i + 1)`` entries of its index row. Batch 0 (Lq 2, Lkv 5):
    thresholds 4, 5; batch 1 (Lq 3, Lkv 7): 5, 6, 7."""
    q, kn, indices, kw = tnd_case(torch.Generator().manual_seed(1))
    out3, smax3, ssum3 = sfa(q, kn, kn, indices, SCALE, sparse_mode=3, **kw)
    out0 = sfa(q, kn, kn, indices, SCALE, sparse_mode=0, **kw)[0]
    rows = [
        [0, 2],  # [4, 0, 2]: 4 >= 4 is cropped
        [1, 3],  # threshold 5: nothing cropped
        [5, 7],  # [6, 0, 5, 2] + 5: 6 and 5 >= 5 cropped
        [8, 8],
        [5, 11, 6],  # threshold 7: all of [0, 6, 1] readable
    ]
    for t, tokens in enumerate(rows):
        want = attend(q[t], kw["query_rope"][t], kn[:, 0], kw["key_rope"][:, 0], tokens)
        check_row((out3[t], smax3[0, t], ssum3[0, t]), want, torch.float16)
    assert not torch.equal(out3[0], out0[0])  # the crop changed row 0


def test_sparse_mode_3_reads_only_the_first_threshold_entries_of_a_row():
    """BSND, one batch, Lq = Lkv = 3: row 0 may read 1 entry, row 1 two. Row 0's
    entries [2, 0]: only 2 is examined, it is past the crop, so the row selects no
    token; row 1's [2, 0, 1]: 2 cropped, 0 read, 1 not examined."""
    gen = torch.Generator().manual_seed(2)
    q, qr = rand(gen, 1, 3, 2, 512), rand(gen, 1, 3, 2, 64)
    kn, kr = rand(gen, 1, 3, 1, 512), rand(gen, 1, 3, 1, 64)
    indices = i32([[[[2, 0, -1]], [[2, 0, 1]], [[1, 2, 0]]]])
    out, smax, ssum = sfa(
        q,
        kn,
        kn,
        indices,
        SCALE,
        query_rope=qr,
        key_rope=kr,
        sparse_mode=3,
        attention_mode=2,
        return_softmax_lse=True,
    )
    assert out.shape == (1, 3, 2, 512) and smax.shape == (1, 1, 3, 2)
    for s, tokens in ((1, [0]), (2, [1, 2, 0])):
        want = attend(q[0, s], qr[0, s], kn[0, :, 0], kr[0, :, 0], tokens)
        check_row((out[0, s], smax[0, 0, s], ssum[0, 0, s]), want, torch.float16)
    # Row 0 selected nothing: undefined by the docs, poisoned by the emulator.
    assert torch.isnan(out[0, 0]).all()
    assert torch.equal(smax[0, 0, 0], torch.full((2,), -2e38))
    assert torch.equal(ssum[0, 0, 0], torch.full((2,), 1.0))  # one slot examined


def test_bsnd_actual_lengths_pad_rows_and_bound_the_kv_sequence():
    """BSND B = 2, S1 = 2, S2 = 6: batch 1 keeps 1 query row (the other is padding:
    all zero) and 4 kv tokens (its slot 5 is past them and skipped in mode 0)."""
    gen = torch.Generator().manual_seed(3)
    q, qr = (
        rand(gen, 2, 2, 8, 512, dtype=torch.bfloat16),
        rand(gen, 2, 2, 8, 64, dtype=torch.bfloat16),
    )
    kn, kr = (
        rand(gen, 2, 6, 1, 512, dtype=torch.bfloat16),
        rand(gen, 2, 6, 1, 64, dtype=torch.bfloat16),
    )
    indices = i32([[[[5, 1, -1]], [[0, -1, -1]]], [[[5, 3, 2]], [[1, 2, 3]]]])
    out, smax, ssum = sfa(
        q,
        kn,
        kn,
        indices,
        SCALE,
        actual_seq_lengths_query=i32([2, 1]),
        actual_seq_lengths_kv=i32([6, 4]),
        query_rope=qr,
        key_rope=kr,
        sparse_mode=0,
        attention_mode=2,
        return_softmax_lse=True,
    )
    assert out.dtype == torch.bfloat16 and smax.shape == (2, 1, 2, 8)
    for b, s, tokens in ((0, 0, [5, 1]), (0, 1, [0]), (1, 0, [3, 2])):
        want = attend(q[b, s], qr[b, s], kn[b, :, 0], kr[b, :, 0], tokens)
        check_row((out[b, s], smax[b, 0, s], ssum[b, 0, s]), want, torch.bfloat16)
    assert torch.equal(out[1, 1], torch.zeros_like(out[1, 1]))
    assert torch.equal(smax[1, 0, 1], torch.zeros(8)) and torch.equal(ssum[1, 0, 1], torch.zeros(8))


def test_causal_rows_before_the_kv_start_are_all_zero():
    """sparse_mode 3 with Lq = 3 > Lkv = 2: row 0's threshold is 0, the kernel writes
    zeros (out, max and sum) without reading its indices."""
    gen = torch.Generator().manual_seed(4)
    q, qr = rand(gen, 1, 3, 1, 512), rand(gen, 1, 3, 1, 64)
    kn, kr = rand(gen, 1, 2, 1, 512), rand(gen, 1, 2, 1, 64)
    indices = i32([[[[0, 1]], [[0, 1]], [[1, 0]]]])
    out, smax, ssum = sfa(
        q,
        kn,
        kn,
        indices,
        SCALE,
        query_rope=qr,
        key_rope=kr,
        sparse_mode=3,
        attention_mode=2,
        return_softmax_lse=True,
    )
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.equal(smax[0, 0, 0], torch.zeros(1)) and torch.equal(ssum[0, 0, 0], torch.zeros(1))
    for s, tokens in ((1, [0]), (2, [1, 0])):
        want = attend(q[0, s], qr[0, s], kn[0, :, 0], kr[0, :, 0], tokens)
        check_row((out[0, s], smax[0, 0, s], ssum[0, 0, s]), want, torch.float16)


def test_pa_bsnd_reads_tokens_through_the_block_table():
    """vllm-ascend's call: TND query, PA_BSND kv. block_size 16, batch 0 holds 20
    tokens in physical blocks [2, 0], batch 1 holds 16 in block [3]; token ``p`` of
    batch ``b`` is row ``p % 16`` of block ``block_table[b, p // 16]``. Without
    ``return_softmax_lse`` the softmax outputs are empty."""
    gen = torch.Generator().manual_seed(5)
    q, qr = rand(gen, 3, 2, 512), rand(gen, 3, 2, 64)
    kn, kr = rand(gen, 4, 16, 1, 512), rand(gen, 4, 16, 1, 64)
    indices = i32([[[17, 3, 19, -1]], [[0, 16, -1, -1]], [[15, 2, 7, 20]]])
    out, smax, ssum = sfa(
        q,
        kn,
        kn,
        indices,
        SCALE,
        block_table=i32([[2, 0], [3, 1]]),
        actual_seq_lengths_query=i32([2, 3]),
        actual_seq_lengths_kv=i32([20, 16]),
        query_rope=qr,
        key_rope=kr,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=0,
        attention_mode=2,
    )
    assert smax.shape == ssum.shape == (0,) and smax.dtype == torch.float32
    flat_n, flat_r = kn.reshape(64, 512), kr.reshape(64, 64)  # physical block * 16 + row
    rows = [
        [0 * 16 + 1, 2 * 16 + 3, 0 * 16 + 3],  # 17 -> block 0 row 1, 3 -> block 2 row 3
        [2 * 16 + 0, 0 * 16 + 0],
        [3 * 16 + 15, 3 * 16 + 2, 3 * 16 + 7],  # 20 is past batch 1's 16 tokens
    ]
    for t, tokens in enumerate(rows):
        want = attend(q[t], qr[t], flat_n, flat_r, tokens)
        assert compare(out[t], want[0], tolerance("sparse_attention", torch.float16)).ok


def test_sparse_block_size_selects_blocks_of_tokens():
    """sparse_block_size 4: entry ``j`` reads tokens ``4j .. 4j + 3``, the last block
    cut at the kv length (6 tokens: block 1 is tokens 4, 5)."""
    gen = torch.Generator().manual_seed(6)
    q, qr = rand(gen, 1, 1, 2, 512), rand(gen, 1, 1, 2, 64)
    kn, kr = rand(gen, 1, 8, 1, 512), rand(gen, 1, 8, 1, 64)
    out, smax, ssum = sfa(
        q,
        kn,
        kn,
        i32([[[[1, 0, -1]]]]),
        SCALE,
        actual_seq_lengths_kv=i32([6]),
        query_rope=qr,
        key_rope=kr,
        sparse_block_size=4,
        sparse_mode=0,
        attention_mode=2,
        return_softmax_lse=True,
    )
    want = attend(q[0, 0], qr[0, 0], kn[0, :, 0], kr[0, :, 0], [4, 5, 0, 1, 2, 3])
    check_row((out[0, 0], smax[0, 0, 0], ssum[0, 0, 0]), want, torch.float16)


# -- documented constraints ------------------------------------------------------------


def base_call(gen=None):
    """A valid TND call (T = 2, N1 = 2, kv 4 tokens) as ``(args, kwargs)``."""
    gen = gen or torch.Generator().manual_seed(7)
    q, qr = rand(gen, 2, 2, 512), rand(gen, 2, 2, 64)
    kn, kr = rand(gen, 4, 1, 512), rand(gen, 4, 1, 64)
    args = [q, kn, kn, i32([[[0, 1]], [[2, -1]]]), SCALE]
    kwargs = dict(
        actual_seq_lengths_query=i32([2]),
        actual_seq_lengths_kv=i32([4]),
        query_rope=qr,
        key_rope=kr,
        layout_query="TND",
        layout_kv="TND",
        sparse_mode=0,
        attention_mode=2,
    )
    return args, kwargs


def test_base_call_is_valid():
    args, kwargs = base_call()
    out = sfa(*args, **kwargs)[0]
    assert out.shape == (2, 2, 512) and torch.isfinite(out.float()).all()


def _paged(kwargs, block_size=16, sbs=1, table=((0,),)):
    gen = torch.Generator().manual_seed(8)
    kv = rand(gen, 2, block_size, 1, 512)
    kwargs.update(
        block_table=i32(list(table)),
        layout_kv="PA_BSND",
        key_rope=rand(gen, 2, block_size, 1, 64),
        sparse_block_size=sbs,
    )
    return kv


def _set(**changes):
    def edit(args, kwargs):
        kwargs.update(changes)

    return edit


def _arg(i, make):
    def edit(args, kwargs):
        args[i] = make(args[i])

    return edit


def _pa(block_size=16, sbs=1, table=((0,),), **more):
    def edit(args, kwargs):
        kv = _paged(kwargs, block_size, sbs, table)
        args[1] = args[2] = kv
        kwargs.update(more)

    return edit


def _heads(n1, n2):
    """``n1`` query heads, ``n2`` kv heads."""

    def edit(args, kwargs):
        args[0] = args[0][:, :1].expand(2, n1, 512).contiguous()
        kwargs["query_rope"] = kwargs["query_rope"][:, :1].expand(2, n1, 64).contiguous()
        args[1] = args[2] = args[1].expand(4, n2, 512).contiguous()
        kwargs["key_rope"] = kwargs["key_rope"].expand(4, n2, 64).contiguous()

    return edit


def _head_dim(d, d_rope):
    def edit(args, kwargs):
        args[0] = args[0][..., :d].contiguous()
        args[1] = args[2] = args[1][..., :d].contiguous()
        kwargs["query_rope"] = kwargs["query_rope"][..., :d_rope].contiguous()
        kwargs["key_rope"] = kwargs["key_rope"][..., :d_rope].contiguous()

    return edit


def _drop(name):
    def edit(args, kwargs):
        del kwargs[name]

    return edit


def _no_query(args, kwargs):
    args[0] = args[0][:0]
    kwargs.update(query_rope=kwargs["query_rope"][:0], actual_seq_lengths_query=i32([0]))


CONSTRAINTS = {
    "fp32_query": (_arg(0, lambda t: t.float()), "query supports float16 and bfloat16"),
    "key_dtype": (_arg(1, lambda t: t.bfloat16()), "key must have query's dtype"),
    "q_heads_3": (_heads(3, 1), "N1 supports"),
    "kv_heads_2": (_heads(2, 2), "KV_N only supports 1"),
    "head_dim_256": (_head_dim(256, 64), "D must be 512"),
    "rope_dim_32": (_head_dim(512, 32), "D_rope=64"),
    "attention_mode_default_0": (_drop("attention_mode"), "attention_mode only supports 2"),
    "no_rope": (_set(query_rope=None), "needs both query_rope and key_rope"),
    "sparse_mode_1": (_set(sparse_mode=1), "sparse_mode must be 0 or 3"),
    "pre_tokens": (_set(pre_tokens=2048), "pre_tokens / next_tokens only support"),
    "next_tokens": (_set(next_tokens=0), "pre_tokens / next_tokens only support"),
    "sparse_block_size_3": (_set(sparse_block_size=3), "power of 2 in [1, 128]"),
    "sparse_block_size_256": (_set(sparse_block_size=256), "power of 2 in [1, 128]"),
    "sinks": (_set(sinks=torch.zeros(2)), "sinks is not supported"),
    "layout_query_bnsd": (_set(layout_query="BNSD"), "layout_query supports"),
    "layout_kv_bsnd_vs_tnd_query": (_set(layout_kv="BSND"), "must equal layout_query"),
    "indices_int64": (_arg(3, lambda t: t.long()), "sparse_indices must be int32"),
    "indices_two_kv_heads": (_arg(3, lambda t: t.expand(2, 2, 2).contiguous()), "sparse_indices"),
    "indices_empty": (_arg(3, lambda t: t[..., :0]), "sparse_indices is empty"),
    "valid_after_minus_one": (
        _arg(3, lambda t: i32([[[-1, 1]], [[2, -1]]])),
        "valid entries come first",
    ),
    "index_below_minus_one": (_arg(3, lambda t: i32([[[0, -2]], [[2, -1]]])), "-1 (an invalid"),
    "value_differs_from_key": (_arg(2, lambda t: t.clone() * 2), "key and value share"),
    "value_shape": (_arg(2, lambda t: t[:3].contiguous()), "value's shape"),
    "non_contiguous_query": (
        _arg(0, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
        "query must be contiguous",
    ),
    "empty_query": (_no_query, "tensor query is empty"),
    "tnd_without_query_lengths": (
        _set(actual_seq_lengths_query=None),
        "actual_seq_lengths_query is required",
    ),
    "query_lengths_not_cumulative": (
        _set(actual_seq_lengths_query=i32([2, 1])),
        "must not decrease",
    ),
    "query_lengths_last_not_t": (_set(actual_seq_lengths_query=i32([1])), "must equal"),
    "kv_lengths_int64": (_set(actual_seq_lengths_kv=torch.tensor([4])), "must be int32"),
    "block_table_without_pa": (_set(block_table=i32([[0]])), "block_table must be None"),
    "pa_without_block_table": (_pa(block_table=None), "needs block_table"),
    "pa_block_size_8": (_pa(block_size=8), "multiple of 16"),
    "pa_block_size_2048": (_pa(block_size=2048), "up to 1024"),
    "pa_sparse_block_size_not_dividing": (_pa(block_size=16, sbs=32), "must divide block_size"),
    "pa_lse": (_pa(return_softmax_lse=True), "not supported with layout_kv PA_BSND"),
    "pa_block_out_of_range": (_pa(table=((5,),)), "block_num=2"),
}


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_documented_constraint_raises(name):
    edit, message = CONSTRAINTS[name]
    args, kwargs = base_call()
    edit(args, kwargs)
    with pytest.raises(NpuContractError, match="npu_sparse_flash_attention") as err:
        sfa(*args, **kwargs)
    assert message in str(err.value)
