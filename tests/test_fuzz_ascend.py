"""Property-based fuzzing of the ascend backend under its emulator: every valid call
reaches the user as the reference's result, never as an ``NpuContractError``.

The emulator raises :class:`NpuContractError` wherever a torch_npu op documents a
constraint (contiguous inputs, a row-major ``x``, head counts, group layouts, int4 K
and group sizes ...). A call that passes glmport's validation must never meet one: the
adapter re-lays its inputs out (a contiguous copy) or runs the generic composite
(docs/ascend.md). Each test draws valid calls of one op, mostly inside the limits the
backend declares (so the adapter runs, not the fallback the dispatcher picks): shapes
around the torch_npu ops' limits (attention Dk 576, indexer Di 128, router group
layouts the op refuses, int4 K and group sizes), every dtype the op takes, key ranges
of every pattern the indexer adapter plans for (causal runs, shared runs, lone
queries, empty and overlapping ranges), and every tensor argument in one of five
layouts: contiguous, strided and broadcast (:mod:`glmport.conformance.layouts`),
transposed, sliced. The only allowed outcome is the cpu reference's float64 result
within the op's tolerance (its conformance judge).

The counts per op, path (adapter or fallback) and outcome (:mod:`fuzz_counts`'
outcomes) are written as JSON lines to the file named by ``FUZZ_COUNTS`` when it is
set (docs/reliability.md quotes them); ``FUZZ_EXAMPLES`` sets the examples per op (60).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from fuzz_counts import BAD_REFUSAL, CORRECT, SILENT_WRONG, TRACEBACK, Counts, Outcome
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import glmport
from glmport.backends.ascend import BACKEND
from glmport.backends.ascend import gemm as ascend_gemm
from glmport.backends.ascend.emulator import NpuContractError
from glmport.conformance.calls import reference
from glmport.conformance.cases.base import Case
from glmport.conformance.judges import JUDGE_OF_OP, JUDGES, Verdict
from glmport.conformance.layouts import relayout
from glmport.core.errors import GlmportError, OpInputError
from glmport.core.formats import FLOAT_WEIGHT, SCHEMES, quantize_tensor
from glmport.core.specs import OP_NAMES, SPECS
from glmport.core.validate import Level

pytestmark = pytest.mark.usefixtures("one_thread")

HALF = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, *HALF)
INDEX = (torch.int32, torch.int64)
BOOLS = (True, False)
LAYOUTS = ("contiguous", "contiguous", "strided", "broadcast", "transposed", "sliced")
# Examples per op: the module runs in about 30 s on one core; FUZZ_EXAMPLES sets more.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
COUNTS = Counts("ascend adapters")
_write_counts = COUNTS.writer()


class Draw:
    """Hypothesis draws with short names, a seeded generator for tensor data, and a
    drawn layout per tensor argument."""

    def __init__(self, draw: Callable) -> None:
        self.draw = draw
        self.gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))

    def int(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def pick(self, choices):
        return self.draw(st.sampled_from(tuple(choices)))

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale).to(dtype)

    def randint(self, low: int, high: int, *shape: int, dtype=torch.int64):
        return torch.randint(low, high, shape, generator=self.gen, dtype=dtype)


def _lay(t: torch.Tensor, layout: str) -> torch.Tensor | None:
    """``t`` in ``layout`` (None when the layout does not apply to its shape)."""
    if layout == "contiguous":
        return t
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else None
    if layout == "sliced":
        if t.dim() == 0:
            return None
        wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    return relayout(t, layout)


def _finish(d: Draw, op: str, args: dict, dtype: torch.dtype, tied: dict | None = None):
    """``args`` in schema order, each tensor in a drawn layout where the call stays
    valid (a broadcast can break a permutation or a key range: that argument then
    stays as built). ``tied`` maps an argument to the one it is a view of (absorbed
    ``v = k[..., :512]``): it follows that one's layout."""
    spec = SPECS[op]
    args = dict(zip(spec.arg_names, spec.complete((), args), strict=True))  # defaults too
    tied = tied or {}
    for name in spec.arg_names:
        t = args[name]
        if not isinstance(t, torch.Tensor) or name in tied.values():
            continue
        laid = _lay(t, d.pick(LAYOUTS))
        if laid is None:
            continue
        trial = dict(args, **{name: laid})
        for view, base in tied.items():
            if base == name:
                trial[view] = laid[..., : args[view].shape[-1]]
        if _valid(spec, trial):
            args = trial
    return op, tuple(args[n] for n in spec.arg_names), dtype


