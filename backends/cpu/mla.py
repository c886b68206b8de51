"""Reference MLA prolog: the formula of ``glmport.ops.mla_prolog``, step by step, each
named intermediate rounded to ``x``'s dtype (none in float64 mode)."""

from __future__ import annotations

import torch

from glmport.core.formats import dequantize, quantize_tensor

from .norm_rope import rms_norm, rope
from .precision import acc_dtype, out_dtype
from .quant import quant_gemm


def _linear(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    dtype: torch.dtype,
    x_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ w.T`` accumulated in the compute dtype, rounded to ``dtype``. For a packed
    ``w`` (W8A8) ``quant_gemm`` quantises ``a`` as the contract names it, in ``x_dtype``,
    in float64 mode too (see :func:`mla_prolog`)."""
    if w_scale is not None:
        return quant_gemm(a.to(x_dtype), w, w_scale, "w8a8").to(dtype)
    return (a.to(acc_dtype()) @ w.to(acc_dtype()).T).to(dtype)


def mla_prolog(
    x,
    w_dq,
    gamma_cq,
    w_uq,
    w_uk,
    w_dkv,
    gamma_ckv,
    cos,
    sin,
    eps=1e-6,
    w_dq_scale=None,
    w_uq_scale=None,
    w_dkv_scale=None,
):
    dtype = out_dtype(x.dtype)
    t = x.shape[0]
    heads, nope, kv_lora = w_uk.shape
    # W8A8 quantises q_norm, a step function of it: the roundings the contract names
    # before that step (x @ w_dq.T, q_norm) are taken in float64 mode too, so the codes
    # are a correct kernel's, not where unrounded values would cross a code edge.
    before_codes = x.dtype if w_uq_scale is not None else dtype
    q_norm = rms_norm(_linear(x, w_dq, w_dq_scale, before_codes, x.dtype), gamma_cq, eps)
    if w_uq_scale is not None:  # as the W8A8 up-projection reads it (product exact)
        cols = q_norm.shape[1]
        codes, scale = quantize_tensor(q_norm.to(x.dtype), "int8_row", cols)
        q_norm = dequantize(codes, scale, "int8_row", cols, dtype=acc_dtype()).to(dtype)
    q = _linear(q_norm, w_uq, w_uq_scale, dtype, x.dtype).view(t, heads, w_uq.shape[0] // heads)
    q_latent = torch.einsum("thn,hnc->thc", q[..., :nope].to(acc_dtype()), w_uk.to(acc_dtype()))
    kv = _linear(x, w_dkv, w_dkv_scale, dtype, x.dtype)
    return (
        q_latent.to(dtype).contiguous(),  # einsum leaves it head-major in memory
        rope(q[..., nope:], cos, sin, True),
        q_norm,
        rms_norm(kv[:, :kv_lora], gamma_ckv, eps),
        rope(kv[:, kv_lora:], cos, sin, True),
    )
