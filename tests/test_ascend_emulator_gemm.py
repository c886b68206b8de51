"""The CPU emulator of torch_npu's quantised and grouped GEMM ops
(npu_convert_weight_to_int4pack, npu_quant_matmul, npu_weight_quant_batchmatmul,
npu_grouped_matmul), on hand-built cases in the vendor's layouts ([K, N] weights, int4
eight to an int32, cumulative or count group lists), each against float64 arithmetic
written here from the documentation, and one test per documented constraint."""

from __future__ import annotations

import itertools

import pytest
import torch

from glmport.backends.ascend.emulator import gemm as eg
from glmport.backends.ascend.emulator import grouped_gemm as egg
from glmport.backends.ascend.emulator.contract import NpuContractError
from glmport.core.formats import pack_int4

BF16, FP16 = torch.bfloat16, torch.float16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int4_words(values: torch.Tensor) -> torch.Tensor:
    """int4 values ``[..., C]`` -> int32 ``[..., C/8]`` in torch_npu's order, written
    from the doc's rule (value ``8i + j`` in bits ``4j``) with Python integers."""
    flat = values.reshape(-1, values.shape[-1]).tolist()
    out = []
    for row in flat:
        words = []
        for i in range(0, len(row), 8):
            word = sum((v & 0xF) << (4 * j) for j, v in enumerate(row[i : i + 8]))
            words.append(word - 2**32 if word >= 2**31 else word)
        out.append(words)
    return torch.tensor(out, dtype=torch.int32).reshape(*values.shape[:-1], -1)


def small_ints(shape, lo, hi, seed) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen(seed))


# -- npu_convert_weight_to_int4pack --------------------------------------------------


def test_int4pack_puts_value_j_in_bits_4j():
    w = torch.tensor([[1, -1, 2, -2, 3, -3, 7, -8], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    packed = eg.npu_convert_weight_to_int4pack(w)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert packed[0, 0].item() == 0x87D3E2F1 - 2**32
    assert packed[1, 0].item() == 0x76543210


def test_int4pack_equals_glmports_int4_bytes_read_as_int32():
    """glmport's int4_group bytes (even column in the low nibble) read as little-endian
    int32 are torch_npu's packing: the adapters rely on it."""
    values = small_ints((6, 32), -8, 8, 1).to(torch.int32)
    packed = eg.npu_convert_weight_to_int4pack(values)
    assert torch.equal(packed, pack_int4(values).view(torch.int32))
    assert torch.equal(packed, int4_words(values))


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.zeros(4, 8, dtype=torch.int8), "int32"),
        (torch.zeros(2, 4, 8, dtype=torch.int32), "2-D"),
        (torch.zeros(16, 8, dtype=torch.int32).T, "contiguous"),
        (torch.zeros(4, 12, dtype=torch.int32), "multiple of 8"),
        (torch.full((4, 8), 8, dtype=torch.int32), r"\[-8, 7\]"),
        (torch.zeros(0, 8, dtype=torch.int32), "> 0"),
    ],
)
def test_int4pack_documented_constraints_raise(weight, match):
    with pytest.raises(NpuContractError, match=match):
        eg.npu_convert_weight_to_int4pack(weight)


# -- npu_quant_matmul ----------------------------------------------------------------


