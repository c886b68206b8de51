"""The cuda backend's quantisation and GEMM kernels (quantize, quant_gemm, grouped_gemm),
run through Triton's interpreter: quantize bit for bit against the format definition
(ties, ragged groups and tiles, float8 as bytes too), the GEMMs against the float64
reference with the conformance suite's GEMM criterion, for every scheme, QAT mode,
every int4 K-step path and the meta-mode rules for unchecked expert offsets."""

from __future__ import annotations

import pytest
import torch

from glmport.backends.cpu import float64_reference
from glmport.conformance import judges
from glmport.core.formats import FORMATS, SCHEMES, quantize_tensor
from glmport.core.registry import REGISTRY

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def quant(cuda_module, one_thread):
    return cuda_module("quant")


@pytest.fixture(scope="module")
def gemm(cuda_module, one_thread):
    return cuda_module("gemm")


def ref(op: str):
    return REGISTRY.kernels("cpu", False)[op]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def as_bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q


# -- quantize ------------------------------------------------------------------------


def check_quantize(quant, x, fmt, group_size):
    q, s = quant.quantize(x, fmt, group_size)
    rq, rs = quantize_tensor(x, fmt, group_size)
    assert q.dtype == rq.dtype and q.shape == rq.shape
    assert torch.equal(as_bits(q), as_bits(rq)), f"{int((as_bits(q) != as_bits(rq)).sum())} codes"
    assert s.dtype == torch.float32 and torch.equal(s, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_bit_exact(quant, fmt, dtype):
    g = gen(1)
    # Rows of different magnitudes (one all zero: the amax floor), wide and narrow.
    shapes = [(6, 64, 32), (3, 96, 32)]
    if FORMATS[fmt].storage != torch.uint8:
        shapes += [(5, 200, 128), (70, 70, 32)]  # ragged last group / tile rows and columns
    for rows, cols, gs in shapes:
        x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
        x[1] = 0
        check_quantize(quant, x.to(dtype), fmt, gs)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_ties_round_half_even(quant, fmt):
    qmax = {torch.int8: 127.0, torch.uint8: 7.0}.get(FORMATS[fmt].storage, 448.0)
    # amax = qmax makes the scale 1 (a power of two): the codes below are exact ties.
    ties = [0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 4.5, -5.5, 6.5, 0.0, -0.0, -qmax, 1.25, 0.75, -1.5]
    if qmax == 448.0:  # e4m3 half-spacing ties, normal and subnormal, and the carry
        ties += [17.0, 19.0, 9.5, 0.0029296875, -0.0009765625, 31.5, 30.5, 240.0, 3e-4]
    row = torch.tensor([qmax, *ties])
    x = torch.stack([row, -row, row * 0.37])
    check_quantize(quant, x, fmt, x.shape[1])
    check_quantize(quant, x.bfloat16(), fmt, x.shape[1])


def test_quantize_strided_input_and_empty(quant):
    x = torch.randn(40, 128, generator=gen(2))
    for fmt in FORMATS:
        check_quantize(quant, x[::3, 32:], fmt, 32)
        check_quantize(quant, x.T[:64, :32], fmt, 16)
        q, s = quant.quantize(x[:0], fmt, 32)
        assert q.shape[0] == 0 and s.shape[0] == 0


def test_quantize_in_chunks(quant, monkeypatch):
    """Groups, rows and tiles larger than one chunk: amax over the chunks, then codes."""
    monkeypatch.setattr(quant, "_chunk_elements", lambda: 128)
    x = torch.randn(20, 280, generator=gen(4)) * torch.logspace(-2, 2, 280)
    # Rows and groups of 2-3 chunks; fp8_block tiles of 24 x 24 in 6 row chunks.
    sizes = {"int4_group": 140, "fp8_group": 200, "fp8_group_pow2": 200}
    for fmt in FORMATS:
        tile = FORMATS[fmt].granularity == "block"
        check_quantize(quant, x[:, :50] if tile else x[:3], fmt, sizes.get(fmt, 24))


def test_quantize_float8_as_bytes(quant, monkeypatch):
    """GPUs without float8e4nv (sm < 89, ROCm) get the bytes from integer arithmetic."""
    x = torch.randn(20, 160, generator=gen(3)) * 4
    x[0, :8] = torch.tensor([448.0, 31.5, -17.0, 3e-4, -1e-9, 0.0, -0.0, 1e-3])
    monkeypatch.setattr(quant, "native_fp8", lambda device: False)
    for fmt in ("fp8_group", "fp8_group_pow2", "fp8_block", "fp8_block_pow2"):
        check_quantize(quant, x, fmt, 128)
        check_quantize(quant, x.half(), fmt, 64)


# -- quant_gemm ----------------------------------------------------------------------


def packed_weight(w, scheme, group_size):
    s = SCHEMES[scheme]
    return quantize_tensor(w, s.weight.name, s.fixed_group_size or group_size)


def check_gemm(op, dtype, args, out):
    with float64_reference():
        expected = ref(op)(*args)
    verdict = judges.gemm(op, dtype, args, out, expected)
    assert verdict.ok, verdict.reason
    assert out.dtype == args[0].dtype and out.data_ptr() != args[0].data_ptr()


def gemm_inputs(m, n, k, dtype, seed=0):
    g = gen(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    # Column blocks of different magnitudes, so a misplaced K-block scale shows.
    w = torch.randn(n, k, generator=g) * k**-0.5 * torch.rand(1, k, generator=g).add(0.1)
    return x, w


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_gemm_schemes(gemm, scheme, dtype):
    # M = 1; K not a multiple of 128 (two fp8 K blocks, the last short); several N / K
    # scale blocks (N 136 = two fp8 row blocks, K 384 = three).
    for m, n, k, gs in [(1, 32, 192, 64), (5, 136, 384, 128), (3, 24, 256, 32)]:
        x, w = gemm_inputs(m, n, k, dtype)
        wq, ws = packed_weight(w, scheme, gs)
        args = (x, wq, ws, scheme, gs)
        check_gemm("quant_gemm", dtype, args, gemm.quant_gemm(*args))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quant_gemm_qat(gemm, scheme):
    for dtype, (m, n, k, gs) in [
        (torch.float32, (4, 16, 128, 32)),
        (torch.bfloat16, (3, 130, 200, 40)),
    ]:
        x, w = gemm_inputs(m, n, k, dtype, seed=4)
        args = (x, w.to(dtype), None, scheme, gs)
        check_gemm("quant_gemm", dtype, args, gemm.quant_gemm(*args))


@pytest.mark.parametrize("scheme", ["w4a8", "w4a16"])
@pytest.mark.parametrize("step", [(32, False), (64, False), (64, True), (128, True)])
def test_int4_k_steps(gemm, monkeypatch, scheme, step):
    """Each int4 K-step path whatever the interpreter picks: a step inside one group
    (exact integer partial sums, as on a GPU), and steps spanning groups (dequantised
    in registers), with group sizes that are no power of two."""
    monkeypatch.setattr(gemm, "_int4_step", lambda group, ieee: (step[0], group % step[0] != 0))
    groups = [64, 192] if not step[1] else [48, 24, 64]
    for gs in groups:
        if not step[1] and gs % step[0]:
            continue
        x, w = gemm_inputs(3, 40, 384, torch.float32, seed=gs)
        wq, ws = packed_weight(w, scheme, gs)
        args = (x, wq, ws, scheme, gs)
        check_gemm("quant_gemm", torch.float32, args, gemm.quant_gemm(*args))


def test_a_gpu_steps_int4_weights_by_exact_groups_and_fp32_by_32(gemm, cuda_module):
    """The GPU's K steps (the interpreter always takes 128): the largest power of two
    dividing the group, at most 128 (32 for float32's FMA dots), or 64 spanning groups."""
    runtime = cuda_module("runtime")
    with runtime.gpu_plan():
        got = {(g, ieee): gemm._int4_step(g, ieee) for g in (128, 64, 192, 48) for ieee in (0, 1)}
    assert got == {
        (128, 0): (128, False), (128, 1): (32, False),
        (64, 0): (64, False), (64, 1): (32, False),
        (192, 0): (64, False), (192, 1): (32, False),
        (48, 0): (64, True), (48, 1): (64, True),
    }  # fmt: skip
    assert gemm._int4_step(32, True) == (128, True)  # the interpreter's own plan


def test_fp8_gemm_as_bytes(gemm, monkeypatch):
    """Without float8 dots the e4m3 codes are decoded in registers: same results."""
    x, w = gemm_inputs(6, 136, 320, torch.bfloat16, seed=5)
    wq, ws = packed_weight(w, "fp8_block", 128)
    native = gemm.quant_gemm(x, wq, ws, "fp8_block", 128)
    monkeypatch.setattr(gemm.quant, "native_fp8", lambda device: False)
    decoded = gemm.quant_gemm(x, wq, ws, "fp8_block", 128)
    check_gemm("quant_gemm", torch.bfloat16, (x, wq, ws, "fp8_block", 128), decoded)
    torch.testing.assert_close(decoded.float(), native.float(), rtol=1e-2, atol=1e-3)


def test_quant_gemm_empty_and_deterministic(gemm):
    x, w = gemm_inputs(7, 48, 128, torch.bfloat16)
    wq, ws = packed_weight(w, "w4a8", 32)
    assert gemm.quant_gemm(x[:0], wq, ws, "w4a8", 32).shape == (0, 48)
    first, second = (gemm.quant_gemm(x, wq, ws, "w4a8", 32) for _ in range(2))
    assert torch.equal(first, second)


# -- grouped_gemm --------------------------------------------------------------------


def grouped_inputs(m, e, n, k, dtype, scheme="none", gs=32, seed=0, qat=False):
    g = gen(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(e, n, k, generator=g) * k**-0.5
    if scheme == "none" or qat:
        return x, w.to(dtype), None
    packed = [packed_weight(w[i], scheme, gs) for i in range(e)]
    return x, torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed])


def check_grouped(gemm, x, w, offsets, ws, scheme, gs):
    args = (x, w, offsets, ws, scheme, gs)
    out = gemm.grouped_gemm(*args)
    check_gemm("grouped_gemm", x.dtype, args, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_float(gemm, dtype):
    x, w, _ = grouped_inputs(40, 5, 24, 96, dtype)
    offsets = torch.tensor([0, 7, 7, 25, 26, 40], dtype=torch.int32)  # an empty expert
    check_grouped(gemm, x, w, offsets, None, "none", 128)
    # Strided activations (a slice of a wider tensor) and int64 offsets.
    wide = torch.randn(40, 160, generator=gen(9)).to(dtype)
    check_grouped(gemm, wide[:, 32:128], w, offsets.long(), None, "none", 128)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_grouped_schemes(gemm, scheme):
    x, w, ws = grouped_inputs(30, 4, 136, 256, torch.bfloat16, scheme, gs=64, seed=1)
    offsets = torch.tensor([0, 0, 13, 13, 30])  # empty first and third experts
    check_grouped(gemm, x, w, offsets, ws, scheme, 64)
    x, w, _ = grouped_inputs(12, 3, 130, 128, torch.float32, scheme, gs=32, seed=2, qat=True)
    check_grouped(gemm, x, w, torch.tensor([0, 5, 9, 12]), None, scheme, 32)


@pytest.mark.parametrize(
    "offsets",
    [
        [3, 10, 8, 20],  # rows before o[0], a non-monotone offset, rows past o[E]
        [-5, 40, 2, 50],  # out of range on both sides
        [0, 0, 0, 0],  # every row owned by no expert
        [26, 30, 31, 99],
    ],
)
def test_grouped_unchecked_offsets(gemm, offsets):
    """Meta mode: o = running max of clamp(offsets, 0, M); other rows are 0."""
    x, w, ws = grouped_inputs(26, 3, 20, 64, torch.float32, "w8a8", seed=3)
    offsets = torch.tensor(offsets)
    out = check_grouped(gemm, x, w, offsets, ws, "w8a8", 32)
    owned = offsets.clamp(0, 26).cummax(0).values
    rows = torch.arange(26)
    assert not out[(rows < owned[0]) | (rows >= owned[-1])].any()


def test_grouped_empty_and_deterministic(gemm):
    x, w, _ = grouped_inputs(0, 3, 20, 64, torch.bfloat16)
    out = gemm.grouped_gemm(x, w, torch.zeros(4, dtype=torch.int32), None, "none", 128)
    assert out.shape == (0, 20) and out.dtype == torch.bfloat16
    x, w, ws = grouped_inputs(50, 6, 40, 128, torch.bfloat16, "fp8_block_ue8m0", seed=4)
    offsets = torch.tensor([0, 9, 9, 30, 31, 44, 50])
    first, second = (gemm.grouped_gemm(x, w, offsets, ws, "fp8_block_ue8m0", 128) for _ in "ab")
    assert torch.equal(first, second)
