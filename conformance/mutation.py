"""Running a mutant: the suite's checks of its op on the base backend with that one
kernel mutated.

:func:`run_mutant` registers the mutant as a backend of its own (:class:`MutantBackend`:
the base backend with that one op replaced, everything else falling back to the base)
and runs the op's quick checks and the model-level check on it, cheapest first, until
one fails it: a **kill**, counted only if the same check passes on the base backend
(a base that fails a check kills nothing with it). A mutant no check fails
**survived**: the suite lacks the case family it ``needs``. An exception raised by the
mutation's own code (not by the base kernel it calls) is no kill: the mutant is
**broken**, and reported so.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache

from glmport.core.errors import ConfigError
from glmport.core.registry import (
    REGISTRY,
    Availability,
    Backend,
    BackendManifest,
    Capability,
    Kernel,
)
from glmport.core.specs import OP_NAMES

from .mutants import LIBRARY, Mutant
from .runner import MODEL_OP, Check, Record, run_check, suite_checks

STATUSES = ("killed", "survived", "unexercised", "broken")


class MutationRaised(RuntimeError):
    """The mutation's own code raised (not the base kernel it wraps): a bug of the
    mutant, never a kill."""


def _guarded(mutant: Mutant, kernel: Kernel) -> Kernel:
    """``mutant``'s wrap of ``kernel``, with exceptions of the mutation's own code
    turned into :class:`MutationRaised` (those of ``kernel`` pass as they are)."""

    def base(*args):
        try:
            return kernel(*args)
        except Exception as err:
            err.glmport_raised_by_base = True
            raise

    mutated = mutant.wrap(base)

    def guarded(*args):
        try:
            return mutated(*args)
        except Exception as err:
            if getattr(err, "glmport_raised_by_base", False):
                raise
            raise MutationRaised(f"mutant {mutant.id}: {type(err).__name__}: {err}") from err

    return guarded


def backend_name(mutant: Mutant, base: str) -> str:
    return f"mutant-{base}-{mutant.id}"


class MutantBackend(Backend):
    """``base`` with ``mutant.op``'s kernel replaced by the mutated one; every other op,
    its backward and prepared weights (canonical layout) fall back to ``base``. The
    mutated op keeps the base's capabilities, so the suite sends it the calls the base
    would take."""

    def __init__(self, mutant: Mutant, base: str) -> None:
        b = REGISTRY.get(base).manifest
        caps = {mutant.op: b.capabilities[mutant.op]} if mutant.op in b.capabilities else {}
        self.mutant, self.base = mutant, base
        self.manifest = BackendManifest(
            name=backend_name(mutant, base),
            device_type=b.device_type,
            description=f"{base} with mutant {mutant.id}: {mutant.breaks}",
            ops=(mutant.op,),
            fallback=(base,),
            capabilities=caps,
            auto=False,
            emulation=b.emulation,
        )

    def probe(self, emulate: bool) -> Availability:
        return REGISTRY.availability(self.base, emulate)

    def device_type(self, emulate: bool) -> str:
        return REGISTRY.get(self.base).device_type(emulate)

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        kernel = REGISTRY.kernels(self.base, emulate)[self.mutant.op]
        return {self.mutant.op: _guarded(self.mutant, kernel)}


def mutation_refusal(base: str, emulate: bool) -> str:
    """Why ``base`` cannot be mutated here ("" when it can): it must run here under
    ``emulate`` and run the model check on its kernels (no whole-model runner, which
    no kernel mutation reaches), and implement an op itself."""
    backend = REGISTRY.get(base, "--backend")
    avail = REGISTRY.availability(base, emulate)
    if not avail.ok:
        hint = "" if emulate or not backend.manifest.emulation else " (try --emulate)"
        return f"it does not run here: {avail.reason}{hint}"
    if type(backend).model_runner is not Backend.model_runner:
        return (
            "it runs the model-level check through a whole-model runner of its own (an "
            "exported graph), which a mutation of its kernels never reaches"
        )
    if not set(backend.manifest.ops) & set(OP_NAMES):
        return "it implements no op itself"
    return ""


def check_mutable(base: str, emulate: bool) -> None:
    """A :class:`ConfigError` naming why ``base`` cannot be mutated, if it cannot."""
    why = mutation_refusal(base, emulate)
    if why:
        raise ConfigError(f"--mutants: backend {base!r} cannot be mutated: {why}")


def inapplicable(mutant: Mutant, base: str) -> str:
    """Why ``mutant`` does not apply to ``base`` ("" when it does): the op is not
    ``base``'s own, or its capabilities take none of the calls the mutant changes."""
    manifest = REGISTRY.get(base).manifest
    if mutant.op not in manifest.ops:
        return f"{base!r} does not implement {mutant.op} itself"
    cap = manifest.capabilities.get(mutant.op, Capability())
    for feature, values in mutant.only:
        if all(cap.refusal({feature: v}) is not None for v in values):
            shown = ", ".join(str(v).removeprefix("torch.") for v in values)
            return f"{base!r} declares no {feature} among {shown} for {mutant.op}"
    return ""


