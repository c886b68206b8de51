"""The mutation score's report: the kill rate, per op and per kind of mutation, the
survivors with the case family each needs, as ``mutants.json`` and ``mutants.md``.

The kill rate is killed / (killed + survived): mutants the suite never ran on the
base's own kernels (``unexercised``) and broken ones (the mutation's own code raised)
are counted and listed apart, never as kills. A survivor's ``base_failures`` are the
checks that fail it but fail the base too: the base must pass them before they count.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .mutation import STATUSES

JSON_NAME, MARKDOWN_NAME = "mutants.json", "mutants.md"


def kill_rate(counts: Counter) -> float | None:
    """killed / (killed + survived), None when neither happened."""
    judged = counts["killed"] + counts["survived"]
    return counts["killed"] / judged if judged else None


def _tally(results: Iterable[dict]) -> dict:
    counts = Counter(r["status"] for r in results)
    return {**{s: counts[s] for s in STATUSES}, "kill_rate": kill_rate(counts)}


def _grouped(results: list[dict], key: str) -> dict[str, dict]:
    keys = sorted({r[key] for r in results})
    return {k: _tally(r for r in results if r[key] == k) for k in keys}


def build_report(
    results: list[dict],
    *,
    base: str,
    emulate: bool,
    full: bool,
    inapplicable: dict[str, str],
    command: str,
    workers: str,
    seconds: float,
) -> dict:
    """The report of one ``--mutants`` run: ``results`` are
    :meth:`~.mutation.MutantResult.to_dict` of each mutant run; ``inapplicable`` maps
    the library ids left out to why; ``command`` reproduces the run."""
    results = sorted(results, key=lambda r: r["id"])
    killers = Counter(r["killed_by"]["family"] for r in results if r["status"] == "killed")
    return {
        "base": base,
        "emulate": emulate,
        "mode": "full" if full else "quick",
        "command": command,
        "workers": workers,
        "seconds": round(seconds, 1),
        "summary": {"mutants": len(results), **_tally(results)},
        "per_op": _grouped(results, "op"),
        "per_kind": _grouped(results, "kind"),
        "killed_by_family": dict(killers.most_common()),
        "killed_by_error": sorted(
            r["id"]
            for r in results
            if r["status"] == "killed" and r["killed_by"]["outcome"] == "error"
        ),
        "survivors": [
            {
                **{k: r[k] for k in ("id", "kind", "breaks", "needs")},
                "base_failures": r.get("base_failures", []),
            }
            for r in results
            if r["status"] == "survived"
        ],
        "unexercised": [r["id"] for r in results if r["status"] == "unexercised"],
        "broken": {r["id"]: r["broken_by"] for r in results if r["status"] == "broken"},
        "inapplicable": dict(sorted(inapplicable.items())),
        "results": results,
    }


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def summary_line(report: dict) -> str:
    s = report["summary"]
    return (
        f"mutants of {report['base']!r} ({report['mode']}): {s['killed']} killed, "
        f"{s['survived']} survived: kill rate {_percent(s['kill_rate'])}"
        + "".join(f", {s[k]} {k}" for k in ("unexercised", "broken") if s[k])
        + f" ({report['seconds']:.0f} s, -n {report['workers']})"
    )


def _table(title: str, groups: dict[str, dict]) -> list[str]:
    lines = [f"| {title} | killed | survived | kill rate |", "|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {g['killed']} | {g['survived']} | {_percent(g['kill_rate'])} |"
        for name, g in groups.items()
    ]
    return lines


def markdown(report: dict) -> str:
    """The report for people."""
    lines = [
        f"# Mutation score: {report['base']}" + (" (emulated)" if report["emulate"] else ""),
        "",
        summary_line(report),
        "",
        f"Reproduce: `{report['command']}`",
        "",
        *_table("op", report["per_op"]),
        "",
        *_table("kind of mutation", report["per_kind"]),
        "",
        "## Survivors",
        "",
    ]
    if report["survivors"]:
        lines += [
            "| mutant | what breaks | the case family it needs | checks it fails that fail "
            "the base too |",
            "|---|---|---|---:|",
        ]
        lines += [
            f"| `{s['id']}` | {s['breaks']} | {s['needs']} | {len(s['base_failures'])} |"
            for s in report["survivors"]
        ]
    else:
        lines.append("None: every mutant was killed.")
    if report["killed_by_family"]:
        lines += ["", "## Which case families killed them", ""]
        lines += [f"- {family}: {n}" for family, n in report["killed_by_family"].items()]
    for title, items in (
        ("Killed by an error (the kernel raised on the mutated call)", report["killed_by_error"]),
        ("Unexercised (no check ran the mutated kernel)", report["unexercised"]),
    ):
        if items:
            lines += ["", f"## {title}", "", *(f"- `{i}`" for i in items)]
    for title, why in (
        ("Broken mutants (their own code raised: fix the library)", report["broken"]),
        ("Not applicable to this backend", report["inapplicable"]),
    ):
        if why:
            lines += ["", f"## {title}", "", *(f"- `{i}`: {w}" for i, w in why.items())]
    return "\n".join(lines) + "\n"


def write_reports(report: dict, directory: str | Path) -> list[Path]:
    """Write ``mutants.json`` and ``mutants.md`` into ``directory``; their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / JSON_NAME, out / MARKDOWN_NAME]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    return paths
