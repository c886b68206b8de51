"""The conformance cases, as data: per op, shape families x dtypes, each a seeded
builder of the op's arguments (schema order, CPU tensors).

One module per op family (``attention``, ``indexer``, ``moe``, ``quant``,
``norm_rope``, ``logprobs``, ``mla``), the machinery they share in ``base`` (:class:`~.base.Case`),
and two families made from the others' calls: ``layout`` and ``magnitude``.

Families: ``tiny``; ``glm5`` (GLM-5's real head counts and widths where affordable:
absorbed attention with 64 heads, Dk 576 / Dv 512; indexer 32 x 128 with topk 2048;
MoE 256 experts top-8, reduced width); ``edge`` (T=1, N < topk, empty key ranges,
every index -1, ragged ranges of packed sequences, topk not a multiple of 64, paged
slot ids, tied scores); ``layout`` (one tensor argument of a small call in a
non-contiguous or stride-0 view, :func:`~.layout.layout_cases`). ``full_only`` cases
run only with ``--full``.
"""

from __future__ import annotations

from .attention import attention_cases
from .base import Case
from .indexer import indexer_cases
from .layout import layout_cases
from .logprobs import logprob_cases
from .magnitude import magnitude_cases
from .mla import mla_cases
from .moe import moe_cases
from .norm_rope import norm_rope_cases
from .quant import quant_cases


def all_cases(*, full: bool = False, ops: tuple[str, ...] | None = None) -> list[Case]:
    """Every value case of the suite for the chosen mode and ops, in a stable order."""
    cases = [
        *attention_cases(),
        *indexer_cases(),
        *moe_cases(),
        *quant_cases(),
        *norm_rope_cases(),
        *logprob_cases(),
        *mla_cases(),
    ]
    wanted = [c for c in cases if ops is None or c.op in ops]
    wanted += magnitude_cases(wanted, full=full)
    wanted += layout_cases(wanted, ops=ops, full=full)
    return [c for c in wanted if full or not c.full_only]
