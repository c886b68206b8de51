"""Sizes an op cannot take are refused up front, with an OpInputError naming the
argument, on every backend (the checks are glmport's shared validation, before any
kernel runs):

- a call whose outputs, or any tensor argument laid out densely, need more bytes than
  the memory of the device (a broadcast, stride-0 view as large as its shape: an
  argument expanded to 2**40 rows used to hang in a kernel or die in the allocator);
- an int argument (``topk``, ``top_k``, ``n_group``, ``topk_group``, ``num_experts``,
  ``group_size``) of 2**31 or more, which kernels take as a 32-bit int, and counts the
  int32 outputs hold (router experts, dispatch copies).
"""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.conformance.cases import all_cases
from glmport.core import dispatch, validate
from glmport.core.specs import SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

BACKENDS = ("cpu", "generic", "cuda", "ascend", "onnxruntime", "tvm")
HUGE = 2**40  # rows: beyond any device's memory in every dtype


def _case(op: str, name: str = "tiny", dtype=torch.float32, scheme=None) -> dict:
    case = next(
        c
        for c in all_cases(ops=(op,))
        if c.name == name and c.dtype == dtype and c.scheme == scheme and c.layout is None
    )
    return dict(zip(SPECS[op].arg_names, case.args(), strict=True))


def _rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """``t``'s first row along ``dim`` broadcast to ``rows`` (stride 0: no memory)."""
    shape = list(t.shape)
    shape[dim] = rows
    return t.narrow(dim, 0, 1).expand(shape)


def _huge_attention():
    a = _case("sparse_attention")
    a["k"], a["v"] = _rows(a["k"], HUGE), _rows(a["v"], HUGE)
    return a, "k"


def _huge_indexer(op):
    def build():
        a = _case(op)
        a["k"] = _rows(a["k"], HUGE)
        return a, "k"

    return build


def _huge_logits_output():
    """Small inputs, a [T, N] output beyond memory: 2**21 queries and keys of one dim."""
    a = _case("indexer_logits")
    t = n = 2**21
    a["q"], a["k"] = _rows(a["q"][:, :1, :1], t), _rows(a["k"][:, :1], n)
    a["weights"] = _rows(a["weights"][:, :1], t)
    a["k_start"] = torch.zeros(t, dtype=torch.int32)
    a["k_end"] = torch.full((t,), n, dtype=torch.int32)
    return a, "q"


def _huge_gate():
    a = _case("moe_gate")
    a["logits"] = _rows(a["logits"], HUGE)
    return a, "logits"


def _huge_dispatch():
    a = _case("moe_dispatch", dtype=torch.bfloat16)
    a["x"] = _rows(a["x"], HUGE, dim=1)
    return a, "x"


def _huge_combine():
    a = _case("moe_combine", dtype=torch.bfloat16)
    a["y_sorted"] = _rows(a["y_sorted"], HUGE, dim=1)
    return a, "y_sorted"


def _huge_grouped():
    a = _case("grouped_gemm", dtype=torch.bfloat16)
    a["w"] = _rows(a["w"], HUGE, dim=1)
    return a, "w"


def _huge_quantize():
    a = _case("quantize", dtype=torch.bfloat16, scheme="int8_row")
    a["x"] = _rows(a["x"], HUGE)
    return a, "x"


def _huge_quant_gemm():
    a = _case("quant_gemm", name="qat", scheme="w8a8")
    a["w"] = _rows(a["w"], HUGE)
    return a, "w"


def _huge_rms_norm():
    a = _case("rms_norm")
    a["x"] = _rows(a["x"], HUGE)
    return a, "x"


def _huge_rope():
    a = _case("rope", name="tiny_interleaved")
    a["x"] = _rows(a["x"], HUGE, dim=1)
    return a, "x"


def _huge_logprobs():
    a = _case("token_logprobs")
    a["lm_head"] = _rows(a["lm_head"], HUGE)
    return a, "lm_head"


HUGE_CALLS = {
    "sparse_attention": _huge_attention,
    "lightning_indexer": _huge_indexer("lightning_indexer"),
    "indexer_logits": _huge_indexer("indexer_logits"),
    "indexer_logits_output": _huge_logits_output,
    "moe_gate": _huge_gate,
    "moe_dispatch": _huge_dispatch,
    "moe_combine": _huge_combine,
    "grouped_gemm": _huge_grouped,
    "quantize": _huge_quantize,
    "quant_gemm": _huge_quant_gemm,
    "rms_norm": _huge_rms_norm,
    "rope": _huge_rope,
    "token_logprobs": _huge_logprobs,
}

INT32_PAST = 2**31


def _int_past(op, arg, **case):
    def build():
        a = _case(op, **case)
        a[arg] = INT32_PAST
        return a, arg

    return build


