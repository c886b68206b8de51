"""The path of one op call: validate, resolve the backend, check it can take the
input, run its kernel, shadow-check; plus the fake kernel and the autograd formula
that every op's ``torch.library`` registration uses."""

from __future__ import annotations

import torch

from .errors import UnsupportedError
from .registry import ANY_DEVICE, REGISTRY
from .selection import (
    Resolution,
    backward_kernel,
    composite_kernel,
    current_settings,
    resolve,
)
from .shadow import observe
from .specs import SPECS, OpSpec


def run(name: str, args: tuple) -> object:
    """Run op ``name`` on the selected backend (``args`` in schema order)."""
    spec = SPECS[name]
    settings = current_settings()
    spec.validate(args, values=settings.validate_values)
    res = resolve(name, settings)
    _check_backend_takes(spec, res, args)
    out = res.kernel(*args)
    if settings.shadow and settings.shadow != res.backend:
        observe(spec, res, settings, args, out)
    return out


def _check_backend_takes(spec: OpSpec, res: Resolution, args: tuple) -> None:
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if res.device_type not in (ANY_DEVICE, device.type):
        raise UnsupportedError(
            f"glmport.ops.{spec.name}: backend {res.backend!r} runs on {res.device_type} tensors, "
            f"got tensors on {device}. Select a backend for {device.type} "
            f"(GLMPORT_BACKEND=generic works on any torch device) or move the inputs."
        )
    cap = REGISTRY.get(res.backend).manifest.capabilities.get(spec.name)
    refusal = cap.refusal(spec.features(*args)) if cap is not None else None
    if refusal is not None:
        raise UnsupportedError(
            f"glmport.ops.{spec.name}: backend {res.backend!r} does not support {refusal}. "
            f"Route this op elsewhere with GLMPORT_OPS={spec.name}=generic"
        )


def fake(name: str, args: tuple) -> object:
    """Fake (meta) kernel: metadata checks, then empty outputs of the right shape."""
    spec = SPECS[name]
    spec.validate(args, values=False)
    return spec.fake(*args)


def setup_context(name: str, ctx, inputs: tuple, output: object) -> None:
    inputs = SPECS[name].complete(tuple(inputs), {})
    ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))
    ctx.non_tensors = tuple(None if isinstance(x, torch.Tensor) else x for x in inputs)
    ctx.is_tensor = tuple(isinstance(x, torch.Tensor) for x in inputs)
    # The backward runs where the forward ran (often outside the use_backend block).
    ctx.chain = resolve(name).chain


def backward(name: str, ctx, *grads: torch.Tensor) -> tuple:
    """Gradients for every input of op ``name``: the spec's closed form if it defines
    one (straight-through quantisation), else a ``"<op>:backward"`` kernel of the
    first backend along the forward's fallback chain and the composites that has
    one, else the vector-Jacobian product of the op's torch composite."""
    saved = iter(ctx.saved_tensors)
    inputs = tuple(
        next(saved) if is_t else v for is_t, v in zip(ctx.is_tensor, ctx.non_tensors, strict=True)
    )
    spec = SPECS[name]
    if spec.backward is not None:
        return tuple(spec.backward(inputs, grads))
    kernel = backward_kernel(name, ctx.chain)
    if kernel is not None:
        return tuple(kernel(inputs, grads))
    return _composite_vjp(spec, inputs, grads)


def _composite_vjp(spec: OpSpec, inputs: tuple, grads: tuple) -> tuple:
    kernel = composite_kernel(spec.name)
    wanted = [
        i
        for i, n in enumerate(spec.arg_names)
        if n in spec.differentiable and isinstance(inputs[i], torch.Tensor)
    ]
    with torch.enable_grad():
        leaves = list(inputs)
        for i in wanted:
            leaves[i] = inputs[i].detach().requires_grad_(True)
        outs = kernel(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None
        ]
        got = torch.autograd.grad(
            [o for o, _ in pairs],
            [leaves[i] for i in wanted],
            [g for _, g in pairs],
            allow_unused=True,
        )
    result: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, got, strict=True):
        result[i] = g
    return tuple(result)