def qmm_expected(a, b, scale, pertoken=None):
    """float64 ``(a @ b) * scale [* pertoken]`` with explicit loops over k."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for i, j in itertools.product(range(m), range(n)):
        acc = sum(int(a[i, t]) * int(b[t, j]) for t in range(k))
        s = float(scale[j if scale.numel() > 1 else 0])
        out[i, j] = acc * s * (1.0 if pertoken is None else float(pertoken[i]))
    return out


@pytest.mark.parametrize(
    "out_dtype, scale_dtype", [(BF16, torch.float32), (BF16, BF16), (FP16, torch.float32)]
)
def test_quant_matmul_int8_pertoken_power_of_two_scales(out_dtype, scale_dtype):
    """Power-of-two scales keep every product exact: the result is the exact integer
    accumulation scaled, rounded once to the output dtype."""
    a = small_ints((3, 16), -127, 128, 2).to(torch.int8)
    b = small_ints((16, 5), -127, 128, 3).to(torch.int8)
    scale = torch.tensor([2.0**-10, 2.0**-12, 2.0**-9, 2.0**-11, 2.0**-13]).to(scale_dtype)
    pertoken = torch.tensor([0.5, 0.25, 2.0**-3])
    y = eg.npu_quant_matmul(a, b, scale, pertoken_scale=pertoken, output_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (3, 5)
    assert torch.equal(y, qmm_expected(a, b, scale.double(), pertoken).to(out_dtype))
    # x2 as the transpose of a contiguous [n, k] weight: the same product.
    yt = eg.npu_quant_matmul(
        a, b.T.contiguous().T, scale, pertoken_scale=pertoken, output_dtype=out_dtype
    )
    assert torch.equal(yt, y)


def test_quant_matmul_accumulates_exactly_in_int32():
    """An odd sum above 2**24 (not a float32 value) comes back exactly as int32."""
    k = 4096
    a = torch.full((1, k), 127, dtype=torch.int8)
    a[0, 0] = 1
    b = torch.full((k, 1), 127, dtype=torch.int8)
    y = eg.npu_quant_matmul(a, b, torch.ones(1), output_dtype=torch.int32)
    assert y.dtype == torch.int32 and y.item() == 127 * 127 * (k - 1) + 127


def test_quant_matmul_int32_bias_before_scale_and_int8_output():
    a = torch.tensor([[1, 2], [3, -4]], dtype=torch.int8)
    b = torch.tensor([[5, 6], [7, 8]], dtype=torch.int8)
    bias = torch.tensor([1, -1], dtype=torch.int32)
    scale = torch.tensor([0.5])
    y = eg.npu_quant_matmul(a, b, scale, bias=bias, output_dtype=BF16)
    assert y.tolist() == [[10.0, 10.5], [-6.0, -7.5]]  # (a @ b + bias) * 0.5
    # int8 output (output_dtype None): acc * scale + offset, round half to even
    # ([190, 220], [-130, -140]) * 0.25 + 0.5 = (48, 55.5), (-32, -34.5); saturating.
    y8 = eg.npu_quant_matmul(a, b * 10, torch.tensor([0.25]), offset=torch.tensor([0.5]))
    assert y8.dtype == torch.int8
    assert y8.tolist() == [[48, 56], [-32, -34]]
    assert eg.npu_quant_matmul(a, b * 10, torch.ones(1)).tolist() == [[127, 127], [-128, -128]]


def test_quant_matmul_int4_operands_in_int32():
    """x1 (m, k//8) and x2 (k, n//8) or (k//8, n) transposed from (n, k//8): int4 values
    eight to an int32, float16 output with a float32 scale (table 2)."""
    av = small_ints((2, 16), -8, 8, 4)
    bv = small_ints((16, 8), -8, 8, 5)
    scale = torch.tensor([2.0**-4])
    expected = qmm_expected(av, bv, scale.double()).to(FP16)
    y = eg.npu_quant_matmul(int4_words(av), int4_words(bv), scale, output_dtype=FP16)
    assert torch.equal(y, expected)
    yt = eg.npu_quant_matmul(int4_words(av), int4_words(bv.T).T, scale, output_dtype=FP16)
    assert torch.equal(yt, expected)


def i8(*shape):
    return torch.ones(*shape, dtype=torch.int8)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: eg.npu_quant_matmul(i8(2, 8), i8(8, 4).int(), torch.ones(1)), "x2 must have"),
        (lambda: eg.npu_quant_matmul(i8(2, 8).half(), i8(8, 4), torch.ones(1)), "int8 or int32"),
        (lambda: eg.npu_quant_matmul(i8(8), i8(8, 4), torch.ones(1)), "2 to 6 dims"),
        (lambda: eg.npu_quant_matmul(i8(2, 8), i8(6, 4), torch.ones(1)), "must equal x2's k"),
        (
            lambda: eg.npu_quant_matmul(i8(1, 65536), i8(65536, 1), torch.ones(1)),
            "must not exceed 65535",
        ),
        (
            lambda: eg.npu_quant_matmul(i8(1, 2), i8(2, 65536), torch.ones(1)),
            "must not exceed 65535",
        ),
        (  # int4: n = 8 * 8192 = 65536 values
            lambda: eg.npu_quant_matmul(
                torch.zeros(1, 1, dtype=torch.int32),
                torch.zeros(8, 8192, dtype=torch.int32),
                torch.ones(1),
                output_dtype=FP16,
            ),
            "must not exceed 65535",
        ),
        (lambda: eg.npu_quant_matmul(i8(2, 8), i8(8, 4), torch.ones(3)), "scale must be 1-D"),
        (
            lambda: eg.npu_quant_matmul(
                i8(2, 8), i8(8, 4), torch.ones(4), pertoken_scale=torch.ones(3), output_dtype=BF16
            ),
            "pertoken_scale must be 1-D",
        ),
        (  # fp16 output with a bf16 scale is not a table-2 row
            lambda: eg.npu_quant_matmul(
                i8(2, 8),
                i8(8, 4),
                torch.ones(4, dtype=BF16),
                pertoken_scale=torch.ones(2),
                output_dtype=FP16,
            ),
            "table 2",
        ),
        (
            lambda: eg.npu_quant_matmul(
                i8(2, 8), i8(8, 4), torch.ones(4), output_dtype=torch.float32
            ),
            "table 2",
        ),
        (
            lambda: eg.npu_quant_matmul(i8(2, 8), i8(8, 4), torch.ones(4), x1_dtype=torch.int8),
            "x1_dtype",
        ),
        (
            lambda: eg.npu_quant_matmul(
                i8(2, 8), i8(8, 4), torch.ones(4), output_dtype=BF16, group_sizes=[0, 0]
            ),
            "group_sizes",
        ),
        (
            lambda: eg.npu_quant_matmul(
                torch.zeros(2, 2, dtype=torch.int32),
                torch.zeros(16, 4, dtype=torch.int32)[:, :2],
                torch.ones(1),
                output_dtype=FP16,
            ),
            "int4 x2 must be a contiguous",
        ),
        (
            lambda: eg.npu_quant_matmul(
                i8(2, 8), i8(8, 4), torch.ones(4), bias=torch.ones(3, dtype=torch.int32)
            ),
            "bias must be",
        ),
        (
            lambda: eg.npu_quant_matmul(i8(2, 8), i8(8, 4), torch.ones(4), offset=torch.ones(2)),
            "offset must be 1-D",
        ),
    ],
)
def test_quant_matmul_documented_constraints_raise(call, match):
    with pytest.raises(NpuContractError, match=match):
        call()


# -- npu_weight_quant_batchmatmul ----------------------------------------------------


def wqbmm_case(seed=6, k=64, n=16, groups=2):
    x = small_ints((3, k), -4, 5, seed).to(FP16)
    values = small_ints((k, n), -8, 8, seed + 1)
    scale = 2.0 ** -small_ints((groups, n), 2, 6, seed + 2).double()
    return x, values, scale


def wqbmm_expected(x, values, scale, group):
    """float64 ``x @ (w * scale[k // group])``, loops over k."""
    k, n = values.shape
    w = torch.zeros(k, n, dtype=torch.float64)
    for t in range(k):
        w[t] = values[t].double() * scale[t // group]
    return x.double() @ w


def test_weight_quant_bmm_int4_per_group_both_layouts():
    x, values, scale = wqbmm_case()
    expected = wqbmm_expected(x, values, scale, 32).to(FP16)
    s = scale.to(FP16)
    y = eg.npu_weight_quant_batchmatmul(x, int4_words(values), s, antiquant_group_size=32)
    assert y.dtype == FP16 and y.shape == (3, 16)
    assert torch.equal(y, expected)
    # weight as the transpose of a contiguous (n, k // 8) int32, scale transposed too.
    wt = int4_words(values.T).T
    yt = eg.npu_weight_quant_batchmatmul(x, wt, s.T.contiguous().T, antiquant_group_size=32)
    assert torch.equal(yt, expected)


def test_weight_quant_bmm_per_channel_per_tensor_offset_bias():
    x, values, scale = wqbmm_case(groups=1)
    s = scale.to(FP16)
    expected = wqbmm_expected(x, values, scale, 64)
    w8 = values.to(torch.int8)
    for shaped in (s, s.reshape(-1)):
        assert torch.equal(eg.npu_weight_quant_batchmatmul(x, w8, shaped), expected.to(FP16))
    one = torch.tensor([0.25], dtype=FP16)
    per_tensor = x.double() @ (values.double() * 0.25)
    assert torch.equal(eg.npu_weight_quant_batchmatmul(x, w8, one), per_tensor.to(FP16))
    off = torch.full((1, 16), 2.0, dtype=FP16)
    bias = torch.arange(16, dtype=FP16)
    with_off = x.double() @ ((values.double() + 2) * scale[0]) + bias.double()
    y = eg.npu_weight_quant_batchmatmul(x, w8, s, antiquant_offset=off, bias=bias)
    assert torch.equal(y, with_off.to(FP16))


def test_weight_quant_bmm_rounds_dequantised_weight_to_x_dtype():
    """(w * scale) is an operand of the bf16 matmul: 3 * (1 + 2**-7) rounds to bf16
    (3.03125, a tie to even) before the product, not the exact 3.0234375."""
    x = torch.ones(1, 32, dtype=BF16)
    w = torch.zeros(32, 1, dtype=torch.int8)
    w[0, 0] = 3
    y = eg.npu_weight_quant_batchmatmul(x, w, torch.tensor([1 + 2**-7], dtype=BF16))
    assert y.item() == 3.03125


def test_weight_quant_bmm_quant_scale_gives_int8():
    x = torch.tensor([[1.0, 2.0]], dtype=BF16)
    w = torch.tensor([[3, -1], [1, 1]], dtype=torch.int8)
    y = eg.npu_weight_quant_batchmatmul(
        x,
        w,
        torch.ones(2, dtype=BF16),
        quant_scale=torch.tensor([0.5, 2.0]),
        quant_offset=torch.tensor([0.0, 1.0]),
    )
    assert y.dtype == torch.int8 and y.tolist() == [[2, 3]]  # round(5 * .5), 1 * 2 + 1


def w_int4(k, n):
    return torch.zeros(k, n // 8, dtype=torch.int32)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64), w_int4(64, 8), torch.ones(8)
            ),
            "float16 or bfloat16",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(1, 2, 64, dtype=FP16), w_int4(64, 8), torch.ones(8, dtype=FP16)
            ),
            "2-D",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 16, dtype=FP16), w_int4(16, 65544), torch.ones(65544, dtype=FP16)
            ),
            r"\[1, 65535\]",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 32, dtype=FP16), w_int4(64, 8), torch.ones(8, dtype=FP16)
            ),
            "must equal weight's K",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(4, 8, dtype=FP16),
                antiquant_group_size=16,
            ),
            "multiple of 32",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(1, 8, dtype=FP16),
                antiquant_group_size=64,
            ),
            "multiple of 32 in",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(3, 8, dtype=FP16),
                antiquant_group_size=32,
            ),
            r"ceil\(K / group\)",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16), w_int4(64, 8), torch.ones(2, 8, dtype=FP16)
            ),
            "set antiquant_group_size",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16), w_int4(64, 8), torch.ones(8, dtype=BF16)
            ),
            "antiquant_scale must have x's dtype",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=BF16),
                w_int4(64, 8),
                torch.ones(8, dtype=BF16),
                bias=torch.ones(8, dtype=BF16),
            ),
            "bias must be torch.float32",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(0, 64, dtype=FP16), w_int4(64, 8), torch.ones(8, dtype=FP16)
            ),
            "empty",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(8, dtype=FP16),
                inner_precise=2,
            ),
            "inner_precise",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(8, dtype=FP16),
                quant_offset=torch.ones(8),
            ),
            "needs quant_scale",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(8, dtype=FP16),
                weight_dtype=torch.int8,
            ),
            "weight_dtype",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(8, dtype=FP16),
                antiquant_offset=torch.ones(1, 8, dtype=FP16),
            ),
            "antiquant_offset must match",
        ),
        (
            lambda: eg.npu_weight_quant_batchmatmul(
                torch.ones(2, 64, dtype=FP16),
                w_int4(64, 8),
                torch.ones(8, dtype=FP16),
                quant_scale=torch.ones(8, dtype=FP16),
            ),
            "quant_scale must be float32",
        ),
    ],
)
def test_weight_quant_bmm_documented_constraints_raise(call, match):
    with pytest.raises(NpuContractError, match=match):
        call()


