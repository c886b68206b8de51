"""Error inputs of every op: each rule an op's checks enforce, broken once.

Every case starts from a good call (checked to succeed on its own) and changes one
thing, then calls the public ``glmport.ops.<name>``; the call must raise
:class:`glmport.OpInputError` naming the op, the offending argument, what was expected
and what came. Cases marked ``value`` break a check that reads tensor data, which
``GLMPORT_VALIDATE=meta`` turns off. :data:`STRICT_CASES` break the whole-cache scans
only ``GLMPORT_VALIDATE=strict`` runs (the default ``full`` skips them: at decode
shapes they cost as much as the op).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hang_guard import guard_s

import glmport
from glmport.core.formats import FORMATS, FP8_DTYPE, SCHEMES

NAN, INF = math.nan, math.inf
T, D, N, E = 3, 8, 6, 2  # tokens, feature dim, key slots, experts


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# -- good calls: keyword arguments of the public call, in schema order ---------------


def _sparse_attention() -> dict:
    return {
        "q": _rand(T, 4, D, seed=1),
        "k": _rand(N, 2, D, seed=2),
        "v": _rand(N, 2, D, seed=3),
        "indices": torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]]),
        "scale": 0.3,
    }


def _indexer_inputs(fp8: bool) -> dict:
    dtype = FP8_DTYPE if fp8 else torch.float32
    args = {
        "q": _rand(T, 2, D, seed=1).to(dtype),
        "k": _rand(N, D, seed=2).to(dtype),
        "weights": _rand(T, 2, seed=3),
        "k_start": _i32(0, 1, 2),
        "k_end": _i32(4, 6, 3),
    }
    return args


def _lightning_indexer() -> dict:
    return {**_indexer_inputs(False), "topk": 2}


def _lightning_indexer_fp8() -> dict:
    return {
        **_indexer_inputs(True),
        "topk": 2,
        "q_scale": torch.full((T, 2), 0.5),
        "k_scale": torch.full((N,), 0.25),
    }


def _indexer_logits() -> dict:
    return _indexer_inputs(False)


def _moe_gate() -> dict:
    return {
        "logits": _rand(T, 4, seed=1),
        "bias": _rand(4, seed=2),
        "top_k": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "score_func": "sigmoid",
    }


def _moe_dispatch() -> dict:
    return {"x": _rand(T, D), "ids": torch.tensor([[0, 1], [1, 0], [1, 1]]), "num_experts": E}


def _moe_combine() -> dict:
    return {
        "y_sorted": _rand(T * 2, D),
        "src_row": torch.tensor([0, 3, 1, 2, 4, 5]),
        "weights": _rand(T, 2, seed=1),
    }


def _grouped_gemm() -> dict:
    return {
        "x": _rand(6, D),
        "w": _rand(E, 5, D, seed=1),
        "expert_offsets": torch.tensor([0, 2, 6]),
    }


def _grouped_gemm_w4a8() -> dict:
    w, w_scale = glmport.ops.quantize_weight(_rand(E, 5, D, seed=1), "w4a8", 4)
    return {**_grouped_gemm(), "w": w, "w_scale": w_scale, "scheme": "w4a8", "group_size": 4}


def _grouped_gemm_qat() -> dict:
    return {**_grouped_gemm(), "w_scale": None, "scheme": "w8a8"}


def _quantize() -> dict:
    return {"x": _rand(T, D), "fmt": "int4_group", "group_size": 4}


def _quant_gemm_qat() -> dict:
    return {
        "x": _rand(T, D),
        "w": _rand(5, D, seed=1),
        "w_scale": None,
        "scheme": "w4a8",
        "group_size": 4,
    }


def _quant_gemm_packed(scheme: str) -> Callable[[], dict]:
    def build() -> dict:
        w, w_scale = glmport.ops.quantize_weight(_rand(5, D, seed=1), scheme, 4)
        return {"x": _rand(T, D), "w": w, "w_scale": w_scale, "scheme": scheme, "group_size": 4}

    return build


def _rms_norm() -> dict:
    return {"x": _rand(T, D), "weight": _rand(D, seed=1), "eps": 1e-6}


def _rope() -> dict:
    return {
        "x": _rand(T, 2, D),
        "cos": _rand(T, D // 2, seed=1),
        "sin": _rand(T, D // 2, seed=2),
        "interleaved": True,
    }


def _mla_prolog() -> dict:
    """hidden D, q_lora 6, 2 heads of nope 4, kv_lora 5, rope 4."""
    return {
        "x": _rand(T, D),
        "w_dq": _rand(6, D, seed=1),
        "gamma_cq": _rand(6, seed=2),
        "w_uq": _rand(2 * 8, 6, seed=3),
        "w_uk": _rand(2, 4, 5, seed=4),
        "w_dkv": _rand(5 + 4, D, seed=5),
        "gamma_ckv": _rand(5, seed=6),
        "cos": _rand(T, 2, seed=7),
        "sin": _rand(T, 2, seed=8),
        "eps": 1e-6,
    }


def _mla_prolog_w8a8() -> dict:
    """:func:`_mla_prolog` with its three projections packed W8A8, scales last."""
    args = _mla_prolog()
    for name in ("w_dq", "w_uq", "w_dkv"):
        args[name], args[name + "_scale"] = glmport.ops.quantize_weight(args[name], "w8a8")
    return args


def _token_logprobs() -> dict:
    return {
        "hidden": _rand(T, D),
        "lm_head": _rand(7, D, seed=1),
        "targets": torch.tensor([0, 3, 6]),
        "temperature": 0.7,
    }


def _quantize_weight() -> dict:
    return {"w": _rand(5, D), "scheme": "w8a8", "group_size": 4}


# builder name -> (public op, builder)
GOOD: dict[str, tuple[str, Callable[[], dict]]] = {
    "sparse_attention": ("sparse_attention", _sparse_attention),
    "lightning_indexer": ("lightning_indexer", _lightning_indexer),
    "lightning_indexer_fp8": ("lightning_indexer", _lightning_indexer_fp8),
    "indexer_logits": ("indexer_logits", _indexer_logits),
    "moe_gate": ("moe_gate", _moe_gate),
    "moe_dispatch": ("moe_dispatch", _moe_dispatch),
    "moe_combine": ("moe_combine", _moe_combine),
    "grouped_gemm": ("grouped_gemm", _grouped_gemm),
    "grouped_gemm_w4a8": ("grouped_gemm", _grouped_gemm_w4a8),
    "grouped_gemm_qat": ("grouped_gemm", _grouped_gemm_qat),
    "quantize": ("quantize", _quantize),
    "quant_gemm_qat": ("quant_gemm", _quant_gemm_qat),
    "quant_gemm_w8a8": ("quant_gemm", _quant_gemm_packed("w8a8")),
    "quant_gemm_w4a8": ("quant_gemm", _quant_gemm_packed("w4a8")),
    "quant_gemm_fp8_block": ("quant_gemm", _quant_gemm_packed("fp8_block")),
    "rms_norm": ("rms_norm", _rms_norm),
    "rope": ("rope", _rope),
    "mla_prolog": ("mla_prolog", _mla_prolog),
    "mla_prolog_w8a8": ("mla_prolog", _mla_prolog_w8a8),
    "token_logprobs": ("token_logprobs", _token_logprobs),
    "quantize_weight": ("quantize_weight", _quantize_weight),
}


# -- mutations ------------------------------------------------------------------------


def put(**changes: object) -> Callable[[dict], None]:
    """Set arguments; a callable value is applied to the good arguments first."""

    def mutate(args: dict) -> None:
        new = {k: v(args) if callable(v) else v for k, v in changes.items()}
        args.update(new)

    return mutate


def poke(arg: str, index: tuple | int, value: float) -> Callable[[dict], None]:
    """Write one element of a tensor argument (a copy)."""

    def mutate(args: dict) -> None:
        t = args[arg].clone()
        t[index] = value
        args[arg] = t

    return mutate


def meta(arg: str) -> Callable[[dict], None]:
    return put(**{arg: lambda a: a[arg].to("meta")})


@dataclass(frozen=True)
class Case:
    id: str
    good: str  # a key of GOOD
    mutate: Callable[[dict], None]
    arg: str  # the argument the error must name
    expect: tuple[str, ...] = ()  # text the message must contain (expected and got)
    value: bool = False  # a value check (off with GLMPORT_VALIDATE=meta)
    op: str | None = None  # the op the error names, if not the builder's

    @property
    def error_op(self) -> str:
        return self.op or GOOD[self.good][0]

    def call(self) -> object:
        op, build = GOOD[self.good]
        args = build()
        self.mutate(args)
        return getattr(glmport.ops, op)(**args)


SCHEME_NAMES = tuple(SCHEMES)
FORMAT_NAMES = tuple(FORMATS)
SCALE_BAD = (("zero", 0.0), ("negative", -1.0), ("nan", NAN), ("inf", INF), ("bool", True))


def _scalar_cases(good: str, arg: str, bad: tuple = SCALE_BAD) -> list[Case]:
    return [Case(f"{good}-{arg}_{name}", good, put(**{arg: v}), arg, ("> 0",)) for name, v in bad]


def _value_scale_cases(good: str, arg: str, index: tuple | int) -> list[Case]:
    return [
        Case(f"{good}-{arg}_{name}_value", good, poke(arg, index, v), arg, ("> 0",), value=True)
        for name, v in (("zero", 0.0), ("negative", -2.0), ("nan", NAN), ("inf", INF))
    ]


CASES: list[Case] = [
    # -- sparse_attention -----------------------------------------------------------
    Case("sa-q_rank", "sparse_attention", put(q=lambda a: a["q"][0]), "q", ("3-D", "[4, 8]")),
    Case("sa-q_dtype_int", "sparse_attention", put(q=lambda a: a["q"].int()), "q", ("int32",)),
    Case("sa-k_rank", "sparse_attention", put(k=lambda a: a["k"][:, 0]), "k", ("3-D",)),
    Case("sa-k_head_dim", "sparse_attention", put(k=_rand(N, 2, 7)), "k", ("Dk=8", "[6, 2, 7]")),
    Case("sa-v_slots", "sparse_attention", put(v=_rand(5, 2, D)), "v", ("N=6", "[5, 2, 8]")),
    Case("sa-v_heads", "sparse_attention", put(v=_rand(N, 1, D)), "v", ("Hkv=2",)),
    Case(
        "sa-k_dtype_mismatch",
        "sparse_attention",
        put(k=lambda a: a["k"].bfloat16(), v=lambda a: a["v"].bfloat16()),
        "k",
        ("same dtype as 'q'", "bfloat16"),
    ),
    Case(
        "sa-v_dtype_mismatch",
        "sparse_attention",
        put(v=lambda a: a["v"].half()),
        "v",
        ("same dtype", "float16"),
    ),
    Case(
        "sa-heads_not_divisible",
        "sparse_attention",
        put(k=_rand(N, 3, D), v=_rand(N, 3, D)),
        "k",
        ("H=4", "Hkv=3"),
    ),
    Case("sa-indices_rank", "sparse_attention", put(indices=lambda a: a["indices"][0]), "indices"),
    Case(
        "sa-indices_dtype",
        "sparse_attention",
        put(indices=lambda a: a["indices"].float()),
        "indices",
        ("int32 | int64", "float32"),
    ),
    Case(
        "sa-indices_rows",
        "sparse_attention",
        put(indices=lambda a: a["indices"][:2]),
        "indices",
        ("T=3", "[2, 3]"),
    ),
    Case(
        "sa-index_equal_N",
        "sparse_attention",
        poke("indices", (1, 2), N),
        "indices",
        ("[-1, 6)", "6"),
        value=True,
    ),
    Case(
        "sa-index_minus_2",
        "sparse_attention",
        poke("indices", (0, 0), -2),
        "indices",
        ("[-1, 6)", "-2"),
        value=True,
    ),
    *_scalar_cases("sparse_attention", "scale"),
    Case("sa-scale_str", "sparse_attention", put(scale="0.3"), "scale", ("> 0", "str")),
    Case("sa-indices_on_meta", "sparse_attention", meta("indices"), "indices", ("meta", "cpu")),
    Case("sa-q_on_meta", "sparse_attention", meta("q"), "k", ("same device as 'q' (meta)",)),
    Case(
        "sa-q_list",
        "sparse_attention",
        put(q=lambda a: a["q"].tolist()),
        "q",
        ("torch.Tensor", "list"),
    ),
    Case("sa-k_str", "sparse_attention", put(k="k"), "k", ("torch.Tensor", "str 'k'")),
    # -- lightning_indexer ----------------------------------------------------------
    Case("li-q_rank", "lightning_indexer", put(q=lambda a: a["q"][0]), "q", ("3-D",)),
    Case("li-q_dtype_int", "lightning_indexer", put(q=lambda a: a["q"].long()), "q", ("int64",)),
    Case("li-k_dim", "lightning_indexer", put(k=_rand(N, 7)), "k", ("Di=8", "[6, 7]")),
    Case("li-k_rank", "lightning_indexer", put(k=_rand(N, 1, D)), "k", ("2-D",)),
    Case(
        "li-qk_dtype_mismatch",
        "lightning_indexer",
        put(k=lambda a: a["k"].bfloat16()),
        "k",
        ("same dtype as 'q'", "bfloat16"),
    ),
    Case(
        "li-weights_shape",
        "lightning_indexer",
        put(weights=_rand(T, 3)),
        "weights",
        ("Hi=2", "[3, 3]"),
    ),
    Case(
        "li-weights_dtype",
        "lightning_indexer",
        put(weights=lambda a: a["weights"].bfloat16()),
        "weights",
        ("float32", "bfloat16"),
    ),
    Case(
        "li-k_start_dtype",
        "lightning_indexer",
        put(k_start=lambda a: a["k_start"].long()),
        "k_start",
        ("int32", "int64"),
    ),
    Case("li-k_end_shape", "lightning_indexer", put(k_end=_i32(4, 6)), "k_end", ("T=3", "[2]")),
    Case(
        "li-k_start_gt_k_end",
        "lightning_indexer",
        put(k_start=_i32(0, 1, 4)),
        "k_start",
        ("<= k_end for every query", "k_start[2]=4 > k_end[2]=3"),
        value=True,
    ),
    Case(
        "li-k_end_gt_N",
        "lightning_indexer",
        poke("k_end", 0, N + 1),
        "k_end",
        ("[0, 7)", "7"),
        value=True,
    ),
    Case(
        "li-k_start_negative",
        "lightning_indexer",
        poke("k_start", 0, -1),
        "k_start",
        ("[0, 7)", "-1"),
        value=True,
    ),
    Case("li-topk_zero", "lightning_indexer", put(topk=0), "topk", ("int >= 1", "0")),
    Case("li-topk_bool", "lightning_indexer", put(topk=True), "topk", ("int >= 1", "bool True")),
    Case("li-topk_float", "lightning_indexer", put(topk=2.0), "topk", ("int >= 1", "float 2.0")),
    Case("li-q_nan", "lightning_indexer", poke("q", (1, 1, 1), NAN), "q", ("finite",), value=True),
    Case(
        "li-weights_nan",
        "lightning_indexer",
        poke("weights", (1, 1), NAN),
        "weights",
        ("finite",),
        value=True,
    ),
    Case(
        "li-q_scale_without_fp8",
        "lightning_indexer",
        put(q_scale=torch.ones(T, 2)),
        "q_scale",
        ("None unless q and k are float8_e4m3fn", "float32"),
    ),
    Case(
        "li-k_scale_without_fp8",
        "lightning_indexer",
        put(k_scale=torch.ones(N)),
        "k_scale",
        ("None unless",),
    ),
    Case("li-weights_on_meta", "lightning_indexer", meta("weights"), "weights", ("meta",)),
    Case("li-weights_list", "lightning_indexer", put(weights=[[1.0, 1.0]] * T), "weights"),
    Case(
        "li8-q_scale_missing",
        "lightning_indexer_fp8",
        put(q_scale=None),
        "q_scale",
        ("float32 scale tensor when q and k are float8_e4m3fn", "None"),
    ),
    Case("li8-k_scale_missing", "lightning_indexer_fp8", put(k_scale=None), "k_scale", ("None",)),
    Case(
        "li8-q_fp8_k_float",
        "lightning_indexer_fp8",
        put(k=_rand(N, D)),
        "k",
        ("same dtype as 'q'", "float32"),
    ),
    Case(
        "li8-q_scale_shape",
        "lightning_indexer_fp8",
        put(q_scale=torch.ones(T)),
        "q_scale",
        ("Hi=2", "[3]"),
    ),
    Case(
        "li8-k_scale_shape",
        "lightning_indexer_fp8",
        put(k_scale=torch.ones(N - 1)),
        "k_scale",
        ("N=6", "[5]"),
    ),
    Case(
        "li8-k_scale_dtype",
        "lightning_indexer_fp8",
        put(k_scale=lambda a: a["k_scale"].double()),
        "k_scale",
        ("float32", "float64"),
    ),
    *_value_scale_cases("lightning_indexer_fp8", "q_scale", (2, 1)),
    *_value_scale_cases("lightning_indexer_fp8", "k_scale", 4),
    Case(
        "li8-q_scale_list",
        "lightning_indexer_fp8",
        put(q_scale=[1.0]),
        "q_scale",
        ("torch.Tensor",),
    ),
    # -- indexer_logits -------------------------------------------------------------
    Case("il-q_rank", "indexer_logits", put(q=lambda a: a["q"][0]), "q", ("3-D",)),
    Case("il-k_dim", "indexer_logits", put(k=_rand(N, 4)), "k", ("Di=8",)),
    Case(
        "il-k_start_gt_k_end",
        "indexer_logits",
        put(k_start=_i32(5, 1, 2)),
        "k_start",
        ("<= k_end", "k_start[0]=5 > k_end[0]=4"),
        value=True,
    ),
    Case(
        "il-k_end_gt_N",
        "indexer_logits",
        poke("k_end", 2, N + 3),
        "k_end",
        ("[0, 7)", "9"),
        value=True,
    ),
    Case(
        "il-weights_inf",
        "indexer_logits",
        poke("weights", (0, 0), INF),
        "weights",
        ("finite",),
        value=True,
    ),
    Case("il-q_scale_without_fp8", "indexer_logits", put(q_scale=torch.ones(T, 2)), "q_scale"),
    Case("il-k_end_on_meta", "indexer_logits", meta("k_end"), "k_end", ("meta",)),
    # -- moe_gate -------------------------------------------------------------------
    Case("gate-logits_rank", "moe_gate", put(logits=_rand(T, 2, 2)), "logits", ("2-D",)),
    Case(
        "gate-logits_dtype",
        "moe_gate",
        put(logits=lambda a: a["logits"].bfloat16()),
        "logits",
        ("float32", "bfloat16"),
    ),
    Case("gate-bias_shape", "moe_gate", put(bias=_rand(3)), "bias", ("E=4", "[3]")),
    Case("gate-bias_dtype", "moe_gate", put(bias=lambda a: a["bias"].half()), "bias", ("float16",)),
    Case("gate-bias_list", "moe_gate", put(bias=[0.0] * 4), "bias", ("torch.Tensor", "list")),
    Case("gate-n_group_not_divisor", "moe_gate", put(n_group=3), "n_group", ("E=4", "3")),
    Case("gate-n_group_zero", "moe_gate", put(n_group=0), "n_group", ("int >= 1",)),
    Case(
        "gate-topk_group_gt_n_group",
        "moe_gate",
        put(topk_group=3),
        "topk_group",
        ("<= n_group=2", "3"),
    ),
    Case("gate-topk_group_zero", "moe_gate", put(topk_group=0), "topk_group", ("int >= 1",)),
    Case("gate-top_k_zero", "moe_gate", put(top_k=0), "top_k", ("int >= 1", "0")),
    Case("gate-top_k_bool", "moe_gate", put(top_k=True), "top_k", ("int >= 1", "bool")),
    Case("gate-top_k_float", "moe_gate", put(top_k=2.0), "top_k", ("int >= 1", "float")),
    Case(
        "gate-top_k_unreachable",
        "moe_gate",
        put(top_k=3),
        "top_k",
        ("<= the 2 experts in the kept groups", "3"),
    ),
    *_scalar_cases("moe_gate", "routed_scaling_factor"),
    Case("gate-norm_topk_prob_int", "moe_gate", put(norm_topk_prob=1), "norm_topk_prob", ("bool",)),
    Case(
        "gate-norm_topk_prob_none",
        "moe_gate",
        put(norm_topk_prob=None),
        "norm_topk_prob",
        ("bool", "None"),
    ),
    Case(
        "gate-norm_topk_prob_str",
        "moe_gate",
        put(norm_topk_prob="yes"),
        "norm_topk_prob",
        ("bool", "'yes'"),
    ),
    Case(
        "gate-score_func_unknown",
        "moe_gate",
        put(score_func="relu"),
        "score_func",
        ("'sigmoid'", "'softmax'", "'relu'"),
    ),
    Case(
        "gate-logits_nan",
        "moe_gate",
        poke("logits", (2, 3), NAN),
        "logits",
        ("finite",),
        value=True,
    ),
    Case("gate-bias_inf", "moe_gate", poke("bias", 0, -INF), "bias", ("finite",), value=True),
    Case("gate-bias_on_meta", "moe_gate", meta("bias"), "bias", ("meta",)),
    # -- moe_dispatch ---------------------------------------------------------------
    Case("disp-x_rank", "moe_dispatch", put(x=_rand(T, 2, D)), "x", ("2-D",)),
    Case("disp-x_dtype", "moe_dispatch", put(x=lambda a: a["x"].int()), "x", ("int32",)),
    Case("disp-ids_rows", "moe_dispatch", put(ids=lambda a: a["ids"][:2]), "ids", ("T=3",)),
    Case("disp-ids_rank", "moe_dispatch", put(ids=lambda a: a["ids"][:, 0]), "ids", ("2-D",)),
    Case("disp-ids_dtype", "moe_dispatch", put(ids=lambda a: a["ids"].float()), "ids", ("int64",)),
    Case("disp-num_experts_zero", "moe_dispatch", put(num_experts=0), "num_experts", (">= 1",)),
    Case("disp-num_experts_bool", "moe_dispatch", put(num_experts=True), "num_experts", ("bool",)),
    Case("disp-id_equal_E", "moe_dispatch", poke("ids", (2, 1), E), "ids", ("[0, 2)",), value=True),
    Case(
        "disp-id_negative",
        "moe_dispatch",
        poke("ids", (0, 0), -1),
        "ids",
        ("[0, 2)", "-1"),
        value=True,
    ),
    Case("disp-ids_on_meta", "moe_dispatch", meta("ids"), "ids", ("meta",)),
    Case("disp-x_list", "moe_dispatch", put(x=[[1.0] * D] * T), "x", ("torch.Tensor",)),
    # -- moe_combine ----------------------------------------------------------------
    Case("comb-y_rank", "moe_combine", put(y_sorted=_rand(T * 2)), "y_sorted", ("2-D",)),
    Case("comb-y_rows", "moe_combine", put(y_sorted=_rand(5, D)), "y_sorted", ("T*k=6", "[5, 8]")),
    Case(
        "comb-y_dtype",
        "moe_combine",
        put(y_sorted=lambda a: a["y_sorted"].double()),
        "y_sorted",
        ("float64",),
    ),
    Case(
        "comb-weights_dtype",
        "moe_combine",
        put(weights=lambda a: a["weights"].bfloat16()),
        "weights",
        ("float32", "bfloat16"),
    ),
    Case("comb-weights_rank", "moe_combine", put(weights=_rand(6)), "weights", ("2-D",)),
    Case(
        "comb-src_row_length",
        "moe_combine",
        put(src_row=torch.arange(5)),
        "src_row",
        ("T*k=6", "[5]"),
    ),
    Case(
        "comb-src_row_dtype",
        "moe_combine",
        put(src_row=lambda a: a["src_row"].float()),
        "src_row",
        ("int32 | int64",),
    ),
    Case(
        "comb-src_row_repeated",
        "moe_combine",
        put(src_row=torch.tensor([0, 3, 1, 1, 4, 5])),
        "src_row",
        ("permutation of 0..5", "repeated"),
        value=True,
    ),
    Case(
        "comb-src_row_out_of_range",
        "moe_combine",
        poke("src_row", 0, 6),
        "src_row",
        ("[0, 6)", "6"),
        value=True,
    ),
    Case(
        "comb-src_row_negative",
        "moe_combine",
        poke("src_row", 5, -1),
        "src_row",
        ("[0, 6)", "-1"),
        value=True,
    ),
    Case(
        "comb-weights_nan",
        "moe_combine",
        poke("weights", (1, 0), NAN),
        "weights",
        ("finite",),
        value=True,
    ),
    Case("comb-src_row_on_meta", "moe_combine", meta("src_row"), "src_row", ("meta",)),
    # -- grouped_gemm ---------------------------------------------------------------
    Case("gg-x_rank", "grouped_gemm", put(x=_rand(6, 1, D)), "x", ("2-D",)),
    Case("gg-w_rank", "grouped_gemm", put(w=_rand(5, D)), "w", ("3-D",)),
    Case(
        "gg-w_dtype_mismatch",
        "grouped_gemm",
        put(w=lambda a: a["w"].bfloat16()),
        "w",
        ("float32", "bfloat16"),
    ),
    Case("gg-w_k_mismatch", "grouped_gemm", put(w=_rand(E, 5, 4)), "w", ("K=8", "[2, 5, 4]")),
    Case(
        "gg-offsets_length",
        "grouped_gemm",
        put(expert_offsets=torch.tensor([0, 6])),
        "expert_offsets",
        ("E+1=3", "[2]"),
    ),
    Case(
        "gg-offsets_dtype",
        "grouped_gemm",
        put(expert_offsets=lambda a: a["expert_offsets"].float()),
        "expert_offsets",
        ("int32 | int64",),
    ),
    Case(
        "gg-w_scale_with_float_weight",
        "grouped_gemm",
        put(w_scale=torch.ones(E, 5)),
        "w_scale",
        ("None with scheme='none'", "scale tensor"),
    ),
    Case(
        "gg-scheme_unknown",
        "grouped_gemm",
        put(scheme="int3"),
        "scheme",
        (*map(repr, SCHEME_NAMES), "'int3'"),
    ),
    Case(
        "gg-offsets_not_from_0",
        "grouped_gemm",
        put(expert_offsets=torch.tensor([1, 2, 6])),
        "expert_offsets",
        ("non-decreasing from 0 to M=6", "[1, 2, 6]"),
        value=True,
    ),
    Case(
        "gg-offsets_not_to_M",
        "grouped_gemm",
        put(expert_offsets=torch.tensor([0, 2, 5])),
        "expert_offsets",
        ("M=6", "[0, 2, 5]"),
        value=True,
    ),
    Case(
        "gg-offsets_decreasing",
        "grouped_gemm",
        put(expert_offsets=torch.tensor([0, 7, 6])),
        "expert_offsets",
        ("non-decreasing", "[0, 7, 6]"),
        value=True,
    ),
    Case("gg-offsets_on_meta", "grouped_gemm", meta("expert_offsets"), "expert_offsets"),
    Case("gg-w_on_meta", "grouped_gemm", meta("w"), "w", ("meta",)),
    Case(
        "gg4-w_scale_experts",
        "grouped_gemm_w4a8",
        put(w_scale=torch.ones(E + 1, 5, 2)),
        "w_scale",
        ("E=2", "[3, 5, 2]"),
    ),
    Case(
        "gg4-w_scale_groups_not_dividing_K",
        "grouped_gemm_w4a8",
        put(w_scale=torch.ones(E, 5, 3)),
        "w_scale",
        ("dividing K=8", "[2, 5, 3]"),
    ),
    Case(
        "gg4-w_scale_missing",
        "grouped_gemm_w4a8",
        put(w_scale=None),
        "w_scale",
        ("float32 scale tensor for a packed w4a8 weight", "None"),
    ),
    Case(
        "gg4-w_packed_dtype",
        "grouped_gemm_w4a8",
        put(w=lambda a: a["w"].to(torch.int8)),
        "w",
        ("uint8", "int8"),
    ),
    Case(
        "gg4-w_scale_nonpositive",
        "grouped_gemm_w4a8",
        poke("w_scale", (1, 4, 1), 0.0),
        "w_scale",
        ("> 0", "0.0"),
        value=True,
    ),
    Case(
        "gg4-x_nan",
        "grouped_gemm_w4a8",
        poke("x", (3, 3), NAN),
        "x",
        ("finite",),
        value=True,
    ),
    Case(
        "ggq-qat_weight_with_w_scale",
        "grouped_gemm_qat",
        put(w_scale=torch.ones(E, 5)),
        "w_scale",
        ("None for a float (fake-quant, QAT) weight",),
    ),
    # -- quantize -------------------------------------------------------------------
    Case("qz-x_rank_1", "quantize", put(x=_rand(D)), "x", ("2-D",)),
    Case("qz-x_rank_3", "quantize", put(x=_rand(1, T, D)), "x", ("2-D",)),
    Case("qz-x_dtype", "quantize", put(x=lambda a: a["x"].to(torch.int8)), "x", ("int8",)),
    Case(
        "qz-fmt_unknown",
        "quantize",
        put(fmt="int3_group"),
        "fmt",
        (*map(repr, FORMAT_NAMES), "'int3_group'"),
    ),
    Case("qz-fmt_int", "quantize", put(fmt=3), "fmt", ("'int8_row'",)),
    Case("qz-group_size_zero", "quantize", put(group_size=0), "group_size", ("int >= 1",)),
    Case("qz-group_size_bool", "quantize", put(group_size=True), "group_size", ("bool",)),
    Case(
        "qz-int4_group_odd",
        "quantize",
        put(x=_rand(T, 6), group_size=3),
        "group_size",
        ("even and a divisor of the 6 columns", "3"),
    ),
    Case(
        "qz-int4_group_not_dividing",
        "quantize",
        put(group_size=6),
        "group_size",
        ("divisor of the 8 columns", "6"),
    ),
    Case("qz-x_nan", "quantize", poke("x", (0, 0), NAN), "x", ("finite",), value=True),
    Case("qz-x_inf", "quantize", poke("x", (2, 7), -INF), "x", ("finite",), value=True),
    # -- quant_gemm: QAT (float weight) ---------------------------------------------
    Case("qg-x_rank", "quant_gemm_qat", put(x=_rand(D)), "x", ("2-D",)),
    Case("qg-x_dtype", "quant_gemm_qat", put(x=lambda a: a["x"].to(torch.int8)), "x", ("int8",)),
    Case("qg-w_rank", "quant_gemm_qat", put(w=_rand(1, 5, D)), "w", ("2-D",)),
    Case("qg-w_k_mismatch", "quant_gemm_qat", put(w=_rand(5, 4)), "w", ("K=8", "[5, 4]")),
    Case(
        "qg-scheme_unknown",
        "quant_gemm_qat",
        put(scheme="w2a2"),
        "scheme",
        (*map(repr, SCHEME_NAMES), "'w2a2'"),
    ),
    Case(
        "qg-qat_weight_with_w_scale",
        "quant_gemm_qat",
        put(w_scale=torch.ones(5, 2)),
        "w_scale",
        ("None for a float (fake-quant, QAT) weight", "a scale tensor"),
    ),
    Case(
        "qg-int4_group_odd",
        "quant_gemm_qat",
        put(x=_rand(T, 6), w=_rand(5, 6), group_size=3),
        "group_size",
        ("even", "3"),
    ),
    Case(
        "qg-int4_group_not_dividing",
        "quant_gemm_qat",
        put(group_size=16),
        "group_size",
        ("divisor of the 8 columns", "16"),
    ),
    Case("qg-group_size_zero", "quant_gemm_qat", put(group_size=0), "group_size", (">= 1",)),
    Case("qg-x_nan", "quant_gemm_qat", poke("x", (1, 1), NAN), "x", ("finite",), value=True),
    Case("qg-w_on_meta", "quant_gemm_qat", meta("w"), "w", ("meta",)),
    Case("qg-w_str", "quant_gemm_qat", put(w="w"), "w", ("torch.Tensor", "str")),
    # -- quant_gemm: packed ---------------------------------------------------------
    Case(
        "qg8-w_scale_missing",
        "quant_gemm_w8a8",
        put(w_scale=None),
        "w_scale",
        ("float32 scale tensor for a packed w8a8 weight", "None"),
    ),
    Case("qg8-w_scale_shape", "quant_gemm_w8a8", put(w_scale=torch.ones(4)), "w_scale", ("[4]",)),
    Case("qg8-w_scale_rank", "quant_gemm_w8a8", put(w_scale=torch.ones(5, 1)), "w_scale", ("1-D",)),
    Case(
        "qg8-w_scale_dtype",
        "quant_gemm_w8a8",
        put(w_scale=lambda a: a["w_scale"].half()),
        "w_scale",
        ("float32", "float16"),
    ),
    *_value_scale_cases("quant_gemm_w8a8", "w_scale", 3),
    Case(
        "qg8-w_packed_dtype",
        "quant_gemm_w8a8",
        put(w=lambda a: a["w"].view(torch.uint8)),
        "w",
        ("int8", "uint8"),
    ),
    Case(
        "qg8-w_k_mismatch",
        "quant_gemm_w8a8",
        put(w=torch.ones(5, 7, dtype=torch.int8)),
        "w",
        ("[5, 7]",),
    ),
    Case("qg8-w_scale_on_meta", "quant_gemm_w8a8", meta("w_scale"), "w_scale", ("meta",)),
    Case("qg8-x_inf", "quant_gemm_w8a8", poke("x", (0, 2), INF), "x", ("finite",), value=True),
    Case(
        "qg4-w_packed_dtype",
        "quant_gemm_w4a8",
        put(w=lambda a: a["w"].view(torch.int8)),
        "w",
        ("uint8", "int8"),
    ),
    Case(
        "qg4-w_unpacked_width",
        "quant_gemm_w4a8",
        put(w=torch.zeros(5, D, dtype=torch.uint8)),
        "w",
        ("4", "[5, 8]"),
    ),
    Case(
        "qg4-w_scale_groups_not_dividing_K",
        "quant_gemm_w4a8",
        put(w_scale=torch.ones(5, 3)),
        "w_scale",
        ("dividing K=8", "[5, 3]"),
    ),
    Case(
        "qg4-w_scale_no_groups",
        "quant_gemm_w4a8",
        put(w_scale=torch.ones(5, 0)),
        "w_scale",
        ("dividing K=8", "[5, 0]"),
    ),
    Case(
        "qg4-w_scale_rows",
        "quant_gemm_w4a8",
        put(w_scale=torch.ones(4, 2)),
        "w_scale",
        ("[4, 2]",),
    ),
    Case("qg4-w_scale_rank", "quant_gemm_w4a8", put(w_scale=torch.ones(5)), "w_scale", ("2-D",)),
    Case(
        "qg4-w_scale_odd_group",
        "quant_gemm_w4a8",
        put(x=_rand(T, 6), w=torch.zeros(5, 3, dtype=torch.uint8), w_scale=torch.ones(5, 2)),
        "group_size",
        ("even", "3"),
    ),
    Case(
        "qgf8-w_packed_dtype",
        "quant_gemm_fp8_block",
        put(w=torch.ones(5, D, dtype=torch.int8)),
        "w",
        ("float8_e4m3fn", "int8"),
    ),
    Case(
        "qgf8-w_scale_shape",
        "quant_gemm_fp8_block",
        put(w_scale=torch.ones(2, 1)),
        "w_scale",
        ("[2, 1]",),
    ),
    Case(
        "qgf8-w_scale_rank",
        "quant_gemm_fp8_block",
        put(w_scale=torch.ones(5)),
        "w_scale",
        ("2-D",),
    ),
    *_value_scale_cases("quant_gemm_fp8_block", "w_scale", (0, 0)),
    # -- rms_norm -------------------------------------------------------------------
    Case("rms-x_0d", "rms_norm", put(x=torch.tensor(1.0)), "x", ("at least 1-D", "0-D")),
    Case("rms-x_dtype", "rms_norm", put(x=lambda a: a["x"].long()), "x", ("int64",)),
    Case("rms-weight_shape", "rms_norm", put(weight=_rand(7)), "weight", ("D=8", "[7]")),
    Case("rms-weight_rank", "rms_norm", put(weight=_rand(1, D)), "weight", ("1-D",)),
    Case("rms-weight_dtype", "rms_norm", put(weight=torch.ones(D, dtype=torch.int32)), "weight"),
    *_scalar_cases("rms_norm", "eps"),
    Case("rms-weight_on_meta", "rms_norm", meta("weight"), "weight", ("meta",)),
    Case("rms-x_list", "rms_norm", put(x=[1.0] * D), "x", ("torch.Tensor", "list")),
    # -- mla_prolog -----------------------------------------------------------------
    Case("mla-x_3d", "mla_prolog", put(x=_rand(T, 1, D)), "x", ("2-D",)),
    Case("mla-x_dtype", "mla_prolog", put(x=lambda a: a["x"].long()), "x", ("int64",)),
    Case("mla-w_dq_width", "mla_prolog", put(w_dq=_rand(6, D + 1)), "w_dq", ("hidden=8", "[6, 9]")),
    Case(
        "mla-w_dq_dtype",
        "mla_prolog",
        put(w_dq=lambda a: a["w_dq"].bfloat16()),
        "w_dq",
        ("float32", "bfloat16"),
    ),
    Case("mla-gamma_cq_shape", "mla_prolog", put(gamma_cq=_rand(5)), "gamma_cq", ("q_lora=6",)),
    Case(
        "mla-w_uq_rows",
        "mla_prolog",
        put(w_uq=_rand(2 * 7, 6)),
        "w_uq",
        ("heads * (nope + rope)=16", "[14, 6]"),
    ),
    Case("mla-w_uk_rank", "mla_prolog", put(w_uk=_rand(2, 20)), "w_uk", ("3-D",)),
    Case(
        "mla-w_dkv_rows", "mla_prolog", put(w_dkv=_rand(5 + 3, D)), "w_dkv", ("kv_lora + rope=9",)
    ),
    Case("mla-gamma_ckv_shape", "mla_prolog", put(gamma_ckv=_rand(4)), "gamma_ckv", ("kv_lora=5",)),
    Case("mla-cos_tokens", "mla_prolog", put(cos=_rand(T + 1, 2)), "cos", ("T=3",)),
    Case(
        "mla-cos_empty", "mla_prolog", put(cos=_rand(T, 0), sin=_rand(T, 0)), "cos", ("rope >= 2",)
    ),
    Case("mla-sin_dtype", "mla_prolog", put(sin=lambda a: a["sin"].double()), "sin", ("float64",)),
    *_scalar_cases("mla_prolog", "eps"),
    Case("mla-w_uk_on_meta", "mla_prolog", meta("w_uk"), "w_uk", ("meta",)),
    Case(
        "mla-one_scale",
        "mla_prolog",
        put(w_dq_scale=torch.ones(6)),
        "w_uq_scale",
        ("all three or none", "None"),
    ),
    Case(
        "mla-w8a8_missing_scale",
        "mla_prolog_w8a8",
        put(w_dkv_scale=None),
        "w_dkv_scale",
        ("all three or none",),
    ),
    Case(
        "mla-w8a8_float_weight",
        "mla_prolog_w8a8",
        put(w_uq=_rand(2 * 8, 6)),
        "w_uq",
        ("int8", "float32"),
    ),
    Case(
        "mla-w8a8_scale_rows",
        "mla_prolog_w8a8",
        put(w_uq_scale=torch.ones(15)),
        "w_uq_scale",
        ("w_uq rows=16", "[15]"),
    ),
    Case(
        "mla-w8a8_scale_dtype",
        "mla_prolog_w8a8",
        put(w_dq_scale=lambda a: a["w_dq_scale"].double()),
        "w_dq_scale",
        ("float32", "float64"),
    ),
    Case(
        "mla-w8a8_scale_on_meta", "mla_prolog_w8a8", meta("w_dkv_scale"), "w_dkv_scale", ("meta",)
    ),
    *_value_scale_cases("mla_prolog_w8a8", "w_uq_scale", 3),
    # -- rope -----------------------------------------------------------------------
    Case("rope-x_1d", "rope", put(x=_rand(D)), "x", ("at least 2-D", "1-D")),
    Case("rope-x_dtype", "rope", put(x=lambda a: a["x"].int()), "x", ("int32",)),
    Case(
        "rope-odd_D",
        "rope",
        put(x=_rand(T, 2, 7), cos=_rand(T, 3), sin=_rand(T, 3)),
        "x",
        ("even", "D=7"),
    ),
    Case("rope-cos_width", "rope", put(cos=_rand(T, 3)), "cos", ("D/2=4", "[3, 3]")),
    Case("rope-cos_rows", "rope", put(cos=_rand(2, 4)), "cos", ("T=3", "[2, 4]")),
    Case("rope-sin_shape", "rope", put(sin=_rand(T, 8)), "sin", ("D/2=4", "[3, 8]")),
    Case(
        "rope-cos_dtype",
        "rope",
        put(cos=lambda a: a["cos"].bfloat16()),
        "cos",
        ("float32", "bfloat16"),
    ),
    Case("rope-interleaved_int", "rope", put(interleaved=1), "interleaved", ("a bool", "1")),
    Case("rope-interleaved_none", "rope", put(interleaved=None), "interleaved", ("a bool",)),
    Case("rope-interleaved_str", "rope", put(interleaved="yes"), "interleaved", ("a bool",)),
    Case("rope-cos_on_meta", "rope", meta("cos"), "cos", ("meta",)),
    # -- token_logprobs -------------------------------------------------------------
    Case("tl-hidden_rank", "token_logprobs", put(hidden=_rand(1, T, D)), "hidden", ("2-D",)),
    Case(
        "tl-hidden_dtype",
        "token_logprobs",
        put(hidden=lambda a: a["hidden"].int()),
        "hidden",
        ("int32",),
    ),
    Case(
        "tl-lm_head_dtype_mismatch",
        "token_logprobs",
        put(lm_head=lambda a: a["lm_head"].bfloat16()),
        "lm_head",
        ("of dtype float32", "bfloat16"),
    ),
    Case("tl-lm_head_D", "token_logprobs", put(lm_head=_rand(7, 4)), "lm_head", ("D=8", "[7, 4]")),
    Case(
        "tl-targets_length",
        "token_logprobs",
        put(targets=torch.tensor([0, 1])),
        "targets",
        ("T=3", "[2]"),
    ),
    Case(
        "tl-targets_dtype",
        "token_logprobs",
        put(targets=lambda a: a["targets"].float()),
        "targets",
        ("int32 | int64", "float32"),
    ),
    Case(
        "tl-target_equal_V",
        "token_logprobs",
        poke("targets", 1, 7),
        "targets",
        ("[0, 7)", "7"),
        value=True,
    ),
    Case(
        "tl-target_negative",
        "token_logprobs",
        poke("targets", 2, -1),
        "targets",
        ("[0, 7)", "-1"),
        value=True,
    ),
    *_scalar_cases("token_logprobs", "temperature"),
    Case("tl-targets_on_meta", "token_logprobs", meta("targets"), "targets", ("meta",)),
    Case("tl-lm_head_list", "token_logprobs", put(lm_head=[[0.0] * D] * 7), "lm_head"),
    # -- quantize_weight ------------------------------------------------------------
    Case("qw-w_1d", "quantize_weight", put(w=_rand(D)), "w", ("2-D [N, K] or 3-D", "[8]")),
    Case("qw-w_4d", "quantize_weight", put(w=_rand(1, 1, 5, D)), "w", ("[1, 1, 5, 8]",)),
    Case("qw-w_list", "quantize_weight", put(w=[[1.0] * D]), "w", ("list",)),
    Case(
        "qw-scheme_unknown",
        "quantize_weight",
        put(scheme="w3a3"),
        "scheme",
        (*SCHEME_NAMES, "'w3a3'"),
    ),
    Case(
        "qw-int4_group_odd",
        "quantize_weight",
        put(scheme="w4a16", group_size=3),
        "group_size",
        ("even", "3"),
        op="quantize",
    ),
    Case(
        "qw-int_weight",
        "quantize_weight",
        put(w=lambda a: a["w"].to(torch.int8)),
        "x",
        ("float32 | bfloat16 | float16", "int8"),
        op="quantize",
    ),
]

VALUE_CASES = [c for c in CASES if c.value]
META_CASES = [c for c in CASES if not c.value]

STRICT_CASES: list[Case] = [
    Case("rope-sin_inf", "rope", poke("sin", (2, 3), INF), "sin", ("finite",), value=True),
    Case("rope-cos_nan", "rope", poke("cos", (1, 1), NAN), "cos", ("finite",), value=True),
    Case("mla-sin_inf", "mla_prolog", poke("sin", (0, 1), INF), "sin", ("finite",), value=True),
    Case(
        "mla-x_overflow",
        "mla_prolog",
        put(x=lambda a: a["x"] * 1e19),
        "x",
        ("float32 range", "sum of squares"),
        value=True,
    ),
    Case("li-k_inf", "lightning_indexer", poke("k", (2, 3), INF), "k", ("finite",), value=True),
    Case("li-k_nan", "lightning_indexer", poke("k", (0, 0), NAN), "k", ("finite",), value=True),
    Case("il-k_inf", "indexer_logits", poke("k", (1, 1), -INF), "k", ("finite",), value=True),
    Case(
        "sa-scores_overflow",
        "sparse_attention",
        put(k=lambda a: torch.full_like(a["k"], 1e38)),  # the cache bounds the scores
        "scale",
        ("float32 range", "max|k|"),
        value=True,
    ),
]


def _ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


@pytest.fixture(autouse=True)
def _default_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLMPORT_VALIDATE", raising=False)


def _check_error(case: Case, err: glmport.OpInputError) -> None:
    msg = str(err)
    assert (err.op, err.arg) == (case.error_op, case.arg), msg
    assert err.expected and err.got, msg
    assert f"glmport.ops.{case.error_op}: argument '{case.arg}'" in msg
    assert err.expected in msg and err.got in msg
    for text in case.expect:
        assert text in msg, f"{text!r} not in {msg!r}"


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_public_op_has_error_cases() -> None:
    covered = {GOOD[c.good][0] for c in CASES}
    assert covered == set(glmport.ops.__all__)


@pytest.mark.parametrize("good", list(GOOD))
def test_good_call_is_accepted(good: str) -> None:
    """The starting points are valid, so each case's error comes from its mutation."""
    op, build = GOOD[good]
    out = getattr(glmport.ops, op)(**build())
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, torch.Tensor) for o in outs)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_bad_input_raises_op_input_error(case: Case) -> None:
    with pytest.raises(glmport.OpInputError) as info:
        case.call()
    _check_error(case, info.value)


