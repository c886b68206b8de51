"""Property-based fuzzing of every op on every backend: cpu, generic, cuda (its Triton
kernels under the interpreter), ascend (its adapters against the torch_npu emulator),
onnxruntime and tvm (each op exported alone and run by the runtime). Every backend
sees the same classes; the slow ones fewer examples of each (:data:`EXAMPLES`).

Each test draws calls of one op from one *class* of input: ``ok`` (ordinary valid
calls: random small shapes, every float dtype, fp8 where the op takes it, contiguous,
transposed, strided or sliced layouts), ``edge:*`` (valid but extreme: 0-size dims,
T / K / N / M = 1, topk > N, -1 indices, values around 1e30 or 1e-30, values at the
dtype's largest magnitude (``edge:near_max``: 3e38 in float32, where float32
intermediates overflow), an indexer score beyond float32, softmax scales up to 1.7e38,
temperatures 1e-6 to 1e6 with the most likely token as target) or ``bad:*`` (one
argument broken: wrong dtype, shape or device, an out-of-range index, NaN where it
matters, a 0-d tensor where an int or float goes).

The only allowed outcomes:

* ``ok`` and ``edge:*``: the result the cpu reference computes in float64, within
  :mod:`glmport.core.tolerance` for the input dtype (integer and index outputs through
  the op's judge in :mod:`glmport.conformance.judges`; no NaN or inf where the
  reference is finite; a log-probability above 0 or an entropy below 0 never).
  ``edge:*`` calls may instead raise a typed glmport error naming the op (a
  documented refusal: an OpInputError for a result float32 cannot hold, an
  UnsupportedError for a call the backend declares it cannot take); ``ok`` may not.
* ``bad:*``: an :class:`~glmport.core.errors.OpInputError` naming the op and the
  broken argument.

Anything else fails: another exception type, a silently accepted bad input, wrong
values. The counts per op, backend, class and outcome (:mod:`fuzz_counts`' outcomes)
are written as JSON lines to the file named by ``FUZZ_COUNTS`` when it is set
(docs/reliability.md quotes them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from fuzz_counts import (
    ACCEPTED_INVALID,
    BAD_REFUSAL,
    CORRECT,
    REFUSED,
    SILENT_WRONG,
    SURFACES,
    Counts,
    Outcome,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import glmport
from glmport.conformance.judges import JUDGE_OF_OP, JUDGES, Verdict
from glmport.conformance.paging import logits_args
from glmport.core.errors import GlmportError, OpInputError
from glmport.core.formats import FLOAT_WEIGHT, FORMATS, FP8_DTYPE, SCHEMES, quantize_tensor
from glmport.core.registry import REGISTRY
from glmport.core.specs import OP_NAMES, SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = SURFACES["ops"].values  # generic, cpu, cuda, ascend, onnxruntime, tvm
EMULATED = ("cuda", "ascend")  # the Triton interpreter, the torch_npu emulator
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INDEX = (torch.int32, torch.int64)
BOOLS = (True, False)
LAYOUTS = ("contiguous", "transposed", "strided", "sliced")
# Examples per (op, class) on each backend: (ok, each edge class, each bad class).
# Bad calls stop in the shared checks, before any kernel: cheap everywhere. The slow
# backends run fewer valid calls: the Triton interpreter (Python per kernel op), and
# onnxruntime / tvm, which export (tvm: compile) a graph per call signature, scalars
# included. Sized so that the module stays within about 3 minutes on two cores.
EXAMPLES = {
    "generic": (40, 8, 8),
    "cpu": (40, 8, 8),
    "ascend": (10, 3, 3),
    "cuda": (6, 2, 3),
    "onnxruntime": (6, 2, 3),
    "tvm": (2, 1, 2),
}
# Extreme but representable magnitudes per dtype: outputs stay inside the dtype's
# range (fp16 tops out at 65504), so the float64 reference is a fair judge.
HUGE = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 1e3, FP8_DTYPE: 1e2}
TINY = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 1e-3, FP8_DTYPE: 1e-2}
# Values near the largest finite magnitude (3e38 in float32; beyond 2 sigma clipped to
# it): valid inputs whose float32 intermediates overflow. Allowed: the correct result,
# or an OpInputError saying what would overflow.
NEAR_MAX = {dt: torch.finfo(dt).max / 2 for dt in (*FLOATS, FP8_DTYPE)}

COUNTS = Counts("ops")
_write_counts = COUNTS.writer()


@dataclass
class Call:
    """One op call: ``args`` in schema order; ``dtype`` picks the tolerance; ``bad``
    names the argument(s) a ``bad:*`` call breaks (any of them may be blamed)."""

    op: str
    label: str
    args: tuple
    dtype: torch.dtype
    bad: tuple[str, ...] = ()

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return f"Call({self.op}, {self.label}, args={_show(self.args)})"


def _show(args: tuple) -> str:
    def one(a: object) -> str:
        if isinstance(a, torch.Tensor):
            if a.numel() <= 12 and not a.is_meta:
                return f"tensor({a.tolist()}, {a.dtype}, stride={a.stride()})"
            return f"<{a.dtype} {list(a.shape)} stride={a.stride()} on {a.device}>"
        return repr(a)

    return "(" + ", ".join(one(a) for a in args) + ")"


# -- building blocks -----------------------------------------------------------------


class Draw:
    """Hypothesis draws with short names, plus a seeded generator for tensor data."""

    def __init__(self, draw: Callable, label: str) -> None:
        self.draw, self.label = draw, label
        self.gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        self.layout = draw(st.sampled_from(LAYOUTS))

    def int(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def pick(self, choices):
        return self.draw(st.sampled_from(tuple(choices)))

    def float(self, low: float, high: float) -> float:
        return self.draw(st.floats(low, high))

    def is_(self, label: str) -> bool:
        return self.label == label

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
        """Normal values times ``scale``, clipped to ``dtype``'s finite range (so that
        ``edge:near_max`` calls hold values at the largest finite magnitude)."""
        x = torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale
        top = torch.finfo(dtype).max
        return self.lay(x.clamp(-top, top).to(dtype))

    def small_ints(self, *shape: int, dtype: torch.dtype = torch.float32):
        """Integer values in [-3, 3]: exact in every dtype and in any dot product, so
        ties and orders are the same in float32 and float64."""
        x = torch.randint(-3, 4, shape, generator=self.gen).to(dtype)
        return self.lay(x)

    def randint(self, low: int, high: int, *shape: int, dtype: torch.dtype = torch.int64):
        return self.lay(torch.randint(low, high, shape, generator=self.gen, dtype=dtype))

    def lay(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s values in the drawn memory layout (same values, other strides)."""
        if self.layout == "transposed" and x.dim() >= 2:
            return x.transpose(-1, -2).contiguous().transpose(-1, -2)
        if self.layout == "strided" and x.dim() >= 1:
            y = torch.zeros((2 * x.shape[0], *x.shape[1:]), dtype=x.dtype)
            y[::2] = x
            return y[::2]
        if self.layout == "sliced" and x.dim() >= 1:
            y = torch.zeros((*x.shape[:-1], x.shape[-1] + 3), dtype=x.dtype)
            y[..., : x.shape[-1]] = x
            return y[..., : x.shape[-1]]
        return x


