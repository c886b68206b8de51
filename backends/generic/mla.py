"""The MLA prolog as torch ops on any device: the two down-projections, the query
up-projection and the per-head ``W_UK`` absorption as GEMMs in ``x``'s dtype, the norms
and one rope call (query heads and key row together) through this backend's kernels."""

from __future__ import annotations

import torch

from glmport.core.formats import fake_quant_activation

from .norm_rope import rms_norm, rope
from .quant import quant_gemm


def _linear(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """``a @ w.T`` in ``a``'s dtype; W8A8's ``quant_gemm`` for a packed ``w``."""
    return a @ w.T if w_scale is None else quant_gemm(a, w, w_scale, "w8a8")


def mla_prolog(
    x: torch.Tensor,
    w_dq: torch.Tensor,
    gamma_cq: torch.Tensor,
    w_uq: torch.Tensor,
    w_uk: torch.Tensor,
    w_dkv: torch.Tensor,
    gamma_ckv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    w_dq_scale: torch.Tensor | None = None,
    w_uq_scale: torch.Tensor | None = None,
    w_dkv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``glmport.ops.mla_prolog`` (shapes there): ``x [T, hidden]`` to ``q_latent [T, H,
    kv_lora]``, ``q_rope [T, H, rope]``, ``q_norm [T, q_lora]``, ``kv_latent [T,
    kv_lora]``, ``k_rope [T, rope]`` in ``x``'s dtype."""
    t = x.shape[0]
    heads, nope, kv_lora = w_uk.shape
    q_norm = rms_norm(_linear(x, w_dq, w_dq_scale), gamma_cq, eps)
    if w_uq_scale is not None:  # as the W8A8 up-projection reads it
        q_norm = fake_quant_activation(q_norm, "w8a8").to(x.dtype)
    q = _linear(q_norm, w_uq, w_uq_scale).view(t, heads, w_uq.shape[0] // heads)
    # Per-head GEMMs over the token axis: [H, T, nope] @ [H, nope, kv_lora].
    q_latent = torch.matmul(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)
    kv = _linear(x, w_dkv, w_dkv_scale)
    pe = rope(torch.cat((q[..., nope:], kv[:, None, kv_lora:]), dim=1), cos, sin, True)
    return (
        q_latent.contiguous(),
        pe[:, :heads].contiguous(),
        q_norm,
        rms_norm(kv[:, :kv_lora], gamma_ckv, eps),
        pe[:, heads].contiguous(),
    )
