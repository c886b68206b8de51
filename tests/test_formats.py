"""The canonical quantised formats (glmport.core.formats) against hand-derived examples
and an independent numpy definition written here (float32 scale arithmetic, explicit
e4m3 grid, round half to even)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glmport.core import formats as F

# -- an independent definition of the formats --------------------------------------

# Every non-negative finite float8_e4m3fn value, indexed by its bit pattern (0..126;
# 127 is NaN): 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent 0.
E4M3_GRID = np.array(
    [
        (c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
        for c in range(127)
    ]
)


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round float values (|v| <= 448) to the nearest e4m3 value, ties to even code."""
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(E4M3_GRID, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - E4M3_GRID[lo], E4M3_GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * np.where(pick_hi, E4M3_GRID[hi], E4M3_GRID[lo])


def decode_e4m3(q: torch.Tensor) -> np.ndarray:
    """float8_e4m3fn tensor -> float64 values, decoded from the raw bits."""
    codes = q.view(torch.uint8).numpy().astype(np.int64)
    assert not ((codes & 0x7F) == 0x7F).any(), "NaN in fp8 output"
    return np.where(codes & 0x80, -1.0, 1.0) * E4M3_GRID[codes & 0x7F]


def ceil_pow2(s: float) -> float:
    """Smallest power of two >= s (exact, via frexp: s = m * 2**e, m in [0.5, 1))."""
    m, e = math.frexp(s)
    return s if m == 0.5 else 2.0**e


def tiles(fmt: str, rows: int, cols: int, g: int):
    """(scale index, row slice, col slice) of every scale of ``fmt``."""
    gran = F.FORMATS[fmt].granularity
    if gran == "row":
        return [((r,), slice(r, r + 1), slice(0, cols)) for r in range(rows)]
    if gran == "group":
        return [
            ((r, j), slice(r, r + 1), slice(j * g, (j + 1) * g))
            for r in range(rows)
            for j in range(math.ceil(cols / g))
        ]
    return [
        ((i, j), slice(i * g, (i + 1) * g), slice(j * g, (j + 1) * g))
        for i in range(math.ceil(rows / g))
        for j in range(math.ceil(cols / g))
    ]


def ref_quantize(x: torch.Tensor, fmt: str, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent quantisation: (grid values float64 [R, C], float32 scales)."""
    xf = x.float().numpy()
    rows, cols = xf.shape
    is_fp8 = fmt.startswith("fp8")
    qmax = {"int8_row": 127, "int4_group": 7}.get(fmt, 448)
    floor = np.float32(1e-4 if is_fp8 else 1e-12)
    shape = F.FORMATS[fmt].scale_shape(rows, cols, g)
    scale = np.zeros(shape, np.float32)
    values = np.zeros((rows, cols))
    for idx, rs, cs in tiles(fmt, rows, cols, g):
        s = np.maximum(np.abs(xf[rs, cs]).max(), floor) / np.float32(qmax)
        if fmt.endswith("pow2"):
            s = np.float32(ceil_pow2(float(s)))
        scale[idx] = s
        v = xf[rs, cs] / s  # float32 division, as defined
        if is_fp8:
            values[rs, cs] = round_e4m3(np.clip(v, -448, 448))
        else:
            values[rs, cs] = np.clip(np.rint(v), -qmax, qmax)
    return values, scale


def values_of(q: torch.Tensor, fmt: str) -> np.ndarray:
    """Stored values as float64, decoded by hand (int4 nibbles, fp8 bits)."""
    if fmt == "int4_group":
        b = q.numpy().astype(np.int64)
        lo, hi = b & 0xF, b >> 4
        nib = np.stack([lo, hi], axis=-1).reshape(b.shape[0], -1)
        return np.where(nib >= 8, nib - 16, nib).astype(np.float64)
    if fmt.startswith("fp8"):
        return decode_e4m3(q)
    return q.numpy().astype(np.float64)


FMT_CASES = [
    ("int8_row", 5, 96, 128),
    ("int4_group", 4, 128, 32),
    ("int4_group", 3, 192, 64),
    ("fp8_group", 3, 300, 128),
    ("fp8_group_pow2", 3, 300, 128),
    ("fp8_block", 130, 200, 128),
    ("fp8_block_pow2", 130, 200, 128),
]


def _rand(rows, cols, seed, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if spread:  # rows of very different magnitudes
        x = x * torch.logspace(-3, 2, rows)[:, None]
    return x


# -- int4 packing --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "packed"),
    [
        ([1, -2], [0xE1]),
        ([-8, 7], [0x78]),
        ([7, -8], [0x87]),
        ([-1, 0], [0x0F]),
        ([0, -1], [0xF0]),
        ([3, 5, -3, -5], [0x53, 0xBD]),
    ],
)
def test_pack_int4_puts_even_column_in_low_nibble_twos_complement(values, packed):
    got = F.pack_int4(torch.tensor([values], dtype=torch.int8))
    assert got.dtype == torch.uint8
    assert got.tolist() == [packed]
    assert F.unpack_int4(got).tolist() == [values]


def test_unpack_int4_decodes_every_byte_as_low_then_high_signed_nibble():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None]
    expected = []
    for b in range(256):
        for nib in (b & 0xF, b >> 4):
            expected.append(nib - 16 if nib >= 8 else nib)
    got = F.unpack_int4(every)
    assert got.dtype == torch.int8
    assert got.tolist() == [expected]
    assert torch.equal(F.pack_int4(got), every)


def test_pack_unpack_int4_round_trip_keeps_leading_dims():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (2, 3, 16), generator=g, dtype=torch.int8)
    packed = F.pack_int4(q)
    assert packed.shape == (2, 3, 8)
    assert torch.equal(F.unpack_int4(packed), q)


# -- scale shapes --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "rows", "cols", "g", "scale_shape", "q_shape", "q_dtype"),
    [
        ("int8_row", 5, 300, 128, (5,), (5, 300), torch.int8),
        ("int4_group", 5, 256, 64, (5, 4), (5, 128), torch.uint8),
        ("int4_group", 2, 64, 32, (2, 2), (2, 32), torch.uint8),
        ("fp8_group", 3, 300, 128, (3, 3), (3, 300), torch.float8_e4m3fn),
        ("fp8_group_pow2", 3, 256, 128, (3, 2), (3, 256), torch.float8_e4m3fn),
        ("fp8_block", 130, 300, 128, (2, 3), (130, 300), torch.float8_e4m3fn),
        ("fp8_block_pow2", 128, 256, 128, (1, 2), (128, 256), torch.float8_e4m3fn),
        ("fp8_block", 7, 5, 128, (1, 1), (7, 5), torch.float8_e4m3fn),
    ],
)
def test_scale_and_packed_shapes_of_every_format(fmt, rows, cols, g, scale_shape, q_shape, q_dtype):
    f = F.FORMATS[fmt]
    assert f.scale_shape(rows, cols, g) == scale_shape
    assert f.packed_shape(rows, cols) == q_shape
    q, scale = F.quantize_tensor(_rand(rows, cols, 1), fmt, g)
    assert (tuple(q.shape), q.dtype) == (q_shape, q_dtype)
    assert (tuple(scale.shape), scale.dtype) == (scale_shape, torch.float32)


def test_scheme_table_pairs_weight_and_activation_formats_as_documented():
    table = {
        name: (s.weight.name, s.activation and s.activation.name, s.fixed_group_size)
        for name, s in F.SCHEMES.items()
    }
    assert table == {
        "w8a8": ("int8_row", "int8_row", None),
        "w4a8": ("int4_group", "int8_row", None),
        "w4a16": ("int4_group", None, None),
        "fp8_block": ("fp8_block", "fp8_group", 128),
        "fp8_block_ue8m0": ("fp8_block_pow2", "fp8_group_pow2", 128),
    }


# -- scales and values against the independent definition ---------------------------


@pytest.mark.parametrize(("fmt", "rows", "cols", "g"), FMT_CASES)
def test_quantize_tensor_matches_independent_definition_bitwise(fmt, rows, cols, g):
    x = _rand(rows, cols, seed=rows + cols)
    q, scale = F.quantize_tensor(x, fmt, g)
    want_values, want_scale = ref_quantize(x, fmt, g)
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(values_of(q, fmt), want_values)


def test_int8_row_scale_is_row_amax_over_127():
    x = torch.tensor([[1.0, -254.0, 3.0], [31.75, 15.875, -0.375]])
    q, scale = F.quantize_tensor(x, "int8_row", 3)
    assert scale.tolist() == [2.0, 0.25]
    assert q.tolist() == [[0, -127, 2], [127, 64, -2]]  # 0.5 -> 0, 1.5 -> 2, 63.5 -> 64


def test_int4_group_scale_is_group_amax_over_7_per_group():
    x = torch.tensor([[7.0, -3.0, 1.0, 2.0, 0.0, -14.0, 3.0, 1.0]])
    q, scale = F.quantize_tensor(x, "int4_group", 4)
    assert scale.tolist() == [[1.0, 2.0]]
    assert F.unpack_int4(q).tolist() == [[7, -3, 1, 2, 0, -7, 2, 0]]  # 1.5 -> 2, 0.5 -> 0


@pytest.mark.parametrize("fmt", ["fp8_group", "fp8_block"])
def test_fp8_scale_is_amax_over_448(fmt):
    x = torch.zeros(2, 4)
    x[0, 1], x[1, 3] = -896.0, 3.0
    _, scale = F.quantize_tensor(x, fmt, 4)
    if fmt == "fp8_group":
        assert scale.tolist() == [[2.0], [np.float32(3.0) / np.float32(448)]]
    else:
        assert scale.tolist() == [[2.0]]  # one 4 x 4 tile over both rows


@pytest.mark.parametrize(
    ("fmt", "floor"),
    [
        ("int8_row", np.float32(1e-12) / np.float32(127)),
        ("int4_group", np.float32(1e-12) / np.float32(7)),
        ("fp8_group", np.float32(1e-4) / np.float32(448)),
        ("fp8_block", np.float32(1e-4) / np.float32(448)),
        ("fp8_group_pow2", 2.0**-22),  # 1e-4 / 448 = 2.23e-7 lies in (2**-23, 2**-22]
        ("fp8_block_pow2", 2.0**-22),
    ],
)
def test_all_zero_input_gets_floored_finite_positive_scale_and_zero_values(fmt, floor):
    x = torch.zeros(2, 8)
    q, scale = F.quantize_tensor(x, fmt, 4)
    assert torch.all(scale == torch.tensor(floor, dtype=torch.float32))
    assert not values_of(q, fmt).any()


def test_fp8_amax_below_floor_uses_the_floor_scale():
    x = torch.tensor([[1e-6, -5e-7, 0.0, 2e-6]])
    q, scale = F.quantize_tensor(x, "fp8_group", 4)
    s = np.float32(1e-4) / np.float32(448)
    assert scale.item() == s
    want = round_e4m3(x.numpy() / s)
    np.testing.assert_array_equal(decode_e4m3(q), want)


def test_int_amax_below_floor_uses_the_floor_scale():
    x = torch.tensor([[1e-14, 0.0]])
    _, scale = F.quantize_tensor(x, "int8_row", 2)
    assert scale.item() == np.float32(1e-12) / np.float32(127)


# -- power-of-two (ue8m0) scales -----------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8_group_pow2", "fp8_block_pow2"])
def test_pow2_scales_round_up_to_a_power_of_two_and_keep_values_within_448(fmt):
    x = _rand(130, 256, seed=7)
    q, scale = F.quantize_tensor(x, fmt, 128)
    plain = F.quantize_tensor(x, fmt.removesuffix("_pow2"), 128)[1]
    for s, p in zip(scale.flatten().tolist(), plain.flatten().tolist(), strict=True):
        assert math.frexp(s)[0] == 0.5  # a power of two
        assert p <= s < 2 * p
        assert s == ceil_pow2(p)
    expanded = F.expand_scale(scale, F.FORMATS[fmt], 130, 256, 128)
    assert (x / expanded).abs().max() <= 448
    np.testing.assert_array_equal(decode_e4m3(q), ref_quantize(x, fmt, 128)[0])


def test_round_up_pow2_keeps_powers_and_rounds_values_just_above_them_up():
    s = torch.tensor(
        [2.0**-9, 2.0**-9 * (1 + 2**-23), 2.0**-9 * (1 - 2**-24), 3 * 2.0**-10, 1.0, 2.0**-20]
    )
    want = [2.0**-9, 2.0**-8, 2.0**-9, 2.0**-8, 1.0, 2.0**-20]
    assert F.round_up_pow2(s).tolist() == want


def test_pow2_scale_of_amax_just_above_a_power_times_448_still_bounds_values():
    # amax / 448 = 2**-9 * (1 + 2**-23): the scale must round UP to 2**-8.
    amax = np.nextafter(np.float32(448 * 2.0**-9), np.float32(1))
    assert np.float32(amax) / np.float32(448) > np.float32(2.0**-9)
    x = torch.zeros(1, 128)
    x[0, 5] = float(amax)
    q, scale = F.quantize_tensor(x, "fp8_group_pow2", 128)
    assert scale.item() == 2.0**-8
    assert (x / scale).abs().max() <= 448
    assert decode_e4m3(q)[0, 5] == 224.0  # 224.00002 on the e4m3 grid


# -- rounding ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "row", "want"),
    [
        # scale 1 (amax == qmax): halves round to the even integer
        ("int8_row", [127, 0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 126.5], [127, 0, 2, 2, 0, -2, -4, 126]),
        ("int4_group", [7, 0.5, 1.5, 2.5, -1.5, -2.5, 3.5, -6.5], [7, 0, 2, 2, -2, -2, 4, -6]),
        # e4m3 spacing is 1 on [8, 16): 8.5 -> 8 (mantissa 000), 9.5 -> 10 (010)
        (
            "fp8_group",
            [448, 8.5, 9.5, 10.5, 11.5, -9.5, 0.5, -15.5],
            [448, 8, 10, 10, 12, -10, 0.5, -16],
        ),
    ],
)
def test_quantisation_rounds_half_to_even(fmt, row, want):
    x = torch.tensor([row])
    q, scale = F.quantize_tensor(x, fmt, len(row))
    assert scale.flatten().tolist() == [1.0]
    assert values_of(q, fmt).tolist() == [want]


# -- ragged fp8 groups and blocks ----------------------------------------------------


def test_fp8_group_last_short_group_is_scaled_by_its_own_columns():
    x = torch.full((2, 300), 0.01)
    x[0, 299] = -44.8  # only in the last group (columns 256..299)
    x[1, 255] = 4.48  # only in the second group
    q, scale = F.quantize_tensor(x, "fp8_group", 128)
    f = np.float32
    assert scale.shape == (2, 3)
    small = f(0.01) / f(448)
    assert scale[0].tolist() == [small, small, f(44.8) / f(448)]
    assert scale[1].tolist() == [small, f(4.48) / f(448), small]
    assert decode_e4m3(q)[0, 299] == -448.0


def test_fp8_block_ragged_edge_tile_covers_only_the_remaining_rows_and_cols():
    x = torch.full((130, 200), 0.5)
    x[129, 199] = 896.0  # tile (1, 1): rows 128..129, cols 128..199
    x[3, 150] = 44.8  # tile (0, 1)
    _, scale = F.quantize_tensor(x, "fp8_block", 128)
    f = np.float32
    assert scale.tolist() == [[f(0.5) / f(448), f(44.8) / f(448)], [f(0.5) / f(448), 2.0]]


# -- dequantisation ------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "rows", "cols", "g"), FMT_CASES)
def test_dequantize_is_values_times_expanded_scale(fmt, rows, cols, g):
    x = _rand(rows, cols, seed=3)
    q, scale = F.quantize_tensor(x, fmt, g)
    got = F.dequantize(q, scale, fmt, g, dtype=torch.float64).numpy()
    want = np.zeros((rows, cols))
    vals = values_of(q, fmt)
    for idx, rs, cs in tiles(fmt, rows, cols, g):
        want[rs, cs] = vals[rs, cs] * float(scale.numpy()[idx])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("fmt", "rows", "cols", "g"), FMT_CASES)
def test_dequantize_round_trip_error_is_within_half_a_grid_step(fmt, rows, cols, g):
    x = _rand(rows, cols, seed=11)
    q, scale = F.quantize_tensor(x, fmt, g)
    err = (F.dequantize(q, scale, fmt, g, dtype=torch.float64) - x.double()).abs().numpy()
    xf = x.double().numpy()
    bound = np.zeros((rows, cols))
    for idx, rs, cs in tiles(fmt, rows, cols, g):
        s = float(scale.numpy()[idx])
        if fmt.startswith("fp8"):
            # 3 mantissa bits: half a step is <= |v| / 16; subnormal step is 2**-9
            bound[rs, cs] = s * np.maximum(np.abs(xf[rs, cs]) / s / 16, 2.0**-10)
        else:
            bound[rs, cs] = s / 2
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)
    # and the grid is used: the largest magnitude of every scale group maps to +-qmax
    qmax = {"int8_row": 127, "int4_group": 7}.get(fmt, 448)
    vals = np.abs(values_of(q, fmt))
    for idx, rs, cs in tiles(fmt, rows, cols, g):
        if fmt.endswith("pow2"):
            assert 224 <= vals[rs, cs].max() <= 448, idx
        else:
            assert vals[rs, cs].max() == qmax, idx


def test_fake_quant_is_dequantized_quantize_in_float32():
    x = _rand(4, 256, seed=5)
    got = F.fake_quant(x, "int4_group", 64)
    vals, scale = ref_quantize(x, "int4_group", 64)
    want = (vals.astype(np.float32) * np.repeat(scale, 64, axis=1)).astype(np.float32)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
