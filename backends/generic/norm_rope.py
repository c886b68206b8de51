"""RMSNorm and RoPE: the reference's code is already device-neutral, elementwise and
memory-light, so the generic backend uses it as is."""

from glmport.backends.cpu.norm_rope import rms_norm, rope

__all__ = ["rms_norm", "rope"]
