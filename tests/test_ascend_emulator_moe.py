"""The emulated torch_npu MoE routing ops against their documentation pages
(Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md,
-npu_moe_init_routing_v2.md; cann/ops-transformer moe/moe_token_unpermute/README.md):
hand-built cases in the vendor's conventions, expectations from float64 loops written
here, and one NpuContractError per documented constraint."""

from __future__ import annotations

import math

import pytest
import torch

from glmport.backends.ascend.emulator import moe as npu
from glmport.backends.ascend.emulator.contract import NpuContractError


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- npu_moe_gating_top_k -----------------------------------------------------------


def ref_gating(x, k, bias, k_group, group_count, mode, norm_type, scaling, eps=1e-20):
    """float64 loops of the page's formulas: ids best first, ties to the lower index."""
    ys, idss = [], []
    for row in x.double().tolist():
        if norm_type == 1:
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            s = [math.exp(v - m) / z for v in row]
        c = [v + (0.0 if bias is None else float(bias[i])) for i, v in enumerate(s)]
        per = len(c) // group_count
        allowed = set(range(len(c)))
        if group_count > 1:
            scores = []
            for g in range(group_count):
                vals = sorted(c[g * per : (g + 1) * per], reverse=True)
                scores.append(vals[0] if mode == 0 else vals[0] + vals[1])
            groups = sorted(range(group_count), key=lambda g: (-scores[g], g))[:k_group]
            allowed = {e for g in groups for e in range(g * per, (g + 1) * per)}
        ids = sorted(allowed, key=lambda e: (-c[e], e))[:k]
        y = [s[e] for e in ids]
        if norm_type == 1:
            total = sum(y) + eps
            y = [v / total for v in y]
        ys.append([v * scaling for v in y])
        idss.append(ids)
    return torch.tensor(ys, dtype=torch.float64), torch.tensor(idss, dtype=torch.int32)


@pytest.mark.parametrize("norm_type", [0, 1])
def test_gating_softmax_is_not_renormalised_and_sigmoid_is(norm_type):
    x = torch.tensor([[0.5, -1.0, 2.0, 0.1, 1.5, -0.3], [1.0, 1.2, -2.0, 0.0, 0.4, 3.0]])
    y, ids, norm_out = npu.npu_moe_gating_top_k(
        x, 2, norm_type=norm_type, out_flag=True, routed_scaling_factor=2.5
    )
    want_y, want_ids = ref_gating(x, 2, None, 1, 1, 0, norm_type, 2.5)
    assert ids.dtype == torch.int32 and y.dtype == torch.float32 and norm_out.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-6, atol=1e-7)
    if norm_type == 1:  # renormalised: the weights sum to the scaling factor
        torch.testing.assert_close(y.sum(dim=1), torch.full((2,), 2.5))
    else:
        assert float(y.sum(dim=1).max()) < 2.5
    want_norm = torch.sigmoid(x.double()) if norm_type else torch.softmax(x.double(), dim=1)
    torch.testing.assert_close(norm_out.double(), want_norm, rtol=1e-6, atol=1e-7)


def grouped_case() -> torch.Tensor:
    # 8 experts in 2 groups of 4. Group 0 holds the single best expert (3.0), group 1
    # the best pair (2.0, 1.9): the group max keeps group 0, the top-2 sum group 1.
    return torch.tensor([[3.0, -2.0, -2.5, -3.0, 2.0, 1.9, -1.0, -2.0]])