@pytest.mark.parametrize("case", VALUE_CASES, ids=_ids(VALUE_CASES))
def test_validate_meta_skips_value_checks(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    try:
        case.call()
    except glmport.OpInputError as err:
        pytest.fail(f"GLMPORT_VALIDATE=meta still ran a value check: {err}")
    except (RuntimeError, IndexError, ValueError):
        pass  # the kernel may fail on its own on the bad values; validation did not


@pytest.mark.parametrize("mode", ["full", None])
@pytest.mark.parametrize("case", VALUE_CASES[:3], ids=_ids(VALUE_CASES[:3]))
def test_validate_full_runs_value_checks(
    case: Case, mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode is not None:
        monkeypatch.setenv("GLMPORT_VALIDATE", mode)
    with pytest.raises(glmport.OpInputError) as info:
        case.call()
    _check_error(case, info.value)


@pytest.mark.parametrize("case", META_CASES, ids=_ids(META_CASES))
def test_validate_meta_keeps_metadata_checks(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMPORT_VALIDATE", "meta")
    with pytest.raises(glmport.OpInputError) as info:
        case.call()
    _check_error(case, info.value)


@pytest.mark.parametrize("case", STRICT_CASES, ids=_ids(STRICT_CASES))
def test_validate_strict_scans_whole_caches(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMPORT_VALIDATE", "strict")
    with pytest.raises(glmport.OpInputError) as info:
        case.call()
    _check_error(case, info.value)


@pytest.mark.parametrize("mode", ["full", "meta"])
@pytest.mark.parametrize("case", STRICT_CASES, ids=_ids(STRICT_CASES))
def test_whole_cache_scans_are_strict_only(
    case: Case, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default reads no whole cache before the kernel: a non-finite key or an
    overflowing one passes its checks. Under meta it propagates NaN / inf into the
    result, as any torch op would; under full, where the result shows NaN or inf, the
    strict checks run after the kernel and refuse the call as strict would."""
    monkeypatch.setenv("GLMPORT_VALIDATE", mode)
    try:
        case.call()
    except glmport.OpInputError as err:
        assert mode == "full", err
        _check_error(case, err)


@pytest.mark.parametrize(
    "case", VALUE_CASES[:3] + META_CASES[:3], ids=_ids(VALUE_CASES[:3] + META_CASES[:3])
)
def test_validate_strict_keeps_the_full_checks(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMPORT_VALIDATE", "strict")
    with pytest.raises(glmport.OpInputError) as info:
        case.call()
    _check_error(case, info.value)


_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("validation_cases", sys.argv[1])
mod = sys.modules["validation_cases"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
import glmport
report = {}
for case in mod.CASES:
    try:
        case.call()
        report[case.id] = "no error"
    except glmport.OpInputError as err:
        report[case.id] = "ok" if err.arg == case.arg else f"arg {err.arg}"
    except Exception as err:
        report[case.id] = type(err).__name__
print(json.dumps(report))
"""


def test_bad_calls_do_not_crash_the_process() -> None:
    """Every bad call, run in a fresh interpreter: it must survive them all and each
    must have raised glmport's error (not a segfault, abort or another exception)."""
    assert importlib.util.find_spec("glmport") is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    # The module imports its neighbours in tests/ (hang_guard), as pytest lets it.
    env["PYTHONPATH"] = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, __file__],
        capture_output=True,
        text=True,
        timeout=guard_s(60),
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {c.id for c in CASES}
    bad = {k: v for k, v in report.items() if v != "ok"}
    assert not bad
