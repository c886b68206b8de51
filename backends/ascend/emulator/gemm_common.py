"""What torch_npu's GEMM documents share (Atlas A2 / A3), for the emulated GEMMs of
:mod:`.gemm` and :mod:`.grouped_gemm`:

* Weights are ``[K, N]`` (``x @ weight``), never glmport's ``[N, K]``; a weight may be
  passed as the transpose of a contiguous ``[N, K]`` tensor (a view whose second-last
  dim has stride 1: :func:`transposed`).
* int4 weights travel as int32, eight values per element (:func:`pack_int4_values`:
  value ``8i + j`` in bits ``4j``), packed along the LAST dim of the stored tensor: an
  ``[K, N // 8]`` int32 tensor, or the transpose of an ``[N, K // 8]`` one (shape
  ``[K // 8, N]``, K then packed).
* Integer products accumulate exactly (int32 on the chip, int64 here); dequantisation
  and float GEMMs accumulate in float32 and round once to the output dtype. Weight-only
  (antiquant) GEMMs dequantise the weight into ``x``'s dtype before the matmul, as the
  Cube unit multiplies fp16 / bf16 operands (:func:`antiquant_weight`).
"""

from __future__ import annotations

import torch

from .contract import require

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4_values(values: torch.Tensor) -> torch.Tensor:
    """Integer values in ``[-8, 7]`` ``[..., C]`` (``C % 8 == 0``) -> int32
    ``[..., C // 8]``: value ``8i + j`` in bits ``4j .. 4j + 3`` of element ``i``, each
    nibble two's complement. This is torch_npu's int32-carries-eight-int4 layout
    (op-plugin ``ConvertWeightToINT4PackKernelNpuOpApi.cpp`` ``convert_to_int4_pack``,
    and the reference packer of ``test/test_custom_ops/test_npu_convert_weight_to_int4pack.py``).
    Read as little-endian bytes it is two values a byte, the even one in the low nibble:
    glmport's ``int4_group`` packing."""
    nib = values.to(torch.int64) & 0xF
    groups = nib.reshape(*nib.shape[:-1], nib.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (groups << shifts).sum(dim=-1)
    # Wrap the unsigned 32-bit word into int32's two's complement range.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def transposed(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are a transposed view (how torch_npu tells a
    transposed weight: the second-last dim is the contiguous one)."""
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., C // 8]`` -> int64 values ``[..., C]`` in ``[-8, 7]``
    (the inverse of :func:`pack_int4_values`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    values = nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
    return torch.where(values >= 8, values - 16, values)


def int4_weight(w: torch.Tensor) -> torch.Tensor:
    """The int64 ``[..., K, N]`` values of an int32 int4 weight: ``[..., K, N // 8]``
    packed along N, or the transposed view ``[..., K // 8, N]`` of an ``[..., N, K // 8]``
    tensor packed along K."""
    if transposed(w):
        return unpack_int32(w.transpose(-1, -2)).transpose(-1, -2)
    return unpack_int32(w)


def logical_kn(w: torch.Tensor) -> tuple[int, int]:
    """``(K, N)`` of a weight ``[..., K, N]``, int4 in int32 counted in int4 values."""
    k, n = w.shape[-2], w.shape[-1]
    if w.dtype != torch.int32:
        return k, n
    return (k * 8, n) if transposed(w) else (k, n * 8)


def decode_int64_scale(scale: torch.Tensor, op: str) -> torch.Tensor:
    """float32 values of an int64 scale from ``npu_trans_quant_param`` (the float32 bits
    in the low 32 bits; the high bits carry an offset, which is not emulated)."""
    bits = scale.to(torch.int64)
    if bool((bits >> 32).any()):
        raise NotImplementedError(f"{op}: int64 scales carrying an offset are not emulated")
    return bits.to(torch.int32).view(torch.float32)


def as_float(scale: torch.Tensor, op: str) -> torch.Tensor:
    """A float or int64 (:func:`decode_int64_scale`) scale as float32, same shape."""
    if scale.dtype == torch.int64:
        return decode_int64_scale(scale, op)
    return scale.float()


def requantise_int8(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` rounded half to even and saturated to int8, same shape."""
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def check_none(op: str, **kwargs: object) -> None:
    """Raise :class:`~.contract.NpuContractError` naming any of ``kwargs`` that is not None."""
    for name, value in kwargs.items():
        require(value is None, op, f"{name} is not documented for Atlas A2 / A3: pass None")


def antiquant_weight(
    values: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``(w + offset) * scale`` of ``values`` ``[K, N]``, in ``dtype`` (the Cube unit's
    operand dtype). ``scale`` / ``offset`` ``[G, N]`` (``G`` groups of ``group`` rows
    along K, the last possibly short) or broadcastable ``[1, N]`` / ``[1, 1]``."""
    k = values.shape[0]
    s = scale.float()
    o = None if offset is None else offset.float()
    if s.shape[0] > 1:
        s = s.repeat_interleave(group, dim=0)[:k]
        o = None if o is None else o.repeat_interleave(group, dim=0)[:k]
    w = values.to(torch.float32)
    if o is not None:
        w = (w + o).to(dtype).float()
    return (w * s).to(dtype)
