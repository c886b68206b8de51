"""Reference MLA prolog: the formula of ``glmport.ops.mla_prolog``, step by step, each
named intermediate rounded to ``x``'s dtype (none in float64 mode)."""

from __future__ import annotations

import torch

from .norm_rope import rms_norm, rope
from .precision import acc_dtype, out_dtype


def _linear(a: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ w.T`` accumulated in the compute dtype, rounded to ``dtype``."""
    return (a.to(acc_dtype()) @ w.to(acc_dtype()).T).to(dtype)


def mla_prolog(x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, eps=1e-6):
    dtype = out_dtype(x.dtype)
    t = x.shape[0]
    heads, nope, kv_lora = w_uk.shape
    q_norm = rms_norm(_linear(x, w_dq, dtype), gamma_cq, eps)
    q = _linear(q_norm, w_uq, dtype).view(t, heads, w_uq.shape[0] // heads)
    q_latent = torch.einsum("thn,hnc->thc", q[..., :nope].to(acc_dtype()), w_uk.to(acc_dtype()))
    kv = _linear(x, w_dkv, dtype)
    return (
        q_latent.to(dtype),
        rope(q[..., nope:], cos, sin, True),
        q_norm,
        rms_norm(kv[:, :kv_lora], gamma_ckv, eps),
        rope(kv[:, kv_lora:], cos, sin, True),
    )
