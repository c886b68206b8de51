"""torch.library conformance of every ``torch.ops.glmport.<name>`` on CPU.

``torch.library.opcheck`` (schema, autograd registration, fake tensor, AOT dispatch)
on tiny samples whose differentiable inputs (``OpSpec.differentiable``) require grad;
the fake kernels' output metadata against the real kernels', their rejection of bad
shapes; and one ``torch.compile(fullgraph=True)`` round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import glmport
from glmport.core.formats import FP8_DTYPE, quantize_tensor
from glmport.core.specs import OP_NAMES, SPECS

T, D, N, E = 3, 8, 6, 2
OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _mla_prolog(dtype: torch.dtype, quantised: bool = False) -> tuple:
    """hidden D, q_lora 6, 2 heads of nope 4, kv_lora 5, rope 4; ``quantised``: the
    three projections packed W8A8 with their scales."""
    x, w_dq, gamma_cq = (
        _rand(T, D, dtype=dtype), _rand(6, D, dtype=dtype, seed=1), _rand(6, dtype=dtype, seed=2)
    )  # fmt: skip
    w_uq, w_uk = _rand(2 * 8, 6, dtype=dtype, seed=3), _rand(2, 4, 5, dtype=dtype, seed=4)
    w_dkv, gamma_ckv = _rand(5 + 4, D, dtype=dtype, seed=5), _rand(5, dtype=dtype, seed=6)
    scales = (None, None, None)
    if quantised:
        (w_dq, s_dq), (w_uq, s_uq), (w_dkv, s_dkv) = (
            quantize_tensor(w, "int8_row", w.shape[1]) for w in (w_dq, w_uq, w_dkv)
        )
        scales = (s_dq, s_uq, s_dkv)
    return (
        x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, _rand(T, 2, seed=7),
        _rand(T, 2, seed=8), 1e-6, *scales,
    )  # fmt: skip


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@dataclass(frozen=True)
class Sample:
    id: str
    op: str
    build: Callable[[], tuple]  # arguments in schema order

    def args(self) -> tuple:
        """Fresh arguments; the op's differentiable float inputs require grad."""
        spec = SPECS[self.op]
        args = self.build()
        assert len(args) == len(spec.arg_names)
        out = []
        for name, a in zip(spec.arg_names, args, strict=True):
            if name in spec.differentiable and _is_float(a):
                a = a.detach().requires_grad_(True)
            out.append(a)
        return tuple(out)

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.glmport, self.op).default


def _is_float(a: object) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _has_fp8(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == FP8_DTYPE for a in args)


# -- samples --------------------------------------------------------------------------


def _sparse_attention(
    dtype: torch.dtype, hkv: int, dv: int, need_lse: bool = True, rope: int = 0
) -> Callable[[], tuple]:
    """``rope`` > 0: the key's last ``rope`` columns stored apart (``k_rope``)."""

    def build() -> tuple:
        k = _rand(N, hkv, D - rope, dtype=dtype, seed=2)
        v = k[..., :dv] if dv < D else _rand(N, hkv, dv, dtype=dtype, seed=3)
        k_rope = _rand(N, hkv, rope, dtype=dtype, seed=4) if rope else None
        indices = torch.tensor([[0, 1, -1], [2, 3, 4], [5, 5, -1]])
        return _rand(T, 4, D, dtype=dtype, seed=1), k, v, indices, 0.3, need_lse, k_rope

    return build


