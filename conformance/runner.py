"""Runs conformance checks on a backend and records their outcomes.

Kinds of check: ``value`` (a case against the float64 cpu reference), ``determinism``
(two identical calls bitwise equal), ``gradient`` (trainable ops against float64
reference gradients), ``grad_consistency`` (the backend's forward, by central
differences, against the backward in use), ``bad_input`` (the shared error for a
malformed call) and
``opcheck`` (``torch.library.opcheck`` of the registration, through the backend),
``expert_parallel`` (the backend's EP across two processes against the single-process
MoE, :mod:`.ep_case`) and ``model``.
Outcomes: pass, fail, unsupported (the backend's manifest declines the input),
skipped (the backend cannot run here, with the reason), error (anything raised).
Each record names the backend whose kernel the check ran (``ran_on``) and whether
that is the backend under test (``own``) or a fallback along its chain: the verdict
is about the backend's own kernels, fallback results are reported apart.

Gradients, whose code they judge: autograd runs the spec's closed form (straight-
through GEMMs), else the first ``"<op>:backward"`` along the forward's chain, else
the vjp of the composite's torch code, so a ``gradient`` check judges the backend
only when that backward is its own (``metrics["backward"]`` names it: ``"X:backward"``,
``"composite vjp (X)"`` or ``"glmport closed form"``); otherwise it is skipped with ``ran_on``
naming whose backward ran. ``grad_consistency`` ties the backend's forward to that
backward, so a wrong forward cannot hide behind a borrowed, right backward.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

import glmport
from glmport.core.errors import BackendUnavailableError, OpInputError, UnsupportedError
from glmport.core.formats import FP8_DTYPE, SCHEMES
from glmport.core.registry import (
    ANY_DEVICE,
    BACKWARD_SUFFIX,
    PREPARABLE_OPS,
    REGISTRY,
    chain_for,
)
from glmport.core.selection import (
    backward_owner,
    composite_owner,
    current_settings,
    resolve,
    selected_device,
    use_backend,
)
from glmport.core.specs import OP_NAMES, SPECS

from .badinput import BAD_INPUTS, BadInput
from .cases import FLOATS, Case, all_cases
from .ep_case import ep_cases, run_ep_check
from .judges import JUDGES, Verdict, close

OUTCOMES = ("pass", "fail", "unsupported", "skipped", "error")
KINDS = (
    "value",
    "prepared",
    "determinism",
    "gradient",
    "grad_consistency",
    "bad_input",
    "opcheck",
    "expert_parallel",
    "model",
)
MODEL_OP = "model"  # the model-level check's name in reports (not an op)


@dataclass(frozen=True)
class Check:
    """One runnable item of the suite."""

    kind: str
    case: Case
    bad: BadInput | None = None

    @property
    def id(self) -> str:
        if self.bad is not None:
            return self.bad.id
        return self.case.id if self.kind == "value" else f"{self.case.id}-{self.kind}"

    @property
    def op(self) -> str:
        return self.case.op


@dataclass
class Record:
    """The outcome of one check, as it goes into the reports.

    ``ran_on`` is the backend whose kernel ran the check: the first along the chain of
    the backend under test that implements the op and takes the case (for a check
    that could not run, the one that would have run it). ``own`` says whether that is
    the backend under test; otherwise the check judged a fallback.
    """

    id: str
    op: str
    kind: str
    family: str
    dtype: str
    scheme: str | None
    params: dict
    outcome: str
    reason: str = ""
    metrics: dict = field(default_factory=dict)
    tolerance: dict = field(default_factory=dict)
    ran_on: str = ""
    own: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def suite_checks(*, full: bool = False, ops: tuple[str, ...] | None = None) -> list[Check]:
    """Every check of the suite for the chosen mode and ops, in a stable order."""
    cases = all_cases(full=full, ops=ops)
    checks = [Check("value", c) for c in cases]
    checks += [Check("prepared", c) for c in cases if _packed_weight_case(c)]
    for op in OP_NAMES if ops is None else ops:
        # The layout family is judged by value; the other kinds take the plain cases.
        mine = [c for c in cases if c.op == op and c.layout is None]
        if not mine:
            continue
        tiny = next(c for c in mine if c.family == "tiny" and c.dtype == torch.float32)
        big = next((c for c in mine if c.family == "glm5" and c.dtype == torch.bfloat16), tiny)
        checks += [Check("determinism", c) for c in dict.fromkeys((tiny, big))]
        if SPECS[op].differentiable:
            grad_cases = [
                c for c in mine if c.family == "tiny" and c.dtype in (torch.float32, torch.bfloat16)
            ]
            if op == "quant_gemm":  # gradients flow in QAT mode (and to x in packed mode)
                grad_cases = [
                    c for c in mine if c.name in ("qat", "tiny") and c.dtype == torch.float32
                ]
            checks += [Check("gradient", c) for c in grad_cases]
            fp32 = [c for c in grad_cases if c.dtype == torch.float32]
            if SPECS[op].backward is not None:  # closed form: one check, skipped, says why
                fp32 = fp32[:1]
            checks += [Check("grad_consistency", c) for c in fp32]
        checks.append(Check("opcheck", tiny))
        checks += [Check("bad_input", tiny, b) for b in BAD_INPUTS if b.op == op]
    if ops is None or "expert_parallel" in ops:
        checks += [Check("expert_parallel", c) for c in ep_cases()]
    if ops is None:
        checks += [Check("model", _model_case(d)) for d in (torch.float32, torch.bfloat16)]
    return checks


def _packed_weight_case(case: Case) -> bool:
    """A case of an op that takes prepared weights, with a packed (not QAT) weight (in
    the layout family: one whose weight or scales are the re-laid-out argument, which
    ``prepare_weight`` converts)."""
    if case.layout is not None and case.layout[0] not in ("w", "w_scale"):
        return False
    qat = case.name.startswith("qat")  # "qat" and the cases built on it: a float weight
    return case.op in PREPARABLE_OPS and case.scheme in SCHEMES and not qat


def _model_case(dtype: torch.dtype) -> Case:
    return Case(
        MODEL_OP, "tiny_glm5_token_logprobs", "model", dtype, build=lambda g: (), judge="model"
    )


def device_for(device_type: str) -> torch.device:
    """Where inputs go for kernels of ``device_type``: device-neutral code takes
    ``GLMPORT_DEVICE`` (else the CPU)."""
    if device_type == ANY_DEVICE:
        return selected_device()  # a ConfigError if GLMPORT_DEVICE names no device here
    return torch.device(device_type)


def _to(args: tuple, device: torch.device) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _on_device(case: Case, args: tuple, device: torch.device) -> tuple:
    """The case's ``args`` on ``device``, in the case's layout there."""
    return case.laid_out(_to(args, device))


def _dense(args: tuple) -> tuple:
    """``args`` with every tensor contiguous: what the reference and the judges read, so
    that they never depend on a layout under test."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _cpu(outs):
    return tuple(o.detach().cpu() for o in outs) if isinstance(outs, tuple) else outs.detach().cpu()


