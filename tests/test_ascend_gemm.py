"""The ascend backend's GEMM adapters (quant_gemm, grouped_gemm, their ':prepared'
kernels and prepare_weight) run on the CPU emulator of torch_npu, against glmport's cpu
reference: W8A8 bit for bit (activations quantised exactly as the int8_row format,
integer products exact), W4A16 and the grouped GEMMs with the conformance suite's GEMM
criterion, prepared weights equal to unprepared ones, N above the ops' 65535 limit in
slices, ragged and empty experts, and the meta-mode rule for unchecked offsets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glmport.backends.ascend import gemm as ag
from glmport.backends.ascend.emulator import gemm as eg
from glmport.backends.ascend.emulator import grouped_gemm as egg
from glmport.backends.cpu import float64_reference
from glmport.backends.generic.moe import grouped_gemm as generic_grouped_gemm
from glmport.backends.generic.quant import quant_gemm as generic_quant_gemm
from glmport.conformance import judges
from glmport.core.formats import SCHEMES, quantize_tensor
from glmport.core.registry import REGISTRY
from glmport.core.specs.quant import PreparedWeight

BF16, FP16 = torch.bfloat16, torch.float16
HALF = (BF16, FP16)

NPU = SimpleNamespace(
    **{name: getattr(module, name) for module in (eg, egg) for name in module.__all__}
)


def ref(op: str):
    return REGISTRY.kernels("cpu", False)[op]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def packed(w: torch.Tensor, scheme: str, group_size: int):
    """A float weight ``[N, K]`` (or ``[E, N, K]``) in ``scheme``'s canonical format."""
    fmt = SCHEMES[scheme].weight.name
    if w.dim() == 3:
        parts = [quantize_tensor(e, fmt, group_size) for e in w.unbind(0)]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return quantize_tensor(w, fmt, group_size)


def prepared(op, w, w_scale, scheme, group_size):
    native = ag.prepare_weight(NPU, op, w, w_scale, scheme)
    return PreparedWeight(op, w, w_scale, scheme, group_size, "ascend", True, native)


def same_math(out: torch.Tensor, other: torch.Tensor) -> None:
    """The same products in another layout or slicing: equal up to the float32
    summation order of the CPU's matmul kernels (one ulp of the output dtype)."""
    assert out.dtype == other.dtype and out.shape == other.shape
    torch.testing.assert_close(out, other)


def check_gemm(op: str, args: tuple, out: torch.Tensor) -> None:
    """The conformance suite's criterion against the float64 reference."""
    with float64_reference():
        expected = ref(op)(*args)
    assert out.dtype == args[0].dtype and out.shape == expected.shape
    verdict = judges.gemm(op, args[0].dtype, args, out, expected)
    assert verdict.ok, verdict.reason


# -- activations -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, *HALF))
def test_activation_codes_are_the_int8_row_format_bit_for_bit(dtype):
    """Rows of different magnitudes, exact halves of the row maximum (where
    npu_dynamic_quant's reciprocal arithmetic rounds the other way) and a zero row."""
    x = torch.randn(6, 96, generator=gen(1)) * torch.logspace(-3, 3, 6)[:, None]
    x[2, :8] = x[2].abs().max() * torch.tensor([0.5, -0.5, 1.5 / 127, 2.5 / 127, 1, 0, 0, 0])
    x[4] = 0
    x = x.to(dtype)
    q, s = ag.quantize_activations(x)
    rq, rs = ref("quantize")(x, "int8_row", 96)
    assert q.dtype == torch.int8 and torch.equal(q, rq)
    assert s.dtype == torch.float32 and torch.equal(s, rs)


