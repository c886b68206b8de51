"""Conformance reports: a summary table (op x dtype), ``conformance.json`` (every
check, the environment, the backend manifest, counts) and ``conformance.md``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from glmport.core.environment import device_name, versions
from glmport.core.registry import REGISTRY, chain_for

from .runner import OUTCOMES

SCHEMA_VERSION = 1


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


def _ratio(rec: dict) -> float | None:
    """The worst error as a fraction of its tolerance (1.0 = at the limit)."""
    got, tol = rec["metrics"].get("max_rel"), rec["tolerance"].get("max_rel")
    if got is None or not tol:
        return None
    return got / tol


def summarize(records: list[dict]) -> tuple[dict, list[dict]]:
    """Counts per outcome, and one row per (op, dtype) with counts and worst ratio."""
    counts = {o: 0 for o in OUTCOMES}
    rows: dict[tuple[str, str], dict] = defaultdict(
        lambda: {o: 0 for o in OUTCOMES} | {"worst": None}
    )
    for rec in records:
        counts[rec["outcome"]] += 1
        row = rows[
            (
                rec["op"],
                rec["dtype"] if rec["scheme"] is None else f"{rec['dtype']}/{rec['scheme']}",
            )
        ]
        row[rec["outcome"]] += 1
        r = _ratio(rec)
        if r is not None and (row["worst"] is None or r > row["worst"]):
            row["worst"] = r
    table = [{"op": op, "dtype": dt, **row} for (op, dt), row in sorted(rows.items())]
    return {"total": len(records), **counts}, table


_NOT_STACK = ("glmport", "python", "torch", "device", "device_name")


def build_report(records: list[dict], *, backend: str, full: bool, emulate: bool, ops) -> dict:
    summary, table = summarize(records)
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
        "manifest": _manifest(backend),
        "summary": summary,
        "table": table,
        "cases": sorted(records, key=lambda r: r["id"]),
    }


def verdict_line(report: dict) -> str:
    s = report["summary"]
    passed = s["fail"] == 0 and s["error"] == 0 and s["pass"] > 0
    word = "CONFORMS" if passed else "DOES NOT CONFORM"
    counts = ", ".join(f"{s[o]} {o}" for o in OUTCOMES)
    return f"backend {report['backend']!r} {word} ({report['mode']} mode): {counts}"


def table_lines(report: dict) -> list[str]:
    rows = [("op", "dtype", "pass", "fail", "unsup", "skip", "error", "worst err/tol")]
    for r in report["table"]:
        worst = "-" if r["worst"] is None else f"{r['worst']:.3f}"
        rows.append((r["op"], r["dtype"], *(str(r[o]) for o in OUTCOMES), worst))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# glmport conformance: `{report['backend']}`",
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
        "| op | dtype | pass | fail | unsupported | skipped | error | worst err/tol |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["table"]:
        worst = "-" if r["worst"] is None else f"{r['worst']:.3f}"
        lines.append(
            f"| {r['op']} | {r['dtype']} | "
            + " | ".join(str(r[o]) for o in OUTCOMES)
            + f" | {worst} |"
        )
    problems = [c for c in report["cases"] if c["outcome"] != "pass"]
    if problems:
        lines += [
            "",
            "## Not passed",
            "",
            "| check | outcome | ran on | reason |",
            "|---|---|---|---|",
        ]
        for c in problems:
            reason = c["reason"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{c['id']}` | {c['outcome']} | {c['ran_on']} | {reason} |")
    return "\n".join(lines) + "\n"


def write_reports(report: dict, directory: str | Path) -> tuple[Path, Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    md_path.write_text(markdown(report))
    return json_path, md_path