def _indexer(
    dtype: torch.dtype, topk: int | None, paged: bool = False, need_scores: bool = True
) -> Callable[[], tuple]:
    """``paged``: the keys as 3 blocks of 2 (each query's table names them in its
    own order), ranges from 0."""

    def build() -> tuple:
        q = _rand(T, 2, D, seed=1).to(dtype)
        k = _rand(N, D, seed=2).to(dtype)
        fp8 = dtype == FP8_DTYPE
        q_scale = torch.rand(T, 2, generator=torch.Generator().manual_seed(4)) + 0.5
        k_scale = torch.rand(N, generator=torch.Generator().manual_seed(5)) + 0.5
        start, table = _i32(0, 1, 2), None
        if paged:
            k, k_scale = k.view(3, 2, D), k_scale.view(3, 2)
            start = _i32(0, 0, 0)
            table = torch.tensor([[2, 0, 1], [1, 2, 0], [0, 1, 2]], dtype=torch.int32)
        head = (q, k, _rand(T, 2, seed=3), start, _i32(4, 6, 3))
        scales = (q_scale, k_scale) if fp8 else (None, None)
        if topk is None:
            return (*head, *scales)
        return (*head, topk, *scales, table, need_scores)

    return build


def _moe_gate(bias: bool, n_group: int, score_func: str, norm: bool) -> Callable[[], tuple]:
    def build() -> tuple:
        b = _rand(4, seed=2) if bias else None
        return _rand(T, 4, seed=1), b, 2, n_group, 1, 1.5, norm, score_func

    return build


def _grouped_packed(scheme: str) -> Callable[[], tuple]:
    def build() -> tuple:
        w, w_scale = glmport.ops.quantize_weight(_rand(E, 5, D, seed=1), scheme, 4)
        return _rand(6, D), w, torch.tensor([0, 2, 6]), w_scale, scheme, 4

    return build


def _quant_gemm(scheme: str, packed: bool) -> Callable[[], tuple]:
    def build() -> tuple:
        w = _rand(5, D, seed=1)
        if packed:
            w, w_scale = glmport.ops.quantize_weight(w, scheme, 4)
        else:
            w_scale = None
        return _rand(T, D), w, w_scale, scheme, 4

    return build


SCHEMES = ("w8a8", "w4a8", "w4a16", "fp8_block", "fp8_block_ue8m0")
FORMATS = ("int8_row", "int4_group", "fp8_group", "fp8_group_pow2", "fp8_block", "fp8_block_pow2")
BF16 = torch.bfloat16