def _valid(spec, args: dict) -> bool:
    try:
        spec.validate(tuple(args[n] for n in spec.arg_names), values=Level.FULL)
    except OpInputError:
        return False
    return True


# -- per-op builders ------------------------------------------------------------------


def build_sparse_attention(d: Draw):
    dtype = d.pick(HALF)
    t, h, n = d.int(0, 4), d.pick((1, 2, 4, 8, 16)), d.int(0, 40)
    kk = d.int(0, n + 8)
    q = d.randn(t, h, 576, dtype=dtype)
    k = d.randn(n, 1, 576, dtype=dtype)
    v_kind = d.pick(("view", "view", "equal copy", "other"))
    v = {"view": k[..., :512], "equal copy": k[..., :512].clone()}.get(v_kind)
    if v is None:
        v = d.randn(n, 1, 512, dtype=dtype)
    indices = d.randint(-1, max(n, 1), t, kk, dtype=d.pick(INDEX))
    if n == 0:
        indices = torch.full_like(indices, -1)
    scale = 576**-0.5 * d.pick((0.5, 1, 2))
    args = {"q": q, "k": k, "v": v, "indices": indices, "scale": scale, "need_lse": d.pick(BOOLS)}
    return _finish(d, "sparse_attention", args, dtype, {"v": "k"} if v_kind == "view" else None)