# -- npu_grouped_matmul --------------------------------------------------------------


def gmm(x, w, group_list, group_list_type=0, **kw):
    return egg.npu_grouped_matmul(
        [x],
        [w],
        group_list=group_list,
        split_item=2,
        group_type=0,
        group_list_type=group_list_type,
        **kw,
    )


def grouped_expected(x, weights, bounds, row_scale=None):
    """float64 per-group ``x[rows] @ weights[e]`` (``row_scale(e, rows)`` multiplies)."""
    out = torch.zeros(x.shape[0], weights[0].shape[1], dtype=torch.float64)
    for e in range(len(weights)):
        r0, r1 = bounds[e], bounds[e + 1]
        part = x[r0:r1].double() @ weights[e].double()
        out[r0:r1] = part if row_scale is None else part * row_scale(e, r0, r1)
    return out


def test_grouped_matmul_float_cumsum_and_counts_with_an_empty_group():
    x = small_ints((6, 4), -3, 4, 7).to(BF16)
    w = small_ints((3, 4, 5), -3, 4, 8).to(BF16)
    expected = grouped_expected(x, list(w), [0, 2, 2, 6]).to(BF16)
    cumsum = torch.tensor([2, 2, 6])
    counts = torch.tensor([2, 0, 4])
    (y0,) = gmm(x, w, cumsum, 0)
    (y1,) = gmm(x, w, counts, 1)
    assert y0.dtype == BF16 and y0.shape == (6, 5)
    assert torch.equal(y0, expected) and torch.equal(y1, expected)
    # the weight as a transposed view of a contiguous [E, N, K] tensor; split_item 3
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)
    (yt,) = egg.npu_grouped_matmul(
        [x], [wt], group_list=cumsum, split_item=3, group_type=0, group_list_type=0
    )
    assert torch.equal(yt, expected)
    (y32,) = gmm(x.float(), w.float(), cumsum)
    assert y32.dtype == torch.float32 and torch.equal(y32, expected.float())


