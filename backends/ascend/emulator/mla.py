"""CPU emulation of torch_npu's MLA prolog, ``npu_mla_prolog_v3`` (MLAPO), and of
``npu_format_cast``, which its weights go through.

Page: Ascend/op-plugin ``docs/context/torch_npu-npu_mla_prolog_v3.md`` (read 2026-12):
two scenarios, with the key rows written into paged (``"PA_BSND"``) or token (``"TND"``)
caches:

- non-quantised (``weight_quant_mode`` / ``kv_cache_quant_mode`` / ``query_quant_mode``
  0): bfloat16 throughout;
- full quantisation with unquantised caches (全量化 kv_cache非量化: ``weight_quant_mode``
  2, the others 0): int8 ``token_x`` with per-token ``dequant_scale_x [T]``, int8
  ``weight_dq`` / ``weight_uq_qr`` / ``weight_dkv_kr`` with per-channel
  ``dequant_scale_w_* [1, N]``; GEMMs sum exactly and apply both scales in float32;
  ``c^Q`` is quantised per token inside the op, and ``query_norm`` (with
  ``query_norm_flag``) comes back as those int8 codes with ``dequant_scale_q_norm
  [T, 1]``, as the page's dtype table gives it.

The partial and cache-quantising scenarios, ``smooth_scales_cq``, the other cache modes
and the scale corrections are refused by name as not emulated. Shapes as documented
(DeepSeek-V3.2's widths): He 7168 or 7680, Hcq 1536, N in 1, 2, 4 ... 128, D 128, Dr
64, Hckv 512, contiguous inputs.

What the page leaves open, the emulator answers as the emulated build says
(:mod:`.build`), so the adapter's handling of each answer is tested: ``weight_uq_qr``'s
column order (by default each head's ``D`` query columns then its ``Dr`` rope columns,
DeepSeek's ``wq_b`` layout transposed; or every head's query columns first) and the
pairs rope rotates (by default interleaved ``(2i, 2i + 1)``, the MLA rope of
DeepSeek-V3.2; or ``(i, i + Dr/2)``), with ``rope_cos`` / ``rope_sin`` giving each
pair's angle in both of its columns. The adapters measure both at start-up
(:func:`..profile.prolog_conventions`). Arithmetic is float32 with each named intermediate (``c^Q``,
``q^C``, ``c^KV``, ``k^R``, the outputs) rounded to bfloat16. Weight formats are not
modelled: ``npu_format_cast`` returns the tensor's contiguous copy whatever the format.
"""

from __future__ import annotations

import torch

from .build import current_build
from .contract import require

_OP = "npu_mla_prolog_v3"
_HE = (7168, 7680)
_HCQ, _HCKV, _D, _DR = 1536, 512, 128, 64
_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
_CACHE_MODES = ("PA_BSND", "TND")
# aclFormat values: ND and FRACTAL_NZ.
ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``tensor`` in memory format ``acl_format`` (ND 2, FRACTAL_NZ 29): a contiguous
    copy here, formats not being modelled."""
    require(
        acl_format in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ),
        "npu_format_cast",
        f"acl_format {acl_format} is not emulated (ND 2, FRACTAL_NZ 29)",
    )
    return tensor.contiguous().clone()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _typed(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    require(
        t.dtype == dtype and tuple(t.shape) == shape,
        _OP,
        f"{name} must be {_name(dtype)} {list(shape)}, got {_name(t.dtype)} {list(t.shape)}",
    )
    require(t.is_contiguous(), _OP, f"{name} must be contiguous (不支持非连续)")


def _bf16(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _typed(name, t, torch.bfloat16, shape)


def _dequantised(
    codes: torch.Tensor, row_scale: torch.Tensor, weight: torch.Tensor, col_scale: torch.Tensor
) -> torch.Tensor:
    """int8 ``codes [T, K] @ weight [K, N]`` summed exactly (int32; float64 holds every
    such sum), times the per-token ``row_scale [T, 1]`` and per-channel ``col_scale
    [1, N]`` in float32, rounded to bfloat16."""
    acc = (codes.double() @ weight.double()).float()
    return (acc * row_scale * col_scale).bfloat16()


def _dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 codes ``[T, C]`` and float32 scales ``[T, 1]`` of bfloat16 ``x``,
    as torch_npu's dynamic-quant kernel computes them (``rint(x * (127 / amax))``,
    scale ``amax * (1 / 127)``): assumed for the prolog's internal quantisation of
    ``c^Q``, which the page does not spell out."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    codes = torch.round(xf * (127.0 / amax)).clamp(-127, 127).to(torch.int8)
    return codes, amax * (1.0 / 127.0)


def _rms(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).bfloat16()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Float32 ``x [T, ..., Dr]`` rotated by ``cos`` / ``sin`` ``[T, Dr]`` (each pair's
    angle in both its columns), rounded to bfloat16: interleaved pairs ``(2i, 2i + 1)``,
    or ``(i, i + Dr/2)`` where the emulated build says ``prolog_rope="half"``."""
    half = x.shape[-1] // 2
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    if current_build().prolog_rope == "half":
        c, s = cos[:, :half].float().reshape(view), sin[:, :half].float().reshape(view)
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1).bfloat16()
    c, s = cos[:, 0::2].float().reshape(view), sin[:, 0::2].float().reshape(view)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).bfloat16()


