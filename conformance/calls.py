"""Calling an op of a conformance case: where its inputs go, the call through
``glmport.ops``, the float64 reference, and the dense CPU copies the judges read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch

import glmport
from glmport.core.registry import ANY_DEVICE, REGISTRY, Kernel
from glmport.core.selection import selected_device

from .cases.base import Case, prefix_width
from .paging import logits_args


def device_for(device_type: str) -> torch.device:
    """Where inputs go for kernels of ``device_type``: device-neutral code takes
    ``GLMPORT_DEVICE`` (else the CPU)."""
    if device_type == ANY_DEVICE:
        return selected_device()  # a ConfigError if GLMPORT_DEVICE names no device here
    return torch.device(device_type)


def to_device(args: tuple, device: torch.device) -> tuple:
    """``args`` with every tensor moved to ``device`` (same dtypes and shapes). An
    argument that is a prefix view of an earlier one (absorbed MLA's ``v = k[..., :512]``)
    stays that view of the moved tensor, as a caller on the device would pass it (moved
    alone it would be a copy, which a vendor kernel may not recognise as the latent)."""
    moved: list = []
    for a in args:
        if isinstance(a, torch.Tensor):
            width = next(
                ((i, w) for i, b in enumerate(args[: len(moved)]) if (w := prefix_width(b, a))),
                None,
            )
            a = moved[width[0]][..., : width[1]] if width else a.to(device)
        moved.append(a)
    return tuple(moved)


def on_device(case: Case, args: tuple, device: torch.device) -> tuple:
    """The case's ``args`` on ``device``, in the case's layout there."""
    return case.laid_out(to_device(args, device))


def dense_args(args: tuple) -> tuple:
    """``args`` with every tensor contiguous: what the reference and the judges read, so
    that they never depend on a layout under test."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def to_cpu(outs: torch.Tensor | tuple) -> torch.Tensor | tuple:
    """An op's output (a tensor or a tuple of them) detached, on the CPU."""
    return tuple(o.detach().cpu() for o in outs) if isinstance(outs, tuple) else outs.detach().cpu()


def call_op(op: str, args: tuple) -> torch.Tensor | tuple:
    """``glmport.ops.<op>(*args)``: dispatched to the selected backend."""
    return getattr(glmport.ops, op)(*args)


def reference_kernels() -> tuple[Mapping[str, Kernel], Callable[[], AbstractContextManager]]:
    """The reference backend's kernels and its float64 mode (the role, not a name)."""
    name = REGISTRY.reference()
    return REGISTRY.kernels(name, False), REGISTRY.get(name).float64


def reference(case: Case, args: tuple) -> torch.Tensor | tuple:
    """The float64 reference's outputs for ``case`` on ``args`` (for the indexer's judge,
    its ``[T, N]`` scores rather than its top-k)."""
    kernels, float64 = reference_kernels()
    with float64():
        if case.judge == "indexer":
            return kernels["indexer_logits"](*logits_args(args))
        return kernels[case.op](*args)
