"""Torch tensors across onnxruntime's boundary, which the ``onnxruntime`` backend and the
ONNX model runner share: ``OrtValue``\\ s in, DLPack out. ``onnxruntime`` is imported
inside functions only: importing this module does not import it.
"""

from __future__ import annotations

import torch

from glmport.core.formats import FP8_DTYPE

from .onnx_ops import onnx_dtype


def to_ort(t: torch.Tensor):
    """``t`` as a CPU ``OrtValue``: bfloat16 as its bits tagged bfloat16, float8 as uint8 bits."""
    import onnxruntime as ort

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view("uint16")
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_dtype(t.dtype))
    if t.dtype == FP8_DTYPE:
        return ort.OrtValue.ortvalue_from_numpy(t.view(torch.uint8).numpy())
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def from_ort(value, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output ``OrtValue`` as a torch tensor; ``dtype`` float8: re-viewed from its bits."""
    out = torch.from_dlpack(value).clone()
    if dtype == FP8_DTYPE:
        out = out.view(FP8_DTYPE)
    return out
