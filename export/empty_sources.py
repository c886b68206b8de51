"""Op calls whose index inputs have no row to point at, answered from the shapes alone.

The exported bodies of ``sparse_attention`` and ``grouped_gemm`` gather one row of
``k`` / ``v`` or of ``w`` for every index, an ignored index included (it gathers row 0
and the result masks it out). With no row at all (``N = 0`` keys, ``E = 0`` experts)
that gather reads past the end of an empty tensor: TVM reads unowned memory (a
segfault), onnxruntime fails with an untyped error. Such a call has a result that
docs/ops.md fixes for every index ("What a kernel may assume under
GLMPORT_VALIDATE=meta": no slot is left, no row belongs to an expert), so the
onnxruntime and tvm backends return it without running a graph. The model's own
graphs never make such a call: their key and expert counts are at least 1.
"""

from __future__ import annotations

import math

import torch

from glmport.core.specs import SPECS


def result_without_source_rows(op: str, args: tuple) -> object | None:
    """The result of ``op`` on ``args`` (schema order) when its index inputs can name no
    row: ``sparse_attention`` with ``k`` of 0 keys gives out 0 ``[T, H, Dv]`` in q's dtype
    and lse ``-inf`` ``[T, H]`` fp32; ``grouped_gemm`` with ``w`` of 0 experts gives 0
    ``[M, N]`` in x's dtype. None for every other call (run the graph)."""
    if op == "sparse_attention" and args[1].shape[0] == 0:
        out, lse = SPECS[op].fake(*args)  # lse [T, H], or [0] without need_lse
        return torch.zeros_like(out), torch.full_like(lse, -math.inf)
    if op == "grouped_gemm" and args[1].shape[0] == 0:
        return torch.zeros_like(SPECS[op].fake(*args))
    return None