@pytest.mark.parametrize("scale_dtype, out_dtype", [(BF16, BF16), (torch.float32, FP16)])
def test_grouped_matmul_pertoken_int8(scale_dtype, out_dtype):
    x = small_ints((5, 16), -127, 128, 9).to(torch.int8)
    w = small_ints((2, 16, 3), -127, 128, 10).to(torch.int8)
    scale = (2.0 ** -small_ints((2, 3), 8, 12, 11)).to(scale_dtype)
    pts = 2.0 ** -small_ints((5,), 1, 4, 12).float()
    bounds = [0, 3, 5]
    expected = grouped_expected(
        x, list(w), bounds, lambda e, r0, r1: scale[e].double() * pts[r0:r1, None].double()
    )
    (y,) = gmm(
        x,
        w,
        torch.tensor(bounds[1:]),
        scale=[scale],
        per_token_scale=[pts],
        output_dtype=out_dtype,
    )
    assert y.dtype == out_dtype and torch.equal(y, expected.to(out_dtype))


def test_grouped_matmul_int4_antiquant_per_group_and_per_channel():
    k, n = 64, 8
    x = small_ints((4, k), -4, 5, 13).to(FP16)
    values = small_ints((2, k, n), -8, 8, 14)
    scale = 2.0 ** -small_ints((2, 2, n), 2, 5, 15).double()  # 2 groups of 32 rows
    deq = [values[e].double() * scale[e].repeat_interleave(32, dim=0) for e in range(2)]
    expected = grouped_expected(x, deq, [0, 1, 4]).to(FP16)
    gl = torch.tensor([1, 4])
    (y,) = gmm(x, int4_words(values), gl, antiquant_scale=[scale.to(FP16)])
    assert torch.equal(y, expected)
    wt = int4_words(values.transpose(1, 2)).transpose(1, 2)  # [E, K/8, N] view
    (yt,) = gmm(x, wt, gl, antiquant_scale=[scale.to(FP16)])
    assert torch.equal(yt, expected)
    per_channel = scale[:, 0]
    deq1 = [values[e].double() * per_channel[e] for e in range(2)]
    (y1,) = gmm(x, int4_words(values), gl, antiquant_scale=[per_channel.to(FP16)])
    assert torch.equal(y1, grouped_expected(x, deq1, [0, 1, 4]).to(FP16))


