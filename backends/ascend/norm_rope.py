"""RMSNorm and rotary embedding onto ``torch_npu.npu_rms_norm`` and
``torch_npu.npu_rotary_mul`` (Atlas A2 / A3).

- ``rms_norm``: ``x [..., D]`` goes in as the rows ``[R, D]`` (the op takes 2-8 dims)
  with a 1-D ``gamma``; a weight of another dtype than ``x`` goes in as float32, which
  makes every dtype pair one the op documents. The op computes in float32 and rounds
  once, as glmport's reference does; its ``rstd`` is dropped.
- ``rope``: ``x [T, ..., D]`` goes in as BSND ``[1, T, H, D]`` (the middle dims merged
  into ``H`` heads) and ``cos`` / ``sin [T, D/2]`` as ``r1`` / ``r2 [1, T, 1, D]``, the
  one broadcast both rotary modes take: ``rotary_mode="interleave"`` for GLM-5's pairs
  ``(2i, 2i+1)`` with each angle repeated in place (``c0 c0 c1 c1 ...``),
  ``rotary_mode="half"`` for DeepSeek-V3.2's ``(i, i + D/2)`` with the angles
  repeated as halves (``c0 c1 ... c0 c1 ...``). More than 999 heads go in slices
  (half mode needs ``N < 1000``, interleave ``B * N < 1000``).

Precision: ``npu_rotary_mul`` casts ``r1`` / ``r2`` to ``x``'s dtype
(``RotaryMulKernelNpuOpApi.cpp``), so on bf16 / fp16 inputs the angles themselves would
be rounded: a phase error that grows with the position and that the tiny GLM-5's
bf16 log-probs showed as a mean ``|delta logp|`` of 0.08 against the reference (0 with
float32 angles; the model check's bound is 0.1). The adapter rotates in float32 and
rounds the result once, as the reference does: ``x``'s rope slice (64 of GLM-5's 576
dims) makes the round trip, a cost small beside the attention it feeds.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

# npu_rotary_mul's documented head limit (half: N < 1000; interleave: B * N < 1000, B = 1).
_MAX_HEADS = 999


def rms_norm(npu: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """glmport ``rms_norm`` on ``torch_npu.npu_rms_norm``.

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_rms_norm.md``
    (gitcode.com/Ascend/op-plugin) and hicann/ops-nn ``norm/rms_norm/docs/aclnnRmsNorm.md``.

    Args:
        npu: ``torch_npu`` or the emulator.
        x: ``[..., D]`` fp32 | bf16 | fp16, any strides (the op takes non-contiguous
            input; the rows are a view where the strides allow).
        weight: ``[D]`` fp32 | bf16 | fp16.
        eps: ``> 0``.

    Returns:
        A new ``[..., D]`` tensor in ``x``'s dtype.
    """
    d = x.shape[-1]
    rows = x.reshape(math.prod(x.shape[:-1]), d)
    # The op pairs fp16 / bf16 x with a gamma of the same dtype or fp32, fp32 x with
    # fp32: any other weight widens to fp32 exactly.
    gamma = weight if weight.dtype == x.dtype else weight.float()
    y, _rstd = npu.npu_rms_norm(rows, gamma, epsilon=eps)
    return y.reshape(x.shape)


def rope(
    npu: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """glmport ``rope`` on ``torch_npu.npu_rotary_mul`` (BSND, ``B = 1``).

    Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_rotary_mul.md``
    (gitcode.com/Ascend/op-plugin; ``rotary_mode`` needs Ascend Extension for PyTorch
    7.0.0 or later).

    Args:
        npu: ``torch_npu`` or the emulator.
        x: ``[T, ..., D]`` fp32 | bf16 | fp16, ``D`` even and ``< 896`` (the
            manifest's limit), any strides (the op takes non-contiguous input).
        cos, sin: ``[T, D/2]`` fp32 (kept fp32: the op would round them to ``x``'s dtype).
        interleaved: pairs ``(2i, 2i+1)`` (``True``) or ``(i, i + D/2)``.

    Returns:
        A new ``[T, ..., D]`` tensor in ``x``'s dtype.
    """
    t, d = x.shape[0], x.shape[-1]
    heads = math.prod(x.shape[1:-1])
    if x.numel() == 0:
        # Empty inputs are documented for Ascend 950 only: no call.
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if interleaved:
        r1, r2 = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        mode = "interleave"
    else:
        r1, r2 = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        mode = "half"
    r1 = r1.float().view(1, t, 1, d)
    r2 = r2.float().view(1, t, 1, d)
    xb = x.reshape(1, t, heads, d).float()  # float32 angles: see the module docstring
    if heads <= _MAX_HEADS:
        out = npu.npu_rotary_mul(xb, r1, r2, rotary_mode=mode)
    else:
        out = torch.empty((1, t, heads, d), dtype=torch.float32, device=x.device)
        for h in range(0, heads, _MAX_HEADS):
            part = xb[:, :, h : h + _MAX_HEADS]
            out[:, :, h : h + _MAX_HEADS] = npu.npu_rotary_mul(part, r1, r2, rotary_mode=mode)
    return out.to(x.dtype).reshape(x.shape)
