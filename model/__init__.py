"""glmport.model: GLM-5 (and DeepSeek-V3.2) written against glmport ops.

HF-compatible configuration and weight names, packed (varlen) batches, the lightning
indexer with top-k sparse attention, MoE, and MTP layers.
"""

from .causal_lm import GlmMoeDsaForCausalLM
from .config import GlmMoeDsaConfig

__all__ = ["GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"]