# -- quant_gemm ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_quant_gemm_w8a8_bit_exact_with_reference(dtype):
    """Integer products are exact and the scales apply in the reference's order, so the
    result equals the float32 reference bit for bit (and passes the float64 judge)."""
    x = (torch.randn(7, 160, generator=gen(2)) * 3).to(dtype)
    x[3, :2] = torch.tensor([x[3].abs().max() / 2, 0])  # an exact half of the row max
    w, s = packed(torch.randn(48, 160, generator=gen(3)) * 0.05, "w8a8", 128)
    args = (x, w, s, "w8a8", 128)
    y = ag.quant_gemm(NPU, *args)
    assert torch.equal(y, ref("quant_gemm")(*args))
    check_gemm("quant_gemm", args, y)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("group_size", [32, 64, 256])
def test_quant_gemm_w4a16_matches_reference(dtype, group_size):
    """Per group (32, 64) and per channel (the group is all of K = 256)."""
    x = torch.randn(5, 256, generator=gen(4)).to(dtype)
    w, s = packed(torch.randn(40, 256, generator=gen(5)) * 0.05, "w4a16", group_size)
    args = (x, w, s, "w4a16", group_size)
    check_gemm("quant_gemm", args, ag.quant_gemm(NPU, *args))


def test_quant_gemm_w4a16_groups_the_op_refuses_run_generic():
    """npu_weight_quant_batchmatmul takes groups that are multiples of 32 only: a group
    of 16 runs the generic backend's code (the same result as it)."""
    x = torch.randn(3, 64, generator=gen(6)).to(BF16)
    w, s = packed(torch.randn(16, 64, generator=gen(7)), "w4a16", 16)
    args = (x, w, s, "w4a16", 16)
    assert torch.equal(ag.quant_gemm(NPU, *args), generic_quant_gemm(*args))
    assert ag.prepare_weight(NPU, "quant_gemm", w, s, "w4a16") is None


