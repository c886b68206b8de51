"""The ascend ``sparse_attention`` adapter run on the emulated
``torch_npu.npu_sparse_flash_attention`` against the float64 cpu reference, at GLM-5's
absorbed-MLA shapes (Dk 576 = latent 512 + rope 64, one kv head, 16 / 64 query heads)
with small T and N: ``-1`` anywhere in a row (the op wants them last), a row with no
valid slot, repeated slots, ``N < topk`` with more valid entries than slots, ``T = 1``,
int64 indices, out-of-range slots (``GLMPORT_VALIDATE=meta``), ``v`` a copy of
``k[..., :512]`` or a different tensor (both the composite), the empty cases, and the
keywords the adapter pins."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glmport.backends.ascend.attention import sparse_attention
from glmport.backends.ascend.emulator import attention as emulator
from glmport.core.registry import REGISTRY
from glmport.core.selection import recording_fallbacks
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.bfloat16, torch.float16)


class Spy:
    """An ``npu`` namespace whose ``npu_sparse_flash_attention`` is the emulator's,
    recording each call's keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def npu_sparse_flash_attention(self, *args, **kwargs):
        self.calls.append(kwargs)
        return emulator.npu_sparse_flash_attention(*args, **kwargs)


NPU = SimpleNamespace(npu_sparse_flash_attention=emulator.npu_sparse_flash_attention)


