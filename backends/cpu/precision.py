"""The cpu reference's compute precision: float32 accumulation by default, float64 on
request (the conformance suite's reference mode)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_float64: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "glmport_cpu_float64", default=False
)


@contextlib.contextmanager
def float64_reference() -> Iterator[None]:
    """Within this block the cpu kernels compute in float64 and return float64 for
    every floating output (integer outputs and quantised values are unchanged: the
    formats define quantisation in float32)."""
    token = _float64.set(True)
    try:
        yield
    finally:
        _float64.reset(token)


def acc_dtype() -> torch.dtype:
    """The dtype the kernels compute in."""
    return torch.float64 if _float64.get() else torch.float32


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating output of nominal ``dtype`` is returned in."""
    return torch.float64 if _float64.get() else dtype
