"""Runs conformance checks on a backend and records their outcomes.

Kinds of check: ``value`` (a case against the float64 cpu reference), ``determinism``
(two identical calls bitwise equal), ``gradient`` (trainable ops against float64
reference gradients), ``bad_input`` (the shared error for a malformed call) and
``opcheck`` (``torch.library.opcheck`` of the registration, through the backend),
``expert_parallel`` (the backend's EP across two processes against the single-process
MoE, :mod:`.ep_case`) and ``model``.
Outcomes: pass, fail, unsupported (the backend's manifest declines the input),
skipped (the backend cannot run here, with the reason), error (anything raised).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

import glmport
from glmport.core.errors import BackendUnavailableError, OpInputError, UnsupportedError
from glmport.core.formats import FP8_DTYPE, SCHEMES
from glmport.core.registry import ANY_DEVICE, PREPARABLE_OPS, REGISTRY
from glmport.core.selection import current_settings, resolve, use_backend
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
    """The outcome of one check, as it goes into the reports."""

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
        mine = [c for c in cases if c.op == op]
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
        checks.append(Check("opcheck", tiny))
        checks += [Check("bad_input", tiny, b) for b in BAD_INPUTS if b.op == op]
    if ops is None or "expert_parallel" in ops:
        checks += [Check("expert_parallel", c) for c in ep_cases()]
    if ops is None:
        checks += [Check("model", _model_case(d)) for d in (torch.float32, torch.bfloat16)]
    return checks


def _packed_weight_case(case: Case) -> bool:
    """A case of an op that takes prepared weights, with a packed (not QAT) weight."""
    return case.op in PREPARABLE_OPS and case.scheme in SCHEMES and case.name != "qat"


def _model_case(dtype: torch.dtype) -> Case:
    return Case(
        MODEL_OP, "tiny_glm5_token_logprobs", "model", dtype, build=lambda g: (), judge="model"
    )


def device_for(device_type: str) -> torch.device:
    """Where inputs go for kernels of ``device_type``: device-neutral code takes
    ``GLMPORT_DEVICE`` (else the CPU)."""
    if device_type == ANY_DEVICE:
        return torch.device(current_settings().device or "cpu")
    return torch.device(device_type)


def _to(args: tuple, device: torch.device) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


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
                rec.ran_on = backend
                dev_type = REGISTRY.get(backend).device_type(current_settings().emulate)
            else:
                res = resolve(c.op)
                rec.ran_on, dev_type = res.backend, res.device_type
                if check.kind != "bad_input":  # malformed input is rejected before limits
                    _require_within_capability(res, c)
            verdict = _RUNNERS[check.kind](check, device_for(dev_type), backend)
        rec.outcome = "pass" if verdict.ok else "fail"
        rec.reason, rec.metrics, rec.tolerance = verdict.reason, verdict.metrics, verdict.tolerance
    except UnsupportedError as err:
        rec.outcome, rec.reason = "unsupported", str(err)
    except BackendUnavailableError as err:
        rec.outcome, rec.reason = "skipped", str(err)
    except Exception as err:  # a backend crash is an outcome, not a crash of the suite
        rec.outcome, rec.reason = "error", f"{type(err).__name__}: {err}"
    rec.seconds = round(time.perf_counter() - start, 4)
    return rec


def _require_within_capability(res, case: Case) -> None:
    """A case outside the backend's declared limits would run on a fallback backend:
    it says nothing about this one, so it is unsupported here."""
    if res.capability is None or case.op not in SPECS:
        return
    refusal = res.capability.refusal(SPECS[case.op].features(*case.args()))
    if refusal is not None:
        raise UnsupportedError(
            f"backend {res.backend!r} declares it does not take {refusal} "
            "(such calls fall back along its chain)"
        )


def _value(check: Check, device: torch.device, backend: str) -> Verdict:
    c = check.case
    args = c.args()
    outs = _cpu(_call(c.op, _to(args, device)))
    return JUDGES[c.judge](c.op, c.dtype, args, outs, _reference(c, args))


def _prepared(check: Check, device: torch.device, backend: str) -> Verdict:
    """The value case again, with the weight converted once by the backend's
    ``prepare_weight`` hook and the call on the prepared weight (its
    ``"<op>:prepared"`` kernel when it keeps a native layout)."""
    c = check.case
    args = c.args()
    x, w, *rest = _to(args, device)
    if c.op == "grouped_gemm":
        offsets, w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.grouped_gemm(x, prepared, offsets)
    else:
        w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.quant_gemm(x, prepared)
    verdict = JUDGES[c.judge](c.op, c.dtype, args, _cpu(out), _reference(c, args))
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


def _gradient(check: Check, device: torch.device, backend: str) -> Verdict:
    """Gradients of ``sum(out * cotangent)`` through the backend against float64
    reference gradients (the autograd of the float64 reference, or the spec's closed
    form for ops whose backward is straight-through)."""
    c = check.case
    spec = SPECS[c.op]
    args = c.args()
    wanted = [
        i
        for i, n in enumerate(spec.arg_names)
        if n in spec.differentiable
        and isinstance(args[i], torch.Tensor)
        and args[i].dtype in FLOATS
    ]
    leaves = list(_to(args, device))
    for i in wanted:
        leaves[i] = leaves[i].detach().requires_grad_(True)
    outs = _call(c.op, tuple(leaves))
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(c.seed + 1)
    cots = [torch.randn(o.shape, generator=gen) if o.is_floating_point() else None for o in outs]
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
            return Verdict(
                False, f"gradient of '{spec.arg_names[i]}': {v.reason}", v.metrics, v.tolerance
            )
    return Verdict(True)


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
    "bad_input": _bad_input,
    "opcheck": _opcheck,
    "expert_parallel": _expert_parallel,
    "model": _model,
}