@pytest.mark.parametrize(("mode", "want_group"), [(0, 0), (1, 1)])
def test_gating_group_select_mode_max_vs_top2_sum(mode, want_group):
    x = grouped_case()
    y, ids, _ = npu.npu_moe_gating_top_k(
        x, 2, k_group=1, group_count=2, group_select_mode=mode, norm_type=1
    )
    assert bool(((ids // 4) == want_group).all())
    want_y, want_ids = ref_gating(x, 2, None, 1, 2, mode, 1, 1.0)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-6, atol=1e-7)


def test_gating_bias_chooses_groups_and_experts_but_not_weights():
    x = grouped_case()
    # The bias lifts experts 1 and 2 of group 0 above group 1's pair and above expert 0,
    # the best unbiased score.
    bias = torch.tensor([0.0, 1.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    y, ids, _ = npu.npu_moe_gating_top_k(
        x, 2, bias=bias, k_group=1, group_count=2, group_select_mode=1, norm_type=1
    )
    want_y, want_ids = ref_gating(x, 2, bias, 1, 2, 1, 1, 1.0)
    assert torch.equal(ids, want_ids) and ids[0].tolist() == [1, 2]
    # The weights are the UNBIASED sigmoids of the chosen experts, renormalised.
    s = torch.sigmoid(x[0, ids[0].long()].double())
    torch.testing.assert_close(y[0].double(), s / s.sum(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-6, atol=1e-7)


def test_gating_deepseek_v3_configuration_random():
    x = torch.randn(5, 256, generator=gen(1)) * 2
    bias = torch.randn(256, generator=gen(2)) * 0.1
    y, ids, _ = npu.npu_moe_gating_top_k(
        x,
        8,
        bias=bias,
        k_group=4,
        group_count=8,
        group_select_mode=1,
        norm_type=1,
        routed_scaling_factor=2.5,
    )
    want_y, want_ids = ref_gating(x, 8, bias, 4, 8, 1, 1, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-7)


def test_gating_ties_go_to_the_lower_index():
    # Experts 1 and 4 tie for first, 0 / 2 / 3 / 5 tie after them.
    x = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    _, ids, _ = npu.npu_moe_gating_top_k(x, 3, norm_type=1)
    assert ids.tolist() == [[1, 4, 0]]
    # Equal group scores: the lower group is kept.
    _, ids, _ = npu.npu_moe_gating_top_k(
        torch.zeros(1, 8), 2, k_group=1, group_count=2, group_select_mode=1, norm_type=1
    )
    assert ids.tolist() == [[0, 1]]


def test_gating_low_precision_dtypes_and_unwritten_norm_out():
    x = torch.randn(3, 16, generator=gen(3)).to(torch.bfloat16)
    bias = torch.zeros(16, dtype=torch.bfloat16)
    y, ids, norm_out = npu.npu_moe_gating_top_k(x, 4, bias=bias, norm_type=1)
    want_y, want_ids = ref_gating(x.float(), 4, None, 1, 1, 0, 1, 1.0)
    assert y.dtype == torch.bfloat16 and torch.equal(ids, want_ids)
    torch.testing.assert_close(y.double(), want_y, rtol=8e-3, atol=1e-3)
    assert norm_out.shape == (3, 16) and bool(norm_out.isnan().all())  # out_flag=False


def gating_call(**overrides):
    args = {"x": torch.randn(2, 16, generator=gen(4)), "k": 2}
    args.update(overrides)
    x, k = args.pop("x"), args.pop("k")
    return npu.npu_moe_gating_top_k(x, k, **args)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"x": torch.randn(2, 3, 8)}, "2D"),
        ({"x": torch.ones(2, 16, dtype=torch.int32)}, "float16, bfloat16 or float32"),
        ({"x": torch.randn(1, 2112)}, "<= 2048"),
        ({"bias": torch.zeros(8)}, "bias must be 1D"),
        ({"bias": torch.zeros(16, dtype=torch.float16)}, "bias dtype"),
        ({"group_count": 0}, "group_count must be > 0"),
        ({"group_count": 3}, "divisible by group_count"),
        ({"group_count": 8}, "must be > 2"),
        ({"x": torch.randn(1, 1024), "group_count": 128, "k_group": 4}, "aligned to 32"),
        ({"group_count": 2, "k_group": 3}, "k_group must be in [1, group_count=2]"),
        ({"group_count": 2, "k_group": 0}, "k_group must be in"),
        ({"k": 0}, "k must be in [1,"),
        ({"group_count": 4, "k_group": 1, "k": 5}, "x.shape[-1] / group_count * k_group = 4"),
        ({"group_select_mode": 2}, "group_select_mode must be 0 or 1"),
        ({"renorm": 1}, "renorm only supports 0"),
        ({"norm_type": 2}, "norm_type must be 0 (softmax) or 1 (sigmoid)"),
    ],
)
def test_gating_documented_constraints_raise(overrides, words):
    with pytest.raises(NpuContractError, match="npu_moe_gating_top_k") as info:
        gating_call(**overrides)
    assert words in str(info.value)


# -- npu_moe_init_routing_v2 --------------------------------------------------------

# 3 tokens, k = 2: flat copies r = t * 2 + j hold experts [2, 0, 0, 1, 2, 2].
IDS = torch.tensor([[2, 0], [0, 1], [2, 2]], dtype=torch.int32)
# Stable sort by expert: expert 0 gets copies 1, 2; expert 1 copy 3; expert 2 copies 0, 4, 5.
SORTED_ROWS = [1, 2, 3, 0, 4, 5]


def x3() -> torch.Tensor:
    return torch.arange(3 * 4, dtype=torch.float32).view(3, 4)


@pytest.mark.parametrize("row_idx_type", [0, 1])
def test_init_routing_row_idx_type_gather_vs_scatter(row_idx_type):
    x = x3()
    expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x,
        IDS,
        expert_num=3,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        row_idx_type=row_idx_type,
    )
    assert row_idx.dtype == torch.int32 and counts.dtype == torch.int64
    if row_idx_type == 1:  # "scatter": destination row i -> its flat copy
        assert row_idx.tolist() == SORTED_ROWS
    else:  # "gather": flat copy r -> its destination row
        assert row_idx.tolist() == [3, 0, 1, 2, 4, 5]
    assert torch.equal(expanded_x, x[[r // 2 for r in SORTED_ROWS]])
    assert counts.tolist() == [2, 1, 3]


@pytest.mark.parametrize(
    ("num_type", "want"),
    [(0, [2, 3, 6, 6]), (1, [2, 1, 3, 0]), (2, [[0, 2], [1, 1], [2, 3], [0, 0]])],
)
def test_init_routing_expert_tokens_cumsum_count_key_value(num_type, want):
    # 4 experts, expert 3 unused: cumsum flat, count 0, no key-value pair (zero row).
    _, _, tokens, _ = npu.npu_moe_init_routing_v2(
        x3(), IDS, expert_num=4, expert_tokens_num_type=num_type, expert_tokens_num_flag=True
    )
    assert tokens.dtype == torch.int64 and tokens.tolist() == want


def test_init_routing_active_expert_range_parks_other_experts():
    # Experts [1, 3) active: copies 1, 2 (expert 0) are not available.
    x = x3()
    expanded_x, gather, tokens, _ = npu.npu_moe_init_routing_v2(
        x, IDS, expert_num=3, active_expert_range=[1, 3], expert_tokens_num_flag=True
    )
    assert gather.tolist() == [1, -1, -1, 0, 2, 3]
    assert tokens.tolist() == [1, 4]  # cumsum over experts 1, 2
    assert torch.equal(expanded_x[:4], x[[1, 0, 2, 2]])
    assert bool(expanded_x[4:].isnan().all())  # rows past the available copies: unwritten
    _, scatter, _, _ = npu.npu_moe_init_routing_v2(
        x, IDS, expert_num=3, active_expert_range=[1, 3], row_idx_type=1
    )
    assert scatter[:4].tolist() == [3, 0, 4, 5]


def test_init_routing_active_num_and_expanded_scale():
    scale = torch.tensor([0.5, 1.5, 2.5])
    expanded_x, _, _, expanded_scale = npu.npu_moe_init_routing_v2(
        x3(), IDS, scale=scale, expert_num=3, active_num=4
    )
    assert expanded_x.shape == (4, 4)
    assert expanded_scale.tolist() == [scale[r // 2].item() for r in SORTED_ROWS[:4]]


def test_init_routing_drop_pad_capacity_drops_and_pads():
    x = x3()
    expanded_x, gather, counts, _ = npu.npu_moe_init_routing_v2(
        x, IDS, expert_num=3, expert_capacity=2, drop_pad_mode=1, expert_tokens_num_flag=True
    )
    assert expanded_x.shape == (3, 2, 4)
    assert torch.equal(expanded_x[0], x[[0, 1]])  # expert 0: copies 1, 2
    assert torch.equal(expanded_x[1], torch.stack([x[1], torch.zeros(4)]))  # padded
    assert torch.equal(expanded_x[2], x[[0, 2]])  # copies 0, 4; copy 5 dropped
    # gather index into the [E * C] slots; the dropped copy is -1.
    assert gather.tolist() == [4, 0, 1, 2, 5, -1]
    assert counts.tolist() == [2, 1, 3]  # counted before the drop


def routing_call(**overrides):
    args = {"x": x3(), "expert_idx": IDS, "expert_num": 3}
    args.update(overrides)
    x, ids = args.pop("x"), args.pop("expert_idx")
    return npu.npu_moe_init_routing_v2(x, ids, **args)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"x": torch.zeros(3, 4, 1)}, "x must be 2D"),
        ({"x": torch.zeros(3, 4, dtype=torch.int32)}, "float16, bfloat16, float32 or int8"),
        ({"expert_idx": IDS.long()}, "expert_idx must be int32"),
        ({"expert_idx": IDS[:, 0]}, "expert_idx must be 2D"),
        ({"expert_idx": IDS[:2]}, "must equal x's NUM_ROWS"),
        ({"drop_pad_mode": 2}, "drop_pad_mode must be 0 or 1"),
        ({"expert_tokens_num_type": 3}, "expert_tokens_num_type must be 0"),
        ({"row_idx_type": 2}, "row_idx_type must be 0 or 1"),
        ({"quant_mode": 5}, "not a documented mode"),
        ({"expert_num": -1}, "expert_num must be in [0, 10240]"),
        ({"expert_num": 10241}, "expert_num must be in [0, 10240]"),
        ({"expert_num": 5121, "expert_tokens_num_type": 2}, "[0, 5120]"),
        ({"active_expert_range": [0, 1, 2]}, "[expert_start, expert_end]"),
        ({"active_expert_range": [0, 4]}, "expert_end <= expert_num=3"),
        ({"active_expert_range": [-1, 2]}, "must be >= 0"),
        ({"active_num": -2}, "active_num must be >= -1"),
        ({"drop_pad_mode": 1, "expert_capacity": 0}, "expert_capacity must be > 0"),
        ({"drop_pad_mode": 1, "expert_capacity": 3}, "< NUM_ROWS=3"),
        (
            {"drop_pad_mode": 1, "expert_capacity": 1, "active_expert_range": [0, 2]},
            "[0, expert_num]",
        ),
        ({"offset": torch.zeros(1)}, "offset must be None"),
        ({"scale": torch.ones(2)}, "scale must be float32 of shape (NUM_ROWS,)"),
        ({"expert_num": 2}, "name one of the expert_num=2 experts"),
    ],
)
def test_init_routing_documented_constraints_raise(overrides, words):
    with pytest.raises(NpuContractError, match="npu_moe_init_routing_v2") as info:
        routing_call(**overrides)
    assert words in str(info.value)


def test_init_routing_quantisation_is_not_emulated():
    with pytest.raises(NotImplementedError, match="quant_mode=1"):
        routing_call(quant_mode=1)


# -- npu_moe_token_unpermute --------------------------------------------------------


def ref_unpermute(tokens, indices, probs):
    """float64 loops of the page's formula: O[i] = sum_j P[i][j] * T[S[i * topK + j]]."""
    n, k = probs.shape
    out = torch.zeros(n, tokens.shape[1], dtype=torch.float64)
    for i in range(n):
        for j in range(k):
            out[i] += float(probs[i, j]) * tokens[int(indices[i * k + j])].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpermute_gathers_each_copy_weights_and_sums_it(dtype):
    n, k, h = 4, 3, 6
    tokens = torch.randn(n * k, h, generator=gen(10)).to(dtype)
    indices = torch.randperm(n * k, generator=gen(11)).to(torch.int32)
    probs = torch.rand(n, k, generator=gen(12)).to(dtype)
    out = npu.npu_moe_token_unpermute(tokens, indices, probs)
    assert out.dtype == dtype and out.shape == (n, h)
    want = ref_unpermute(tokens, indices, probs)
    # float32 arithmetic, one rounding to the dtype at the end: within half a unit in
    # the last place of the dtype (plus float32's own rounding).
    rtol = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=1e-6)


