"""Conformance reports: a summary table (op x dtype x the backend it ran on),
``conformance.json`` (every check, the environment, the backend manifest, the verdict,
counts) and ``conformance.md``.

The verdict is about the backend under test: its own checks (``own``: the check ran
its kernel) decide whether it conforms, and at least one of them must pass. Checks
that ran on a fallback along its chain judge that fallback: they are counted and
listed apart, and a fallback failure still fails the run, as the fallback's bug.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from glmport.core.environment import device_name, versions
from glmport.core.registry import REGISTRY, chain_for

from .runner import MODEL_OP, OUTCOMES

# 2: records carry ``own``; ``summary`` counts the backend's own checks only, with
# ``fallback_summary`` and ``verdict`` beside it; table rows carry ``ran_on`` / ``own``.
SCHEMA_VERSION = 2


def _manifest(backend: str) -> dict:
    m = REGISTRY.get(backend).manifest
    return {
        "name": m.name,
        "device_type": m.device_type,
        "description": m.description,
        "ops": list(m.ops),
        "role": m.role,
        "fallback": list(chain_for(backend)[1:]),
        "capabilities": {op: c.describe() for op, c in m.capabilities.items()},
        "emulation": m.emulation,
        "verified": m.verified,
    }


def worst_ratio(metrics: dict, tolerance: dict) -> float | None:
    """The worst error as a fraction of its tolerance (1.0 = at the limit), over every
    criterion the judge reported: each metric that has a tolerance of the same name.
    None when no metric has one (exact checks, outcomes without a verdict)."""
    ratios = []
    for key, limit in tolerance.items():
        got = metrics.get(key)
        if not isinstance(got, (int, float)) or not isinstance(limit, (int, float)):
            continue
        if math.isnan(got):  # NaN is never within a tolerance
            ratios.append(math.inf)
        elif limit > 0:
            ratios.append(got / limit)
        else:  # a zero tolerance is met exactly or not at all
            ratios.append(0.0 if got <= 0 else math.inf)
    return max(ratios, default=None)


def _counts(records: list[dict]) -> dict:
    counts = {"total": len(records)} | {o: 0 for o in OUTCOMES}
    for rec in records:
        counts[rec["outcome"]] += 1
    return counts


def summarize(records: list[dict]) -> list[dict]:
    """One row per (op, dtype[/scheme], backend it ran on) with counts per outcome and
    the worst error / tolerance; the backend's own rows first."""
    rows: dict[tuple, dict] = defaultdict(lambda: {o: 0 for o in OUTCOMES} | {"worst": None})
    for rec in records:
        dtype = rec["dtype"] if rec["scheme"] is None else f"{rec['dtype']}/{rec['scheme']}"
        row = rows[(not rec["own"], rec["op"], dtype, rec["ran_on"])]
        row[rec["outcome"]] += 1
        r = worst_ratio(rec["metrics"], rec["tolerance"])
        if r is not None and (row["worst"] is None or r > row["worst"]):
            row["worst"] = r
    return [
        {"op": op, "dtype": dt, "ran_on": ran_on, "own": not fallback, **row}
        for (fallback, op, dt, ran_on), row in sorted(rows.items())
    ]


def _verdict(backend: str, declared: list[str], own: dict, fallback: dict) -> dict:
    """``conforms``: the backend's own checks all passed (or were declared
    unsupported / skipped) and at least one passed; ``run_ok``: that, and no fallback
    check failed either (what the exit status follows); ``why`` when it does not."""
    conforms = own["pass"] > 0 and own["fail"] == 0 and own["error"] == 0
    fallback_ok = fallback["fail"] == 0 and fallback["error"] == 0
    if not declared:
        why = "it implements no op: every check ran on a fallback"
    elif own["total"] == 0:
        why = f"none of its own ops ({', '.join(declared)}) ran a check"
    elif own["pass"] == 0:
        why = "none of its own checks passed"
    elif not conforms:
        why = "its own kernels failed checks"
    elif not fallback_ok:
        why = f"checks on fallbacks failed: bugs of the fallback, not of {backend!r}"
    else:
        why = ""
    return {"conforms": conforms, "run_ok": conforms and fallback_ok, "why": why}


_NOT_STACK = ("glmport", "python", "torch", "device", "device_name")


def build_report(records: list[dict], *, backend: str, full: bool, emulate: bool, ops) -> dict:
    """The report of one run: ``summary`` counts the backend's own checks (and names
    its ``ops`` they covered), ``fallback_summary`` the checks that ran on fallbacks
    (and the ``backends`` they ran on); ``table`` has one row per (op, dtype, ran_on)."""
    own = [r for r in records if r["own"]]
    fallback = [r for r in records if not r["own"]]
    manifest = _manifest(backend)
    summary = {**_counts(own), "ops": sorted({r["op"] for r in own})}
    fallback_summary = {
        **_counts(fallback),
        "backends": sorted({r["ran_on"] for r in fallback}),
        "ops": sorted({r["op"] for r in fallback}),
    }
    device = next((r["device"] for r in records if r.get("device")), "cpu")
    return {
        "schema_version": SCHEMA_VERSION,
        "backend": backend,
        "mode": "full" if full else "quick",
        "emulate": emulate,
        "ops": list(ops) if ops else "all",
        "environment": {
            **versions(),
            "device": device,
            "device_name": device_name(torch.device(device)),
        },
        "manifest": manifest,
        "verdict": _verdict(backend, manifest["ops"], summary, fallback_summary),
        "summary": summary,
        "fallback_summary": fallback_summary,
        "table": summarize(records),
        "cases": sorted(records, key=lambda r: r["id"]),
    }


