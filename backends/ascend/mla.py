"""The MLA prolog (MLAPO) onto ``npu_mla_prolog_v3``, the fused preprocessing the
GLM-5 report names beside the lightning indexer and sparse flash attention.

Doc: Ascend/op-plugin ``docs/context/torch_npu-npu_mla_prolog_v3.md`` (read 2026-12).
The page documents DeepSeek-V3.2's widths only (He 7168 / 7680, Hcq 1536, D 128, Dr 64,
Hckv 512, bfloat16), declared as the backend's capability: GLM-5's (hidden 6144,
q_lora 2048, nope 192) run on the generic backend until a torch_npu documents them.
``_v3`` is the version that returns the normalised query latent (``query_norm``), which
glmport's indexer reads; it is documented for Atlas A3 only, so an Atlas A2 runs the
generic composite too (``npu_mla_prolog_v2`` lacks that output).

Mapping: the nn.Linear weights ``[out, in]`` go in transposed, ``[in, out]``, through
``npu_format_cast`` to FRACTAL_NZ as the page requires (a per-call conversion: glmport
has no prepared-weight path for this op yet); the angles as ``[T, Dr]`` bfloat16 tables
with each interleaved pair's angle in both its columns; the key rows into a scratch
paged cache of ``T`` slots (``"PA_BSND"``, blocks of 16, ``cache_index = 0 .. T - 1``),
which is the op's ``kv_latent`` / ``k_rope``: glmport's op is functional, and the
caller scatters the rows into its own cache.

W8A8 (the op's three weight scales given) is the page's full-quantisation scenario with
unquantised caches (``weight_quant_mode=2``): ``x`` quantised per token by glmport's
own ``int8_row`` arithmetic (as ``gemm.py`` does for ``npu_quant_matmul``), the int8
weights and their per-channel scales as ``[1, N]``. The op returns ``query_norm`` as the
int8 codes its up-projection read, with per-token scales, which the adapter multiplies
out: glmport's W8A8 ``q_norm`` is defined as exactly that.

``weight_uq_qr``'s column order and the rope's pairs are not documented: the backend
measures both at start-up (:func:`.profile.prolog_conventions`, one tiny call) and the
adapter orders the weights' rows, the angle tables and the rope outputs for the answer
(DeepSeek's layout, each head's query then rope columns with interleaved pairs, passes
everything through unchanged). The emulator answers in each convention on request.
"""

from __future__ import annotations

from typing import Any

import torch

from glmport.backends.generic.mla import mla_prolog as _generic_mla_prolog
from glmport.core.selection import log_fallback_once

from .gemm import quantize_activations
from .profile import HALF, INTERLEAVED, PER_HEAD, SPLIT, NpuProfile

_BLOCK = 16
_FRACTAL_NZ = 29


def _nz(npu: Any, w: torch.Tensor) -> torch.Tensor:
    """An nn.Linear weight ``[out, in]`` as the op's ``[in, out]`` FRACTAL_NZ matrix."""
    return npu.npu_format_cast(w.t().contiguous(), _FRACTAL_NZ)