SAMPLES: list[Sample] = [
    Sample("sparse_attention-fp32-gqa", "sparse_attention", _sparse_attention(torch.float32, 2, D)),
    Sample("sparse_attention-bf16-mla_v_view", "sparse_attention", _sparse_attention(BF16, 1, 6)),
    Sample(
        "sparse_attention-fp32-no_lse",
        "sparse_attention",
        _sparse_attention(torch.float32, 2, D, False),
    ),
    Sample(
        "sparse_attention-fp32-split_rope",
        "sparse_attention",
        _sparse_attention(torch.float32, 1, D - 2, rope=2),
    ),
    Sample("lightning_indexer-fp32", "lightning_indexer", _indexer(torch.float32, 2)),
    Sample(
        "lightning_indexer-fp32-paged-no_scores",
        "lightning_indexer",
        _indexer(torch.float32, 2, paged=True, need_scores=False),
    ),
    Sample("lightning_indexer-bf16", "lightning_indexer", _indexer(BF16, 2)),
    Sample("lightning_indexer-fp8", "lightning_indexer", _indexer(FP8_DTYPE, 2)),
    Sample("indexer_logits-fp32", "indexer_logits", _indexer(torch.float32, None)),
    Sample("indexer_logits-fp8", "indexer_logits", _indexer(FP8_DTYPE, None)),
    Sample("moe_gate-sigmoid-grouped", "moe_gate", _moe_gate(True, 2, "sigmoid", True)),
    Sample("moe_gate-softmax-no_bias", "moe_gate", _moe_gate(False, 1, "softmax", False)),
    Sample(
        "moe_dispatch",
        "moe_dispatch",
        lambda: (_rand(T, D), torch.tensor([[0, 1], [1, 0], [1, 1]]), E),
    ),
    Sample(
        "moe_combine",
        "moe_combine",
        lambda: (_rand(6, D), torch.tensor([0, 3, 1, 2, 4, 5]), _rand(T, 2, seed=1)),
    ),
    Sample(
        "grouped_gemm-float",
        "grouped_gemm",
        lambda: (_rand(6, D), _rand(E, 5, D, seed=1), torch.tensor([0, 2, 6]), None, "none", 128),
    ),
    Sample(
        "grouped_gemm-float-empty_expert",
        "grouped_gemm",
        lambda: (_rand(6, D), _rand(E, 5, D, seed=1), _i32(0, 6, 6), None, "none", 128),
    ),
    Sample("grouped_gemm-packed-w4a8", "grouped_gemm", _grouped_packed("w4a8")),
    Sample("grouped_gemm-packed-fp8_block", "grouped_gemm", _grouped_packed("fp8_block")),
    Sample(
        "grouped_gemm-qat-w8a8",
        "grouped_gemm",
        lambda: (_rand(6, D), _rand(E, 5, D, seed=1), torch.tensor([0, 2, 6]), None, "w8a8", 4),
    ),
    *(Sample(f"quant_gemm-packed-{s}", "quant_gemm", _quant_gemm(s, True)) for s in SCHEMES),
    *(Sample(f"quant_gemm-qat-{s}", "quant_gemm", _quant_gemm(s, False)) for s in SCHEMES),
    *(Sample(f"quantize-{f}", "quantize", lambda f=f: (_rand(T, D), f, 4)) for f in FORMATS),
    Sample("rms_norm-fp32", "rms_norm", lambda: (_rand(T, D), _rand(D, seed=1), 1e-6)),
    Sample(
        "rms_norm-bf16_x-fp32_weight",
        "rms_norm",
        lambda: (_rand(T, 2, D, dtype=BF16), _rand(D, seed=1), 1e-5),
    ),
    Sample("mla_prolog-fp32", "mla_prolog", lambda: _mla_prolog(torch.float32)),
    Sample("mla_prolog-bf16", "mla_prolog", lambda: _mla_prolog(BF16)),
    Sample("mla_prolog-w8a8", "mla_prolog", lambda: _mla_prolog(BF16, quantised=True)),
    *(
        Sample(
            f"rope-{'interleaved' if il else 'half_split'}",
            "rope",
            lambda il=il: (_rand(T, 2, D), _rand(T, D // 2, seed=1), _rand(T, D // 2, seed=2), il),
        )
        for il in (True, False)
    ),
    Sample(
        "token_logprobs",
        "token_logprobs",
        lambda: (_rand(T, D), _rand(7, D, seed=1), torch.tensor([0, 3, 6]), 0.7),
    ),
]
SAMPLE_IDS = [s.id for s in SAMPLES]


def _snapshot(args: tuple) -> list[bytes | None]:
    return [
        a.detach().contiguous().flatten().view(torch.uint8).clone().numpy().tobytes()
        if isinstance(a, torch.Tensor)
        else None
        for a in args
    ]


def test_every_op_has_an_opcheck_sample() -> None:
    assert {s.op for s in SAMPLES} == set(OP_NAMES)


def test_differentiable_samples_require_grad() -> None:
    """Each op with autograd has a sample where its differentiable inputs require grad,
    so opcheck's autograd and AOT tests exercise the backward."""
    for op in OP_NAMES:
        spec = SPECS[op]
        if not spec.differentiable:
            continue
        for sample in (s for s in SAMPLES if s.op == op):
            args = dict(zip(spec.arg_names, sample.args(), strict=True))
            assert any(args[n].requires_grad for n in spec.differentiable if _is_float(args[n])), (
                sample.id
            )


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_opcheck_passes(sample: Sample) -> None:
    torch.manual_seed(0)
    args = sample.args()
    before = _snapshot(args)
    if _has_fp8(args):
        # torch's schema test compares inputs with allclose, which float8 lacks:
        # skip it and check the "no input is mutated" part of the schema directly.
        utils = tuple(u for u in OPCHECK_UTILS if u != "test_schema")
    else:
        utils = OPCHECK_UTILS
    result = torch.library.opcheck(sample.overload, args, test_utils=utils)
    assert result == dict.fromkeys(utils, "SUCCESS")
    with torch.no_grad():
        sample.overload(*args)
    assert _snapshot(args) == before, "the op mutated an input"


def _metadata(out: object) -> list[tuple]:
    outs = out if isinstance(out, tuple) else (out,)
    return [(tuple(o.shape), o.dtype, o.device.type) for o in outs]


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_fake_kernel_matches_real_metadata(sample: Sample) -> None:
    args = sample.args()
    with torch.no_grad():
        real = _metadata(sample.overload(*args))
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fake = sample.overload(*fake_args)
    assert all(isinstance(o, torch._subclasses.FakeTensor) for o in fake)
    assert _metadata(fake) == real


def _first(op: str) -> Sample:
    return next(s for s in SAMPLES if s.op == op)


# op -> (argument to replace, bad-shape replacement built from the good argument)
BAD_SHAPES: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "sparse_attention": ("v", lambda v: v[:-1]),
    "lightning_indexer": ("weights", lambda w: torch.cat([w, w[:, :1]], 1)),
    "indexer_logits": ("k", lambda k: k[:, :-1]),
    "moe_gate": ("bias", lambda b: b[:-1]),
    "moe_dispatch": ("ids", lambda ids: ids[:-1]),
    "moe_combine": ("y_sorted", lambda y: y[:-1]),
    "grouped_gemm": ("expert_offsets", lambda o: o[:-1]),
    "quantize": ("x", lambda x: x[0]),
    "quant_gemm": ("w", lambda w: w[:, :-2]),
    "rms_norm": ("weight", lambda w: torch.cat([w, w[:1]])),
    "rope": ("cos", lambda c: c[:-1]),
    "token_logprobs": ("targets", lambda t: t[:-1]),
    "mla_prolog": ("gamma_ckv", lambda g: torch.cat([g, g[:1]])),
}


def test_every_op_has_a_bad_shape_case() -> None:
    assert set(BAD_SHAPES) == set(OP_NAMES)


@pytest.mark.parametrize("op", sorted(BAD_SHAPES))
def test_fake_kernel_rejects_bad_shape(op: str) -> None:
    arg, bad = BAD_SHAPES[op]
    sample = _first(op)
    names = SPECS[op].arg_names
    args = list(sample.args())
    i = names.index(arg)
    args[i] = bad(args[i].detach())
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(glmport.OpInputError) as info:
            sample.overload(*fake_args)
    assert (info.value.op, info.value.arg) == (op, arg)


def test_fake_kernel_skips_value_checks() -> None:
    """Fake tensors have no data: an out-of-range index is only caught on real ones."""
    q, k, v, indices, scale = _first("sparse_attention").args()[:5]
    indices = indices.clone()
    indices[0, 0] = N
    with pytest.raises(glmport.OpInputError):
        glmport.ops.sparse_attention(q, k, v, indices, scale)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (q, k, v, indices)]
        out, lse = torch.ops.glmport.sparse_attention.default(*fake, scale)
    assert out.shape == (T, 4, D) and lse.shape == (T, 4)


def test_torch_compile_fullgraph_matches_eager() -> None:
    q, k, v, indices = _sparse_attention(torch.float32, 2, D)()[:4]
    weight = _rand(D, seed=7)

    def block(q, k, v, indices, weight):
        out, lse = glmport.ops.sparse_attention(q, k, v, indices, 0.3)
        return glmport.ops.rms_norm(out * 2.0, weight, 1e-6), lse

    compiled = torch.compile(block, fullgraph=True, backend="eager")
    got = compiled(q, k, v, indices, weight)
    want = block(q, k, v, indices, weight)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
