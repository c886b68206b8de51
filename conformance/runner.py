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

The gradient checks, and whose backward they judge, are in :mod:`.gradients`; calling
an op of a case and the float64 reference in :mod:`.calls`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

import glmport
from glmport.core.errors import BackendUnavailableError, OpInputError, UnsupportedError
from glmport.core.formats import FP8_DTYPE, SCHEMES
from glmport.core.registry import PREPARABLE_OPS, REGISTRY, chain_for
from glmport.core.selection import current_settings, recording_fallbacks, resolve, use_backend
from glmport.core.specs import OP_NAMES, SPECS

from .badinput import BAD_INPUTS, BadInput
from .calls import call_op, dense_args, device_for, on_device, reference, to_cpu, to_device
from .cases import all_cases
from .cases.base import FLOATS, Case
from .ep_case import ep_cases, run_ep_check
from .gradients import Attributed, consistency_verdict, gradient_verdict
from .judges import JUDGES, Verdict

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

    @property
    def dtype_column(self) -> str:
        """Its record's column in the reports (:func:`dtype_key`)."""
        return dtype_key(dtype_name(self.case.dtype), self.case.scheme)


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


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_key(dtype: str, scheme: str | None) -> str:
    """The reports' dtype column: ``"bfloat16"``, or ``"bfloat16/w8a8"`` with a scheme."""
    return dtype if scheme is None else f"{dtype}/{scheme}"


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


def run_check(check: Check, backend: str, *, emulate: bool | None = None) -> Record:
    """Run one check on ``backend``; never raises for what the backend does."""
    c = check.case
    rec = Record(
        id=check.id,
        op=c.op,
        kind=check.kind,
        family=c.family,
        dtype=dtype_name(c.dtype),
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
            with recording_fallbacks() as fallbacks:
                verdict = _RUNNERS[check.kind](check, device_for(dev_type), backend)
        rec.outcome = "pass" if verdict.ok else "fail"
        rec.reason, rec.metrics, rec.tolerance = verdict.reason, verdict.metrics, verdict.tolerance
        _attribute(rec, verdict)
        _attribute_handed_over(rec, fallbacks)
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
    outs = to_cpu(call_op(c.op, on_device(c, args, device)))
    dense = dense_args(args)
    return JUDGES[c.judge](c.op, c.dtype, dense, outs, reference(c, dense))


def _prepared(check: Check, device: torch.device, backend: str) -> Verdict:
    """The value case again, with the weight converted once by the backend's
    ``prepare_weight`` hook and the call on the prepared weight (its
    ``"<op>:prepared"`` kernel when it keeps a native layout)."""
    c = check.case
    args = c.args()
    x, w, *rest = on_device(c, args, device)
    if c.op == "grouped_gemm":
        offsets, w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.grouped_gemm(x, prepared, offsets)
    else:
        w_scale, scheme, group_size = rest
        prepared = glmport.prepare_weight(c.op, w, w_scale, scheme, group_size)
        out = glmport.ops.quant_gemm(x, prepared)
    dense = dense_args(args)
    verdict = JUDGES[c.judge](c.op, c.dtype, dense, to_cpu(out), reference(c, dense))
    layout = "native layout" if prepared.native is not None else "canonical layout"
    return Verdict(verdict.ok, f"{layout}; {verdict.reason}".rstrip("; "), verdict.metrics,
                   verdict.tolerance)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def _determinism(check: Check, device: torch.device, backend: str) -> Verdict:
    c = check.case
    args = to_device(c.args(), device)
    first, second = call_op(c.op, args), call_op(c.op, args)
    first = first if isinstance(first, tuple) else (first,)
    second = second if isinstance(second, tuple) else (second,)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        if a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            return Verdict(False, f"output {i} differs between two identical calls")
    return Verdict(True)


def _attribute(rec: Record, verdict: Verdict) -> None:
    """Apply an :class:`Attributed` verdict's ``ran_on`` and ``skipped`` to ``rec``."""
    if isinstance(verdict, Attributed):
        rec.ran_on = verdict.ran_on or rec.ran_on
        if verdict.skipped:
            rec.outcome = "skipped"


def _attribute_handed_over(rec: Record, fallbacks: list[tuple[str, str, str]]) -> None:
    """A kernel that handed the check's op to another backend inside itself (an
    adapter running the generic composite for an input it cannot take) did not run
    the check: credit the backend that did."""
    handed = [used for requested, op, used in fallbacks if op == rec.op and requested == rec.ran_on]
    if handed:
        rec.reason = "; ".join(
            filter(None, (rec.reason, f"{rec.ran_on}'s kernel handed it to {handed[0]}"))
        )
        rec.ran_on = handed[0]


def _bad_input(check: Check, device: torch.device, backend: str) -> Verdict:
    bad = check.bad
    spec = SPECS[bad.op]
    args = list(to_device(check.case.args(), device))
    pos = spec.arg_names.index(bad.arg)
    args[pos] = bad.mutate(args[pos])
    # Off the CPU the default level's value checks are device-side asserts, which would
    # stop the device for the rest of the run; strict reads them into the same error.
    level = None if device.type == "cpu" else "strict"
    try:
        with use_backend(validate=level):
            call_op(bad.op, tuple(args))
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
    args = list(to_device(c.args(), device))
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


def _gradient(check: Check, device: torch.device, backend: str) -> Verdict:
    return gradient_verdict(check.case, device, backend)


def _grad_consistency(check: Check, device: torch.device, backend: str) -> Verdict:
    return consistency_verdict(check.case, device, backend)


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