def _with_first(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()  # keeps the layout; index the first element (reshape may copy)
    t[(0,) * t.dim()] = value
    return t


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


# A bad class: (argument, how to break it: (args dict, Draw) -> new value, other
# arguments that may be blamed instead).
Bad = tuple[str, Callable[[dict, Draw], object], tuple[str, ...]]


def _finish(op: str, d: Draw, args: dict, dtype: torch.dtype, bads: dict[str, Bad]) -> Call:
    bad: tuple[str, ...] = ()
    if d.label.startswith("bad:"):
        arg, mutate, also = bads[d.label]
        args[arg] = mutate(args, d)
        bad = (arg, *also)
    ordered = SPECS[op].complete((), args)  # arguments no builder draws: their defaults
    return Call(op, d.label, ordered, dtype, bad)


# -- per-op builders ------------------------------------------------------------------
# Each returns the classes it draws from (EDGES, BADS) and a builder (Draw) -> Call.


def _scale_of(d: Draw, dtype: torch.dtype) -> float:
    scales = {"edge:huge": HUGE[dtype], "edge:tiny": TINY[dtype], "edge:near_max": NEAR_MAX[dtype]}
    return scales.get(d.label, 1.0)


RMS_EDGES = (
    "edge:empty",
    "edge:D=0",
    "edge:D=1",
    "edge:huge",
    "edge:tiny",
    "edge:eps_extreme",
    "edge:near_max",
)
RMS_BADS: dict[str, Bad] = {
    "bad:weight_shape": ("weight", lambda a, d: torch.ones(a["x"].shape[-1] + 1), ()),
    "bad:x_int": ("x", lambda a, d: torch.ones(a["x"].shape, dtype=torch.int32), ()),
    "bad:x_0d": ("x", lambda a, d: torch.tensor(1.0), ("weight",)),
    "bad:eps_zero": ("eps", lambda a, d: 0.0, ()),
    "bad:eps_nan": ("eps", lambda a, d: math.nan, ()),
    "bad:eps_0d": ("eps", lambda a, d: torch.tensor(1e-6), ()),
    "bad:weight_meta": ("weight", lambda a, d: _meta(a["weight"]), ()),
}


def build_rms_norm(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    lead = [d.int(1, 4) for _ in range(d.int(0, 2))]
    if d.is_("edge:empty"):
        lead = [0, *lead]
    dim = 0 if d.is_("edge:D=0") else 1 if d.is_("edge:D=1") else d.int(1, 24)
    x = d.randn(*lead, dim, dtype=dtype, scale=_scale_of(d, dtype))
    weight = d.randn(dim, dtype=d.pick(FLOATS))
    eps = d.pick((1e-30, 1e4)) if d.is_("edge:eps_extreme") else d.pick((1e-6, 1e-5))
    return _finish("rms_norm", d, {"x": x, "weight": weight, "eps": eps}, dtype, RMS_BADS)


ROPE_EDGES = (
    "edge:T=0",
    "edge:D=2",
    "edge:huge",
    "edge:tiny",
    "edge:free_cos_sin",
    "edge:near_max",
)
ROPE_BADS: dict[str, Bad] = {
    "bad:odd_D": ("x", lambda a, d: torch.ones((*a["x"].shape[:-1], 3)), ("cos", "sin")),
    "bad:cos_shape": ("cos", lambda a, d: torch.ones(a["cos"].shape[0], a["cos"].shape[1] + 1), ()),
    "bad:cos_bf16": ("cos", lambda a, d: a["cos"].bfloat16(), ()),
    "bad:interleaved_int": ("interleaved", lambda a, d: 1, ()),
    "bad:interleaved_0d": ("interleaved", lambda a, d: torch.tensor(True), ()),
    "bad:x_1d": ("x", lambda a, d: torch.ones(4), ()),
    "bad:x_int": ("x", lambda a, d: a["x"].to(torch.int32), ()),
    "bad:cos_meta": ("cos", lambda a, d: _meta(a["cos"]), ()),
}


def build_rope(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    t = 0 if d.is_("edge:T=0") else d.int(1, 5)
    mids = [d.int(1, 3) for _ in range(d.int(0, 2))]
    half = 1 if d.is_("edge:D=2") else d.int(1, 8)
    x = d.randn(t, *mids, 2 * half, dtype=dtype, scale=_scale_of(d, dtype))
    angle = d.randn(t, half, scale=3.0)
    cos, sin = angle.cos(), angle.sin()
    if d.is_("edge:free_cos_sin"):  # the op rotates by whatever it is given
        cos, sin = d.randn(t, half, scale=10.0), d.randn(t, half, scale=10.0)
    args = {"x": x, "cos": cos, "sin": sin, "interleaved": d.pick((True, False))}
    return _finish("rope", d, args, dtype, ROPE_BADS)


MLA_EDGES = ("edge:T=0", "edge:tiny")
MLA_BADS: dict[str, Bad] = {
    "bad:w_uq_rows": ("w_uq", lambda a, d: a["w_uq"][:-1], ()),
    "bad:x_int": ("x", lambda a, d: a["x"].to(torch.int32), ()),
    "bad:cos_bf16": ("cos", lambda a, d: a["cos"].bfloat16(), ()),
    "bad:w_uk_meta": ("w_uk", lambda a, d: _meta(a["w_uk"]), ()),
}


def build_mla_prolog(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    t = 0 if d.is_("edge:T=0") else d.int(1, 4)
    hidden, q_lora, heads = d.int(1, 24), d.int(1, 16), d.int(1, 3)
    nope, kv_lora, rope = d.int(1, 8), d.int(1, 12), 2 * d.int(1, 4)

    def weight(*shape: int) -> torch.Tensor:
        return d.randn(*shape, dtype=dtype, scale=shape[-1] ** -0.5)

    angle = d.randn(t, rope // 2, scale=3.0)
    args = {
        "x": d.randn(t, hidden, dtype=dtype, scale=_scale_of(d, dtype)),
        "w_dq": weight(q_lora, hidden),
        "gamma_cq": d.randn(q_lora, dtype=dtype),
        "w_uq": weight(heads * (nope + rope), q_lora),
        "w_uk": weight(heads, nope, kv_lora),
        "w_dkv": weight(kv_lora + rope, hidden),
        "gamma_ckv": d.randn(kv_lora, dtype=dtype),
        "cos": angle.cos(),
        "sin": angle.sin(),
        "eps": d.pick((1e-6, 1e-5)),
    }
    # W8A8 drawn in float32, where any slip of the integer path shows (the conformance
    # cases judge it in every float dtype).
    if dtype == torch.float32 and d.pick((False, True)):
        for name in ("w_dq", "w_uq", "w_dkv"):
            args[name], args[name + "_scale"] = quantize_tensor(args[name], "int8_row", 1)
    return _finish("mla_prolog", d, args, dtype, MLA_BADS)


LOGP_EDGES = (
    "edge:T=0", "edge:V=1", "edge:temp_tiny", "edge:temp_huge", "edge:huge_logits",
    "edge:temperatures", "edge:near_max",
)  # fmt: skip
# Temperatures 1e-6 .. 1e6 on ordinary logits; half of the targets are the most likely
# token, whose log-probability is about 0 (a rounding error shows as logp > 0).
TEMPERATURES = (1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4, 1e6)
LOGP_BADS: dict[str, Bad] = {
    "bad:target_V": ("targets", lambda a, d: a["targets"] * 0 + a["lm_head"].shape[0], ()),
    "bad:target_neg": ("targets", lambda a, d: torch.full_like(a["targets"], -1), ()),
    "bad:temp_zero": ("temperature", lambda a, d: 0.0, ()),
    "bad:temp_neg": ("temperature", lambda a, d: -1.0, ()),
    "bad:temp_nan": ("temperature", lambda a, d: math.nan, ()),
    "bad:temp_inf": ("temperature", lambda a, d: math.inf, ()),
    "bad:temp_0d": ("temperature", lambda a, d: torch.tensor(0.7), ()),
    "bad:targets_float": ("targets", lambda a, d: a["targets"].float(), ()),
    "bad:lm_head_dtype": ("lm_head", lambda a, d: a["lm_head"].to(
        torch.float16 if a["hidden"].dtype != torch.float16 else torch.float32), ()),
    "bad:lm_head_D": ("lm_head", lambda a, d: torch.ones(3, a["hidden"].shape[1] + 1,
                                                        dtype=a["hidden"].dtype), ()),
    "bad:targets_meta": ("targets", lambda a, d: _meta(a["targets"]), ()),
}  # fmt: skip


def build_token_logprobs(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    t = 0 if d.is_("edge:T=0") else d.int(1, 5)
    dim, v = d.int(1, 16), 1 if d.is_("edge:V=1") else d.int(1, 40)
    if d.is_("edge:temperatures"):  # widths at which a GEMM and a dot product round apart
        dim, v = d.int(24, 64), d.int(100, 500)
    temperature = d.float(0.3, 3.0)
    if d.is_("edge:temp_tiny"):
        # Integer-valued logits (exact in any precision): with a temperature near 0
        # the distribution is one-hot (or split between exact ties).
        hidden, lm_head = d.small_ints(t, dim, dtype=dtype), d.small_ints(v, dim, dtype=dtype)
        temperature = d.pick((1e-3, 1e-8, 1e-20, 1e-30))
    else:
        big = HUGE[dtype] ** 0.5 if d.is_("edge:huge_logits") else _scale_of(d, dtype)
        hidden = d.randn(t, dim, dtype=dtype, scale=big)
        lm_head = d.randn(v, dim, dtype=dtype, scale=dim**-0.5)
        if d.is_("edge:temp_huge"):
            temperature = d.pick((1e10, 1e30))
        elif d.is_("edge:temperatures"):
            temperature = d.pick(TEMPERATURES)
    targets = d.randint(0, v, t, dtype=d.pick(INDEX))
    if d.is_("edge:temperatures") and t:
        best = (hidden.double() @ lm_head.double().T).argmax(dim=1)
        targets = d.lay(torch.where(torch.arange(t) % 2 == 0, best, targets).to(targets.dtype))
    args = {"hidden": hidden, "lm_head": lm_head, "targets": targets, "temperature": temperature}
    return _finish("token_logprobs", d, args, dtype, LOGP_BADS)


ATTN_EDGES = (
    "edge:T=0", "edge:N=0", "edge:K=0", "edge:all_masked", "edge:topk>N", "edge:T=1",
    "edge:huge_scale", "edge:tiny_scale", "edge:huge_values", "edge:absorbed",
    "edge:near_max", "edge:v_near_max", "edge:scale_near_max",
)  # fmt: skip
ATTN_BADS: dict[str, Bad] = {
    "bad:index_N": ("indices", lambda a, d: torch.full_like(a["indices"], a["k"].shape[0]), ()),
    "bad:index_-2": ("indices", lambda a, d: torch.full_like(a["indices"], -2), ()),
    "bad:scale_zero": ("scale", lambda a, d: 0.0, ()),
    "bad:scale_nan": ("scale", lambda a, d: math.nan, ()),
    "bad:scale_inf": ("scale", lambda a, d: math.inf, ()),
    "bad:scale_0d": ("scale", lambda a, d: torch.tensor(0.5), ()),
    "bad:heads": ("k", lambda a, d: torch.ones(a["k"].shape[0], a["q"].shape[1] + 1,
                                               a["q"].shape[2], dtype=a["q"].dtype), ("v",)),
    "bad:k_dim": ("k", lambda a, d: torch.ones(*a["k"].shape[:2], a["k"].shape[2] + 1,
                                               dtype=a["q"].dtype), ()),
    "bad:q_int": ("q", lambda a, d: a["q"].to(torch.int32), ()),
    "bad:v_dtype": ("v", lambda a, d: a["v"].to(
        torch.float16 if a["q"].dtype != torch.float16 else torch.float32), ()),
    "bad:indices_float": ("indices", lambda a, d: a["indices"].float(), ()),
    "bad:indices_T": ("indices", lambda a, d: torch.zeros(a["q"].shape[0] + 1, 2,
                                                          dtype=torch.int64), ()),
    "bad:indices_meta": ("indices", lambda a, d: _meta(a["indices"]), ()),
    "bad:need_lse_int": ("need_lse", lambda a, d: 1, ()),
}  # fmt: skip


def build_sparse_attention(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    hkv = d.int(1, 2)
    h = hkv * d.int(1, 3)
    dk, dv = d.int(1, 16), d.int(1, 16)
    n = 0 if d.is_("edge:N=0") else d.int(1, 12)
    t = {"edge:T=0": 0, "edge:T=1": 1}.get(d.label, d.int(1, 5))
    topk = {"edge:K=0": 0, "edge:topk>N": n + d.int(1, 5)}.get(d.label, d.int(1, n + 3))
    make = d.small_ints if d.label in ("edge:huge_scale", "edge:scale_near_max") else d.randn
    q, k = make(t, h, dk, dtype=dtype), make(n, hkv, dk, dtype=dtype)
    if d.is_("edge:near_max"):
        q = d.randn(t, h, dk, dtype=dtype, scale=NEAR_MAX[dtype])
    if d.is_("edge:absorbed"):
        dv = d.int(1, dk)
        v = k[..., :dv]
    else:
        v_scale = {"edge:huge_values": HUGE[dtype], "edge:v_near_max": NEAR_MAX[dtype]}
        v = d.randn(n, hkv, dv, dtype=dtype, scale=v_scale.get(d.label, 1.0))
    if d.is_("edge:topk>N"):
        indices = d.randint(0, max(n, 1), t, topk, dtype=d.pick(INDEX)) if n else None
    else:
        indices = d.randint(-1, n, t, topk, dtype=d.pick(INDEX))
    if indices is None or d.is_("edge:all_masked"):
        indices = torch.full((t, topk), -1, dtype=d.pick(INDEX))
    scale = dk**-0.5 * d.float(0.5, 2.0)
    if d.is_("edge:huge_scale"):
        scale = d.pick((1e4, 1e10, 1e20, 1e30))
    elif d.is_("edge:tiny_scale"):
        scale = d.pick((1e-10, 1e-30))
    elif d.is_("edge:scale_near_max"):  # up to half the float32 maximum: still accepted
        scale = d.pick((1e38, 1.7e38))
    args = {"q": q, "k": k, "v": v, "indices": indices, "scale": scale, "need_lse": d.pick(BOOLS)}
    return _finish("sparse_attention", d, args, dtype, ATTN_BADS)


IDX_EDGES = (
    "edge:T=0", "edge:N=0", "edge:empty_ranges", "edge:topk>N", "edge:T=1",
    "edge:huge_weights", "edge:tiny_weights", "edge:fp8", "edge:near_max", "edge:score_overflow",
)  # fmt: skip
IDX_BADS: dict[str, Bad] = {
    "bad:start_after_end": ("k_start", lambda a, d: a["k_end"] + 1, ("k_end",)),
    "bad:end_past_N": ("k_end", lambda a, d: torch.full_like(a["k_end"], a["k"].shape[0] + 1), ()),
    "bad:start_neg": ("k_start", lambda a, d: torch.full_like(a["k_start"], -1), ()),
    "bad:start_int64": ("k_start", lambda a, d: a["k_start"].long(), ()),
    "bad:weights_fp16": ("weights", lambda a, d: a["weights"].half(), ()),
    "bad:q_nan": ("q", lambda a, d: _with_first(a["q"].float(), math.nan).to(a["q"].dtype), ()),
    "bad:k_dim": ("k", lambda a, d: torch.ones(a["k"].shape[0], a["k"].shape[1] + 1,
                                               dtype=a["k"].dtype), ()),
    "bad:scale_without_fp8": ("q_scale", lambda a, d: torch.ones(a["q"].shape[:2]), ()),
    "bad:fp8_without_scale": ("q", lambda a, d: a["q"].to(FP8_DTYPE), ("k", "q_scale")),
    "bad:weights_meta": ("weights", lambda a, d: _meta(a["weights"]), ()),
}  # fmt: skip
TOPK_BADS: dict[str, Bad] = {
    "bad:topk_zero": ("topk", lambda a, d: 0, ()),
    "bad:topk_0d": ("topk", lambda a, d: torch.tensor(2.7), ()),
    "bad:topk_float": ("topk", lambda a, d: 2.0, ()),
}


def _indexer_args(d: Draw) -> tuple[dict, torch.dtype]:
    fp8 = d.is_("edge:fp8")
    dtype = FP8_DTYPE if fp8 else d.pick(FLOATS)
    t = {"edge:T=0": 0, "edge:T=1": 1}.get(d.label, d.int(1, 4))
    hi, di = d.int(1, 4), d.int(1, 16)
    n = 0 if d.is_("edge:N=0") else d.int(1, 20)
    q, k = d.randn(t, hi, di, dtype=dtype, scale=_scale_of(d, dtype)), d.randn(n, di, dtype=dtype)
    if d.is_("edge:score_overflow") and n:  # one key's score beyond float32 (+inf)
        big = 1e20 if dtype != torch.float16 else 6e4  # float16: no float32 overflow
        q, k = _with_first(q.float(), big).to(dtype), _with_first(k.float(), big).to(dtype)
    w_scale = {"edge:huge_weights": 1e30, "edge:tiny_weights": 1e-30}.get(d.label, 1.0)
    weights = d.randn(t, hi, scale=w_scale)
    start = torch.randint(0, n + 1, (t,), generator=d.gen, dtype=torch.int32)
    end = start + (torch.rand(t, generator=d.gen) * (n + 1 - start)).to(torch.int32)
    if d.is_("edge:empty_ranges"):
        end = start.clone()
    args = {"q": q, "k": k, "weights": weights, "k_start": d.lay(start), "k_end": d.lay(end)}
    args["q_scale"] = d.randn(t, hi).abs() + 0.5 if fp8 else None
    args["k_scale"] = d.randn(n).abs() + 0.5 if fp8 else None
    wide = d.label in ("edge:topk>N", "edge:score_overflow")
    args["topk"] = n + d.int(1, 5) if wide else d.int(1, n + 3)
    return args, dtype


def build_lightning_indexer(d: Draw) -> Call:
    args, dtype = _indexer_args(d)
    return _finish("lightning_indexer", d, args, dtype, IDX_BADS | TOPK_BADS)


def build_indexer_logits(d: Draw) -> Call:
    args, dtype = _indexer_args(d)
    return _finish("indexer_logits", d, args, dtype, IDX_BADS)


GATE_EDGES = (
    "edge:T=0", "edge:E=1", "edge:top_k_max", "edge:huge_logits", "edge:tiny_logits",
    "edge:scaling_extreme", "edge:near_max", "edge:bias_near_max",
)  # fmt: skip
GATE_BADS: dict[str, Bad] = {
    "bad:top_k_unreachable": ("top_k", lambda a, d: a["logits"].shape[1] // a["n_group"]
                              * a["topk_group"] + 1, ()),
    "bad:top_k_zero": ("top_k", lambda a, d: 0, ()),
    "bad:top_k_0d": ("top_k", lambda a, d: torch.tensor(2.7), ()),
    "bad:top_k_float": ("top_k", lambda a, d: 2.0, ()),
    "bad:n_group_divisor": ("n_group", lambda a, d: a["logits"].shape[1] + 1, ("topk_group",)),
    "bad:topk_group_gt": ("topk_group", lambda a, d: a["n_group"] + 1, ()),
    "bad:scaling_zero": ("routed_scaling_factor", lambda a, d: 0.0, ()),
    "bad:scaling_nan": ("routed_scaling_factor", lambda a, d: math.nan, ()),
    "bad:scaling_0d": ("routed_scaling_factor", lambda a, d: torch.tensor(2.5), ()),
    "bad:norm_int": ("norm_topk_prob", lambda a, d: 1, ()),
    "bad:score_func": ("score_func", lambda a, d: "relu", ()),
    "bad:logits_bf16": ("logits", lambda a, d: a["logits"].bfloat16(), ()),
    "bad:bias_shape": ("bias", lambda a, d: torch.zeros(a["logits"].shape[1] + 1), ()),
    "bad:logits_nan": ("logits", lambda a, d: _with_first(a["logits"], math.nan), ()),
    "bad:bias_inf": ("bias", lambda a, d: _with_first(torch.zeros(a["logits"].shape[1]),
                                                      math.inf), ()),
    "bad:logits_meta": ("logits", lambda a, d: _meta(a["logits"]), ("bias",)),
}  # fmt: skip


def build_moe_gate(d: Draw) -> Call:
    t = 0 if d.is_("edge:T=0") else d.int(1, 5)
    if d.is_("edge:E=1"):
        n_group = per = 1
    else:
        n_group, per = d.int(1, 4), d.int(1, 8)
    e = n_group * per
    topk_group = d.int(1, n_group)
    reach = per * topk_group
    top_k = reach if d.is_("edge:top_k_max") else d.int(1, reach)
    scale = {
        "edge:huge_logits": 1e30,
        "edge:tiny_logits": 1e-30,
        "edge:near_max": NEAR_MAX[torch.float32],
    }.get(d.label, 2.0)
    logits = d.randn(t, e, scale=scale)
    bias = d.randn(e, scale=NEAR_MAX[torch.float32] if d.is_("edge:bias_near_max") else 0.1)
    # Meta logits with no cpu bias would be a valid meta call; a huge bias is the point.
    if d.label not in ("bad:logits_meta", "edge:bias_near_max"):
        bias = d.pick((None, bias))
    scaling = d.pick((1e-30, 1e30, 3e38)) if d.is_("edge:scaling_extreme") else d.float(0.5, 3.0)
    args = {
        "logits": logits,
        "bias": bias,
        "top_k": top_k,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": scaling,
        "norm_topk_prob": d.pick((True, False)),
        "score_func": d.pick(("sigmoid", "softmax")),
    }
    return _finish("moe_gate", d, args, torch.float32, GATE_BADS)


DISPATCH_EDGES = (
    "edge:T=0",
    "edge:D=0",
    "edge:E=1",
    "edge:many_experts",
    "edge:huge",
    "edge:one_expert",
    "edge:near_max",
)
DISPATCH_BADS: dict[str, Bad] = {
    "bad:id_E": ("ids", lambda a, d: torch.full_like(a["ids"], a["num_experts"]), ()),
    "bad:id_neg": ("ids", lambda a, d: torch.full_like(a["ids"], -1), ()),
    "bad:experts_zero": ("num_experts", lambda a, d: 0, ()),
    "bad:experts_0d": ("num_experts", lambda a, d: torch.tensor(a["num_experts"]), ()),
    "bad:experts_bool": ("num_experts", lambda a, d: True, ()),
    "bad:ids_float": ("ids", lambda a, d: a["ids"].float(), ()),
    "bad:ids_T": ("ids", lambda a, d: torch.zeros(a["x"].shape[0] + 1, 2, dtype=torch.int64), ()),
    "bad:x_int": ("x", lambda a, d: a["x"].to(torch.int32), ()),
    "bad:ids_meta": ("ids", lambda a, d: _meta(a["ids"]), ()),
}  # fmt: skip


def build_moe_dispatch(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    t = 0 if d.is_("edge:T=0") else d.int(1, 6)
    topk, dim = d.int(1, 4), 0 if d.is_("edge:D=0") else d.int(1, 8)
    e = {"edge:E=1": 1, "edge:many_experts": d.int(100, 1000)}.get(d.label, d.int(1, 8))
    x = d.randn(t, dim, dtype=dtype, scale=_scale_of(d, dtype))
    ids = d.randint(0, e, t, topk, dtype=d.pick(INDEX))
    if d.is_("edge:one_expert"):
        ids = torch.full_like(ids, d.int(0, e - 1))
    args = {"x": x, "ids": ids, "num_experts": e}
    return _finish("moe_dispatch", d, args, dtype, DISPATCH_BADS)


COMBINE_EDGES = (
    "edge:T=0", "edge:D=0", "edge:k=1", "edge:huge_weights", "edge:tiny_weights", "edge:near_max",
)  # fmt: skip
COMBINE_BADS: dict[str, Bad] = {
    "bad:src_repeated": ("src_row", lambda a, d: torch.zeros_like(a["src_row"]), ()),
    "bad:src_out_of_range": ("src_row", lambda a, d: a["src_row"] + a["src_row"].numel(), ()),
    "bad:weights_bf16": ("weights", lambda a, d: a["weights"].bfloat16(), ()),
    "bad:weights_nan": ("weights", lambda a, d: _with_first(a["weights"], math.nan), ()),
    "bad:y_rows": ("y_sorted", lambda a, d: torch.ones(a["y_sorted"].shape[0] + 1,
                                                       a["y_sorted"].shape[1]), ()),
    "bad:src_float": ("src_row", lambda a, d: a["src_row"].float(), ()),
    "bad:src_meta": ("src_row", lambda a, d: _meta(a["src_row"]), ()),
}  # fmt: skip


def build_moe_combine(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    t = 0 if d.is_("edge:T=0") else d.int(1, 5)
    topk = 1 if d.is_("edge:k=1") else d.int(1, 4)
    if d.is_("bad:src_repeated"):
        t, topk = t + 1, max(topk, 2)  # a single row cannot repeat
    dim = 0 if d.is_("edge:D=0") else d.int(1, 8)
    y = d.randn(t * topk, dim, dtype=dtype, scale=_scale_of(d, dtype))
    src = d.lay(torch.randperm(t * topk, generator=d.gen).to(d.pick(INDEX)))
    w_scale = {"edge:huge_weights": HUGE[dtype] / 10, "edge:tiny_weights": TINY[dtype]}
    weights = d.randn(t, topk, scale=w_scale.get(d.label, 1.0))
    args = {"y_sorted": y, "src_row": src, "weights": weights}
    return _finish("moe_combine", d, args, dtype, COMBINE_BADS)


# -- GEMMs: float, packed and fake-quant (QAT) weights ---------------------------------

GEMM_EDGES = (
    "edge:K=1",
    "edge:N=1",
    "edge:M=1",
    "edge:M=0",
    "edge:huge",
    "edge:tiny",
    "edge:large_M",
    "edge:near_max",
)
GEMM_BADS: dict[str, Bad] = {
    "bad:scheme": ("scheme", lambda a, d: "w2a2", ()),
    "bad:x_int": ("x", lambda a, d: a["x"].to(torch.int32), ()),
    "bad:w_K": ("w", lambda a, d: torch.ones(*a["w"].shape[:-1], a["w"].shape[-1] + 2,
                                             dtype=a["w"].dtype), ("w_scale", "x")),
    "bad:group_size_0d": ("group_size", lambda a, d: torch.tensor(32), ()),
    "bad:group_size_zero": ("group_size", lambda a, d: 0, ()),
}  # fmt: skip
PACKED_BADS: dict[str, Bad] = {
    "bad:scale_negative": ("w_scale", lambda a, d: -a["w_scale"], ()),
    "bad:scale_missing": ("w_scale", lambda a, d: None, ()),
    "bad:x_nan": ("x", lambda a, d: _with_first(a["x"], math.nan), ()),
}
GROUPED_BADS: dict[str, Bad] = {
    "bad:offsets_short": ("expert_offsets", lambda a, d: a["expert_offsets"] // 2, ()),
    "bad:offsets_decreasing": ("expert_offsets", lambda a, d: a["expert_offsets"].flip(0), ()),
    "bad:offsets_float": ("expert_offsets", lambda a, d: a["expert_offsets"].float(), ()),
    "bad:offsets_length": ("expert_offsets", lambda a, d: a["expert_offsets"][:-1], ()),
    "bad:offsets_meta": ("expert_offsets", lambda a, d: _meta(a["expert_offsets"]), ()),
}  # fmt: skip


def _gemm_sizes(d: Draw, scheme: str) -> tuple[int, int, int, int]:
    """(M, N, K, int4 group size) for ``scheme`` and the class."""
    int4 = scheme != FLOAT_WEIGHT and SCHEMES[scheme].weight.storage == torch.uint8
    gs = d.pick((2, 4, 8, 32)) if int4 else 32
    k = gs * d.int(1, 4) if int4 else d.int(1, 40)
    if d.is_("edge:K=1"):
        k, gs = (2, 2) if int4 else (1, gs)  # int4 packs pairs: its smallest K is 2
    m = {"edge:M=1": 1, "edge:M=0": 0, "edge:large_M": d.int(17, 64)}.get(d.label, d.int(1, 24))
    n = 1 if d.is_("edge:N=1") else d.int(1, 24)
    return m, n, k, gs


def _gemm_x(d: Draw, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return d.randn(m, k, dtype=dtype, scale=_scale_of(d, dtype))


def _pack(d: Draw, w: torch.Tensor, scheme: str, gs: int):
    """Weights ``[..., N, K]`` packed for ``scheme`` by the format definitions (not by
    a backend), laid out per the drawn layout."""
    s = SCHEMES[scheme]
    size = s.fixed_group_size or gs
    flat = w.reshape(-1, *w.shape[-2:])
    packed = [quantize_tensor(e, s.weight.name, size) for e in flat]
    wq = torch.stack([p[0] for p in packed]).reshape(*w.shape[:-1], -1)
    ws = torch.stack([p[1] for p in packed])
    ws = ws.reshape(*w.shape[:-2], *ws.shape[1:])
    return d.lay(wq), d.lay(ws)


def _gemm_weight(
    d: Draw, lead: tuple[int, ...], n: int, k: int, dtype: torch.dtype, scheme: str, gs: int
):
    w = torch.randn((*lead, n, k), generator=d.gen) * k**-0.5
    qat = scheme != FLOAT_WEIGHT and d.pick((False, True))
    if scheme == FLOAT_WEIGHT or qat:
        return d.lay(w.to(dtype)), None
    return _pack(d, w, scheme, gs)


def build_quant_gemm(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    scheme = d.pick(SCHEMES)
    m, n, k, gs = _gemm_sizes(d, scheme)
    if d.label in PACKED_BADS:
        w, w_scale = _pack(d, torch.randn(n, k, generator=d.gen) * k**-0.5, scheme, gs)
        if d.is_("bad:x_nan") and SCHEMES[scheme].activation is None:
            scheme = "w8a8"  # the NaN check guards activation quantisation
            m, n, k, gs = _gemm_sizes(d, scheme)
            w, w_scale = _pack(d, torch.randn(n, k, generator=d.gen), scheme, gs)
    else:
        w, w_scale = _gemm_weight(d, (), n, k, dtype, scheme, gs)
    args = {"x": _gemm_x(d, m, k, dtype), "w": w, "w_scale": w_scale, "scheme": scheme}
    args["group_size"] = gs
    return _finish("quant_gemm", d, args, dtype, GEMM_BADS | PACKED_BADS)


def build_grouped_gemm(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    scheme = d.pick((FLOAT_WEIGHT, *SCHEMES))
    if d.label in PACKED_BADS:
        scheme = "w8a8"
    m, n, k, gs = _gemm_sizes(d, scheme)
    e = d.int(1, 4)
    cuts = torch.randint(0, m + 1, (e - 1,), generator=d.gen).sort().values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([m])])
    if d.label in PACKED_BADS:
        w, w_scale = _pack(d, torch.randn(e, n, k, generator=d.gen) * k**-0.5, scheme, gs)
    else:
        w, w_scale = _gemm_weight(d, (e,), n, k, dtype, scheme, gs)
    args = {
        "x": _gemm_x(d, m, k, dtype),
        "w": w,
        "expert_offsets": d.lay(offsets.to(d.pick(INDEX))),
        "w_scale": w_scale,
        "scheme": scheme,
        "group_size": gs,
    }
    return _finish("grouped_gemm", d, args, dtype, GEMM_BADS | PACKED_BADS | GROUPED_BADS)


QUANT_EDGES = (
    "edge:R=0", "edge:C=1", "edge:huge", "edge:tiny", "edge:zeros", "edge:group_huge",
    "edge:near_max",
)  # fmt: skip
QUANT_BADS: dict[str, Bad] = {
    "bad:fmt": ("fmt", lambda a, d: "int3_row", ()),
    "bad:group_zero": ("group_size", lambda a, d: 0, ()),
    "bad:group_0d": ("group_size", lambda a, d: torch.tensor(a["group_size"]), ()),
    "bad:x_inf": ("x", lambda a, d: _with_first(a["x"], math.inf), ()),
    "bad:x_nan": ("x", lambda a, d: _with_first(a["x"], math.nan), ()),
    "bad:x_int": ("x", lambda a, d: a["x"].to(torch.int32), ()),
    "bad:x_3d": ("x", lambda a, d: a["x"][None], ()),
    "bad:int4_odd_group": ("group_size", lambda a, d: 3, ("fmt",)),
}


def build_quantize(d: Draw) -> Call:
    dtype = d.pick(FLOATS)
    fmt = d.pick(FORMATS)
    if d.is_("bad:int4_odd_group") or (d.is_("edge:C=1") and fmt == "int4_group"):
        fmt = "int8_row" if d.is_("edge:C=1") else "int4_group"
    int4 = fmt == "int4_group"
    gs = d.pick((2, 4, 8, 32)) if int4 else d.pick((1, 4, 32, 128))
    if d.is_("edge:group_huge"):
        gs = 1024
    c = gs * d.int(1, 4) if int4 else (1 if d.is_("edge:C=1") else d.int(1, 70))
    if d.is_("bad:int4_odd_group"):
        c = 6
    r = 0 if d.is_("edge:R=0") else d.int(1, 9)
    x = d.randn(r, c, dtype=dtype, scale=0.0 if d.is_("edge:zeros") else _scale_of(d, dtype))
    return _finish("quantize", d, {"x": x, "fmt": fmt, "group_size": gs}, dtype, QUANT_BADS)


BUILDERS: dict[str, tuple[Callable[[Draw], Call], tuple[str, ...], dict[str, Bad]]] = {
    "lightning_indexer": (build_lightning_indexer, IDX_EDGES, IDX_BADS | TOPK_BADS),
    "indexer_logits": (build_indexer_logits, IDX_EDGES, IDX_BADS),
    "sparse_attention": (build_sparse_attention, ATTN_EDGES, ATTN_BADS),
    "moe_gate": (build_moe_gate, GATE_EDGES, GATE_BADS),
    "moe_dispatch": (build_moe_dispatch, DISPATCH_EDGES, DISPATCH_BADS),
    "moe_combine": (build_moe_combine, COMBINE_EDGES, COMBINE_BADS),
    "grouped_gemm": (build_grouped_gemm, GEMM_EDGES, GEMM_BADS | PACKED_BADS | GROUPED_BADS),
    "quantize": (build_quantize, QUANT_EDGES, QUANT_BADS),
    "quant_gemm": (build_quant_gemm, GEMM_EDGES, GEMM_BADS | PACKED_BADS),
    "rms_norm": (build_rms_norm, RMS_EDGES, RMS_BADS),
    "rope": (build_rope, ROPE_EDGES, ROPE_BADS),
    "token_logprobs": (build_token_logprobs, LOGP_EDGES, LOGP_BADS),
    "mla_prolog": (build_mla_prolog, MLA_EDGES, MLA_BADS),
}
CLASSES = [
    (op, label) for op, (_, edges, bads) in BUILDERS.items() for label in ("ok", *edges, *bads)
]


@st.composite
def calls(draw, op: str, label: str) -> Call:
    return BUILDERS[op][0](Draw(draw, label))


# -- judging ------------------------------------------------------------------------


def _reference(call: Call):
    """The cpu reference's outputs in float64 (the indexer's: its full score matrix,
    which the tie-safe judge needs)."""
    kernels = REGISTRY.kernels("cpu", False)
    with REGISTRY.get("cpu").float64():
        if call.op == "lightning_indexer":
            return kernels["indexer_logits"](*logits_args(call.args))
        return kernels[call.op](*call.args)


def _judge(call: Call, outs, refs):
    """The op's conformance judge (token log-probabilities: ``logp <= 0``, ``entropy
    >= 0``, errors against ``max(|ref|, 1 nat)``), with two adjustments: empty outputs
    are judged by shape (the judges take a max over them); an indexer whose every
    finite score is 0 is judged shifted by 1 (the judge divides by the largest score)."""
    out_t, ref_t = _tuple(outs), _tuple(refs)
    if all(r.numel() == 0 for r in ref_t) and call.op != "lightning_indexer":
        ok = [tuple(o.shape) for o in out_t] == [tuple(r.shape) for r in ref_t]
        return Verdict(ok, "" if ok else f"shapes {[list(o.shape) for o in out_t]}")
    if call.op == "lightning_indexer" and outs[0].numel():
        finite = refs[torch.isfinite(refs)]
        if finite.numel() == 0 or float(finite.abs().max()) == 0:
            idx, sc = outs
            outs = (idx, torch.where(torch.isfinite(sc), sc + 1, sc))
            refs = torch.where(torch.isfinite(refs), refs + 1, refs)
    return JUDGES[JUDGE_OF_OP.get(call.op, "close")](call.op, call.dtype, call.args, outs, refs)


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _refusal(call: Call, err: GlmportError) -> Outcome:
    """``call``'s refusal ``err``, judged: a ``bad:*`` call must be refused by an
    OpInputError naming the op and a broken argument; an ``edge:*`` call may be refused
    by any glmport error (an OpInputError naming the op); an ``ok`` call never."""
    error = type(err).__name__
    if call.bad:
        if isinstance(err, OpInputError) and err.op == call.op and err.arg in call.bad:
            return Outcome(REFUSED, error)
        if isinstance(err, OpInputError):
            named = f"the error names {err.op}/{err.arg!r}, expected {call.op}/{call.bad}"
        else:
            named = f"{error} instead of an OpInputError naming {call.bad}"
        return Outcome(BAD_REFUSAL, error, f"{call.label}: {named}: {err}")
    if not call.label.startswith("edge:"):
        return Outcome(BAD_REFUSAL, error, f"an ordinary valid call was refused: {err}")
    if isinstance(err, OpInputError) and f"glmport.ops.{call.op}" not in str(err):
        return Outcome(BAD_REFUSAL, error, f"the refusal does not name the op: {err}")
    return Outcome(REFUSED, error)


def _outcome(call: Call, backend: str) -> Outcome:
    """Run ``call`` on ``backend``: how it ended (a failure says what is wrong)."""
    try:
        with glmport.use_backend(backend, emulate=backend in EMULATED):
            out = getattr(glmport.ops, call.op)(*call.args)
    except GlmportError as err:
        return _refusal(call, err)
    if call.bad:
        return Outcome(
            ACCEPTED_INVALID, problem=f"{call.label}: the bad argument {call.bad[0]!r} was accepted"
        )
    outs = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
    verdict = _judge(call, outs, _reference(call))
    if not verdict.ok:
        return Outcome(SILENT_WRONG, problem=f"{call.label} on {backend}: {verdict.reason}")
    return Outcome(CORRECT)


def _example_count(backend: str, label: str) -> int:
    ok, edge, bad = EXAMPLES[backend]
    return ok if label == "ok" else edge if label.startswith("edge:") else bad


def test_every_op_is_fuzzed():
    assert set(BUILDERS) == set(OP_NAMES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("op", "label"), CLASSES, ids=[f"{o}-{c}" for o, c in CLASSES])
def test_fuzz(op: str, label: str, backend: str) -> None:
    @settings(
        max_examples=_example_count(backend, label),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(call=calls(op, label))
    def prop(call: Call) -> None:
        where = {"op": op, "backend": backend, "class": label}
        outcome = COUNTS.observe(lambda: _outcome(call, backend), label, **where)
        event(str(outcome))

    prop()