def _call(op: str, args: tuple):
    return getattr(glmport.ops, op)(*args)


def _reference_kernels():
    """The reference backend's kernels and its float64 mode (the role, not a name)."""
    name = REGISTRY.reference()
    return REGISTRY.kernels(name, False), REGISTRY.get(name).float64


def _reference(case: Case, args: tuple):
    kernels, float64 = _reference_kernels()
    with float64():
        if case.judge == "indexer":
            q, k, w, ks, ke, _, qs, kss = args
            return kernels["indexer_logits"](q, k, w, ks, ke, qs, kss)
        return kernels[case.op](*args)


def run_check(check: Check, backend: str, *, emulate: bool | None = None) -> Record:
    """Run one check on ``backend``; never raises for what the backend does."""
    c = check.case
    rec = Record(
        id=check.id,
        op=c.op,
        kind=check.kind,
        family=c.family,
        dtype=_dtype_name(c.dtype),
        scheme=c.scheme,
        params={k: (list(v) if isinstance(v, tuple) else v) for k, v in c.params},
        outcome="error",
    )
    start = time.perf_counter()
    try:
        with use_backend(backend, emulate=emulate):
            if c.op == MODEL_OP:  # the whole model: the backend's own device
                rec.ran_on = _model_runs_on(backend)
                dev_type = REGISTRY.get(backend).device_type(current_settings().emulate)
            else:
                res = resolve(c.op)
                rec.ran_on, dev_type = res.backend, res.device_type
                if check.kind != "bad_input":  # malformed input is rejected before limits
                    rec.ran_on, declined = _capability_fallback(res, c, device_for(dev_type).type)
                    if declined:
                        raise UnsupportedError(declined)
            verdict = _RUNNERS[check.kind](check, device_for(dev_type), backend)
        rec.outcome = "pass" if verdict.ok else "fail"
        rec.reason, rec.metrics, rec.tolerance = verdict.reason, verdict.metrics, verdict.tolerance
        _attribute(rec, verdict)
    except UnsupportedError as err:
        rec.outcome, rec.reason = "unsupported", str(err)
    except BackendUnavailableError as err:
        rec.outcome, rec.reason = "skipped", str(err)
    except Exception as err:  # a backend crash is an outcome, not a crash of the suite
        rec.outcome, rec.reason = "error", f"{type(err).__name__}: {err}"
    if not rec.ran_on:  # nothing resolved (the backend cannot run here): name who would
        rec.ran_on = _declared_runner(backend, OP_NAMES if c.op == MODEL_OP else (c.op,))
    rec.own = rec.ran_on == backend
    rec.seconds = round(time.perf_counter() - start, 4)
    return rec


