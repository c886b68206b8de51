"""glmport's quantised and grouped GEMMs onto torch_npu (Atlas A2 / A3):
``quant_gemm`` on ``npu_quant_matmul`` (W8A8) and ``npu_weight_quant_batchmatmul``
(W4A16), ``grouped_gemm`` on ``npu_grouped_matmul`` (float, W8A8, W4A16), and the
load-time ``prepare_weight`` hook with the ``':prepared'`` kernels.

Conventions mapped:

- Layout: glmport weights are ``[N, K']`` (``y = x @ w.T``), the ops take ``[K, N]``;
  the adapters pass ``w.T`` (a transposed view, which every op documents as accepted),
  so no weight is copied per call.
- int4: glmport's ``int4_group`` bytes (two values a byte, the even column in the low
  nibble) ARE torch_npu's int32 x8 packing along K read as little-endian int32
  (``npu_convert_weight_to_int4pack`` puts value ``8i + j`` in bits ``4j``): a packed
  ``[N, K/2]`` uint8 weight is, bit for bit, an int32 ``[N, K/8]`` weight packed along
  K, and its transposed view ``[K/8, N]`` is the layout the ops take without a copy.
  ``prepare_weight`` converts to the layout vllm-ascend deploys instead (int32
  ``[K, N/8]`` packed along N via ``npu_convert_weight_to_int4pack``, scales
  ``[K/G, N]`` in the activation dtype), once, at load time.
- Scales: float32 for W8A8 (``npu_quant_matmul`` takes float32 with bf16 / fp16
  output; ``npu_grouped_matmul`` takes bf16 scales for bf16 output and float32 for
  fp16, so bf16 grouped W8A8 rounds the per-channel scales to bf16, one more
  rounding than the reference, inside bf16's tolerance); W4A16 scales must be in
  ``x``'s dtype (bf16 / fp16), so they are rounded to it.
- W8A8 activations are quantised with glmport's own ``int8_row`` arithmetic
  (:func:`quantize_activations`, torch ops on the device), not by ``npu_dynamic_quant``
  (``torch_npu-npu_dynamic_quant.md``): its rounding agrees (half to even,
  ``CAST_RINT``) but the A2 / A3 kernel (hicann/ops-nn
  ``quant/dynamic_quant/op_kernel/dynamic_quant_single_row.h``) computes
  ``rint(x * (127 / amax))`` with scale ``amax * (1 / 127)`` where the format defines
  ``round(x / (amax / 127))`` with ``amax`` floored at ``1e-12``: a code near a ``.5``
  boundary lands on the other side (``[1.3984375, 0.69921875]`` gives 64 there, 63
  here), scales differ in the last bit, an all-zero row gets scale 0. So the int32
  products stay exactly the scheme's, and the backend registers no ``quantize``
  (every format runs on the generic backend).
- Limits the adapters handle themselves: N above 65535 (``npu_quant_matmul`` and
  ``npu_weight_quant_batchmatmul`` take K, N up to 65535) runs in slices of
  ``N_CHUNK`` columns; int4 group sizes ``npu_weight_quant_batchmatmul`` does not take
  (not a multiple of 32), K not a multiple of 8 or below 16, QAT (float weights,
  ``w_scale=None``) and float32 activations with a quantised grouped weight run the
  generic backend's device-neutral torch code. Rows of no expert (offsets unchecked
  under ``GLMPORT_VALIDATE=meta``) are zeroed on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import torch

from glmport.backends.cpu.moe import owned_rows
from glmport.backends.generic.moe import grouped_gemm as generic_grouped_gemm
from glmport.backends.generic.quant import quant_gemm as generic_quant_gemm
from glmport.core.formats import FLOAT_WEIGHT, quantize_tensor, unpack_int4
from glmport.core.selection import log_fallback_once
from glmport.core.specs.quant import PreparedWeight

__all__ = [
    "grouped_gemm",
    "grouped_gemm_prepared",
    "prepare_weight",
    "quant_gemm",
    "quant_gemm_prepared",
]

QUANT_MATMUL_DOC = "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_quant_matmul.md"
WEIGHT_QUANT_BMM_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md"
)
GROUPED_MATMUL_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md"
)

# npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535"; npu_weight_quant_batchmatmul:
# "K、N的范围为[1, 65535]". Wider N runs in slices of N_CHUNK (a multiple of 8, so an
# int4 slice packs whole int32 words).
MAX_DIM = 65535
N_CHUNK = 32768
# npu_grouped_matmul: each tensor's last dim "应小于" the inner limit 65536.
GROUPED_INNER_LIMIT = 65536

_SCALE_KEY = {torch.bfloat16: "scale_bfloat16", torch.float16: "scale_float16"}


# -- shared helpers ------------------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (fp32 | bf16 | fp16) in glmport's ``int8_row`` format: int8
    codes ``[M, K]`` and float32 per-token scales ``[M]`` (the ``x1`` / ``pertoken_scale``
    of ``npu_quant_matmul`` and ``npu_grouped_matmul``), bit-identical to the reference
    wherever the device's float32 division and ``round`` (half to even on Ascend:
    ``aclnnRound``) are IEEE."""
    return quantize_tensor(x, "int8_row", x.shape[1])