def make(seed, t, h, n, k, dtype, *, valid=0.75, index_dtype=torch.int32):
    """``q [t, h, 576]``, ``kv [n, 1, 576]``, ``v = kv[..., :512]`` (a view),
    ``indices [t, k]``: random slots (repeats included) with about ``1 - valid`` of
    them ``-1``, scattered through the row, and scale ``576 ** -0.5``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 576, generator=g).to(dtype)
    kv = torch.randn(n, 1, 576, generator=g).to(dtype)
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) > valid] = -1
    return q, kv, kv[..., :512], idx.to(index_dtype), 576**-0.5


def reference(*args):
    with REGISTRY.get("cpu").float64():
        return REGISTRY.kernels("cpu", False)["sparse_attention"](*args)


def check(npu, q, k, v, indices, scale):
    out, lse = sparse_attention(npu, q, k, v, indices, scale)
    t, h = q.shape[:2]
    assert out.shape == (t, h, 512) and out.dtype == q.dtype
    assert lse.shape == (t, h) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, indices, scale)
    tol = tolerance("sparse_attention", q.dtype)
    for got, want in ((out, ref_out), (lse, ref_lse)):
        result = compare(got, want, tol)
        assert result.ok, (q.dtype, result)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,k", [(16, 32), (64, 128)])
def test_glm5_shapes_with_scattered_padding(h, k, dtype):
    """``-1`` entries sit anywhere in a row: the adapter must move them last (the
    emulator raises otherwise), and ignore them."""
    args = make(1, 6, h, 256, k, dtype)
    assert ((args[3][:, :-1] == -1) & (args[3][:, 1:] >= 0)).any()  # a -1 before a slot
    check(NPU, *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_without_valid_slot_is_zero_with_minus_inf_lse(dtype):
    """The op leaves such a row undefined (the emulator returns NaN / a -2e38 max):
    the adapter masks it."""
    q, kv, v, idx, scale = make(2, 4, 16, 256, 64, dtype)
    idx[2] = -1
    out, lse = check(NPU, q, kv, v, idx, scale)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.equal(lse[2], torch.full_like(lse[2], float("-inf")))


def test_single_query_and_repeated_slots():
    """T = 1 (decode); a slot listed three times counts three times."""
    q, kv, v, idx, scale = make(3, 1, 64, 256, 32, torch.bfloat16)
    idx[0, :3] = 7
    check(NPU, q, kv, v, idx, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fewer_slots_than_topk_with_more_valid_entries_than_slots(dtype):
    """N = 20 < K = 32 and every entry valid (repeats): the op reads only a row's first
    ``min(K, S2)`` entries, so the adapter pads the kv sequence to K rows."""
    q, kv, v, idx, scale = make(4, 3, 16, 20, 32, dtype, valid=1.0)
    check(NPU, q, kv, v, idx, scale)


def test_int64_indices():
    check(NPU, *make(5, 4, 16, 256, 48, torch.bfloat16, index_dtype=torch.int64))


def test_out_of_range_slots_are_ignored_like_minus_one(monkeypatch):
    """Under GLMPORT_VALIDATE=meta indices are unchecked: slots past N and below -1
    must not reach the op (it would read outside the kv sequence) and count as -1."""
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    q, kv, v, idx, scale = make(6, 4, 16, 20, 32, torch.float16, index_dtype=torch.int64)
    idx[:, 0] = 20 + 3  # inside the rows the adapter pads the kv sequence with
    idx[:, 1] = -5
    idx[1, 2] = 2**40
    idx[3] = torch.where(torch.arange(32) % 2 == 0, -7, 20 + torch.arange(32))
    _, lse = check(NPU, q, kv, v, idx, scale)
    assert torch.equal(lse[3], torch.full_like(lse[3], float("-inf")))


def test_v_copy_of_the_latent_runs_the_generic_composite_without_reading_the_cache():
    """``v`` equal to ``k[..., :512]`` but not a view of it: telling it from another
    ``v`` would compare the whole cache (a host sync), so it runs the composite."""
    q, kv, v, idx, scale = make(7, 3, 16, 64, 32, torch.bfloat16)
    spy = Spy()
    with recording_fallbacks() as handed:
        check(spy, q, kv, v.clone(), idx, scale)
    assert spy.calls == [] and handed == [("ascend", "sparse_attention", "generic")]


def test_v_that_is_not_the_latent_runs_the_generic_composite():
    """The op in MLA-absorb mode uses ``key`` as the value: any other ``v`` cannot go
    through it, and the result must still be right."""
    q, kv, _, idx, scale = make(8, 3, 16, 64, 32, torch.bfloat16)
    v = torch.randn(64, 1, 512).to(torch.bfloat16)
    spy = Spy()
    check(spy, q, kv, v, idx, scale)
    assert spy.calls == []


def test_adapter_pins_every_drift_prone_keyword():
    """torch_npu defaults attention_mode to 0, vllm-ascend's copy to 2: the adapter
    passes it and the other keywords whose defaults differ between builds."""
    spy = Spy()
    q, kv, v, idx, scale = make(9, 2, 16, 64, 16, torch.bfloat16)
    sparse_attention(spy, q, kv, v, idx, scale)
    (kw,) = spy.calls
    assert kw["attention_mode"] == 2 and kw["sparse_mode"] == 0
    assert kw["layout_query"] == "TND" and kw["layout_kv"] == "TND"
    assert kw["sparse_block_size"] == 1 and kw["return_softmax_lse"] is True
    assert kw["pre_tokens"] == kw["next_tokens"] == 2**63 - 1
    assert kw["block_table"] is None
    assert kw["actual_seq_lengths_query"].tolist() == [2]
    assert kw["actual_seq_lengths_kv"].tolist() == [64]


def test_outputs_are_not_views_of_the_inputs():
    q, kv, v, idx, scale = make(10, 2, 16, 64, 16, torch.float16)
    out, lse = sparse_attention(NPU, q, kv, v, idx, scale)
    for x in (q, kv, v, idx):
        assert not torch._C._is_alias_of(out, x) and not torch._C._is_alias_of(lse, x)


@pytest.mark.parametrize(
    "t,n,k",
    [(0, 64, 8), (3, 64, 0), (3, 0, 8)],
    ids=["no_query", "no_index", "no_slot"],
)
def test_empty_inputs_never_reach_the_op(t, n, k):
    """The op rejects an empty query, key or sparse_indices."""
    q = torch.randn(t, 16, 576).to(torch.bfloat16)
    kv = torch.randn(n, 1, 576).to(torch.bfloat16)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    spy = Spy()
    out, lse = sparse_attention(spy, q, kv, kv[..., :512], idx, 576**-0.5)
    assert spy.calls == []
    assert torch.equal(out, torch.zeros(t, 16, 512, dtype=torch.bfloat16))
    assert torch.equal(lse, torch.full((t, 16), float("-inf")))