def _model_runs_on(backend: str) -> str:
    """Whose kernels the model check exercises: the backend under test when it runs
    any op of the model itself (its kernels are then judged in context), else the
    first backend along its chain that runs one."""
    used = {resolve(op).backend for op in OP_NAMES}
    # GLMPORT_OPS may send ops off the chain: then one of those backends ran them.
    return next(name for name in (*chain_for(backend), *sorted(used)) if name in used)


def _declared_runner(backend: str, entries: tuple[str, ...]) -> str:
    """The first backend along ``backend``'s chain whose manifest declares any of
    ``entries``, availability aside: where a check that could not run would have run
    ("" when the chain cannot even be built, e.g. a plug-in that fails to load)."""
    try:
        chain = chain_for(backend)
    except BackendUnavailableError:
        return ""
    for name in chain:
        try:
            declared = REGISTRY.get(name).manifest.ops
        except BackendUnavailableError:  # a broken fallback plug-in runs nothing
            continue
        if set(entries) & set(declared):
            return name
    return ""


def _capability_fallback(res, case: Case, device_type: str) -> tuple[str, str]:
    """Where ``case`` runs (inputs on ``device_type``), and why the first backend
    declines it ("" when it does not). A case outside the first backend's declared
    limits runs on a fallback: it says nothing about the first one, so the suite
    reports it unsupported, naming the fallback the dispatcher picks (the first later
    candidate that takes the device and the features)."""
    if res.capability is None or case.op not in SPECS:
        return res.backend, ""
    features = SPECS[case.op].features(*case.args())
    refusal = res.capability.refusal(features)
    if refusal is None:
        return res.backend, ""
    taker, _ = res.taker(device_type, features)  # the one the dispatcher picks
    if taker is None:  # the dispatcher refuses such a call outright
        path = " -> ".join(cand.backend for cand in res.candidates)
        return res.backend, f"no backend along {path} takes {refusal}"
    return taker.backend, (
        f"backend {res.backend!r} declares it does not take {refusal} "
        f"(such calls fall back to {taker.backend!r})"
    )


def _value(check: Check, device: torch.device, backend: str) -> Verdict:
    c = check.case
    args = c.args()
    outs = _cpu(_call(c.op, _on_device(c, args, device)))
    dense = _dense(args)
    return JUDGES[c.judge](c.op, c.dtype, dense, outs, _reference(c, dense))


def _prepared(check: Check, device: torch.device, backend: str) -> Verdict:
    """The value case again, with the weight converted once by the backend's
    ``prepare_weight`` hook and the call on the prepared weight (its
    ``"<op>:prepared"`` kernel when it keeps a native layout)."""
    c = check.case
    args = c.args()
    x, w, *rest = _on_device(c, args, device)
    if c.op == "grouped_gemm":
        offsets, w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.grouped_gemm(x, prepared, offsets)
    else:
        w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.quant_gemm(x, prepared)
    dense = _dense(args)
    verdict = JUDGES[c.judge](c.op, c.dtype, dense, _cpu(out), _reference(c, dense))
    layout = "native layout" if prepared.native is not None else "canonical layout"
    return Verdict(verdict.ok, f"{layout}; {verdict.reason}".rstrip("; "), verdict.metrics,
                   verdict.tolerance)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def _determinism(check: Check, device: torch.device, backend: str) -> Verdict:
    c = check.case
    args = _to(c.args(), device)
    first, second = _call(c.op, args), _call(c.op, args)
    first = first if isinstance(first, tuple) else (first,)
    second = second if isinstance(second, tuple) else (second,)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            return Verdict(False, f"output {i} differs between two identical calls")
    return Verdict(True)