def gx(m=4, k=8, dtype=BF16):
    return torch.ones(m, k, dtype=dtype)


def gw(e=2, k=8, n=4, dtype=BF16):
    return torch.ones(e, k, n, dtype=dtype)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: gmm(gx(), gw(), torch.tensor([1, 4], dtype=torch.int32)), "int64"),
        (lambda: gmm(gx(), gw(), torch.tensor([3, 1]), 0), "non-decreasing"),
        (lambda: gmm(gx(), gw(), torch.tensor([1, 3]), 0), "last value must equal"),
        (lambda: gmm(gx(), gw(), torch.tensor([1, 2]), 1), "must sum to"),
        (lambda: gmm(gx(), gw(e=1), torch.tensor([4]), 1), "must not have length 1"),
        (lambda: gmm(gx(), gw(), torch.tensor([4]), 0), "group_list's length"),
        (lambda: gmm(gx(), gw(), torch.tensor([-1, 4]), 1), "non-negative"),
        (lambda: gmm(gx(), gw(), torch.tensor([1, 4]), 3), "group_list_type"),
        (
            lambda: gmm(gx(k=1), gw(e=1025, k=1, n=1), torch.arange(1025).clamp(max=4)),
            "at most 1024",
        ),
        (
            lambda: egg.npu_grouped_matmul(
                [gx()], [gw()], group_list=torch.tensor([1, 4]), split_item=0, group_type=0
            ),
            "split_item 2 or 3",
        ),
        (
            lambda: egg.npu_grouped_matmul(
                [gx()], [gw()], group_list=torch.tensor([1, 4]), split_item=2, group_type=1
            ),
            "group_type",
        ),
        (lambda: gmm(gx(m=8, k=4).T, gw(k=8), torch.tensor([1, 4])), "must not be transposed"),
        (lambda: gmm(gx(m=1, k=65536), gw(e=1, k=65536, n=1), torch.tensor([1])), "inner limit"),
        (lambda: gmm(gx(m=1, k=2), gw(e=1, k=2, n=65536), torch.tensor([1])), "inner limit"),
        (
            lambda: gmm(
                gx(k=8).to(torch.int8),
                gw(k=8).to(torch.int8),
                torch.tensor([1, 4]),
                scale=[torch.ones(2, 4)],
                per_token_scale=[torch.ones(4)],
                output_dtype=BF16,
            ),
            "per-token int8",
        ),
        (
            lambda: gmm(gx(), gw(), torch.tensor([1, 4]), scale=[torch.ones(2, 4)]),
            "float GEMM takes no scale",
        ),
        (lambda: gmm(gx(), gw(dtype=FP16), torch.tensor([1, 4])), "table 2"),
        (
            lambda: gmm(
                gx(),
                gw().to(torch.int8),
                torch.tensor([1, 4]),
                antiquant_scale=[torch.ones(2, 4, dtype=FP16)],
            ),
            "antiquant_scale must have x's dtype",
        ),
        (
            lambda: gmm(
                gx(),
                gw().to(torch.int8),
                torch.tensor([1, 4]),
                antiquant_scale=[torch.ones(2, 2, 4, dtype=BF16)],
            ),
            "int8 weights are per-channel only",
        ),
        (
            lambda: gmm(
                gx(k=16),
                torch.zeros(2, 16, 1, dtype=torch.int32),
                torch.tensor([1, 4]),
                antiquant_scale=[torch.ones(2, 3, 8, dtype=BF16)],
            ),
            "must divide K",
        ),
        (
            lambda: gmm(gx(), gw(), torch.tensor([1, 4]), offset=[torch.ones(4)]),
            "offset",
        ),
        (lambda: gmm(gx(), gw(), torch.tensor([1, 4]), act_type=3), "act_type"),
        (lambda: gmm(gx(), gw(), torch.tensor([1, 4]), act_type=1), "per-token quantised mode"),
        (
            lambda: gmm(
                gx(k=8).to(torch.int8),
                gw(k=8).to(torch.int8),
                torch.tensor([1, 4]),
                scale=[torch.ones(4)],
                per_token_scale=[torch.ones(4)],
                output_dtype=FP16,
            ),
            r"scale must be \[E, N\]",
        ),
        (
            lambda: gmm(
                gx(k=8).to(torch.int8),
                gw(k=8).to(torch.int8),
                torch.tensor([1, 4]),
                scale=[torch.ones(2, 4)],
                per_token_scale=[torch.ones(3)],
                output_dtype=FP16,
            ),
            "per_token_scale must be",
        ),
        (
            lambda: gmm(gx(), gw(), torch.tensor([1, 4]), bias=[torch.ones(2, 3)]),
            r"bias must be \[E, N\]",
        ),
        (
            lambda: gmm(gx(), gw(), torch.tensor([1, 4]), bias=[torch.ones(2, 4, dtype=FP16)]),
            "bias must be torch.float32",
        ),
        (
            lambda: egg.npu_grouped_matmul(
                [], [gw()], group_list=torch.tensor([1, 4]), split_item=2, group_type=0
            ),
            "lists of 1 to 128",
        ),
        (  # transposed int4 [E, K/8, N] with 16 groups of K = 16: group length 1 is odd
            lambda: gmm(
                gx(k=16),
                torch.zeros(2, 8, 2, dtype=torch.int32).transpose(1, 2),
                torch.tensor([1, 4]),
                antiquant_scale=[torch.ones(2, 16, 8, dtype=BF16)],
            ),
            "must be even",
        ),
    ],
)
def test_grouped_matmul_documented_constraints_raise(call, match):
    with pytest.raises(NpuContractError, match=match):
        call()


def test_grouped_matmul_transposed_weight_lifts_the_n_limit():
    """The inner limit is on the weight's contiguous dim: a transposed [E, N, K] weight
    with N = 65536 is within it (K = 2 is the inner dim)."""
    w = torch.ones(1, 65536, 2, dtype=BF16).transpose(1, 2)
    (y,) = gmm(torch.ones(1, 2, dtype=BF16), w, torch.tensor([1]))
    assert y.shape == (1, 65536) and bool((y == 2).all())
