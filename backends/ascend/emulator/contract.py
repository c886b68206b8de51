"""What every emulated torch_npu op shares: the error the real op's documented
constraints raise, and the reading of TND layouts' cumulative sequence lengths."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class NpuContractError(RuntimeError):
    """A call the real torch_npu op documents as unsupported (a head count, head dim,
    dtype, layout or attribute value outside its documented range). The real op raises
    a ``RuntimeError`` from CANN's parameter check; the emulator raises this subclass,
    naming the op, the argument and the documented constraint."""


def unwritten(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor standing for output memory the op does not write: NaN for floating
    dtypes and the dtype's minimum for integer ones, so a caller that reads it is caught."""
    if dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype)
    return torch.full(tuple(shape), torch.iinfo(dtype).min, dtype=dtype)


def require(ok: bool, op: str, message: str) -> None:
    """Raise :class:`NpuContractError` ``"<op>: <message>"`` unless ``ok``."""
    if not ok:
        raise NpuContractError(f"{op}: {message}")


def cumulative_segments(
    lengths: torch.Tensor | Sequence[int], total: int, op: str, name: str
) -> list[tuple[int, int]]:
    """``[(start, end)]`` per batch from TND-layout CUMULATIVE sequence lengths
    ``lengths`` ``[B]`` (int32 / int64 tensor or ints: batch ``b`` holds rows
    ``lengths[b-1]:lengths[b]`` of a ``[total, ...]`` tensor). Raises when they
    decrease or the last one is not ``total``."""
    ends = [int(v) for v in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    require(len(ends) > 0, op, f"{name} must hold at least one batch")
    starts = [0, *ends[:-1]]
    require(
        all(e >= s for s, e in zip(starts, ends, strict=True)),
        op,
        f"{name} is cumulative in TND layout and must not decrease, got {ends}",
    )
    require(
        ends[-1] == total,
        op,
        f"{name} is cumulative in TND layout: its last entry {ends[-1]} must equal the "
        f"token count {total}",
    )
    return list(zip(starts, ends, strict=True))
