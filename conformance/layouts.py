"""Memory layouts the conformance suite feeds an op's tensor arguments in.

A kernel that reads a tensor through its data pointer with strides it assumed (a
contiguous ``[T]`` index vector, a unit-stride last dim) is right on contiguous
inputs and silently wrong on any other view. Two layouts catch that class:

- ``strided``: the same values in a view that shares nothing with the contiguous
  layout: every dim has a stride other than its contiguous one (at least 2, the last
  dim included), the dims lie in reverse memory order (dim 0 has the smallest
  stride), and the view starts one element in along every dim (a storage offset).
- ``broadcast``: the values of the first row along the first dim longer than 1,
  expanded over that dim with stride 0 (``t[:1].expand(t.shape)``), as
  ``torch.expand`` and broadcasting views hand them to an op. The values differ from
  the contiguous call's, so the reference is computed on the broadcast values.

Both are views on the tensor's own device, made after the arguments reach it
(``Tensor.to(device)`` makes a non-dense tensor contiguous).
"""

from __future__ import annotations

import torch

LAYOUTS = ("strided", "broadcast")


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous view: dims in reverse memory order, every
    stride at least 2 (``[1::2]`` along every dim of a buffer ``2 s + 1`` long in a dim
    of size ``s``), so a storage offset too. A 0-d tensor comes back as is."""
    if t.dim() == 0:
        return t
    buffer = torch.zeros(
        tuple(2 * s + 1 for s in reversed(t.shape)), dtype=t.dtype, device=t.device
    )
    view = buffer.permute(*reversed(range(t.dim())))[(slice(1, None, 2),) * t.dim()]
    view.copy_(t)
    return view


def broadcast(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s first row along its first dim longer than 1, expanded over that dim with
    stride 0; None when no dim is longer than 1 (a stride-0 view would change nothing)."""
    for dim, size in enumerate(t.shape):
        if size > 1:
            return t.narrow(dim, 0, 1).expand(t.shape)
    return None


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor | None:
    """``t`` in ``layout`` (one of :data:`LAYOUTS`), or None when it does not apply."""
    if layout == "strided":
        return strided(t)
    if layout == "broadcast":
        return broadcast(t)
    raise ValueError(f"unknown layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
