"""The ``gradient`` and ``grad_consistency`` checks, and whose code they judge.

Autograd runs the spec's closed form (straight-through GEMMs), else the first
``"<op>:backward"`` along the forward's chain, else the vjp of the composite's torch
code, so a ``gradient`` check judges the backend only when that backward is its own
(``metrics["backward"]`` names it: ``"X:backward"``, ``"composite vjp (X)"`` or
``"glmport closed form"``); otherwise it is skipped with ``ran_on`` naming whose backward
ran. ``grad_consistency`` ties the backend's forward to that backward, so a wrong
forward cannot hide behind a borrowed, right backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmport.core.registry import BACKWARD_SUFFIX
from glmport.core.selection import backward_owner, composite_owner, current_settings, resolve
from glmport.core.specs import SPECS

from .calls import call_op, reference_kernels, to_device
from .cases.base import FLOATS, Case
from .judges import Verdict, close


@dataclass
class Attributed(Verdict):
    """A verdict that says whose code it judged: ``ran_on`` (when set) replaces the
    record's (the backend whose backward ran), and ``skipped`` makes the outcome
    "skipped" (the check ran none of the backend under test's code, or cannot judge it)."""

    ran_on: str = ""
    skipped: bool = False


CLOSED_FORM = "glmport closed form"


def _backward_in_use(op: str, device: torch.device) -> tuple[str, str]:
    """Which backward autograd runs for ``op`` on ``device`` under the current settings,
    as ``(label, owner)``, resolved as :func:`glmport.core.dispatch.backward` does:
    the spec's closed form (``"glmport closed form"``, no backend's code), else the first
    ``"<op>:backward"`` along the forward's chain (``"X:backward"``, owner X), else the
    vjp of the composite's torch code (``"composite vjp (X)"``, owner X)."""
    if SPECS[op].backward is not None:
        return CLOSED_FORM, CLOSED_FORM
    settings = current_settings()
    chain = resolve(op, settings, device_type=device.type).chain
    owner = backward_owner(op, chain, settings.emulate)
    if owner is not None:
        return f"{owner}{BACKWARD_SUFFIX}", owner
    owner = composite_owner(op, chain)
    return f"composite vjp ({owner})", owner


def _forward_on_leaves(case: Case, device: torch.device):
    """The case's arguments, the positions that receive gradients, the arguments on
    ``device`` with those as fresh leaves, the op's outputs on them (a tuple) and the
    case's seeded cotangents (None for integer outputs)."""
    args = case.args()
    wanted = _differentiable(SPECS[case.op], args)
    leaves = list(to_device(args, device))
    for i in wanted:
        leaves[i] = leaves[i].detach().requires_grad_(True)
    outs = call_op(case.op, tuple(leaves))
    outs = outs if isinstance(outs, tuple) else (outs,)
    return args, wanted, leaves, outs, _cotangents(case, outs)


def _differentiable(spec, args: tuple) -> list[int]:
    """Positions of the floating tensor arguments that receive gradients."""
    return [
        i
        for i, n in enumerate(spec.arg_names)
        if n in spec.differentiable
        and isinstance(args[i], torch.Tensor)
        and args[i].dtype in FLOATS
    ]


def _cotangents(case: Case, outs: tuple) -> list[torch.Tensor | None]:
    """A seeded float32 cotangent (CPU) per floating output, None for integer outputs."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    return [torch.randn(o.shape, generator=gen) if o.is_floating_point() else None for o in outs]


def gradient_verdict(c: Case, device: torch.device, backend: str) -> Verdict:
    """Gradients of ``sum(out * cotangent)`` through the backend against float64
    reference gradients (the autograd of the float64 reference).

    Judged only when the backward in use (:func:`_backward_in_use`) is the backend's
    own code (its ``"<op>:backward"``, or the vjp of its own forward when it is the
    composite); otherwise the check is skipped with ``ran_on`` naming whose backward
    ran (``"glmport closed form"`` for the spec's straight-through gradients), since a pass
    would say nothing about the backend: ``grad_consistency`` judges its forward
    against that backward instead. ``metrics["backward"]`` names the backward."""
    source, owner = _backward_in_use(c.op, device)
    if owner != backend:
        return Attributed(
            True,
            f"gradients come from {source}, not from {backend}'s code; "
            "see the forward/backward consistency check",
            {"backward": source},
            ran_on=owner,
            skipped=True,
        )
    spec = SPECS[c.op]
    args, wanted, leaves, outs, cots = _forward_on_leaves(c, device)
    loss = sum(
        (torch.where(torch.isfinite(o), o, 0).float() * ct.to(device)).sum()
        for o, ct in zip(outs, cots, strict=True)
        if ct is not None
    )
    got = torch.autograd.grad(loss, [leaves[i] for i in wanted], allow_unused=True)
    want = _reference_grads(c.op, args, wanted, outs, cots)
    for i, g, r in zip(wanted, got, want, strict=True):
        g = torch.zeros_like(r) if g is None else g.detach().cpu()
        v = close(c.op, c.dtype, args, g, r)
        if not v.ok:
            return Attributed(
                False,
                f"gradient of '{spec.arg_names[i]}' ({source}): {v.reason}",
                {**v.metrics, "backward": source},
                v.tolerance,
                ran_on=owner,
            )
    return Attributed(True, "", {"backward": source}, ran_on=owner)


# Consistency by central differences of the float32 forward (specs take no float64).
# One differentiable input x at a time moves by +-h * d, d ~ N(0, rms(x)^2) per entry,
# starting at h = eps32^(1/3) ~ 5e-3, which balances truncation (~h^2) against rounding
# (~eps/h). The error is relative to ||grad * step||_2, the size of a directional
# derivative along a random direction: the cpu and generic kernels stay near 1e-4 of it
# (a kernel rounding up to the value tolerance, ~100x more, still passes), a wrong
# forward or backward is off by O(0.1-1). Kinks (relu) and discrete choices (top-k)
# are met with smaller steps: one step must agree.
FD_STEPS = tuple(float(torch.finfo(torch.float32).eps) ** (1 / 3) / 4**j for j in range(3))


FD_RTOL = 1e-2


def _objective(outs: tuple, cots: list, finite: list) -> torch.Tensor:
    """``sum(out * cot)`` in float64 over the floating outputs, leaving out entries that
    are non-finite at the base point (``-inf`` lse of empty rows). A scalar."""
    return sum(
        (torch.where(f, o.double(), 0) * ct.to(o.device).double()).sum()
        for o, ct, f in zip(outs, cots, finite, strict=True)
        if ct is not None
    )


def consistency_verdict(c: Case, device: torch.device, backend: str) -> Verdict:
    """The backend's forward against the backward in use (:func:`_backward_in_use`).

    With ``L = sum(out * cot)`` (cotangents as in the gradient check), per differentiable
    input ``x`` (float32; integer inputs such as indices fixed): the central difference
    ``L(x+) - L(x-)`` of the backend's forward kernel at ``x+- = x +- h d`` (``d`` a
    seeded random tensor of ``x``'s shape, scaled to ``x``'s RMS; ``L`` a scalar) must match
    ``<dL/dx, x+ - x->`` from the backward autograd runs, within ``FD_RTOL`` of
    ``||dL/dx * (x+ - x-)||_2``, at one of the steps ``FD_STEPS`` at which the integer
    outputs (top-k choices) stay those at ``x``. A wrong forward disagrees with a
    borrowed backward, a wrong fused backward with a right forward. Ops whose spec has
    a closed-form (straight-through) backward are skipped: their gradient is by design
    not the derivative of the forward (piecewise constant in quantised weights)."""
    spec = SPECS[c.op]
    source, owner = _backward_in_use(c.op, device)
    if owner == CLOSED_FORM:
        return Attributed(
            True,
            f"{c.op}'s backward is the spec's closed form (straight-through), by design "
            "not the derivative of its forward",
            {"backward": source},
            skipped=True,
        )
    args, wanted, leaves, outs, cots = _forward_on_leaves(c, device)
    finite = [torch.isfinite(o) if o.is_floating_point() else None for o in outs]
    grads = torch.autograd.grad(
        _objective(outs, cots, finite), [leaves[i] for i in wanted], allow_unused=True
    )
    gen = torch.Generator().manual_seed(c.seed + 2)
    metrics: dict = {"backward": source, "consistency_rel": 0.0}
    tol = {"consistency_rel": FD_RTOL}
    for i, g in zip(wanted, grads, strict=True):
        g = torch.zeros(args[i].shape) if g is None else g.detach().cpu().double()
        x = args[i].double()
        d = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        d = d * x.square().mean().sqrt().clamp_min(1e-3)
        best = None
        for h in FD_STEPS:
            plus, minus = list(args), list(args)
            plus[i], minus[i] = ((x + s * h * d).to(args[i].dtype) for s in (1, -1))
            got = []
            for a in (plus, minus):
                o = call_op(c.op, to_device(tuple(a), device))
                got.append(o if isinstance(o, tuple) else (o,))
            if any(
                not o.is_floating_point() and not (torch.equal(o, p) and torch.equal(o, m))
                for o, p, m in zip(outs, *got, strict=True)
            ):
                continue  # a discrete choice flipped: the derivative holds it fixed
            step = plus[i].double() - minus[i].double()
            numeric = float(_objective(got[0], cots, finite) - _objective(got[1], cots, finite))
            analytic = float((g * step).sum())
            err = abs(numeric - analytic) / max(float((g * step).norm()), 1e-30)
            if best is None or err < best[0]:
                best = (err, numeric, analytic)
            if err <= FD_RTOL:
                break
        name = spec.arg_names[i]
        if best is None:
            return Attributed(
                True,
                f"'{name}': integer outputs (top-k choices) change under every step "
                f"{FD_STEPS}: no derivative to compare",
                metrics,
                skipped=True,
            )
        metrics["consistency_rel"] = max(metrics["consistency_rel"], best[0])
        if best[0] > FD_RTOL:
            return Attributed(
                False,
                f"'{name}': the forward's directional derivative {best[1]:.6g} (central "
                f"differences) disagrees with {source}'s {best[2]:.6g}: off by "
                f"{best[0]:.3g} of ||grad*step|| (tolerance {FD_RTOL:g})",
                metrics,
                tol,
            )
    return Attributed(True, "", metrics, tol)


def _reference_grads(op, args, wanted, outs, cots):
    spec = SPECS[op]
    if spec.backward is not None:
        grads = tuple(
            torch.zeros(o.shape, dtype=torch.float64) if ct is None else ct.double()
            for o, ct in zip(outs, cots, strict=True)
        )
        inputs = tuple(a.double() if i in wanted else a for i, a in enumerate(args))
        full = spec.backward(inputs, grads)
        return [full[i].double() for i in wanted]
    kernels, float64 = reference_kernels()
    kernel = kernels[op]
    leaves = list(args)
    for i in wanted:
        leaves[i] = args[i].detach().double().requires_grad_(True)
    with float64():
        refs = kernel(*leaves)
    refs = refs if isinstance(refs, tuple) else (refs,)
    loss = sum(
        (torch.where(torch.isfinite(r), r, 0) * ct.double()).sum()
        for r, ct in zip(refs, cots, strict=True)
        if ct is not None
    )
    grads = torch.autograd.grad(loss, [leaves[i] for i in wanted], allow_unused=True)
    return [
        torch.zeros_like(leaves[i]) if g is None else g for i, g in zip(wanted, grads, strict=True)
    ]
