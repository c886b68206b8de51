"""Conformance reports: a summary table (op x dtype x the backend it ran on),
``conformance.json`` (every check, the environment, the backend manifest, the verdict,
counts) and ``conformance.md``; :func:`.html.write_reports` writes them with the HTML
page.

The verdict is about the backend under test: its own checks (``own``: the check ran
its kernel) decide whether it conforms, and at least one of them must pass. Checks
that ran on a fallback along its chain judge that fallback: they are counted and
listed apart, and a fallback failure still fails the run, as the fallback's bug.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from glmport.core.environment import device_name, versions
from glmport.core.errors import ConfigError
from glmport.core.registry import REGISTRY, chain_for

from .formatting import md_cell, shapes_text, stack_text, worst_text
from .mustpass import STATUSES, defined_ids, evaluate, load, newest, summary_line
from .runner import MODEL_OP, OUTCOMES, dtype_key
from .scorecard import (
    cell_text,
    combine,
    family_blocks,
    read_bench,
    read_json,
    scorecard_rows,
    worst_ratio,
)

# 2: records carry ``own``; ``summary`` counts the backend's own checks only, with
# ``fallback_summary`` and ``verdict`` beside it; table rows carry ``ran_on`` / ``own``.
# Since then, added without a new version (readers take a report without them):
# ``mustpass`` and ``scorecard``, and ``mode`` "mustpass".
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
        row = rows[
            (not rec["own"], rec["op"], dtype_key(rec["dtype"], rec["scheme"]), rec["ran_on"])
        ]
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


def _mustpass_parts(records: list[dict], *, backend: str, emulate: bool, ops, mustpass) -> dict:
    """``mustpass``: the run judged against version ``mustpass`` (the newest when None;
    ``requested`` says whether the run asked for it) and ``scorecard``: this backend's
    rows against that version. Both None when no version ships."""
    version = mustpass or newest()
    if version is None:
        return {"mustpass": None, "scorecard": None}
    listing = load(version)
    result = evaluate(listing, records, ops, defined_ids(ops)) | {"requested": bool(mustpass)}
    rows = scorecard_rows(records, listing, backend=backend, emulated=emulate, ops=ops)
    return {"mustpass": result, "scorecard": {"mustpass": version, "rows": rows}}


def build_report(
    records: list[dict], *, backend: str, full: bool, emulate: bool, ops, mustpass=None
) -> dict:
    """The report of one run: ``summary`` counts the backend's own checks (and names
    its ``ops`` they covered), ``fallback_summary`` the checks that ran on fallbacks
    (and the ``backends`` they ran on); ``table`` has one row per (op, dtype, ran_on);
    ``mustpass`` and ``scorecard`` judge it against a mustpass version (``mustpass``,
    the version the run was asked to meet, else the newest: see :func:`_mustpass_parts`)."""
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
        "mode": "mustpass" if mustpass else "full" if full else "quick",
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
        **_mustpass_parts(records, backend=backend, emulate=emulate, ops=ops, mustpass=mustpass),
        "cases": sorted(records, key=lambda r: r["id"]),
    }


def _count_text(counts: dict, *, every: bool) -> str:
    """``"3 pass, 1 fail, ..."``: every outcome, or only those that occurred."""
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if every or counts[o])


def _mode_text(report: dict) -> str:
    if report["mode"] == "mustpass":
        return f"mustpass {report['mustpass']['version']}'s checks"
    return f"{report['mode']} mode"


def mustpass_line(report: dict) -> str:
    """The mustpass version the run meets or misses ("" in a report without one)."""
    result = report.get("mustpass")
    return summary_line(result, report["backend"]) if result else ""


def verdict_line(report: dict) -> str:
    """One line: the verdict on the backend's own kernels, then the fallbacks apart."""
    name, mode = report["backend"], _mode_text(report)
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
                worst_text(r["worst"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _md_table(rows: list[dict]) -> list[str]:
    lines = [
        "| op | dtype | ran on | pass | fail | unsupported | skipped | error | worst err/tol |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['dtype']} | {r['ran_on']} | "
            + " | ".join(str(r[o]) for o in OUTCOMES)
            + f" | {worst_text(r['worst'])} |"
        )
    return lines


def _md_problems(cases: list[dict]) -> list[str]:
    lines = [
        "| check | outcome | ran on | shapes | worst err/tol | reason |",
        "|---|---|---|---|---|---|",
    ]
    for c in cases:
        worst = worst_text(worst_ratio(c["metrics"], c["tolerance"]))
        lines.append(
            f"| `{c['id']}` | {c['outcome']} | {c['ran_on']} | {shapes_text(c['params'])} | "
            f"{worst} | {md_cell(c['reason'])} |"
        )
    return lines


def markdown(report: dict) -> str:
    """``conformance.md``: the verdict, the environment, the tables and the checks not
    passed (own kernels and fallbacks apart), then the mustpass section."""
    env, name = report["environment"], report["backend"]
    stack = stack_text(env)
    own, fb = report["summary"], report["fallback_summary"]
    lines = [
        f"# glmport conformance: `{name}`",
        "",
        f"**{verdict_line(report)}**",
        "",
        *([f"**{mustpass_line(report)}**", ""] if report.get("mustpass") else []),
        f"- device: {env['device']} ({env['device_name']}); emulated: {report['emulate']}",
        f"- glmport {env['glmport']}, torch {env['torch']}, python {env['python']}"
        + (f", {stack}" if stack else ""),
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
    return "\n".join(lines + _md_mustpass(report)) + "\n"


def _md_mustpass(report: dict) -> list[str]:
    """The mustpass section (its line is under the verdict): per family, every
    required check that did not pass on the backend's own kernels with its reason;
    then the scorecard."""
    result = report.get("mustpass")
    if not result:
        return []
    lines = ["", f"## Mustpass {result['version']}", "",
             "| family | ops | required | status | " + " | ".join(STATUSES) + " |",
             "|---|---|---|---|" + "---|" * len(STATUSES)]  # fmt: skip
    for family, fam in result["families"].items():
        lines.append(
            f"| {family} | {', '.join(fam['ops'])} | {fam['required']} | {fam['status']} | "
            + " | ".join(str(fam["counts"][s]) for s in STATUSES)
            + " |"
        )
    shown = [p for p in result["not_passed"] if p["status"] != "fallback_pass"]
    if shown:
        lines += ["", "Required checks not passed on its own kernels (passes on fallbacks "
                  "are counted above, not listed):", "", "| check | status | ran on | reason |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| `{p['id']}` | {p['status']} | {p['ran_on'] or '-'} | {md_cell(p['reason'])} |"
            for p in shown
        ]
    card = report["scorecard"]
    columns = [(report["backend"], report["emulate"])]
    lines += ["", f"## Scorecard (mustpass {card['mustpass']})", ""]
    for family, cells in family_blocks(card["rows"], columns):
        lines += [f"**{family}**", "", f"| op | dtype | {report['backend']} |", "|---|---|---|"]
        lines += [f"| {op} | {dt} | {cell_text(row[0])} |" for op, dt, row in cells]
        lines.append("")
    return lines[:-1]


def read_report(path: str | Path, source: str = "--scorecard") -> dict:
    """The ``conformance.json`` at ``path`` (the file, or a folder holding it);
    ConfigError naming ``source`` when there is none or it cannot be read."""
    file = Path(path)
    file = file / "conformance.json" if file.is_dir() else file
    if not str(path) or not file.is_file():
        raise ConfigError(f"{source} {str(path)!r}: no conformance report (conformance.json) there")
    try:
        return read_json(file, SCHEMA_VERSION)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def combined_scorecard(
    paths: Sequence[str | Path], bench: Sequence[str | Path] = (), mustpass: str | None = None
) -> dict:
    """The scorecard across the runs whose reports are at ``paths``, against version
    ``mustpass`` (the newest when None), with peaks from the benchmark files ``bench``
    (:func:`.scorecard.combine`)."""
    version = mustpass or newest()
    if version is None:
        raise ConfigError("--scorecard: no mustpass version ships with this glmport")
    reports = [(str(p), read_report(p)) for p in paths]
    return combine(reports, load(version), [read_bench(Path(b)) for b in bench])