def test_quant_gemm_qat_and_empty_rows():
    x = torch.randn(4, 64, generator=gen(8)).to(BF16)
    wf = torch.randn(24, 64, generator=gen(9)).to(BF16)
    for scheme in ("w8a8", "w4a16"):
        args = (x, wf, None, scheme, 32)
        assert torch.equal(ag.quant_gemm(NPU, *args), generic_quant_gemm(*args))
    w, s = packed(wf.float(), "w8a8", 128)
    y = ag.quant_gemm(NPU, x[:0], w, s, "w8a8", 128)
    assert y.shape == (0, 24) and y.dtype == BF16


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("group_size", [32, 64])
def test_quant_gemm_prepared_equals_unprepared(dtype, group_size):
    x = torch.randn(6, 64, generator=gen(10)).to(dtype)
    w, s = packed(torch.randn(36, 64, generator=gen(11)) * 0.1, "w4a16", group_size)
    prep = prepared("quant_gemm", w, s, "w4a16", group_size)
    native = prep.native
    # The layout vllm-ascend deploys: int32 [1, K, N/8] (N = 36 padded to 40), scales
    # [1, K/G, 40] in both activation dtypes.
    assert native["weight"].dtype == torch.int32 and native["weight"].shape == (1, 64, 5)
    assert native["scale_bfloat16"].shape == (1, 64 // group_size, 40)
    y = ag.quant_gemm_prepared(NPU, x, prep, s, "w4a16", group_size)
    same_math(y, ag.quant_gemm(NPU, x, w, s, "w4a16", group_size))
    assert ag.quant_gemm_prepared(NPU, x[:0], prep, s, "w4a16", group_size).shape == (0, 36)


def test_prepare_weight_keeps_canonical_layouts():
    w, s = packed(torch.randn(16, 64, generator=gen(12)), "w8a8", 128)
    assert ag.prepare_weight(NPU, "quant_gemm", w, s, "w8a8") is None
    w4, s4 = packed(torch.randn(16, 64, generator=gen(13)), "w4a8", 32)
    assert ag.prepare_weight(NPU, "quant_gemm", w4, s4, "w4a8") is None


def test_quant_gemm_splits_n_above_65535():
    """npu_quant_matmul and npu_weight_quant_batchmatmul take N up to 65535 (the
    emulator raises beyond): wider weights run in N_CHUNK slices, same results."""
    n = 65536 + 72
    x = torch.randn(2, 64, generator=gen(14)).to(BF16)
    wf = torch.randn(n, 64, generator=gen(15)) * 0.1
    w8, s8 = packed(wf, "w8a8", 128)
    args = (x, w8, s8, "w8a8", 128)
    y = ag.quant_gemm(NPU, *args)
    assert y.shape == (2, n) and torch.equal(y, ref("quant_gemm")(*args))
    w4, s4 = packed(wf, "w4a16", 32)
    args4 = (x, w4, s4, "w4a16", 32)
    y4 = ag.quant_gemm(NPU, *args4)
    check_gemm("quant_gemm", args4, y4)
    prep = prepared("quant_gemm", w4, s4, "w4a16", 32)
    assert prep.native["weight"].shape == (3, 64, ag.N_CHUNK // 8)  # padded to 3 chunks
    same_math(ag.quant_gemm_prepared(NPU, x, prep, s4, "w4a16", 32), y4)


def test_quant_gemm_chunks_with_a_small_split_threshold(monkeypatch):
    """The slicing, the padding of the last prepared chunk and the concatenation, with
    the thresholds shrunk (N = 72 in chunks of 16)."""
    monkeypatch.setattr(ag, "MAX_DIM", 40)
    monkeypatch.setattr(ag, "N_CHUNK", 16)
    x = torch.randn(3, 64, generator=gen(16)).to(FP16)
    wf = torch.randn(72, 64, generator=gen(17)) * 0.1
    w8, s8 = packed(wf, "w8a8", 128)
    assert torch.equal(
        ag.quant_gemm(NPU, x, w8, s8, "w8a8", 128), ref("quant_gemm")(x, w8, s8, "w8a8", 128)
    )
    w4, s4 = packed(wf, "w4a16", 32)
    prep = prepared("quant_gemm", w4, s4, "w4a16", 32)
    assert prep.native["weight"].shape == (5, 64, 2)
    y = ag.quant_gemm_prepared(NPU, x, prep, s4, "w4a16", 32)
    assert y.shape == (3, 72) and y.is_contiguous()
    monkeypatch.undo()  # the unsliced call, for comparison
    same_math(y, ag.quant_gemm(NPU, x, w4, s4, "w4a16", 32))


# -- grouped_gemm ----------------------------------------------------------------------


OFFSETS = [0, 5, 5, 12, 20]  # ragged, expert 1 empty


def grouped_args(scheme, dtype, group_size=32, *, seed=20, offsets=OFFSETS, index=torch.int32):
    e, m, k, n = len(offsets) - 1, offsets[-1], 64, 24
    x = torch.randn(m, k, generator=gen(seed)).to(dtype)
    wf = torch.randn(e, n, k, generator=gen(seed + 1)) * 0.1
    off = torch.tensor(offsets, dtype=index)
    if scheme == "none":
        return (x, wf.to(dtype), off, None, "none", group_size)
    w, s = packed(wf, scheme, group_size)
    return (x, w, off, s, scheme, group_size)


@pytest.mark.parametrize("dtype", (torch.float32, *HALF))
def test_grouped_gemm_float_matches_reference(dtype):
    for index in (torch.int32, torch.int64):
        args = grouped_args("none", dtype, index=index)
        check_gemm("grouped_gemm", args, ag.grouped_gemm(NPU, *args))


@pytest.mark.parametrize("dtype", HALF)
def test_grouped_gemm_w8a8_matches_reference(dtype):
    """bf16 output takes bf16 scales (the doc's table 2), fp16 float32 ones."""
    args = grouped_args("w8a8", dtype)
    y = ag.grouped_gemm(NPU, *args)
    check_gemm("grouped_gemm", args, y)
    if dtype == FP16:  # float32 scales: the reference's arithmetic exactly
        assert torch.equal(y, ref("grouped_gemm")(*args))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("group_size", [32, 64])
def test_grouped_gemm_w4a16_matches_reference(dtype, group_size):
    args = grouped_args("w4a16", dtype, group_size)
    check_gemm("grouped_gemm", args, ag.grouped_gemm(NPU, *args))


@pytest.mark.parametrize("scheme, group_size", [("w8a8", 32), ("w4a16", 32), ("w4a16", 64)])
@pytest.mark.parametrize("dtype", HALF)
def test_grouped_gemm_prepared_equals_unprepared(scheme, group_size, dtype):
    x, w, off, s, _, _ = grouped_args(scheme, dtype, group_size, seed=30)
    prep = prepared("grouped_gemm", w, s, scheme, group_size)
    if scheme == "w4a16":  # int32 [E, K, N/8] packed along N
        assert prep.native["weight"].shape == (4, 64, 3)
    y = ag.grouped_gemm_prepared(NPU, x, prep, off, s, scheme, group_size)
    same_math(y, ag.grouped_gemm(NPU, x, w, off, s, scheme, group_size))


def test_grouped_gemm_cases_outside_the_ops_run_generic():
    """float32 activations with a quantised weight, QAT float weights, int4 K below 16:
    the generic backend's code, whose result they equal."""
    cases = [grouped_args("w8a8", torch.float32), grouped_args("w4a16", torch.float32)]
    x, wf, off, _, _, _ = grouped_args("none", BF16)
    cases.append((x, wf, off, None, "w4a16", 32))
    xs = torch.randn(20, 8, generator=gen(40)).to(BF16)
    w8k, s8k = packed(torch.randn(4, 16, 8, generator=gen(41)), "w4a16", 8)
    cases.append((xs, w8k, off, s8k, "w4a16", 8))
    for args in cases:
        assert torch.equal(ag.grouped_gemm(NPU, *args), generic_grouped_gemm(*args))
    args = grouped_args("w8a8", torch.float32)
    prep = prepared("grouped_gemm", args[1], args[3], "w8a8", 32)
    assert torch.equal(
        ag.grouped_gemm_prepared(NPU, args[0], prep, *args[2:]), generic_grouped_gemm(*args)
    )


def test_grouped_gemm_empty_rows_and_single_expert():
    x, w, off, s, scheme, gs = grouped_args("w8a8", BF16, offsets=[0, 0, 0])
    y = ag.grouped_gemm(NPU, x, w, off, s, scheme, gs)
    assert y.shape == (0, 24) and y.dtype == BF16
    args = grouped_args("none", BF16, offsets=[0, 9])
    check_gemm("grouped_gemm", args, ag.grouped_gemm(NPU, *args))


@pytest.mark.parametrize("scheme", ["none", "w8a8", "w4a16"])
def test_grouped_gemm_unchecked_offsets_zero_rows_of_no_expert(scheme):
    """GLMPORT_VALIDATE=meta leaves offsets unchecked: they are clamped to [0, M] and
    made non-decreasing (the reference's owned_rows), rows before the first and from the
    last offset belong to no expert and come back zero."""
    for offsets in ([3, 5, 4, 12, 15], [-2, 5, 30, 12, 20], [0, 5, 5, 12, 9]):
        x, w, _, s, _, gs = grouped_args(scheme, BF16, seed=50)
        off = torch.tensor(offsets, dtype=torch.int64)
        y = ag.grouped_gemm(NPU, x, w, off, s, scheme, gs)
        expected = ref("grouped_gemm")(x, w, off, s, scheme, gs)
        torch.testing.assert_close(y, expected, rtol=1.6e-2, atol=1e-2)
        owned = off.clamp(0, 20).cummax(0).values
        assert not y[: owned[0]].any() and not y[owned[-1] :].any()