def _n_slices(n: int) -> list[tuple[int, int]]:
    """Column ranges of at most ``MAX_DIM`` (``N_CHUNK`` each when ``n`` is wider)."""
    if n <= MAX_DIM:
        return [(0, n)]
    return [(a, min(a + N_CHUNK, n)) for a in range(0, n, N_CHUNK)]


def _cat_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _int32_words(w: torch.Tensor) -> torch.Tensor:
    """A packed int4 uint8 weight ``[..., K/2]`` (``K % 8 == 0``) as int32 ``[..., K/8]``:
    the same bytes, so the same values in torch_npu's int32 x8 order packed along K. A
    view of ``w`` when it is contiguous and 4-byte aligned, else of a row-major copy (a
    contiguous tensor may still carry any stride on a size-1 dim, which a 4-byte view
    cannot take)."""
    w = w.contiguous()
    if w.storage_offset() % 4 or any(s % 4 for s in w.stride()[:-1]):
        w = w.clone(memory_format=torch.contiguous_format)
    return w.view(torch.int32)


def _wqbmm_takes(k: int, group: int) -> bool:
    """Whether ``npu_weight_quant_batchmatmul`` takes int4 ``K`` with ``group``-column
    scales: per channel (``group == K``) or ``antiquant_group_size`` a multiple of 32 in
    ``[32, K - 1]``; K a multiple of 8 (whole int32 words) and at least 16 (an
    ``[1, N]`` transposed int4 weight is the one the doc excludes)."""
    return k % 8 == 0 and k >= 16 and (group == k or (group % 32 == 0 and group < k))


def _gmm_int4_takes(k: int) -> bool:
    """Whether a transposed int4 ``[E, K/8, N]`` weight is unambiguous for
    ``npu_grouped_matmul`` (whole int32 words along K, more than one of them)."""
    return k % 8 == 0 and k >= 16


def _antiquant_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """glmport's int4 scales ``[..., N, G]`` as torch_npu's antiquant_scale: per group
    ``[..., G, N]`` (a transposed view), per channel (``G = 1``) ``[..., N]``."""
    return w_scale[..., 0] if w_scale.shape[-1] == 1 else w_scale.transpose(-1, -2)