def npu_mla_prolog_v3(
    token_x: torch.Tensor,
    weight_dq: torch.Tensor,
    weight_uq_qr: torch.Tensor,
    weight_uk: torch.Tensor,
    weight_dkv_kr: torch.Tensor,
    rmsnorm_gamma_cq: torch.Tensor,
    rmsnorm_gamma_ckv: torch.Tensor,
    rope_sin: torch.Tensor,
    rope_cos: torch.Tensor,
    kv_cache: torch.Tensor,
    kr_cache: torch.Tensor,
    cache_index: torch.Tensor | None = None,
    dequant_scale_x: torch.Tensor | None = None,
    dequant_scale_w_dq: torch.Tensor | None = None,
    dequant_scale_w_uq_qr: torch.Tensor | None = None,
    dequant_scale_w_dkv_kr: torch.Tensor | None = None,
    quant_scale_ckv: torch.Tensor | None = None,
    quant_scale_ckr: torch.Tensor | None = None,
    smooth_scales_cq: torch.Tensor | None = None,
    actual_seq_len: torch.Tensor | None = None,
    k_nope_clip_alpha: torch.Tensor | None = None,
    rmsnorm_epsilon_cq: float = 1e-05,
    rmsnorm_epsilon_ckv: float = 1e-05,
    cache_mode: str = "PA_BSND",
    query_norm_flag: bool = False,
    weight_quant_mode: int = 0,
    kv_cache_quant_mode: int = 0,
    query_quant_mode: int = 0,
    ckvkr_repo_mode: int = 0,
    quant_scale_repo_mode: int = 0,
    tile_size: int = 128,
    qc_qr_scale: float = 1.0,
    kc_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """MLA's preprocessing (see the module doc): returns ``(query [T, N, Hckv],
    query_rope [T, N, Dr], dequant_scale_q_nope [0], query_norm [T, Hcq] (``[0]``
    without ``query_norm_flag``), dequant_scale_q_norm [0])`` in bfloat16 (the scales
    float32), and writes ``c^KV`` / ``k^R`` into ``kv_cache`` / ``kr_cache`` in place at
    ``cache_index`` (``"PA_BSND"``: flat slots of ``[BlockNum, BlockSize, 1, D]``
    caches) or row by row (``"TND"``: ``[T, 1, D]`` caches)."""
    quantised = weight_quant_mode == 2
    unset = {
        "quant_scale_ckv": quant_scale_ckv,
        "quant_scale_ckr": quant_scale_ckr,
        "smooth_scales_cq": smooth_scales_cq,
        "actual_seq_len": actual_seq_len,
        "k_nope_clip_alpha": k_nope_clip_alpha,
    }
    dequant = {
        "dequant_scale_x": dequant_scale_x,
        "dequant_scale_w_dq": dequant_scale_w_dq,
        "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr,
        "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
    }
    for name, value in (unset if quantised else {**unset, **dequant}).items():
        require(value is None, _OP, f"{name} is not emulated in this scenario")
    require(
        weight_quant_mode in (0, 2),
        _OP,
        f"weight_quant_mode={weight_quant_mode} is not emulated (0: none, 2: full W8A8)",
    )
    modes = {
        "kv_cache_quant_mode": kv_cache_quant_mode,
        "query_quant_mode": query_quant_mode,
        "ckvkr_repo_mode": ckvkr_repo_mode,
        "quant_scale_repo_mode": quant_scale_repo_mode,
    }
    for name, value in modes.items():
        require(value == 0, _OP, f"{name}={value} is not emulated (unquantised caches only)")
    require(
        qc_qr_scale == 1.0 and kc_scale == 1.0,
        _OP,
        "qc_qr_scale / kc_scale other than 1.0 are not emulated",
    )
    require(cache_mode in _CACHE_MODES, _OP, f"cache_mode {cache_mode!r} is not emulated")
    require(
        token_x.dim() == 2 and token_x.shape[1] in _HE,
        _OP,
        f"token_x must be [T, He] with He in {_HE}, got {list(token_x.shape)}",
    )
    t, he = token_x.shape
    require(
        weight_uk.dim() == 3 and weight_uk.shape[0] in _HEADS,
        _OP,
        f"weight_uk must be [N, {_D}, {_HCKV}] with N in {_HEADS}, got {list(weight_uk.shape)}",
    )
    heads = weight_uk.shape[0]
    # Full quantisation: token_x and the three NZ weights int8, everything else bf16.
    packed = torch.int8 if quantised else torch.bfloat16
    _typed("token_x", token_x, packed, (t, he))
    _typed("weight_dq", weight_dq, packed, (he, _HCQ))
    _typed("weight_uq_qr", weight_uq_qr, packed, (_HCQ, heads * (_D + _DR)))
    _bf16("weight_uk", weight_uk, (heads, _D, _HCKV))
    _typed("weight_dkv_kr", weight_dkv_kr, packed, (he, _HCKV + _DR))
    if quantised:
        require(
            dequant_scale_x is not None and dequant_scale_x.shape in ((t,), (t, 1)),
            _OP,
            f"dequant_scale_x must be float [T] or [T, 1] (T={t}) with an int8 token_x",
        )
        _typed("dequant_scale_x", dequant_scale_x, torch.float32, tuple(dequant_scale_x.shape))
        for name, width in (
            ("dequant_scale_w_dq", _HCQ),
            ("dequant_scale_w_uq_qr", heads * (_D + _DR)),
            ("dequant_scale_w_dkv_kr", _HCKV + _DR),
        ):
            scale = dequant[name]
            require(scale is not None, _OP, f"{name} must be given (weight_quant_mode=2)")
            _typed(name, scale, torch.float32, (1, width))
    _bf16("rmsnorm_gamma_cq", rmsnorm_gamma_cq, (_HCQ,))
    _bf16("rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, (_HCKV,))
    _bf16("rope_sin", rope_sin, (t, _DR))
    _bf16("rope_cos", rope_cos, (t, _DR))
    if cache_mode == "TND":
        _bf16("kv_cache", kv_cache, (t, 1, _HCKV))
        _bf16("kr_cache", kr_cache, (t, 1, _DR))
        require(t > 0, _OP, "TND caches do not take T = 0 (不支持空Tensor)")
        slots = torch.arange(t)
    else:
        require(
            kv_cache.dim() == 4 and kv_cache.shape[1] in range(16, 1025, 16),
            _OP,
            f"kv_cache must be [BlockNum, BlockSize, 1, {_HCKV}] with BlockSize 16..1024 "
            f"in steps of 16, got {list(kv_cache.shape)}",
        )
        blocks, block_size = kv_cache.shape[:2]
        _bf16("kv_cache", kv_cache, (blocks, block_size, 1, _HCKV))
        _bf16("kr_cache", kr_cache, (blocks, block_size, 1, _DR))
        require(
            cache_index is not None and cache_index.dtype == torch.int64,
            _OP,
            "cache_index must be an int64 [T] tensor in PA_BSND mode",
        )
        require(tuple(cache_index.shape) == (t,), _OP, f"cache_index must be [T={t}]")
        require(
            bool(((cache_index >= 0) & (cache_index < blocks * block_size)).all()),
            _OP,
            f"cache_index must lie in [0, BlockNum * BlockSize = {blocks * block_size})",
        )
        slots = cache_index
    if quantised:
        sx = dequant_scale_x.reshape(t, 1)
        c_q = _dequantised(token_x, sx, weight_dq, dequant_scale_w_dq)
        query_norm = _rms(c_q.float(), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
        q_codes, q_scale = _dynamic_quant(query_norm)
        q_c = _dequantised(q_codes, q_scale, weight_uq_qr, dequant_scale_w_uq_qr)
        kv = _dequantised(token_x, sx, weight_dkv_kr, dequant_scale_w_dkv_kr)
    else:
        x = token_x.float()
        c_q = (x @ weight_dq.float()).bfloat16()
        query_norm = _rms(c_q.float(), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
        q_c = (query_norm.float() @ weight_uq_qr.float()).bfloat16()
        kv = (x @ weight_dkv_kr.float()).bfloat16()
    if current_build().prolog_columns == "split":
        q_nope = q_c[:, : heads * _D].reshape(t, heads, _D)
        q_pe = q_c[:, heads * _D :].reshape(t, heads, _DR)
    else:
        q_nope, q_pe = q_c.view(t, heads, _D + _DR).split((_D, _DR), dim=-1)
    query = torch.einsum("thd,hdc->thc", q_nope.float(), weight_uk.float()).bfloat16()
    query_rope = _rope(q_pe.float(), rope_cos, rope_sin)
    latent = _rms(kv[:, :_HCKV].float(), rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    kv_cache.view(-1, _HCKV)[slots] = latent
    kr_cache.view(-1, _DR)[slots] = _rope(kv[:, _HCKV:].float(), rope_cos, rope_sin)
    empty = torch.empty(0, dtype=torch.float32)
    if not query_norm_flag:
        return query, query_rope, empty, torch.empty(0, dtype=packed), empty.clone()
    if quantised:  # query_norm as the up-projection read it: int8 codes and their scales
        return query, query_rope, empty, q_codes, q_scale
    return query, query_rope, empty, query_norm, empty.clone()
