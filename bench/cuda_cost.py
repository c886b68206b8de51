"""A byte / FLOP / occupancy model of the cuda backend's decode and prefill attention and
its lightning indexer at GLM-5's shapes, beside the anchors' records.

Per call: bytes from HBM (what the kernels must read and write once; the decode
partials, written and read back by the combine, are listed apart: at these sizes they
stay in an H200's 50 MB L2), FLOPs, programs launched (from the backend's own host
plan: head blocks and decode splits of attention, key splits of the indexer), the
roofline's time
at the device's HBM bandwidth and bf16 / fp8 tensor peak, and the MMA kind the compile
table found (``bench/cuda_compile.py``). ``bytes_per_query`` of the attention is set
against one gather of the selected latent rows (``topk x Dk x 2 B``): the target is
1.2x.

The previous attention design (32-head blocks, keys in 64-column chunks and values
loaded again: each selected row read twice per head block) is a row of its own, for
the redesign's sake.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# HBM TB/s, dense bf16 and fp8 tensor TFLOPS, SMs.
H200 = {"name": "H200", "tbs": 4.8, "bf16": 989.0, "fp8": 1979.0, "sms": 132}
# The anchors' records (docs/benchmarks.md, ../shared/reference/ANCHORS.md).
ANCHORS = {
    "FlashMLA sparse decode, H800": "410 TFLOPS",
    "FlashMLA sparse prefill, H800": "640 TFLOPS",
    "DeepGEMM FP8 GEMM, H800": "~1550 TFLOPS",
    "H200 HBM3e": "4.8 TB/s",
}
COMPILE_RESULTS = Path(__file__).parent / "results" / "cuda_compile_glm5.json"


@dataclass(frozen=True)
class Shapes:
    """GLM-5's attention and indexer shapes (GLM5.md)."""

    heads: int = 64
    dk: int = 576
    dv: int = 512
    topk: int = 2048
    index_heads: int = 32
    index_dim: int = 128


def _mma_kinds() -> dict[tuple[str, str, str], str]:
    """``(kernel, arch, dtype) -> MMA kinds`` of the default configs in the GLM-5 compile
    table (``bench/results/cuda_compile_glm5.json``), where it has been run."""
    if not COMPILE_RESULTS.exists():
        return {}
    kinds: dict[tuple[str, str, str], set] = {}
    for row in json.loads(COMPILE_RESULTS.read_text())["rows"]:
        if "error" not in row and row.get("config") in (0, None):
            dtype = row["case"].split("-")[2]
            kinds.setdefault((row["kernel"], row["arch"], dtype), set()).add(row["mma"])
    return {k: "/".join(sorted(v)) for k, v in kinds.items()}


def attention_plan(tokens: int, shapes: Shapes, device: torch.device) -> dict:
    """Head blocks and decode splits the backend plans for ``tokens`` absorbed-MLA bf16
    queries (call under ``runtime.gpu_plan`` when no GPU is present)."""
    from glmport.backends.cuda import attention

    meta = torch.device("meta")
    kv = torch.empty(1, 1, shapes.dk, dtype=torch.bfloat16, device=meta)
    q = torch.empty(1, shapes.heads, shapes.dk, dtype=torch.bfloat16, device=meta)
    block = attention.head_block(q, kv, kv[..., : shapes.dv])
    blocks = math.ceil(shapes.heads / block)
    split = attention.plan_split_len(tokens, 1, blocks, shapes.topk, device)
    splits = math.ceil(shapes.topk / split)
    return {"head_block": block, "head_blocks": blocks, "splits": splits}


