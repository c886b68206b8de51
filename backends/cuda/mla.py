"""The MLA prolog: cuBLAS GEMMs and one Triton kernel for the per-token work between them.

The four projections are GEMMs (``x @ w_dq.T`` and ``x @ w_dkv.T`` from ``x``, the
query up-projection, the per-head ``W_UK`` absorption): torch's cuBLAS calls, which a
Triton GEMM would not beat at these shapes. What lies between the down-projections and
the rest is memory-bound and per token: the query latent's RMSNorm, the key latent's
RMSNorm and the key's rope. :func:`_prolog_rows_kernel` does all three in one launch,
one program per token, reading each down-projected row once (three launches and an
extra read of the key row as separate ops). The query's rope runs on the ``rope``
kernel after the up-projection. Math in float32, every output rounded to ``x``'s dtype
at the store, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmport.core.formats import fake_quant_activation

from .gemm import quant_gemm
from .norm_rope import rope
from .runtime import next_pow2, rounded_to, tuned


@triton.jit
def _normalised_row(src, n, w_ptr, dst, eps, BLOCK: tl.constexpr):
    """Store ``src[:n] * rsqrt(mean(src[:n]**2) + eps) * w`` at ``dst`` (one row)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + cols, rounded_to(x * rstd * w, dst.dtype.element_ty), mask=mask)


@tuned(
    configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8)],
    key=["q_lora", "kv_lora", "half"],
    interpreter={},
)
@triton.jit
def _prolog_rows_kernel(
    cq_ptr,
    kv_ptr,
    gamma_cq_ptr,
    gamma_ckv_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    latent_ptr,
    k_rope_ptr,
    q_lora,
    kv_lora,
    half,
    stride_ct,
    stride_ci,
    stride_st,
    stride_si,
    eps,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    kv_row = kv_ptr + t * (kv_lora + 2 * half)
    _normalised_row(
        cq_ptr + t * q_lora, q_lora, gamma_cq_ptr, q_norm_ptr + t * q_lora, eps, BLOCK_Q
    )
    _normalised_row(kv_row, kv_lora, gamma_ckv_ptr, latent_ptr + t * kv_lora, eps, BLOCK_KV)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < half
    c = tl.load(cos_ptr + t * stride_ct + i * stride_ci, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i * stride_si, mask=mask, other=0.0)
    pe = kv_row + kv_lora
    a = tl.load(pe + 2 * i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(pe + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    out = k_rope_ptr + t * (2 * half)
    dtype = k_rope_ptr.dtype.element_ty
    tl.store(out + 2 * i, rounded_to(a * c - b * s, dtype), mask=mask)
    tl.store(out + 2 * i + 1, rounded_to(a * s + b * c, dtype), mask=mask)


def _linear(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """``a @ w.T`` in ``a``'s dtype: cuBLAS, or the W8A8 kernel for a packed ``w``."""
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
    """``glmport.ops.mla_prolog`` (shapes there): ``q_latent [T, H, kv_lora]``,
    ``q_rope [T, H, rope]``, ``q_norm [T, q_lora]``, ``kv_latent [T, kv_lora]``,
    ``k_rope [T, rope]`` in ``x``'s dtype, all contiguous. W8A8 (the scales given):
    the three projections run on this backend's int8 ``quant_gemm`` kernel."""
    t = x.shape[0]
    heads, nope, kv_lora = w_uk.shape
    q_lora, half = w_dq.shape[0], cos.shape[1]
    cq = _linear(x, w_dq, w_dq_scale).contiguous()
    kv = _linear(x, w_dkv, w_dkv_scale).contiguous()
    q_norm = x.new_empty((t, q_lora))
    kv_latent = x.new_empty((t, kv_lora))
    k_rope = x.new_empty((t, 2 * half))
    if t:
        _prolog_rows_kernel[(t,)](
            cq,
            kv,
            gamma_cq.contiguous(),
            gamma_ckv.contiguous(),
            cos,
            sin,
            q_norm,
            kv_latent,
            k_rope,
            q_lora,
            kv_lora,
            half,
            *cos.stride(),
            *sin.stride(),
            eps,
            BLOCK_Q=next_pow2(q_lora),
            BLOCK_KV=next_pow2(kv_lora),
            BLOCK_HALF=next_pow2(half, floor=1),
        )
    if w_uq_scale is not None:  # as the W8A8 up-projection reads it
        q_norm = fake_quant_activation(q_norm, "w8a8").to(x.dtype)
    q = _linear(q_norm, w_uq, w_uq_scale).view(t, heads, nope + 2 * half)
    # Per-head GEMMs over the token axis: [H, T, nope] @ [H, nope, kv_lora].
    q_latent = torch.matmul(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1).contiguous()
    return q_latent, rope(q[..., nope:], cos, sin, True), q_norm, kv_latent, k_rope