def _count_text(counts: dict, *, every: bool) -> str:
    """``"3 pass, 1 fail, ..."``: every outcome, or only those that occurred."""
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if every or counts[o])


def verdict_line(report: dict) -> str:
    """One line: the verdict on the backend's own kernels, then the fallbacks apart."""
    name, mode = report["backend"], f"{report['mode']} mode"
    v, own, fb = report["verdict"], report["summary"], report["fallback_summary"]
    if own["total"] == 0:
        line = f"backend {name!r} DOES NOT CONFORM ({mode}): {v['why']}"
    else:
        word = "CONFORMS" if v["conforms"] else "DOES NOT CONFORM"
        kernels = ", ".join(op for op in own["ops"] if op != MODEL_OP) or "in the model"
        line = f"backend {name!r} {word} on its own kernels ({kernels}), {mode}: " + _count_text(
            own, every=True
        )
        if own["pass"] == 0:
            line += f" ({v['why']})"
    if fb["total"]:
        line += (
            f"; {fb['total']} checks ran on fallbacks ({', '.join(fb['backends'])}), "
            f"listed apart: {_count_text(fb, every=False)}"
        )
        if fb["fail"] or fb["error"]:
            line += f" (the fallback's bugs, not {name!r}'s; they fail the run)"
    return line


def _worst_text(worst: float | None) -> str:
    return "-" if worst is None else f"{worst:.3f}"


def table_lines(report: dict) -> list[str]:
    """The terminal table: own rows first, the ``ran on`` column tells them apart."""
    rows = [("op", "dtype", "ran on", "pass", "fail", "unsup", "skip", "error", "worst err/tol")]
    for r in report["table"]:
        rows.append(
            (
                r["op"],
                r["dtype"],
                r["ran_on"],
                *(str(r[o]) for o in OUTCOMES),
                _worst_text(r["worst"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _shapes(params: dict) -> str:
    """A case's sizes, compactly: ``t=5, h=4, shape=5x32``."""
    shown = ("x".join(map(str, v)) if isinstance(v, list) else str(v) for v in params.values())
    return ", ".join(f"{k}={s}" for k, s in zip(params, shown, strict=True)) or "-"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(rows: list[dict]) -> list[str]:
    lines = [
        "| op | dtype | ran on | pass | fail | unsupported | skipped | error | worst err/tol |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['ran_on']} | "
            + " | ".join(str(r[o]) for o in OUTCOMES)
            + f" | {_worst_text(r['worst'])} |"
        )
    return lines


def _md_problems(cases: list[dict]) -> list[str]:
    lines = [
        "| check | outcome | ran on | shapes | worst err/tol | reason |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        worst = _worst_text(worst_ratio(c["metrics"], c["tolerance"]))
        lines.append(
            f"| `{c['id']}` | {c['outcome']} | {c['ran_on']} | {_shapes(c['params'])} | "
            f"{worst} | {_md_cell(c['reason'])} |"
        )
    return lines


def markdown(report: dict) -> str:
    env, name = report["environment"], report["backend"]
    own, fb = report["summary"], report["fallback_summary"]
    lines = [
        f"# glmport conformance: `{name}`",
        "",
        f"**{verdict_line(report)}**",
        "",
        f"- device: {env['device']} ({env['device_name']}); emulated: {report['emulate']}",
        f"- glmport {env['glmport']}, torch {env['torch']}, python {env['python']}"
        + "".join(f", {k} {v or '-'}" for k, v in env.items() if k not in _NOT_STACK),
        f"- backend implements: {', '.join(report['manifest']['ops']) or 'no op (all fall back)'}; "
        f"falls back to: {' -> '.join(report['manifest']['fallback']) or '-'}",
        f"- verified on: {report['manifest']['verified']}",
        "",
        f"## Its own kernels: {own['total']} checks ran on `{name}`",
        "",
    ]
    own_rows = [r for r in report["table"] if r["own"]]
    lines += _md_table(own_rows) if own_rows else [f"None: {report['verdict']['why']}."]
    if fb["total"]:
        lines += [
            "",
            f"## On fallbacks: {fb['total']} checks ran on {', '.join(fb['backends'])}",
            "",
            f"These judge the fallback backends, not `{name}`; a failure here is the "
            "fallback's bug, and it still fails the run.",
            "",
            *_md_table([r for r in report["table"] if not r["own"]]),
        ]
    problems = [c for c in report["cases"] if c["outcome"] != "pass"]
    for title, mine in (("its own kernels", True), ("on fallbacks", False)):
        shown = [c for c in problems if c["own"] is mine]
        if shown:
            lines += ["", f"## Not passed: {title}", "", *_md_problems(shown)]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, directory: str | Path) -> tuple[Path, Path, Path]:
    """Write ``conformance.json``, ``conformance.md`` and ``conformance.html`` (which
    also shows a mismatch matrix left in ``directory`` by ``--matrix``)."""
    from .html import write_html

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    md_path.write_text(markdown(report))
    return json_path, md_path, write_html(out)
