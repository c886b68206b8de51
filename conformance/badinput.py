"""Malformed calls every backend must reject with the same glmport error.

Each entry mutates one argument of an op's ``tiny`` float32 case; the backend must
raise :class:`~glmport.core.errors.OpInputError` naming that argument. Sizes too: an
int argument past int32, an argument broadcast (stride 0) beyond any device's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BadInput:
    op: str
    name: str
    arg: str
    mutate: Callable[[object], object]  # the good value of ``arg`` -> the bad one

    @property
    def id(self) -> str:
        return f"{self.op}-bad-{self.name}"


def _fill(value):
    return lambda t: torch.full_like(t, value)


def _set_first(value):
    def mutate(t):
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return mutate


def _broadcast_rows(rows: int):
    """The first row expanded to ``rows`` (stride 0): as large as its shape, no memory."""
    return lambda t: t[:1].expand(rows, *t.shape[1:])


def _int_table(dtype: torch.dtype):
    """An integer tensor where an optional argument was None (a one-entry table)."""
    return lambda _: torch.zeros(1, 1, dtype=dtype)


# Beyond any device's memory in every dtype, and past what kernels take as an int32.
HUGE_ROWS = 2**40
INT32_PAST = 2**31

BAD_INPUTS: tuple[BadInput, ...] = (
    BadInput("sparse_attention", "index_past_n", "indices", _fill(10**6)),
    BadInput("sparse_attention", "index_below_minus_one", "indices", _fill(-2)),
    BadInput("sparse_attention", "int_query", "q", lambda q: q.to(torch.int32)),
    BadInput("sparse_attention", "zero_scale", "scale", lambda s: 0.0),
    BadInput("sparse_attention", "nan_scale", "scale", lambda s: float("nan")),
    BadInput("sparse_attention", "key_dim_mismatch", "k", lambda k: k[..., :-1]),
    BadInput("sparse_attention", "int_need_lse", "need_lse", lambda _: 1),
    BadInput("sparse_attention", "int_rope_key", "k_rope", _int_table(torch.int32)),
    BadInput("lightning_indexer", "k_end_past_n", "k_end", _fill(10**6)),
    BadInput("lightning_indexer", "negative_k_start", "k_start", _fill(-1)),
    BadInput("lightning_indexer", "topk_zero", "topk", lambda k: 0),
    BadInput("lightning_indexer", "weights_fp16", "weights", lambda w: w.half()),
    BadInput("lightning_indexer", "nan_query", "q", _set_first(float("nan"))),
    BadInput("lightning_indexer", "topk_past_int32", "topk", lambda k: INT32_PAST),
    BadInput("lightning_indexer", "keys_past_memory", "k", _broadcast_rows(HUGE_ROWS)),
    BadInput("lightning_indexer", "int64_block_table", "block_table", _int_table(torch.int64)),
    BadInput("lightning_indexer", "int_need_scores", "need_scores", lambda _: 1),
    BadInput("indexer_logits", "start_after_end", "k_start", lambda s: s + 10**3),
    BadInput("moe_gate", "top_k_too_large", "top_k", lambda k: 10**3),
    BadInput("moe_gate", "unknown_score_func", "score_func", lambda f: "relu"),
    BadInput("moe_gate", "nan_logits", "logits", _set_first(float("nan"))),
    BadInput("moe_dispatch", "expert_id_past_e", "ids", _fill(10**3)),
    BadInput("moe_dispatch", "num_experts_past_int32", "num_experts", lambda e: INT32_PAST),
    BadInput("moe_combine", "repeated_src_row", "src_row", torch.zeros_like),
    BadInput("grouped_gemm", "offsets_short_of_m", "expert_offsets", lambda o: o // 2),
    BadInput("quantize", "unknown_format", "fmt", lambda f: "int3_row"),
    BadInput("quantize", "inf_input", "x", _set_first(float("inf"))),
    BadInput("quant_gemm", "unknown_scheme", "scheme", lambda s: "w2a2"),
    BadInput("quant_gemm", "negative_scale", "w_scale", lambda s: -s),
    BadInput("rms_norm", "weight_size", "weight", lambda w: w[:-1]),
    BadInput("rms_norm", "zero_eps", "eps", lambda e: 0.0),
    BadInput("rope", "cos_shape", "cos", lambda c: c[:, :-1]),
    BadInput("token_logprobs", "target_past_v", "targets", _fill(10**6)),
    BadInput("token_logprobs", "zero_temperature", "temperature", lambda t: 0.0),
    BadInput("token_logprobs", "vocab_past_memory", "lm_head", _broadcast_rows(HUGE_ROWS)),
)