def _key_ranges(d: Draw, t: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranges of every pattern the adapter plans for: packed causal runs, shared runs,
    lone queries, empty and arbitrary (overlapping, unordered) ranges."""
    pattern = d.pick(("causal", "shared", "lone", "arbitrary", "empty"))
    if pattern == "causal":  # one or two sequences packed, each causal
        split = d.int(0, t)
        start = torch.tensor([0] * split + [n // 2] * (t - split), dtype=torch.int64)
        first = torch.arange(split) + max(n // 2 - split, 0) + 1
        second = torch.arange(t - split) + max(n - (t - split), n // 2) + 1
        end = torch.cat((first, second)).clamp(max=n)
        end = torch.maximum(end, start)
    elif pattern == "shared":
        a = d.int(0, n)
        start, end = torch.full((t,), a), torch.full((t,), d.int(a, n))
    elif pattern == "empty":
        start = d.randint(0, n + 1, t)
        end = start.clone()
    else:
        start = d.randint(0, n + 1, t)
        end = start + (torch.rand(t, generator=d.gen) * (n + 1 - start)).long()
        if pattern == "lone":
            end = torch.maximum(end, (start + 1).clamp(max=n))
    return start.to(torch.int32), end.to(torch.int32)


def _indexer_args(d: Draw):
    dtype = d.pick(HALF)
    t, hi, n = d.int(1, 6), d.int(1, 8), d.int(1, 64)
    start, end = _key_ranges(d, t, n)
    args = {
        "q": d.randn(t, hi, 128, dtype=dtype),
        "k": d.randn(n, 128, dtype=dtype),
        "weights": d.randn(t, hi, scale=hi**-0.5 * 128**-0.5),
        "k_start": start,
        "k_end": end,
        "topk": d.pick((1, d.int(1, n + 4), n + d.int(1, 8))),
        "q_scale": None,
        "k_scale": None,
    }
    return args, dtype


def build_lightning_indexer(d: Draw):
    args, dtype = _indexer_args(d)
    return _finish(d, "lightning_indexer", args, dtype)


def build_indexer_logits(d: Draw):
    args, dtype = _indexer_args(d)
    del args["topk"]
    return _finish(d, "indexer_logits", args, dtype)


def build_moe_gate(d: Draw):
    # Group layouts around the op's: 2 experts a group (refused: the adapter runs the
    # composite), 3 and more, ungrouped, grouping that changes nothing.
    n_group, per = d.pick(((1, 3), (1, 16), (2, 2), (4, 3), (4, 8), (8, 4), (2, 32)))
    e = n_group * per
    topk_group = d.int(1, n_group)
    bias = d.randn(e, scale=0.1) if d.pick((True, False)) else None
    args = {
        "logits": d.randn(d.int(0, 6), e, scale=2.0),
        "bias": bias,
        "top_k": d.int(1, per * topk_group),
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": d.pick((1.0, 2.5)),
        "norm_topk_prob": d.pick((True, False)),
        "score_func": d.pick(("sigmoid", "softmax")),
    }
    return _finish(d, "moe_gate", args, torch.float32)


def build_moe_dispatch(d: Draw):
    dtype = d.pick(FLOATS)
    t, k, e = d.int(0, 6), d.int(1, 4), d.int(1, 20)
    ids = torch.stack([torch.randperm(max(e, k), generator=d.gen)[:k] % e for _ in range(t + 1)])
    ids = ids[:t].to(d.pick(INDEX))
    args = {"x": d.randn(t, d.int(1, 24), dtype=dtype), "ids": ids, "num_experts": e}
    return _finish(d, "moe_dispatch", args, dtype)


def build_moe_combine(d: Draw):
    dtype = d.pick(FLOATS)
    t, k = d.int(0, 6), d.int(1, 4)
    args = {
        "y_sorted": d.randn(t * k, d.int(1, 24), dtype=dtype),
        "src_row": torch.randperm(t * k, generator=d.gen).to(d.pick(INDEX)),
        "weights": torch.rand(t, k, generator=d.gen),
    }
    return _finish(d, "moe_combine", args, dtype)


def _packed(d: Draw, w: torch.Tensor, scheme: str, group: int):
    """Float weights ``[..., N, K]`` packed for ``scheme`` by the format definitions."""
    s = SCHEMES[scheme]
    size = s.fixed_group_size or group
    flat = [quantize_tensor(e, s.weight.name, size) for e in w.reshape(-1, *w.shape[-2:])]
    wq = torch.stack([p[0] for p in flat]).reshape(*w.shape[:-1], -1)
    ws = torch.stack([p[1] for p in flat])
    return wq, ws.reshape(*w.shape[:-2], *ws.shape[1:])


def _gemm_shapes(d: Draw, scheme: str) -> tuple[int, int, int, int]:
    """(M, N, K, int4 group): int4 K and groups on both sides of what the ops take
    (groups a multiple of 32, K a multiple of 8 and at least 16)."""
    m, n = d.int(0, 12), d.int(1, 24)
    if scheme in SCHEMES and SCHEMES[scheme].weight.storage == torch.uint8:
        group = d.pick((2, 8, 16, 32, 64))
        return m, n, group * d.int(1, 4), group
    return m, n, d.pick((1, 8, 16, 40, 64, 128)), 32


def build_quant_gemm(d: Draw):
    dtype = d.pick(HALF)
    scheme = d.pick(("w8a8", "w4a16", "w8a8", "w4a16", *SCHEMES))
    m, n, k, group = _gemm_shapes(d, scheme)
    w = d.randn(n, k, scale=k**-0.5)
    qat = d.int(0, 5) == 0
    wq, ws = (w.to(dtype), None) if qat else _packed(d, w, scheme, group)
    args = {"x": d.randn(m, k, dtype=dtype), "w": wq, "w_scale": ws, "scheme": scheme}
    args["group_size"] = group
    return _finish(d, "quant_gemm", args, dtype)


def build_grouped_gemm(d: Draw):
    scheme = d.pick((FLOAT_WEIGHT, "w8a8", "w4a16", FLOAT_WEIGHT, "w8a8", "w4a16", *SCHEMES))
    dtype = d.pick(FLOATS if scheme == FLOAT_WEIGHT else HALF)
    m, n, k, group = _gemm_shapes(d, scheme)
    e = d.int(1, 4)
    cuts = d.randint(0, m + 1, e - 1).sort().values
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([m])))
    w = d.randn(e, n, k, scale=k**-0.5)
    if scheme == FLOAT_WEIGHT:
        wq, ws = w.to(dtype), None
    else:
        wq, ws = _packed(d, w, scheme, group)
    args = {
        "x": d.randn(m, k, dtype=dtype),
        "w": wq,
        "expert_offsets": offsets.to(d.pick(INDEX)),
        "w_scale": ws,
        "scheme": scheme,
        "group_size": group,
    }
    return _finish(d, "grouped_gemm", args, dtype)


def build_rms_norm(d: Draw):
    dtype = d.pick(FLOATS)
    lead = [d.int(1, 4) for _ in range(d.int(0, 2))]
    dim = d.pick((1, 8, 64, 512))
    args = {
        "x": d.randn(*lead, dim, dtype=dtype),
        "weight": (1 + d.randn(dim, scale=0.1)).to(d.pick(FLOATS)),
        "eps": 1e-6,
    }
    return _finish(d, "rms_norm", args, dtype)


def build_rope(d: Draw):
    dtype = d.pick(FLOATS)
    t, half = d.int(1, 5), d.pick((1, 8, 32, 447))
    mids = [d.int(1, 3) for _ in range(d.int(0, 2))]
    angle = d.randn(t, half, scale=3.0)
    args = {
        "x": d.randn(t, *mids, 2 * half, dtype=dtype),
        "cos": angle.cos(),
        "sin": angle.sin(),
        "interleaved": d.pick((True, False)),
    }
    return _finish(d, "rope", args, dtype)


def build_quantize(d: Draw):
    dtype = d.pick(HALF)
    fmt = d.pick(("int8_row", "int4_group", "fp8_group", "fp8_block"))
    group = 32
    args = {"x": d.randn(d.int(1, 8), group * d.int(1, 3), dtype=dtype), "fmt": fmt}
    args["group_size"] = group
    return _finish(d, "quantize", args, dtype)


def build_token_logprobs(d: Draw):
    dtype = d.pick(HALF)
    # V >= 2: with one token log(1) = 0 and the relative judge has no scale.
    t, dim, v = d.int(1, 5), d.int(1, 32), d.int(2, 60)
    args = {
        "hidden": d.randn(t, dim, dtype=dtype),
        "lm_head": d.randn(v, dim, dtype=dtype, scale=dim**-0.5),
        "targets": d.randint(0, v, t, dtype=d.pick(INDEX)),
        "temperature": d.pick((0.7, 1.0)),
    }
    return _finish(d, "token_logprobs", args, dtype)


def build_mla_prolog(d: Draw):
    """Mostly npu_mla_prolog_v3's documented widths (DeepSeek-V3.2's), a few small ones
    (the fallback)."""
    inside = d.pick((True, True, True, False))
    dtype = torch.bfloat16 if inside else d.pick(FLOATS)
    hidden, q_lora, nope, kv_lora, rope = (
        (7168, 1536, 128, 512, 64) if inside else (24, 16, 8, 12, 4)
    )
    t, heads = d.int(0, 3), d.pick((1, 2))

    def weight(*shape: int) -> torch.Tensor:
        return d.randn(*shape, dtype=dtype, scale=shape[-1] ** -0.5)

    angle = d.randn(t, rope // 2, scale=3.0)
    args = {
        "x": d.randn(t, hidden, dtype=dtype),
        "w_dq": weight(q_lora, hidden),
        "gamma_cq": (1 + d.randn(q_lora, scale=0.1)).to(dtype),
        "w_uq": weight(heads * (nope + rope), q_lora),
        "w_uk": weight(heads, nope, kv_lora),
        "w_dkv": weight(kv_lora + rope, hidden),
        "gamma_ckv": (1 + d.randn(kv_lora, scale=0.1)).to(dtype),
        "cos": angle.cos(),
        "sin": angle.sin(),
        "eps": 1e-6,
    }
    if d.pick((False, True)):  # W8A8: the page's full-quantisation scenario when inside
        for name in ("w_dq", "w_uq", "w_dkv"):
            args[name], args[name + "_scale"] = quantize_tensor(args[name], "int8_row", 1)
    return _finish(d, "mla_prolog", args, dtype)


BUILDERS = {
    "lightning_indexer": build_lightning_indexer,
    "indexer_logits": build_indexer_logits,
    "sparse_attention": build_sparse_attention,
    "moe_gate": build_moe_gate,
    "moe_dispatch": build_moe_dispatch,
    "moe_combine": build_moe_combine,
    "grouped_gemm": build_grouped_gemm,
    "quantize": build_quantize,
    "quant_gemm": build_quant_gemm,
    "rms_norm": build_rms_norm,
    "rope": build_rope,
    "token_logprobs": build_token_logprobs,
    "mla_prolog": build_mla_prolog,
}


@st.composite
def calls(draw, op: str):
    return BUILDERS[op](Draw(draw))


def _as_the_op_rounds(op: str, args: tuple) -> tuple:
    """``args`` with the weight scales rounded as docs/ascend.md says the GEMM ops take
    them, where the adapter calls the op: W4A16 scales in the activation dtype (both
    GEMMs), grouped W8A8 scales in bf16 for bf16 activations. The reference on these is
    what the op computes; on a one-column output whose groups cancel, the float32
    scales' reference can sit further off than the relative tolerance (found at 500
    examples: fp16, K 16, N 1)."""
    pos = 2 if op == "quant_gemm" else 3
    x, w_scale, scheme = args[0], args[pos], args[pos + 1]
    k = x.shape[1]
    if w_scale is None or x.dtype not in HALF:
        return args
    if scheme == "w4a16" and op == "quant_gemm":
        rounded = ascend_gemm._wqbmm_takes(k, k // w_scale.shape[-1])
    elif scheme == "w4a16":
        rounded = ascend_gemm._gmm_int4_takes(k)
    else:  # grouped W8A8: bf16 scales for bf16 output, float32 for fp16
        rounded = op == "grouped_gemm" and scheme == "w8a8" and x.dtype == torch.bfloat16
    if not rounded:
        return args
    return (*args[:pos], w_scale.to(x.dtype).float(), *args[pos + 1 :])


def _judge(op: str, dtype: torch.dtype, args: tuple, outs) -> Verdict:
    """The op's conformance judge against the float64 cpu reference on dense copies
    (GEMM scales rounded as the ops take them, :func:`_as_the_op_rounds`); empty
    outputs are judged by shape (the judges take a max over them)."""
    if op in ("quant_gemm", "grouped_gemm") and _inside_limits(op, args):
        args = _as_the_op_rounds(op, args)
    dense = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    case = Case(
        op, "fuzz", "fuzz", dtype, build=lambda g: dense, judge=JUDGE_OF_OP.get(op, "close")
    )
    refs = reference(case, dense)
    out_t = outs if isinstance(outs, tuple) else (outs,)
    ref_t = refs if isinstance(refs, tuple) else (refs,)
    if op != "lightning_indexer" and all(r.numel() == 0 for r in ref_t):
        ok = [o.shape for o in out_t] == [r.shape for r in ref_t]
        return Verdict(ok, "" if ok else f"shapes {[list(o.shape) for o in out_t]}")
    return JUDGES[case.judge](op, dtype, dense, outs, refs)


def _inside_limits(op: str, args: tuple) -> bool:
    cap = BACKEND.manifest.capabilities.get(op)
    return op in BACKEND.manifest.ops and (
        cap is None or cap.refusal(SPECS[op].features(*args)) is None
    )


def _outcome(op: str, args: tuple, dtype: torch.dtype) -> Outcome:
    """Run the valid call ``op(*args)`` on the emulated ascend backend: correct or a
    failure (an NpuContractError the adapter let out, any refusal, a wrong value)."""
    try:
        with glmport.use_backend("ascend", emulate=True):
            outs = getattr(glmport.ops, op)(*args)
    except NpuContractError as err:
        problem = f"an NpuContractError reached a valid call: {err}"
        return Outcome(TRACEBACK, "NpuContractError", problem)
    except GlmportError as err:
        error = type(err).__name__
        return Outcome(BAD_REFUSAL, error, f"a valid call raised {error}: {err}")
    verdict = _judge(op, dtype, args, outs)
    return Outcome(CORRECT) if verdict.ok else Outcome(SILENT_WRONG, problem=verdict.reason)


def test_every_op_is_fuzzed():
    assert set(BUILDERS) == set(OP_NAMES)


@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_no_npu_contract_error_reaches_a_valid_call(op: str) -> None:
    inside = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls(op))
    def prop(call) -> None:
        name, args, dtype = call
        path = "adapter" if _inside_limits(name, args) else "fallback"
        COUNTS.observe(lambda: _outcome(name, args, dtype), name, op=name, path=path)
        inside[path] += 1
        event(path)

    prop()
    if op in BACKEND.manifest.ops:  # most draws must reach the adapter
        assert inside["adapter"] >= EXAMPLES // 2, dict(inside)


def _row_sliced(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[1, ..., C]`` as a slice of wider rows: contiguous (its only row), with a
    row stride of ``C + 3``, which no 4-byte view of its bytes can take."""
    wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


@pytest.mark.parametrize("op", ["quant_gemm", "grouped_gemm"])
def test_an_int4_weight_of_one_row_sliced_from_wider_rows_runs(op):
    """Found by this module at 500 examples: a one-row int4 weight sliced from wider
    rows is contiguous, yet its row stride (11) made the adapter's int32 view raise."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen).bfloat16()
    w = torch.randn(1, 1, 16, generator=gen) * 0.25
    wq, ws = quantize_tensor(w[0], "int4_group", 16)
    wq, ws = (wq[None], ws[None]) if op == "grouped_gemm" else (wq, ws)
    wq = _row_sliced(wq)
    assert wq.is_contiguous() and wq.stride()[0] % 4
    if op == "grouped_gemm":
        args = (x, wq, torch.tensor([0, 3]), ws, "w4a16", 16)
    else:
        args = (x, wq, ws, "w4a16", 16)
    with glmport.use_backend("ascend", emulate=True):
        out = getattr(glmport.ops, op)(*args)
    assert _judge(op, torch.bfloat16, args, out).ok