@dataclass
class Attributed(Verdict):
    """A verdict that says whose code it judged: ``ran_on`` (when set) replaces the
    record's (the backend whose backward ran), and ``skipped`` makes the outcome
    "skipped" (the check ran none of the backend under test's code, or cannot judge it)."""

    ran_on: str = ""
    skipped: bool = False


def _attribute(rec: Record, verdict: Verdict) -> None:
    """Apply an :class:`Attributed` verdict's ``ran_on`` and ``skipped`` to ``rec``."""
    if isinstance(verdict, Attributed):
        rec.ran_on = verdict.ran_on or rec.ran_on
        if verdict.skipped:
            rec.outcome = "skipped"


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
    leaves = list(_to(args, device))
    for i in wanted:
        leaves[i] = leaves[i].detach().requires_grad_(True)
    outs = _call(case.op, tuple(leaves))
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


def _gradient(check: Check, device: torch.device, backend: str) -> Verdict:
    """Gradients of ``sum(out * cotangent)`` through the backend against float64
    reference gradients (the autograd of the float64 reference).

    Judged only when the backward in use (:func:`_backward_in_use`) is the backend's
    own code (its ``"<op>:backward"``, or the vjp of its own forward when it is the
    composite); otherwise the check is skipped with ``ran_on`` naming whose backward
    ran (``"glmport closed form"`` for the spec's straight-through gradients), since a pass
    would say nothing about the backend: ``grad_consistency`` judges its forward
    against that backward instead. ``metrics["backward"]`` names the backward."""
    c = check.case
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


def _grad_consistency(check: Check, device: torch.device, backend: str) -> Verdict:
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
    c = check.case
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
                o = _call(c.op, _to(tuple(a), device))
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
    kernels, float64 = _reference_kernels()
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


def _bad_input(check: Check, device: torch.device, backend: str) -> Verdict:
    bad = check.bad
    spec = SPECS[bad.op]
    args = list(_to(check.case.args(), device))
    pos = spec.arg_names.index(bad.arg)
    args[pos] = bad.mutate(args[pos])
    try:
        _call(bad.op, tuple(args))
    except OpInputError as err:
        if err.arg != bad.arg or err.op != bad.op:
            return Verdict(
                False, f"raised OpInputError for {err.op}.{err.arg}, expected {bad.op}.{bad.arg}"
            )
        return Verdict(True)
    except Exception as err:
        return Verdict(False, f"raised {type(err).__name__} instead of glmport.OpInputError: {err}")
    return Verdict(False, f"accepted a malformed '{bad.arg}' without an error")


def _opcheck(check: Check, device: torch.device, backend: str) -> Verdict:
    c = check.case
    spec = SPECS[c.op]
    args = list(_to(c.args(), device))
    for i, n in enumerate(spec.arg_names):
        if (
            n in spec.differentiable
            and isinstance(args[i], torch.Tensor)
            and args[i].dtype in FLOATS
        ):
            args[i] = args[i].detach().requires_grad_(True)
    utils = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    if any(isinstance(a, torch.Tensor) and a.dtype == FP8_DTYPE for a in args):
        utils = utils[1:]  # torch's schema checker cannot compare float8 tensors (allclose)
    torch.library.opcheck(getattr(torch.ops.glmport, c.op).default, tuple(args), test_utils=utils)
    return Verdict(True)


def _expert_parallel(check: Check, device: torch.device, backend: str) -> Verdict:
    return run_ep_check(check.case, device, backend)


def _model(check: Check, device: torch.device, backend: str) -> Verdict:
    from .model_case import run_model_check

    return run_model_check(check.case.dtype, backend, device)


_RUNNERS = {
    "value": _value,
    "prepared": _prepared,
    "determinism": _determinism,
    "gradient": _gradient,
    "grad_consistency": _grad_consistency,
    "bad_input": _bad_input,
    "opcheck": _opcheck,
    "expert_parallel": _expert_parallel,
    "model": _model,
}
