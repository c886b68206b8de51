"""Shadow checks (``GLMPORT_SHADOW=cpu``): run the first few live calls of each op on
a reference backend too and log any mismatch beyond the shared tolerance."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from .registry import REGISTRY
from .tolerance import compare, tolerance

log = logging.getLogger("glmport.shadow")


@dataclass(frozen=True)
class ShadowReport:
    """One compared output of one shadowed call."""

    op: str
    backend: str
    shadow: str
    output: int
    max_rel: float
    mean_rel: float
    ok: bool


_lock = threading.Lock()
_counts: Counter[str] = Counter()
_reports: list[ShadowReport] = []


def reports() -> list[ShadowReport]:
    """Every comparison made so far in this process."""
    with _lock:
        return list(_reports)


def reset() -> None:
    with _lock:
        _counts.clear()
        _reports.clear()


def observe(spec, backend: str, settings, args: tuple, out: object) -> None:
    """Compare ``out``, what ``backend`` returned for ``args``, with the shadow backend."""
    with _lock:
        if _counts[spec.name] >= settings.shadow_calls:
            return
        _counts[spec.name] += 1
    if not REGISTRY.availability(settings.shadow, settings.emulate).ok:
        log.warning("glmport shadow: backend %r is not available; no check", settings.shadow)
        return
    kernel = REGISTRY.kernels(settings.shadow, settings.emulate).get(spec.name)
    if kernel is None:
        return
    cpu_args = tuple(a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        ref = kernel(*cpu_args)
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    tol = tolerance(spec.name, spec.features(*args)["dtype"])
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if i in spec.tie_outputs:
            continue  # order may differ on ties; the scores output is compared instead
        if o.is_floating_point():
            cmp = compare(o.detach(), r, tol)
            rep = ShadowReport(
                spec.name, backend, settings.shadow, i, cmp.max_rel, cmp.mean_rel, cmp.ok
            )
        else:
            same = o.shape == r.shape and torch.equal(o.detach().cpu(), r)
            rep = ShadowReport(
                spec.name, backend, settings.shadow, i, 0.0 if same else float("inf"), 0.0, same
            )
        with _lock:
            _reports.append(rep)
        if not rep.ok:
            log.warning(
                "glmport shadow: %s output %d on %r differs from %r: max|err|/max|ref|=%.3g "
                "mean=%.3g (tolerance %.3g / %.3g)",
                spec.name,
                i,
                backend,
                settings.shadow,
                rep.max_rel,
                rep.mean_rel,
                tol.max_rel,
                tol.mean_rel,
            )