def mutants_for(base: str, ops: tuple[str, ...] | None = None) -> tuple[list[Mutant], dict]:
    """The library's mutants that apply to ``base`` (of ``ops``, default all), and
    ``{mutant id: why not}`` for those that do not."""
    wanted = [m for m in LIBRARY.values() if ops is None or m.op in ops]
    why = {m.id: inapplicable(m, base) for m in wanted}
    return [m for m in wanted if not why[m.id]], {i: w for i, w in why.items() if w}


# Cheapest and most telling first: value cases (small families first), then the other
# kinds, the model check last. ``bad_input`` checks are left out: glmport rejects a
# malformed call before any kernel runs, so no kernel mutation can change them.
_KIND_ORDER = ("value", "prepared", "grad_consistency", "determinism", "gradient", "opcheck")
_FAMILY_ORDER = ("tiny", "edge", "layout", "glm5")


@cache
def op_checks(op: str, full: bool) -> tuple[Check, ...]:
    """``op``'s checks and the model checks, in the order a mutant runs them."""
    mine = [c for c in suite_checks(full=full, ops=(op,)) if c.kind in _KIND_ORDER]
    mine.sort(
        key=lambda c: (
            _KIND_ORDER.index(c.kind),
            _FAMILY_ORDER.index(c.case.family) if c.case.family in _FAMILY_ORDER else 9,
        )
    )
    model = [c for c in suite_checks(full=full) if c.op == MODEL_OP]
    return (*mine, *model)


_base_outcomes: dict[tuple, Record] = {}


def _on_base(check: Check, base: str, emulate: bool | None) -> Record:
    """``check`` on ``base`` itself, once per process."""
    key = (check.id, base, emulate)
    if key not in _base_outcomes:
        _base_outcomes[key] = run_check(check, base, emulate=emulate)
    return _base_outcomes[key]


@dataclass
class MutantResult:
    """What the suite did to one mutant.

    ``status`` (one of :data:`STATUSES`): ``killed`` (``killed_by`` names the first
    check that failed it and passed on the base), ``survived`` (every check ran and
    none did), ``unexercised`` (no check ran the mutated kernel: every call was
    unsupported or skipped) or ``broken`` (the mutation's own code raised:
    ``broken_by`` says where). ``checks`` counts the checks run on the mutant;
    ``base_failures`` the ids of checks that failed the mutant but fail the base too
    (no kill)."""

    id: str
    op: str
    name: str
    kind: str
    breaks: str
    needs: str
    status: str
    killed_by: dict | None = None
    broken_by: str = ""
    checks: int = 0
    own_checks: int = 0
    base_failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def run_mutant(
    mutant: Mutant,
    base: str,
    *,
    emulate: bool | None = None,
    full: bool = False,
    checks: Sequence[Check] | None = None,
) -> MutantResult:
    """Judge ``mutant`` of ``base``: its op's checks then the model check, cheapest
    first, until one fails it (and passes on ``base``). ``emulate``: as
    :func:`~.runner.run_check` takes it; ``full``: the full mode's checks; ``checks``:
    these instead (in this order)."""
    start = time.perf_counter()
    result = MutantResult(
        mutant.id, mutant.op, mutant.name, mutant.kind, mutant.breaks, mutant.needs, "survived"
    )
    backend = MutantBackend(mutant, base)
    name = backend.manifest.name
    REGISTRY.register(backend, replace=True)
    try:
        for check in op_checks(mutant.op, full) if checks is None else checks:
            rec = run_check(check, name, emulate=emulate)
            result.checks += 1
            result.own_checks += rec.own
            if not rec.own or rec.outcome not in ("fail", "error"):
                continue
            if rec.outcome == "error" and rec.reason.startswith(MutationRaised.__name__):
                result.status, result.broken_by = "broken", f"{rec.id}: {rec.reason}"
                break
            if _on_base(check, base, emulate).outcome != "pass":
                result.base_failures.append(rec.id)
                continue
            result.status = "killed"
            result.killed_by = {
                "check": rec.id,
                "kind": rec.kind,
                "family": rec.family,
                "outcome": rec.outcome,
                "reason": rec.reason,
            }
            break
    finally:
        REGISTRY.unregister(name)
    if result.status == "survived" and result.own_checks == 0:
        result.status = "unexercised"
    result.seconds = round(time.perf_counter() - start, 3)
    return result
