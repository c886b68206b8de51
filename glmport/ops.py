"""The public op calls: ``glmport.ops.<name>(...)``.

Each runs ``torch.ops.glmport.<name>`` on the backend selected by ``GLMPORT_BACKEND``
(or :func:`glmport.use_backend`); shapes, dtypes and semantics are in each docstring
and in ``docs/ops.md``.
"""

from glmport.core import library as _library  # noqa: F401  (registers torch.ops.glmport.*)
from glmport.core.specs.attention import sparse_attention
from glmport.core.specs.indexer import indexer_logits, lightning_indexer
from glmport.core.specs.logprobs import token_logprobs
from glmport.core.specs.mla import mla_prolog
from glmport.core.specs.moe import grouped_gemm, moe_combine, moe_dispatch, moe_gate
from glmport.core.specs.norm_rope import rms_norm, rope
from glmport.core.specs.quant import quant_gemm, quantize, quantize_weight

__all__ = [
    "grouped_gemm",
    "indexer_logits",
    "lightning_indexer",
    "mla_prolog",
    "moe_combine",
    "moe_dispatch",
    "moe_gate",
    "quant_gemm",
    "quantize",
    "quantize_weight",
    "rms_norm",
    "rope",
    "sparse_attention",
    "token_logprobs",
]
