"""Family ``layout``: small calls of every op with one tensor argument in a
non-contiguous or stride-0 view of :mod:`glmport.conformance.layouts`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from glmport.core.errors import OpInputError
from glmport.core.formats import FP8_DTYPE
from glmport.core.specs import SPECS, OpSpec
from glmport.core.validate import Level

from ..layouts import LAYOUTS, relayout
from .attention import attention_builder
from .base import Case, per_dtype, prefix_width
from .indexer import indexer_builder, paged_indexer_builder

# The calls whose tensor arguments the layout family re-lays out, one at a time: small
# cases of every op (every scheme and format), inside every built-in backend's declared
# limits where a limit allows a small case (ascend: attention Dk 576, indexer Di 128).
# Named cases of the op families' modules (cases/attention.py ...), by (op, name) ...
LAYOUT_BASES = (
    ("sparse_attention", "tiny_gqa"),
    ("moe_gate", "grouped"),
    ("moe_dispatch", "tiny"),
    ("moe_combine", "tiny"),
    ("grouped_gemm", "tiny"),
    ("quantize", "tiny"),
    ("quant_gemm", "tiny"),
    ("quant_gemm", "qat"),
    ("rms_norm", "t1_3d"),
    ("rope", "tiny_interleaved"),
    ("rope", "tiny_half"),
    ("token_logprobs", "tiny"),
    ("mla_prolog", "tiny"),
    ("mla_prolog", "tiny_w8a8"),
)


# ... and the dtypes quick mode takes of them (the others run with --full); a case
# with none of these (fp32-only router logits, QAT) keeps the dtypes it has.
LAYOUT_QUICK_DTYPES = (torch.bfloat16, FP8_DTYPE)


def _layout_only_bases() -> Iterator[Case]:
    """Bases of the layout family alone: absorbed MLA attention and a 128-dim indexer
    (the shapes the ascend adapters take), small enough for an interpreter."""
    absorbed = dict(t=3, h=4, hkv=1, dk=576, dv=512, n=24, k=8, absorbed=True)
    yield from per_dtype(
        "sparse_attention", "absorbed_small", "edge", absorbed, attention_builder(**absorbed)
    )
    split = {**absorbed, "n": 32, "split_rope": True}  # the paged cache's pools
    yield from per_dtype(
        "sparse_attention", "split_small", "edge", split, attention_builder(**split)
    )
    paged = dict(hi=4, di=128, topk=8, block_size=16, blocks=6, queries=((20, 1), (40, 2)))
    yield from per_dtype(
        "lightning_indexer", "paged_d128", "edge", paged, paged_indexer_builder(**paged),
        judge="indexer",
    )  # fmt: skip
    index = dict(t=5, hi=4, di=128, n=40, topk=8, ranges="staggered")
    for op, logits in (("lightning_indexer", False), ("indexer_logits", True)):
        judge = "logits" if logits else "indexer"
        plain = indexer_builder(**index, logits=logits)
        yield from per_dtype(op, "d128", "edge", index, plain, judge=judge)
        fp8 = indexer_builder(**index, logits=logits, fp8=True)  # quantises fp32 data itself
        yield from per_dtype(
            op, "d128", "edge", index, lambda g, _, fp8=fp8: fp8(g, torch.float32),
            dtypes=(FP8_DTYPE,), judge=judge,
        )  # fmt: skip


def layout_cases(
    cases: list[Case], *, ops: tuple[str, ...] | None = None, full: bool = False
) -> list[Case]:
    """Family ``layout``: each base call (:data:`LAYOUT_BASES` among ``cases``, and
    :func:`_layout_only_bases`) once per tensor argument and layout of
    :data:`~glmport.conformance.layouts.LAYOUTS`, that argument in that view, the
    others as built. A variant is kept where it is a valid call (glmport's full
    checks pass on it): a broadcast ``src_row`` is no permutation, broadcast
    ``expert_offsets`` do not rise from 0 to M. A view of another argument (absorbed
    ``v``) is re-laid out with it, not alone. Quick mode takes the bases in
    :data:`LAYOUT_QUICK_DTYPES`; the other dtypes are ``full_only``."""
    named = [c for c in cases if (c.op, c.name) in LAYOUT_BASES]
    bases = [*named, *(c for c in _layout_only_bases() if ops is None or c.op in ops)]
    dtypes_of: dict[tuple, set[torch.dtype]] = {}
    for c in bases:
        dtypes_of.setdefault((c.op, c.name, c.scheme), set()).add(c.dtype)
    out = []
    for base in bases:
        has_quick = dtypes_of[(base.op, base.name, base.scheme)] & set(LAYOUT_QUICK_DTYPES)
        quick = base.dtype in LAYOUT_QUICK_DTYPES or not has_quick
        if not (quick or full):
            continue
        args = base.args()
        spec = SPECS[base.op]
        for pos, arg in enumerate(spec.arg_names):
            if not isinstance(args[pos], torch.Tensor) or _is_view_of_another(args, pos):
                continue
            for layout in LAYOUTS:
                case = replace(base, family="layout", layout=(arg, layout), full_only=not quick)
                if relayout(args[pos], layout) is not None and _valid(spec, case.args()):
                    out.append(case)
    return out


def _valid(spec: OpSpec, args: tuple) -> bool:
    try:
        spec.validate(args, values=Level.FULL)
    except OpInputError:
        return False
    return True


def _is_view_of_another(args: tuple, pos: int) -> bool:
    return any(prefix_width(a, args[pos]) is not None for i, a in enumerate(args) if i != pos)