def _group_list(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """``npu_grouped_matmul``'s int64 cumulative ``group_list`` (``group_list_type=0``)
    from owned offsets ``[E + 1]``: the expert ends, the last set to ``M`` as the op
    requires (rows past the last expert's end are zeroed afterwards)."""
    ends = offsets[1:].to(torch.int64)
    return torch.cat((ends[:-1], ends.new_full((1,), m)))


def _zero_unowned(y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Zero the rows of ``y`` before ``offsets[0]`` and from ``offsets[-1]`` on (no host
    sync): the op gives them to the first / last expert, glmport to no expert."""
    rows = torch.arange(y.shape[0], device=y.device)
    return y.masked_fill_(((rows < offsets[0]) | (rows >= offsets[-1]))[:, None], 0)


def _grouped(
    npu: ModuleType,
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    **quant: object,
) -> torch.Tensor:
    """One ``npu_grouped_matmul`` call: ``x [M, K]`` by ``weight [E, K, N]`` grouped
    along M (single x, weight and y: ``split_item=2``, ``group_type=0``). The op takes
    no transposed ``x`` ("x不支持转置"): any ``x`` goes in row-major, a copy only when
    its strides are other (an O(M K) pass beside the O(M K N) product)."""
    (y,) = npu.npu_grouped_matmul(
        [x.contiguous()],
        [weight],
        group_list=_group_list(offsets, x.shape[0]),
        split_item=2,
        group_type=0,
        group_list_type=0,
        **quant,
    )
    return _zero_unowned(y, offsets)


# -- quant_gemm ----------------------------------------------------------------------


def quant_gemm(
    npu: ModuleType,
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int = 128,
) -> torch.Tensor:
    """glmport ``quant_gemm`` for ``w8a8`` / ``w4a16`` on bf16 / fp16 activations.

    Sources: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_quant_matmul.md``
    (table 2, row ``int8 | int8 | float32 | None | None | float32 | bfloat16`` and its
    float16 twin) and ``torch_npu-npu_weight_quant_batchmatmul.md`` (int4 ``weight``
    through int32, per-channel / per-group ``antiquant_scale``).

    - ``w8a8``: ``x`` quantised per token exactly as the ``int8_row`` format (not by
      ``npu_dynamic_quant``: see the module docstring), then ``npu_quant_matmul(qx, w.T,
      w_scale, pertoken_scale=sx, output_dtype=x.dtype)``: the int32 product is exact and
      ``(acc * w_scale) * sx`` is the reference's float32 arithmetic.
    - ``w4a16``: ``npu_weight_quant_batchmatmul(x, wq, scale)`` with ``wq`` the packed
      bytes read as int32 and transposed (no copy) and ``scale`` ``[K/G, N]`` in ``x``'s
      dtype. Group sizes the op does not take run the generic backend.

    Without a prepared weight nothing is converted beyond the per-call cast of the
    (small) int4 scales to ``x``'s dtype; :func:`quant_gemm_prepared` skips that too.

    Args:
        npu: ``torch_npu`` or the emulator.
        x: ``[M, K]`` bf16 | fp16, ``K <= 65535``.
        w: int8 ``[N, K]`` (w8a8) or uint8 ``[N, K/2]`` (w4a16), or float ``[N, K]`` with
            ``w_scale=None`` (QAT: the generic backend's fake quantisation).
        w_scale: float32 ``[N]`` (w8a8) or ``[N, K/G]`` (w4a16).
        scheme: ``"w8a8"`` or ``"w4a16"`` (the capability's schemes).
        group_size: the int4 group in QAT mode.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    if w_scale is None:
        log_fallback_once("ascend", "quant_gemm", "generic", "cannot take float (QAT) weights in")
        return generic_quant_gemm(x, w, w_scale, scheme, group_size)
    n = w.shape[0]
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    if scheme == "w8a8":
        qx, sx = quantize_activations(x)
        parts = [
            npu.npu_quant_matmul(
                qx, w[a:b].T, w_scale[a:b], pertoken_scale=sx, output_dtype=x.dtype
            )
            for a, b in _n_slices(n)
        ]
        return _cat_columns(parts)
    k = x.shape[1]
    group = k // w_scale.shape[1]
    if not _wqbmm_takes(k, group):
        why = f"cannot take int4 K {k} with group {group} in"
        log_fallback_once("ascend", "quant_gemm", "generic", why)
        return generic_quant_gemm(x, w, w_scale, scheme, group_size)
    words = _int32_words(w)  # [N, K/8]
    gsize = 0 if group == k else group
    parts = [
        npu.npu_weight_quant_batchmatmul(
            x, words[a:b].T, _antiquant_scale(w_scale[a:b]).to(x.dtype), antiquant_group_size=gsize
        )
        for a, b in _n_slices(n)
    ]
    return _cat_columns(parts)


def quant_gemm_prepared(
    npu: ModuleType,
    x: torch.Tensor,
    prepared: PreparedWeight,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int = 128,
) -> torch.Tensor:
    """``quant_gemm`` on a weight from :func:`prepare_weight` (only ``w4a16`` weights
    get a native layout): ``npu_weight_quant_batchmatmul`` per column chunk of
    ``native["weight"]`` (int32 ``[C, K, W/8]``, packed along N) with
    ``native["scale_<dtype>"]`` (``[C, G, W]``); the padding columns of the last chunk
    are dropped. Source: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_weight_quant_batchmatmul.md``.

    Args: as :func:`quant_gemm`, ``x`` bf16 | fp16 ``[M, K]``.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    n = prepared.w.shape[0]
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    weight = prepared.native["weight"]
    scale = prepared.native[_SCALE_KEY[x.dtype]]
    k = x.shape[1]
    groups = scale.shape[1]
    gsize = 0 if groups == 1 else k // groups
    parts = [
        npu.npu_weight_quant_batchmatmul(x, weight[c], scale[c], antiquant_group_size=gsize)
        for c in range(weight.shape[0])
    ]
    y = _cat_columns(parts)
    return y if y.shape[1] == n else y[:, :n].contiguous()


# -- grouped_gemm --------------------------------------------------------------------


def grouped_gemm(
    npu: ModuleType,
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    scheme: str = FLOAT_WEIGHT,
    group_size: int = 128,
) -> torch.Tensor:
    """glmport ``grouped_gemm`` on ``npu_grouped_matmul`` (m-axis grouping, one ``x``,
    one 3-D weight, one ``y``: ``split_item=2``, ``group_type=0``, cumulative
    ``group_list``).

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``
    (table 2, Tensor ``group_list``, Atlas A2 / A3: float fp16 / bf16 / fp32; per-token
    int8 with scale bf16 -> bf16, float32 -> fp16; weight-only int4 with
    ``antiquant_scale`` in ``x``'s dtype, ``[E, G, N]`` per group, ``[E, N]`` per channel).

    - ``'none'``: ``weight = w.transpose(1, 2)`` (a view).
    - ``w8a8``: ``x`` quantised per token as ``int8_row`` (:func:`quantize_activations`),
      int8 weight view, ``scale [E, N]`` (bf16 for bf16 output), ``per_token_scale [M]``.
    - ``w4a16``: the packed bytes as int32 ``[E, N, K/8]``, transposed (a view).

    ``expert_offsets`` become the op's cumulative ``group_list`` on the device (no host
    sync); offsets that do not start at 0 or end at ``M`` (unchecked under
    ``GLMPORT_VALIDATE=meta``) are made a partition of ``[0, M]`` and the rows of no
    expert zeroed. Without a prepared weight nothing is converted beyond casting the
    scales (bf16 W8A8 scales, int4 scales to ``x``'s dtype) per call.

    Args:
        npu: ``torch_npu`` or the emulator.
        x: ``[M, K]`` fp32 | bf16 | fp16 (fp32 only with ``'none'``; a quantised weight
            with fp32 ``x``, QAT float weights, and int4 K not a multiple of 8 or below
            16 run the generic backend).
        w: ``[E, N, K]`` in ``x``'s dtype, int8 ``[E, N, K]`` or uint8 ``[E, N, K/2]``.
        expert_offsets: ``[E + 1]`` int32 | int64, ``E <= 1024``.
        w_scale: float32 ``[E, N]`` (w8a8) or ``[E, N, K/G]`` (w4a16), else None.
        scheme: ``'none'``, ``'w8a8'`` or ``'w4a16'``.
        group_size: the int4 group in QAT mode.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    quantised = scheme != FLOAT_WEIGHT
    k = x.shape[1]
    if quantised and (
        w_scale is None
        or x.dtype == torch.float32
        or (scheme == "w4a16" and not _gmm_int4_takes(k))
    ):
        why = f"cannot take {scheme} weights with {x.dtype} activations and K {k} in"
        log_fallback_once("ascend", "grouped_gemm", "generic", why)
        return generic_grouped_gemm(x, w, expert_offsets, w_scale, scheme, group_size)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, w.shape[1]))
    offsets = owned_rows(expert_offsets, m)
    if scheme == FLOAT_WEIGHT:
        return _grouped(npu, x, w.transpose(1, 2), offsets)
    if scheme == "w8a8":
        scale = w_scale if x.dtype == torch.float16 else w_scale.to(torch.bfloat16)
        return _grouped_w8a8(npu, x, w, scale, offsets)
    scale = _antiquant_scale(w_scale).to(x.dtype)
    return _grouped(npu, x, _int32_words(w).transpose(1, 2), offsets, antiquant_scale=[scale])


def _grouped_w8a8(
    npu: ModuleType, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    qx, sx = quantize_activations(x)
    return _grouped(
        npu,
        qx,
        w.transpose(1, 2),
        offsets,
        scale=[scale],
        per_token_scale=[sx],
        output_dtype=x.dtype,
    )


def grouped_gemm_prepared(
    npu: ModuleType,
    x: torch.Tensor,
    prepared: PreparedWeight,
    expert_offsets: torch.Tensor,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int = 128,
) -> torch.Tensor:
    """``grouped_gemm`` on a weight from :func:`prepare_weight`: W8A8 with the bf16
    scales made at load time (``native["scale_bfloat16"]``; fp16 output takes the
    float32 ones), W4A16 with ``native["weight"]`` (int32 ``[E, K, N/8]`` packed along
    N, the layout vllm-ascend deploys) and ``native["scale_<dtype>"]``. Source:
    Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``.
    float32 ``x`` runs the generic backend on the canonical weight.

    Args: as :func:`grouped_gemm`.

    Returns:
        ``[M, N]`` in ``x``'s dtype.
    """
    if x.dtype == torch.float32:
        why = f"cannot take {scheme} weights with float32 activations in"
        log_fallback_once("ascend", "grouped_gemm", "generic", why)
        return generic_grouped_gemm(x, prepared.w, expert_offsets, w_scale, scheme, group_size)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, prepared.w.shape[1]))
    offsets = owned_rows(expert_offsets, m)
    native = prepared.native
    if scheme == "w8a8":
        scale = w_scale if x.dtype == torch.float16 else native["scale_bfloat16"]
        return _grouped_w8a8(npu, x, prepared.w, scale, offsets)
    scale = native[_SCALE_KEY[x.dtype]]
    return _grouped(npu, x, native["weight"], offsets, antiquant_scale=[scale])


# -- prepare_weight ------------------------------------------------------------------


def prepare_weight(
    npu: ModuleType,
    op: str,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    scheme: str,
) -> Mapping[str, torch.Tensor] | None:
    """The backend's ``prepare_weight`` hook: convert one canonical packed weight, once,
    at load time, into the layouts the ``':prepared'`` kernels pass to the ops.

    - ``quant_gemm`` ``w4a16`` (group sizes ``npu_weight_quant_batchmatmul`` takes):
      ``{"weight": int32 [C, K, W/8], "scale_bfloat16" / "scale_float16": [C, G, W]}``,
      the ``N`` columns in ``C`` chunks of ``W`` (``N`` rounded up to a multiple of 8 when
      that is at most 65535, else ``N_CHUNK``; the padding columns are zero), each chunk
      packed by ``npu_convert_weight_to_int4pack`` (its documented ``(k, n)`` input).
    - ``grouped_gemm`` ``w8a8``: ``{"scale_bfloat16": [E, N]}``.
    - ``grouped_gemm`` ``w4a16`` (``N`` a multiple of 8, below 65536):
      ``{"weight": int32 [E, K, N/8], "scale_bfloat16" / "scale_float16": [E, G, N]
      (per channel [E, N])}``, as vllm-ascend's W4A16 MoE repacks its experts.
    - Anything else keeps the canonical layout (None): ``quant_gemm`` ``w8a8`` takes
      ``w.T`` as is; schemes the capability refuses run the generic backend.

    ``npu_convert_weight_to_int4pack`` round-trips through the host on the NPU (a sync):
    another reason it only runs here. Sources: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_convert_weight_to_int4pack.md``;
    vllm-project/vllm-ascend ``vllm_ascend/quantization/methods/w4a16.py``
    (``process_weights_after_loading``).
    """
    if scheme == "w4a16" and op == "quant_gemm":
        return _prepare_linear_int4(npu, w, w_scale)
    if scheme == "w4a16" and op == "grouped_gemm":
        return _prepare_experts_int4(npu, w, w_scale)
    if scheme == "w8a8" and op == "grouped_gemm":
        return {"scale_bfloat16": w_scale.to(torch.bfloat16)}
    return None


def _half_scales(scale: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: scale.to(dtype).contiguous() for dtype, key in _SCALE_KEY.items()}


def _prepare_linear_int4(
    npu: ModuleType, w: torch.Tensor, w_scale: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    n, k = w.shape[0], w.shape[1] * 2
    groups = w_scale.shape[1]
    if not _wqbmm_takes(k, k // groups):
        return None
    width = -(-n // 8) * 8
    if width > MAX_DIM:
        width = N_CHUNK
    chunks = -(-n // width)
    pad = chunks * width - n
    values = unpack_int4(w)  # [N, K] int8
    scale = w_scale
    if pad:
        values = torch.cat((values, values.new_zeros((pad, k))))
        scale = torch.cat((scale, scale.new_zeros((pad, groups))))
    # [C*W, K] -> [C, W, K] -> [C, K, W]: each chunk's (k, n) weight, packed along n.
    blocks = values.reshape(chunks, width, k).transpose(1, 2).to(torch.int32)
    packed = npu.npu_convert_weight_to_int4pack(blocks.reshape(chunks * k, width).contiguous())
    return {
        "weight": packed.reshape(chunks, k, width // 8),
        **_half_scales(scale.reshape(chunks, width, groups).transpose(1, 2)),
    }


def _prepare_experts_int4(
    npu: ModuleType, w: torch.Tensor, w_scale: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * 2
    if n % 8 or n >= GROUPED_INNER_LIMIT:
        return None
    values = unpack_int4(w).transpose(1, 2).to(torch.int32)  # [E, K, N]
    packed = npu.npu_convert_weight_to_int4pack(values.reshape(e * k, n).contiguous())
    return {"weight": packed.reshape(e, k, n // 8), **_half_scales(_antiquant_scale(w_scale))}