def mla_prolog(
    npu: Any,
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
    *,
    profile: NpuProfile,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """glmport ``mla_prolog`` (shapes in ``glmport.ops.mla_prolog``) through
    ``npu_mla_prolog_v3`` on an Atlas A3, else the generic composite (logged once).
    W8A8 takes the page's full-quantisation scenario (``weight_quant_mode=2``)."""
    scales = (w_dq_scale, w_uq_scale, w_dkv_scale)
    if profile.generation != "A3":
        why = f"has npu_mla_prolog_v3 on Atlas A3 only, not on {profile.generation}, for"
        log_fallback_once("ascend", "mla_prolog", "generic", why)
        return _generic_mla_prolog(
            x, w_dq, gamma_cq, w_uq, w_uk, w_dkv, gamma_ckv, cos, sin, eps, *scales
        )
    t = x.shape[0]
    heads, nope, kv_lora = w_uk.shape
    rope = 2 * cos.shape[1]
    blocks = max(1, -(-t // _BLOCK))
    kv_cache = x.new_empty((blocks, _BLOCK, 1, kv_lora))
    kr_cache = x.new_empty((blocks, _BLOCK, 1, rope))
    slots = torch.arange(t, dtype=torch.int64, device=x.device)
    half = profile.prolog_rope == HALF
    # Each pair's angle in both its columns: (2i, 2i + 1), or (i, i + rope / 2).
    angles = [
        (a.repeat(1, 2) if half else a.repeat_interleave(2, dim=1)).to(x.dtype) for a in (sin, cos)
    ]
    w_uq, w_uq_scale = _uq_rows(w_uq, w_uq_scale, heads, nope, profile)
    w_dkv, w_dkv_scale = _dkv_rows(w_dkv, w_dkv_scale, kv_lora, profile)
    token_x, quant = x.contiguous(), {}
    if w_dq_scale is not None:
        # glmport's own int8_row codes of x (see gemm.py on npu_dynamic_quant's rounding).
        token_x, x_scale = quantize_activations(token_x)
        quant = {
            "dequant_scale_x": x_scale,
            "dequant_scale_w_dq": w_dq_scale.reshape(1, -1).contiguous(),
            "dequant_scale_w_uq_qr": w_uq_scale.reshape(1, -1).contiguous(),
            "dequant_scale_w_dkv_kr": w_dkv_scale.reshape(1, -1).contiguous(),
            "weight_quant_mode": 2,
        }
    query, query_rope, _, query_norm, q_norm_scale = npu.npu_mla_prolog_v3(
        token_x,
        _nz(npu, w_dq),
        _nz(npu, w_uq),
        w_uk.contiguous(),
        _nz(npu, w_dkv),
        gamma_cq.contiguous(),
        gamma_ckv.contiguous(),
        *angles,
        kv_cache,
        kr_cache,
        cache_index=slots,
        rmsnorm_epsilon_cq=eps,
        rmsnorm_epsilon_ckv=eps,
        cache_mode="PA_BSND",
        query_norm_flag=True,
        **quant,
    )
    if quant:  # the int8 codes the up-projection read, and their per-token scales
        query_norm = (query_norm.float() * q_norm_scale).to(x.dtype)
    k_rope = kr_cache.view(-1, rope)[:t]
    if half:  # the kernel's (i, i + rope / 2) pairs back to glmport's (2i, 2i + 1)
        query_rope, k_rope = (_interleaved(r) for r in (query_rope, k_rope))
    return query, query_rope, query_norm, kv_cache.view(-1, kv_lora)[:t], k_rope


def _deinterleaved(rope: int, device: torch.device) -> torch.Tensor:
    """The row order that puts glmport's pair ``(2i, 2i + 1)`` at ``(i, i + rope / 2)``."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2))).to(device)


def _interleaved(r: torch.Tensor) -> torch.Tensor:
    """``[..., rope]`` in half-split pair order back to interleaved pair order."""
    a, b = r.chunk(2, dim=-1)
    return torch.stack((a, b), dim=-1).flatten(-2)


def _uq_rows(
    w: torch.Tensor, scale: torch.Tensor | None, heads: int, nope: int, profile: NpuProfile
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w_uq [H * (nope + rope), q_lora]`` (and its W8A8 row scales) in the row order
    the build's ``weight_uq_qr`` columns take (measured at start-up): per head or split,
    rope rows in the build's pair order. Unchanged (no copy) for DeepSeek's layout."""
    if profile.prolog_columns == PER_HEAD and profile.prolog_rope == INTERLEAVED:
        return w, scale
    rows = torch.arange(w.shape[0], device=w.device).view(heads, -1)
    q_rows, rope_rows = rows[:, :nope], rows[:, nope:]
    if profile.prolog_rope == HALF:
        rope_rows = rope_rows[:, _deinterleaved(rope_rows.shape[1], w.device)]
    if profile.prolog_columns == SPLIT:
        order = torch.cat((q_rows.flatten(), rope_rows.flatten()))
    else:
        order = torch.cat((q_rows, rope_rows), dim=1).flatten()
    return w[order], None if scale is None else scale[order]


def _dkv_rows(
    w: torch.Tensor, scale: torch.Tensor | None, kv_lora: int, profile: NpuProfile
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w_dkv [kv_lora + rope, hidden]`` (and its row scales) with the rope rows in the
    build's pair order; unchanged (no copy) for interleaved pairs."""
    if profile.prolog_rope != HALF:
        return w, scale
    rope = w.shape[0] - kv_lora
    order = torch.cat(
        (torch.arange(kv_lora, device=w.device), kv_lora + _deinterleaved(rope, w.device))
    )
    return w[order], None if scale is None else scale[order]