def attention_rows(tokens: int, phase: str, shapes: Shapes, device: torch.device) -> list[dict]:
    """The new design's row and the previous design's row for ``tokens`` queries."""
    s, elem = shapes, 2
    plan = attention_plan(tokens, s, device)
    one_gather = s.topk * s.dk * elem
    q_out = s.heads * (s.dk + s.dv) * elem + s.topk * 4  # q, out, the index row
    partials = plan["splits"] * s.heads * (s.dv + 2) * 4 * 2 if plan["splits"] > 1 else 0
    flops = 2.0 * s.heads * s.topk * (s.dk + s.dv)
    old_gather = 2 * s.topk * (s.dk + s.dv) * elem  # two 32-head blocks, K and V apart
    rows = []
    for design, gather, programs in (
        ("latent path (one gather)", one_gather, tokens * plan["head_blocks"] * plan["splits"]),
        ("previous (2 x 32 heads, K and V)", old_gather, None),
    ):
        per_query = gather + q_out
        rows.append(
            {
                "kernel": "sparse_attention",
                "phase": phase,
                "design": design,
                "tokens": tokens,
                "bytes_per_query": per_query,
                "vs_one_gather": per_query / one_gather,
                "l2_partials_per_query": partials if programs is not None else None,
                "flops_per_query": flops,
                "programs": programs,
                "plan": plan if programs is not None else None,
            }
        )
    return rows


def indexer_rows(tokens: int, keys: int, shapes: Shapes, device: torch.device) -> list[dict]:
    """The lightning indexer (fp8 keys) over ``keys`` keys: the programs of the
    backend's plan (splits of each query's keys in decode, a program per query in
    prefill) and the splits' sorted lists, written and merged through L2."""
    from glmport.backends.cuda import indexer

    s = shapes
    split = indexer.plan_key_split(tokens, keys, s.topk, device)
    splits = math.ceil(keys / split)
    local = 1 << indexer.log_tile(min(s.topk, split), split)
    key_bytes = keys * (s.index_dim + 4)  # e4m3 rows and their fp32 scales
    return [
        {
            "kernel": "lightning_indexer",
            "phase": "decode" if splits > 1 else "prefill",
            "design": f"fp8, {splits} split(s) of {split} keys a query",
            "tokens": tokens,
            "keys": keys,
            "bytes_per_query": key_bytes + s.topk * 8,
            "l2_partials_per_query": splits * local * 8 * 2 if splits > 1 else 0,
            "flops_per_query": 2.0 * s.index_heads * s.index_dim * keys,
            "programs": tokens * splits,
        }
    ]


def roofline(row: dict, device: dict) -> dict:
    """Time bounds of one call on ``device``: HBM-bound (every query's bytes read once:
    decode; prefill's queries share key rows through L2, so this is an upper bound
    there) and tensor-bound, the SM fill, and the rate the bound allows."""
    tokens = row["tokens"]
    peak = device["fp8" if row["kernel"] == "lightning_indexer" else "bf16"]
    hbm_us = tokens * row["bytes_per_query"] / (device["tbs"] * 1e12) * 1e6
    mma_us = tokens * row["flops_per_query"] / (peak * 1e12) * 1e6
    bound_us = max(hbm_us, mma_us)
    out = {"hbm_us": hbm_us, "tensor_us": mma_us, "bound_tflops": mma_us / bound_us * peak}
    if row["programs"] is not None:
        out["sm_fill"] = min(1.0, row["programs"] / device["sms"])
    return out


def model_rows(device: torch.device, shapes: Shapes | None = None) -> list[dict]:
    """Every row of the model at GLM-5's decode (batch 1, 64, 128) and prefill (4096
    queries) shapes and the indexer's (batch-1 decode and 128 queries at 65536 keys,
    2048 queries at 16384), each with its roofline on an H200 and MMA kinds."""
    s = shapes or Shapes()
    rows = []
    for tokens, phase in ((1, "decode"), (64, "decode"), (128, "decode"), (4096, "prefill")):
        rows += attention_rows(tokens, phase, s, device)
    for tokens, keys in ((1, 65536), (128, 65536), (2048, 16384)):
        rows += indexer_rows(tokens, keys, s, device)
    kinds = _mma_kinds()
    # Each kernel in its production dtype: bf16 attention, fp8 indexer.
    names = {
        "sparse_attention": ("_attention_kernel", "bfloat16"),
        "lightning_indexer": ("_lightning_kernel", "float8_e4m3fn"),
    }
    for row in rows:
        row |= roofline(row, H200)
        if row["programs"] is not None:
            kernel, dtype = names[row["kernel"]]
            row["mma"] = {a: v for (k, a, d), v in kinds.items() if (k, d) == (kernel, dtype)}
    return rows