def test_unpermute_reads_the_row_each_copy_names_not_the_copy_each_row_holds():
    # Rows [10, 20, 30, 40]; copy (token 0, j = 1) is entry 1 of S, held in row S[1].
    tokens = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
    indices = torch.tensor([3, 2, 0, 1], dtype=torch.int32)
    probs = torch.tensor([[1.0, 100.0], [0.0, 0.0]])
    out = npu.npu_moe_token_unpermute(tokens, indices, probs)
    assert out[0].item() == 40.0 + 100.0 * 30.0


def test_unpermute_without_probs_is_top_k_1():
    tokens = torch.randn(4, 8, generator=gen(20)).to(torch.bfloat16)
    indices = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    out = npu.npu_moe_token_unpermute(tokens, indices)
    assert out.dtype == torch.bfloat16 and torch.equal(out, tokens[indices.long()])


def test_unpermute_a_repeated_index_is_undefined_so_nan():
    tokens = torch.randn(4, 2, generator=gen(21))
    indices = torch.tensor([0, 0, 2, 3], dtype=torch.int32)  # row 0 twice, row 1 never
    out = npu.npu_moe_token_unpermute(tokens, indices, torch.ones(2, 2))
    assert out[0].isnan().all() and not out[1].isnan().any()


def unpermute_call(**overrides):
    n, k, h = 2, 2, 4
    args = {
        "permuted_tokens": torch.randn(n * k, h),
        "sorted_indices": torch.arange(n * k, dtype=torch.int32),
        "probs": torch.rand(n, k),
        "padded_mode": False,
        "restore_shape": None,
    }
    args.update(overrides)
    return npu.npu_moe_token_unpermute(*args.values())


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"padded_mode": True}, "padded_mode supports only False"),
        ({"restore_shape": (2, 4)}, "restore_shape supports only None"),
        ({"permuted_tokens": torch.ones(4, 4, dtype=torch.int32)}, "unsupported"),
        ({"permuted_tokens": torch.randn(1, 4, 4)}, "must be 2D"),
        ({"permuted_tokens": torch.randn(0, 4)}, "must not be empty"),
        ({"sorted_indices": torch.arange(4)}, "1D int32 with 4 entries"),
        ({"sorted_indices": torch.arange(3, dtype=torch.int32)}, "1D int32 with 4 entries"),
        ({"probs": torch.rand(2, 2, dtype=torch.float64)}, "probs dtype"),
        ({"probs": torch.rand(2, 2).to(torch.bfloat16)}, "must have permuted_tokens' dtype"),
        ({"probs": torch.rand(3, 2)}, "tokens * topK = 4"),
        ({"sorted_indices": torch.tensor([0, 1, 2, 4], dtype=torch.int32)}, "[0, 3]"),
        ({"sorted_indices": torch.tensor([0, 1, 2, -1], dtype=torch.int32)}, "[0, 3]"),
    ],
)
def test_unpermute_documented_constraints_raise(overrides, words):
    with pytest.raises(NpuContractError, match="npu_moe_token_unpermute") as info:
        unpermute_call(**overrides)
    assert words in str(info.value)
