"""Op specs: the contract every backend implements.

Each op is declared once as an :class:`OpSpec` (schema, checks, fake kernel, the
features a backend's capabilities are matched against, which inputs are
differentiable). The family modules hold the specs and the documented public calls;
``glmport.core.library`` turns each spec into ``torch.ops.glmport.<name>``.
"""

from __future__ import annotations

from .attention import SPARSE_ATTENTION
from .base import OpSpec
from .indexer import INDEXER_LOGITS, LIGHTNING_INDEXER
from .logprobs import TOKEN_LOGPROBS
from .mla import MLA_PROLOG
from .moe import GROUPED_GEMM, MOE_COMBINE, MOE_DISPATCH, MOE_GATE
from .norm_rope import RMS_NORM, ROPE
from .quant import QUANT_GEMM, QUANTIZE

SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        LIGHTNING_INDEXER,
        INDEXER_LOGITS,
        SPARSE_ATTENTION,
        MOE_GATE,
        MOE_DISPATCH,
        MOE_COMBINE,
        GROUPED_GEMM,
        QUANTIZE,
        QUANT_GEMM,
        RMS_NORM,
        ROPE,
        TOKEN_LOGPROBS,
        MLA_PROLOG,
    )
}
OP_NAMES: tuple[str, ...] = tuple(SPECS)
# Parts of the interface that are not single tensor ops: a backend provides each as a
# factory in its kernel table (see ``glmport.core.expert_parallel``).
COMPONENT_NAMES: tuple[str, ...] = ("expert_parallel",)
INTERFACE_NAMES: tuple[str, ...] = (*OP_NAMES, *COMPONENT_NAMES)

__all__ = ["COMPONENT_NAMES", "INTERFACE_NAMES", "OP_NAMES", "SPECS", "OpSpec"]
