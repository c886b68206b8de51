"""The ascend backend's MoE routing adapters (moe_gate, moe_dispatch, moe_combine) run on
the emulated torch_npu ops, against glmport's cpu reference: the gate's ids exactly and
its weights closely, dispatch bit for bit, combine within the dtype's tolerance against
the float64 reference, including GLM-5 / DeepSeek-V3.2 shapes, experts nobody picks,
T = 1, and the GLMPORT_VALIDATE=meta rules for out-of-range ids and src_row values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glmport.backends.ascend import moe
from glmport.backends.ascend.emulator import moe as emulator
from glmport.backends.cpu import float64_reference
from glmport.core.registry import REGISTRY
from glmport.core.selection import clear_cache
from glmport.core.tolerance import compare, tolerance

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

pytestmark = pytest.mark.usefixtures("one_thread")


def ref(op: str):
    return REGISTRY.kernels("cpu", False)[op]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Spy(SimpleNamespace):
    """The emulator's ops, recording each call's name and keyword arguments."""

    def __init__(self) -> None:
        super().__init__(calls=[])
        for name in (
            "npu_moe_gating_top_k",
            "npu_moe_init_routing_v2",
            "npu_moe_token_unpermute",
        ):
            setattr(self, name, self._recording(name, getattr(emulator, name)))

    def _recording(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs))
            return fn(*args, **kwargs)

        return call


@pytest.fixture
def meta_mode(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    clear_cache()
    yield
    clear_cache()


# -- moe_gate ------------------------------------------------------------------------


def gate_inputs(t, e, *, bias=True, seed=0):
    g = gen(seed)
    logits = torch.randn(t, e, generator=g) * 2
    return logits, (torch.randn(e, generator=g) * 0.1 if bias else None)


def check_gate(logits, bias, *args, npu=emulator):
    w, ids = moe.moe_gate(npu, logits, bias, *args)
    with float64_reference():
        rw, rids = ref("moe_gate")(logits.double(), None if bias is None else bias.double(), *args)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert w.shape == ids.shape == rids.shape
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w.double(), rw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_gate_matches_reference_for_every_score_and_normalisation(score_func, norm, bias):
    # sigmoid+norm and softmax+no-norm use the op's weights, the other two normOut.
    logits, b = gate_inputs(9, 32, bias=bias, seed=1)
    for n_group, topk_group in ((1, 1), (4, 2), (8, 3)):
        check_gate(logits, b, 6, n_group, topk_group, 2.5, norm, score_func)


@pytest.mark.parametrize(
    ("e", "n_group", "topk_group", "fused"),
    [
        (32, 16, 4, False),  # groups of 2: refused by the op, generic torch code
        (1024, 128, 4, False),  # 8 per group: 32-aligned * 128 = 4096 > 2048
        (32, 32, 4, True),  # groups of 1: the plain top-k
        (32, 4, 4, True),  # every group kept: the plain top-k
    ],
)
def test_gate_groupings_the_op_refuses_or_that_change_nothing(e, n_group, topk_group, fused):
    logits, b = gate_inputs(5, e, seed=2)
    for bias in (b, None):
        spy = Spy()
        check_gate(logits, bias, 4, n_group, topk_group, 1.5, True, "sigmoid", npu=spy)
        assert len(spy.calls) == int(fused)
        if fused:
            assert spy.calls[0][1]["group_count"] == 1


def test_gate_glm5_and_deepseek_v32_shapes_map_to_one_fused_call():
    for t in (1, 16):
        logits, b = gate_inputs(t, 256, seed=3 + t)
        for n_group, topk_group in ((1, 1), (8, 4)):  # GLM-5, DeepSeek-V3.2
            spy = Spy()
            check_gate(logits, b, 8, n_group, topk_group, 2.5, True, "sigmoid", npu=spy)
            (name, kwargs), *rest = spy.calls
            assert name == "npu_moe_gating_top_k" and not rest
            assert kwargs["norm_type"] == 1 and kwargs["group_select_mode"] == 1
            assert kwargs["group_count"] == n_group and kwargs["k_group"] == topk_group
            assert kwargs["routed_scaling_factor"] == 2.5 and not kwargs["out_flag"]


@pytest.mark.parametrize("bias", [True, False])
def test_gate_ties_go_to_the_lower_id_and_group(bias):
    # Experts in identical pairs: the lower id first.
    logits, _ = gate_inputs(8, 16, bias=False, seed=5)
    check_gate(logits[:, torch.arange(16) // 2], None, 5, 1, 1, 1.0, True, "sigmoid")
    # Every group's best two equal: the lower groups are kept.
    e, n_group = 32, 4
    logits, b = gate_inputs(8, e, bias=bias, seed=6)
    best = torch.arange(n_group)[:, None] * (e // n_group) + torch.arange(2)
    logits[:, best] = logits.amax(dim=1)[:, None, None] + torch.tensor([1.0, 0.5])
    if b is not None:
        b[best] = b.amax() + 0.05
    check_gate(logits, b, 6, n_group, 2, 2.5, True, "sigmoid")


def test_gate_no_tokens():
    w, ids = moe.moe_gate(emulator, torch.empty(0, 16), None, 4, 1, 1, 1.0, True, "sigmoid")
    assert w.shape == ids.shape == (0, 4) and ids.dtype == torch.int32


# -- moe_dispatch --------------------------------------------------------------------


def route(t, k, e, seed, id_dtype=torch.int32):
    g = gen(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(id_dtype)


def check_dispatch(x, ids, e):
    got = moe.moe_dispatch(emulator, x, ids, e)
    want = ref("moe_dispatch")(x, ids, e)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_is_the_reference_bit_for_bit(dtype):
    x = torch.randn(40, 24, generator=gen(10)).to(dtype)
    check_dispatch(x, route(40, 4, 16, seed=11), 16)
    # Many copies per expert (the stable order inside each) and int64 ids.
    ids = torch.randint(0, 3, (30, 6), generator=gen(13))
    check_dispatch(torch.randn(30, 8, generator=gen(12)).to(dtype), ids, 3)


def test_dispatch_experts_nobody_picks_and_one_token():
    # Only experts 3 and 9 of 12 are used: the others own empty row ranges.
    ids = torch.tensor([[3, 9], [9, 3], [3, 9]], dtype=torch.int32)
    _, offsets, _ = check_dispatch(torch.randn(3, 8, generator=gen(14)), ids, 12)
    assert offsets.tolist() == [0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 6, 6, 6]
    check_dispatch(torch.randn(1, 16, generator=gen(15)), route(1, 8, 256, seed=16), 256)


def test_dispatch_glm5_shape():
    x = torch.randn(16, 64, generator=gen(17)).to(torch.bfloat16)
    check_dispatch(x, route(16, 8, 256, seed=18), 256)


@pytest.mark.usefixtures("meta_mode")
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_dispatch_out_of_range_ids_go_after_every_expert(id_dtype):
    e = 8
    ids = route(12, 3, e, seed=19, id_dtype=id_dtype)
    ids[0, 1], ids[3, 0], ids[3, 2], ids[7, 1] = -1, e, -5, e + 100
    if id_dtype == torch.int64:
        ids[9, 0] = 1 << 40  # past int32: clamped before the op's int32 cast
    _, offsets, src_row = check_dispatch(torch.randn(12, 16, generator=gen(20)), ids, e)
    assert int(offsets[-1]) == ids.numel() - (5 if id_dtype == torch.int64 else 4)
    assert torch.equal(src_row.sort().values, torch.arange(ids.numel(), dtype=torch.int32))


@pytest.mark.parametrize(("meta", "experts", "expert_num"), [(False, 256, 256), (True, 6, 7)])
def test_dispatch_calls_init_routing_drop_less_with_the_scatter_index(
    request, meta, experts, expert_num
):
    """Checked ids take the page's fast templates (GLM-5's 256 experts, count mode, the
    scatter index); unchecked ones (GLMPORT_VALIDATE=meta) park on one extra expert."""
    if meta:
        request.getfixturevalue("meta_mode")
    spy = Spy()
    moe.moe_dispatch(spy, torch.randn(4, 8), route(4, 2, experts, seed=21), experts)
    (name, kwargs), *rest = spy.calls
    assert name == "npu_moe_init_routing_v2" and not rest
    assert kwargs["expert_num"] == expert_num
    assert kwargs["active_expert_range"] == [0, expert_num]
    assert kwargs["drop_pad_mode"] == 0 and kwargs["active_num"] == 8
    assert kwargs["row_idx_type"] == 1 and kwargs["expert_tokens_num_type"] == 1


@pytest.mark.usefixtures("meta_mode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_unchecked_path_on_valid_ids_is_the_reference(dtype):
    x = torch.randn(40, 24, generator=gen(10)).to(dtype)
    check_dispatch(x, route(40, 4, 16, seed=11), 16)


def test_dispatch_no_copies():
    x_sorted, offsets, src_row = moe.moe_dispatch(
        emulator, torch.empty(0, 16), torch.empty(0, 4, dtype=torch.int32), 6
    )
    assert x_sorted.shape == (0, 16) and src_row.shape == (0,)
    assert torch.equal(offsets, torch.zeros(7, dtype=torch.int32))


# -- moe_combine ---------------------------------------------------------------------


def check_combine(y, src_row, weights):
    out = moe.moe_combine(emulator, y, src_row, weights)
    with float64_reference():
        want = ref("moe_combine")(y.double(), src_row, weights.double())
    assert out.dtype == y.dtype and out.shape == want.shape
    cmp = compare(out, want, tolerance("moe_combine", y.dtype))
    assert cmp.ok, cmp
    return out


def combine_inputs(t, k, d, dtype, seed):
    g = gen(seed)
    y = torch.randn(t * k, d, generator=g).to(dtype)
    return y, torch.randperm(t * k, generator=g).to(torch.int32), torch.rand(t, k, generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_permutation_within_tolerance(dtype):
    check_combine(*combine_inputs(10, 4, 40, dtype, seed=30))
    y, src, w = combine_inputs(1, 8, 64, dtype, seed=31)  # T = 1
    check_combine(y, src.long(), w)


def test_combine_glm5_shape_after_dispatch():
    # The layer's order: dispatch, experts (here the identity), combine: each token gets
    # sum_j w[t, j] * x[t].
    t, k, e, d = 16, 8, 256, 128
    x = torch.randn(t, d, generator=gen(32)).to(torch.bfloat16)
    w = torch.rand(t, k, generator=gen(33)) * 2.5
    x_sorted, _, src_row = moe.moe_dispatch(emulator, x, route(t, k, e, seed=34), e)
    out = check_combine(x_sorted, src_row, w)
    want = x.double() * w.double().sum(dim=1, keepdim=True)
    assert compare(out, want, tolerance("moe_combine", torch.bfloat16)).ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_calls_unpermute_with_float32_weights_never_rounded_to_the_rows_dtype(dtype):
    """``(1 + 2**-12) * 1 + 1 * (-1) = 2**-12``: a combine that rounds the weights to
    bf16 / fp16 first (finalize_routing's rule, 0.011 to 0.048 mean |dlogp| on the tiny
    GLM-5) gives 0."""
    spy = Spy()
    y = torch.tensor([[1.0], [-1.0]] * 3, dtype=dtype)  # copy (t, 0): +1, (t, 1): -1
    src = torch.arange(6, dtype=torch.int32)
    w = torch.tensor([[1 + 2**-12, 1.0]] * 3)
    out = moe.moe_combine(spy, y, src, w)
    (name, kwargs), *rest = spy.calls
    assert name == "npu_moe_token_unpermute" and not rest and kwargs == {}
    assert torch.equal(out, torch.full((3, 1), 2**-12, dtype=dtype))


@pytest.mark.usefixtures("meta_mode")
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_meta_mode_skips_out_of_range_rows_and_adds_repeats(dtype):
    y, src, w = combine_inputs(9, 3, 24, dtype, seed=36)
    src = src.long()
    src[0] = src[1]  # slot src[1] adds two rows, slot src[0] none
    src[2], src[3], src[4] = -1, 27, 1 << 40  # skipped
    src[5] = src[6] = src[7] = src[8]  # one slot, four rows
    check_combine(y, src, w)


@pytest.mark.usefixtures("meta_mode")
def test_combine_meta_mode_on_a_permutation_matches_the_checked_path():
    y, src, w = combine_inputs(6, 4, 16, torch.bfloat16, seed=37)
    meta = moe.moe_combine(emulator, y, src, w)
    clear_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GLMPORT_VALIDATE")
        clear_cache()
        assert torch.equal(moe.moe_combine(emulator, y, src, w), meta)


def test_combine_empty():
    no_rows = torch.empty(0, dtype=torch.int32)
    assert moe.moe_combine(emulator, torch.empty(0, 8), no_rows, torch.empty(0, 2)).shape == (0, 8)
    out = moe.moe_combine(emulator, torch.empty(0, 8), no_rows, torch.empty(3, 0))  # k = 0
    assert torch.equal(out, torch.zeros(3, 8))
