"""The cuda backend's sparse_attention kernels, run through Triton's interpreter,
against the float64 cpu reference within the dtype's tolerance: both paths (prefill:
one program streams the whole index row; decode: splits merged by the combine kernel)
for MHA / GQA / MQA and absorbed MLA (``v`` a view of ``k``, ``Dk`` not a power of two
and wider than one column chunk), index rows longer than one slot block, ``-1`` and
out-of-range slots, repeated slots, empty rows and empty splits, int64 indices,
non-contiguous inputs, ``T = 0``, ``K = 0`` and ``N = 0``."""

from __future__ import annotations

import math

import pytest
import torch

from glmport.core.registry import REGISTRY
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PATHS = ("prefill", "decode")


@pytest.fixture(scope="module")
def attn(cuda_module, one_thread):
    return cuda_module("attention")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_indices(g, t: int, n: int, k: int, dtype=torch.int32) -> torch.Tensor:
    """Random slots (repeats included) with ``-1``, past-``N`` and below ``-1`` entries,
    a repeated slot, a row whose first half is invalid (a whole decode split empty)
    and, with ``t > 1``, a last row with no valid slot at all."""
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.2] = -1
    if k >= 4:
        idx[:, 0] = n + 3  # out of range: ignored like -1
        idx[:, 1] = -5
        idx[:, 3] = idx[:, 2]  # listed twice: counts twice
    idx[0, : k // 2] = -1
    if t > 1:
        idx[-1] = torch.where(torch.arange(k) % 2 == 0, -1, n + torch.arange(k))
    return idx.to(dtype)


def make_inputs(g, t, h, hkv, dk, dv, n, k, dtype, *, absorbed=False, q_scale=1.0):
    q = (q_scale * torch.randn(t, h, dk, generator=g)).to(dtype)
    kv = torch.randn(n, hkv, dk, generator=g).to(dtype)
    v = kv[..., :dv] if absorbed else torch.randn(n, hkv, dv, generator=g).to(dtype)
    return q, kv, v, make_indices(g, t, n, k), dk**-0.5


def run(attn, path: str, q, k, v, indices, scale):
    """The kernel on ``path``: prefill streams the row in one program, decode cuts it
    into two splits (the first one empty in row 0 of :func:`make_indices`)."""
    kk = indices.shape[1]
    split_len = kk if path == "prefill" else max(1, math.ceil(kk / 2))
    return attn.sparse_attention_split(q, k, v, indices, scale, split_len)


def reference(*args):
    with REGISTRY.get("cpu").float64():
        return REGISTRY.kernels("cpu", False)["sparse_attention"](*args)


def check(attn, path, q, k, v, indices, scale):
    out, lse = run(attn, path, q, k, v, indices, scale)
    t, h = q.shape[:2]
    assert out.shape == (t, h, v.shape[2]) and out.dtype == q.dtype
    assert lse.shape == (t, h) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, indices, scale)
    tol = tolerance("sparse_attention", q.dtype)
    for got, want in ((out, ref_out), (lse, ref_lse)):
        result = compare(got, want, tol)
        assert result.ok, (path, q.dtype, result)
    return out, lse


LAYOUTS = {  # (h, hkv)
    "mha": (2, 2),
    "gqa": (8, 2),
    "mqa": (4, 1),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "layout,dtype",
    [
        ("gqa", torch.float32),
        ("gqa", torch.bfloat16),
        ("gqa", torch.float16),
        ("mha", torch.float32),
        ("mqa", torch.bfloat16),
    ],
)
def test_head_layouts(attn, path, layout, dtype):
    h, hkv = LAYOUTS[layout]
    out, lse = check(attn, path, *make_inputs(gen(1), 3, h, hkv, 32, 16, 40, 12, dtype))
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the row with no valid slot
    assert torch.equal(lse[-1], torch.full_like(lse[-1], float("-inf")))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_mla_long_rows(attn, path, dtype):
    """v = k[..., :128] with Dk = 144 (two column chunks, the second mostly masked), rows
    of 1100 slots (several slot blocks per program: the online softmax rescales), large
    scores (the running max moves)."""
    args = make_inputs(gen(2), 2, 16, 1, 144, 128, 1500, 1100, dtype, absorbed=True, q_scale=3.0)
    assert args[2]._base is args[1] or args[2].data_ptr() == args[1].data_ptr()
    check(attn, path, *args)


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs_and_int64_indices(attn, path):
    g = gen(3)
    q = torch.randn(40, 4, 2, 24, generator=g)[:3, :, 0, :20]  # gaps between heads, tokens
    k = torch.randn(30, 2, 20, generator=g).transpose(0, 1).contiguous().transpose(0, 1)
    v = torch.randn(30, 2, 40, generator=g)[:, :, ::2]
    indices = make_indices(g, 3, 30, 9, torch.int64).t().contiguous().t()
    check(attn, path, q, k, v, indices, 0.3)


@pytest.mark.parametrize("path", PATHS)
def test_deterministic(attn, path):
    args = make_inputs(gen(4), 2, 8, 1, 32, 16, 50, 24, torch.bfloat16)
    first, second = run(attn, path, *args), run(attn, path, *args)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize(
    "t,n,k",
    [(0, 10, 4), (3, 10, 0), (3, 0, 5)],
    ids=["no_query", "no_index", "no_slot"],
)
def test_empty(attn, t, n, k):
    q = torch.randn(t, 4, 16, dtype=torch.bfloat16)
    kv = torch.randn(n, 2, 16, dtype=torch.bfloat16)
    indices = torch.full((t, k), -1, dtype=torch.int32)
    indices[:, 1:] = 7  # past N when N = 0: ignored
    out, lse = attn.sparse_attention(q, kv, kv[..., :8], indices, 0.25)
    assert torch.equal(out, torch.zeros(t, 4, 8, dtype=torch.bfloat16))
    assert torch.equal(lse, torch.full((t, 4), float("-inf")))


def test_plan_split_len(attn):
    """Few (token, kv head) programs with a long row take the decode path, in splits
    that are a multiple of the granule; many programs or short rows take prefill."""
    cpu = torch.device("cpu")
    split = attn.plan_split_len(2, 1, 1, 2048, cpu)
    assert split < 2048 and split % attn._INTERPRETER_MIN_SPLIT == 0
    assert attn.plan_split_len(64, 1, 1, 2048, cpu) == 2048
    assert attn.plan_split_len(1, 1, 1, 100, cpu) == 100
    assert attn.plan_split_len(1, 1, 1, 0, cpu) == 0


def test_public_entry_point_takes_decode_path(attn, monkeypatch):
    """sparse_attention follows plan_split_len: forced to decode it splits the row."""
    seen = []

    def split(*args, **kwargs):
        seen.append(args[5])  # split_len
        return real(*args, **kwargs)

    real = attn.sparse_attention_split
    monkeypatch.setattr(attn, "plan_split_len", lambda *args: 5)
    monkeypatch.setattr(attn, "sparse_attention_split", split)
    args = make_inputs(gen(5), 2, 4, 1, 32, 16, 30, 11, torch.float32)
    out, lse = attn.sparse_attention(*args)
    assert seen == [5]
    ref_out, ref_lse = reference(*args)
    assert compare(out, ref_out, tolerance("sparse_attention", torch.float32)).ok
    assert compare(lse, ref_lse, tolerance("sparse_attention", torch.float32)).ok