def _dispatch_copies_past_int32():
    a = _case("moe_dispatch", dtype=torch.bfloat16)
    a["x"], a["ids"] = _rows(a["x"], 2**30), _rows(a["ids"], 2**30)  # 2**31 copies (k = 2)
    return a, "ids"


def _combine_slots_past_int32():
    a = _case("moe_combine", dtype=torch.bfloat16)
    a["y_sorted"], a["src_row"] = _rows(a["y_sorted"], 2**31), _rows(a["src_row"], 2**31)
    a["weights"] = _rows(a["weights"], 2**30)  # k = 2
    return a, "weights"


def _gate_experts_past_int32():
    a = _case("moe_gate")
    a["logits"] = _rows(a["logits"][:1], INT32_PAST, dim=1)
    a["bias"] = None
    return a, "logits"


BIG_INTS = {
    "topk": _int_past("lightning_indexer", "topk"),
    "top_k": _int_past("moe_gate", "top_k"),
    "n_group": _int_past("moe_gate", "n_group"),
    "topk_group": _int_past("moe_gate", "topk_group"),
    "num_experts": _int_past("moe_dispatch", "num_experts", dtype=torch.bfloat16),
    "quantize.group_size": _int_past(
        "quantize", "group_size", dtype=torch.bfloat16, scheme="fp8_group"
    ),
    "quant_gemm.group_size": _int_past("quant_gemm", "group_size", name="qat", scheme="w4a16"),
    "grouped_gemm.group_size": _int_past("grouped_gemm", "group_size", dtype=torch.bfloat16),
    "dispatch_copies": _dispatch_copies_past_int32,
    "combine_slots": _combine_slots_past_int32,
    "gate_experts": _gate_experts_past_int32,
}


def _refused(op: str, args: dict, arg: str, backend: str) -> glmport.OpInputError:
    with (
        glmport.use_backend(backend, emulate=backend in ("cuda", "ascend")),
        pytest.raises(glmport.OpInputError) as info,
    ):
        getattr(glmport.ops, op)(*args.values())
    assert (info.value.op, info.value.arg) == (op, arg), str(info.value)
    return info.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HUGE_CALLS))
def test_a_call_beyond_the_device_memory_is_refused_up_front(name, backend):
    args, arg = HUGE_CALLS[name]()
    op = name.removesuffix("_output")
    err = _refused(op, args, arg, backend)
    assert "the memory of cpu" in err.expected and "iB" in err.got, str(err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(BIG_INTS))
def test_an_int_past_int32_is_refused_naming_the_argument(name, backend):
    args, arg = BIG_INTS[name]()
    op = next(op for op in SPECS if tuple(args) == SPECS[op].arg_names)
    err = _refused(op, args, arg, backend)
    assert "2**31 - 1" in err.expected, str(err)


@pytest.fixture
def memory_of_4096_bytes(monkeypatch):
    """The device holds 4096 bytes: the bound is exact, and no signature is cached."""
    monkeypatch.setattr(validate, "device_memory", lambda device: 4096)
    monkeypatch.setattr(dispatch, "_passed", set())


def test_the_bound_is_the_device_memory_exactly(memory_of_4096_bytes):
    w = torch.ones(32)
    glmport.ops.rms_norm(torch.ones(32, 32), w)  # 4096 bytes in, 4096 out
    with pytest.raises(glmport.OpInputError, match=r"'x' must be at most the memory of cpu"):
        glmport.ops.rms_norm(torch.ones(33, 32), w)
    with pytest.raises(glmport.OpInputError, match=r"'x' .* laid out densely") as info:
        glmport.ops.rms_norm(torch.ones(1, 32).expand(33, 32), w)  # stride 0, same bound
    assert "4.12 KiB" in info.value.got and "4 KiB" in info.value.expected


def test_outputs_beyond_the_memory_name_the_int_argument_they_follow(memory_of_4096_bytes):
    q, k = torch.ones(4, 1, 1), torch.ones(64, 1)
    w, start, end = torch.ones(4, 1), torch.zeros(4, dtype=torch.int32), torch.full((4,), 64)
    end = end.to(torch.int32)
    glmport.ops.lightning_indexer(q, k, w, start, end, 128)  # int32 + fp32 [4, 128]: 4096
    with pytest.raises(glmport.OpInputError, match=r"'topk' .* outputs fit") as info:
        glmport.ops.lightning_indexer(q, k, w, start, end, 129)
    assert "int32 [4, 129], float32 [4, 129]" in info.value.got


def test_a_device_of_unknown_memory_is_not_bounded():
    assert validate.device_memory(torch.device("meta")) is None
    assert validate.device_memory(torch.device("cpu")) > 2**30
