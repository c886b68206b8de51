"""The path of one op call: validate, resolve the backend for the inputs' device, pick
the first backend along the chain whose capabilities take the call, run its kernel,
check its result for overflow (``full`` and ``strict``), shadow-check, record it in an
open op trace (:mod:`.trace`); plus the fake kernel and the autograd formula that
every op's ``torch.library`` registration uses.

Eager calls that need neither autograd nor tracing skip the ``torch.library``
dispatcher (its Python custom-op path costs tens of microseconds a call) and come
here directly; everything else goes through ``torch.ops.glmport.*``, which calls
:func:`run` too, so both paths run the same code.
"""

from __future__ import annotations

import inspect

import torch

from .errors import KernelSignatureError, UnsupportedError
from .registry import ANY_DEVICE, PREPARED_SUFFIX, REGISTRY
from .selection import (
    Resolution,
    backward_kernel,
    composite_kernel,
    current_settings,
    log_fallback_once,
    resolve,
)
from .shadow import observe
from .specs import SPECS, OpSpec
from .specs.quant import PreparedWeight
from .trace import active_trace
from .validate import Level

# Metadata signatures (shapes, dtypes, devices, scalars) that passed the checks: in
# meta mode a repeated call shape is not checked again (the checks read nothing else).
_passed: set[tuple] = set()
_MAX_PASSED = 4096


def _validate(spec: OpSpec, args: tuple, level: Level) -> str:
    """Check ``args`` at ``level``; returns the device type of the first (tensor)
    argument. The metadata checks read nothing but the signature (shapes, dtypes,
    devices, scalars), so a signature that passed them once skips them: in ``meta``
    mode nothing is left to run, otherwise only the value checks."""
    sig = tuple(
        [
            (a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
            for a in args
        ]
    )
    key: tuple | None = (spec.name, sig)
    try:
        known = key in _passed
    except TypeError:  # an unhashable argument (a list where a tensor belongs): no cache
        key, known = None, False
    if not (known and level == Level.META):
        spec.validate(args, values=level, metadata=not known)
    if key is not None and not known:
        if len(_passed) >= _MAX_PASSED:
            _passed.clear()
        _passed.add(key)
    return sig[0][2].type


def run(name: str, args: tuple) -> object:
    """Run op ``name`` on the selected backend (``args`` in schema order; the first
    argument of every op is a tensor; ``quant_gemm`` / ``grouped_gemm`` may carry a
    :class:`PreparedWeight` as ``w``)."""
    spec = SPECS[name]
    settings = current_settings()
    prepared = args[1] if type(args[1]) is PreparedWeight else None
    call_args = args
    if prepared is not None:  # checks, resolution and shadow see the canonical weight
        args = call_args = (args[0], prepared.w, *args[2:])
    device_type = _validate(spec, args, settings.validate)
    res = resolve(name, settings, device_type=device_type)
    if res.capability is None and (res.device_type == device_type or res.device_type == ANY_DEVICE):
        kernel, backend = res.kernel, res.backend
    else:
        kernel, backend = _pick(spec, res, args, device_type)
    entry = name
    if prepared is not None and prepared.native is not None:
        if backend == prepared.backend and settings.emulate == prepared.emulate:
            entry = name + PREPARED_SUFFIX
            kernel = REGISTRY.kernels(backend, settings.emulate)[entry]
            call_args = (args[0], prepared, *args[2:])
        else:
            log_fallback_once(
                prepared.backend, name, backend, "prepared a weight but no longer runs"
            )
    try:
        out = kernel(*call_args)
    except TypeError as err:  # costs nothing unless raised; then: the kernel, or its call?
        misfit = _signature_misfit(spec, backend, entry, kernel, call_args, err)
        if misfit is not None:
            raise misfit from err
        raise
    if settings.validate >= Level.FULL:
        spec.validate_result(args, out, settings.validate)
    if settings.shadow and settings.shadow != backend:
        observe(spec, backend, settings, args, out)
    trace = active_trace()
    if trace is not None:
        trace.add(name, backend, args, out)
    return out


def _signature_misfit(
    spec: OpSpec, backend: str, entry: str, kernel, args: tuple, err: TypeError
) -> KernelSignatureError | None:
    """The error for a kernel that cannot be called with ``args`` at all (its
    signature does not bind them; ``err`` is what the call raised), or None: the
    TypeError came from inside the kernel, or its signature cannot be read (a
    builtin), and stands as raised."""
    try:
        inspect.signature(kernel).bind(*args)
    except TypeError:
        return KernelSignatureError(
            f"backend {backend!r} kernel for {entry!r} does not take the op's arguments "
            f"(schema {spec.schema}; glmport passes all {len(args)} positionally, in "
            f"schema order, defaults filled in): {err}"
        )
    except ValueError:
        return None
    return None


def _pick(spec: OpSpec, res: Resolution, args: tuple, device_type: str):
    """The first candidate along ``res``'s chain that runs on ``device_type`` and whose
    capabilities take these inputs; a refused call falls back with one log line."""
    if not res.candidates[0].takes(device_type):
        raise UnsupportedError(
            f"glmport.ops.{spec.name}: backend {res.backend!r} runs on {res.device_type} "
            f"tensors, got tensors on {device_type}. Select a backend for {device_type} "
            "(GLMPORT_BACKEND=auto follows the inputs' device) or move the inputs."
        )
    cand, refusals = res.taker(device_type, spec.features(*args))
    if cand is None:
        path = " -> ".join(c.backend for c in res.candidates)
        refused = "; ".join(f"{b}: {r}" for b, r in refusals)
        raise UnsupportedError(
            f"glmport.ops.{spec.name}: no backend along {path} takes this call ({refused})"
        )
    if refusals:
        why = f"cannot take {refusals[0][1]} in"
        log_fallback_once(refusals[0][0], spec.name, cand.backend, why)
    return cand.kernel, cand.backend


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
    settings = current_settings()
    ctx.chain = resolve(name, settings, device_type=inputs[0].device.type).chain
    ctx.emulate = settings.emulate


def backward(name: str, ctx, *grads: torch.Tensor) -> tuple:
    """Gradients for every input of op ``name``: the spec's closed form if it defines
    one (straight-through quantisation), else a ``"<op>:backward"`` kernel of the
    first backend along the forward's fallback chain, the composites and the
    reference that has one, else the vector-Jacobian product of the op's composite
    (the forward's own code when it ran on torch code: a composite or the reference)."""
    saved = iter(ctx.saved_tensors)
    inputs = tuple(
        next(saved) if is_t else v for is_t, v in zip(ctx.is_tensor, ctx.non_tensors, strict=True)
    )
    spec = SPECS[name]
    if spec.backward is not None:
        return tuple(spec.backward(inputs, grads))
    kernel = backward_kernel(name, ctx.chain, ctx.emulate)
    if kernel is not None:
        return tuple(kernel(inputs, grads))
    return _composite_vjp(spec, inputs, grads, ctx.chain)


def _composite_vjp(spec: OpSpec, inputs: tuple, grads: tuple, chain: tuple[str, ...]) -> tuple:
    kernel = composite_kernel(spec.name, chain)
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
