"""``conformance.html``: one self-contained page (inline CSS, the heatmap embedded as
a data URI, no external link) of whatever a report folder holds: the scorecard across
backends (``scorecard.json``: one block per op family, rows op x dtype, a column per
backend, sticky headers), the suite's report (``conformance.json``: the verdict and
the mustpass version it meets, the environment, one block per op family with a row
per op x dtype[/scheme] x backend it ran on, coloured by outcome, own kernels and
fallbacks apart, the checks not passed, its scorecard) and the mismatch matrix
(``matrix.json`` and ``matrix.png``). :func:`write_reports` writes a run's report
files, this page among them."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from glmport.core.errors import ConfigError

from .formatting import pair_text, sci, shapes_text, stack_text, worst_text
from .matrix import NO_PAIR, backend_errors, grid
from .matrix import SCHEMA_VERSION as MATRIX_SCHEMA
from .mustpass import OP_FAMILIES, STATUSES
from .report import SCHEMA_VERSION as REPORT_SCHEMA
from .report import markdown, mustpass_line, verdict_line
from .runner import OUTCOMES
from .scorecard import SCHEMA_VERSION as SCORECARD_SCHEMA
from .scorecard import (
    cell_class,
    cell_parts,
    column,
    coverage_text,
    family_blocks,
    met_text,
    read_json,
    worst_ratio,
)

# Most telling first: a cell shows the worst outcome among its checks.
_SEVERITY = ("error", "fail", "pass", "skipped", "unsupported")
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; vertical-align: top; }
th { background: #eee; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { background: #c9efc9; }
.fail { background: #f4a6a6; }
.error { background: #8b1a1a; color: #fff; }
.unsupported { background: #ddd; }
.skipped { background: #ffd98a; }
.na { background: #d9d9d9; }
.verdict { font-weight: bold; padding: 0.5em; border-left: 0.4em solid; }
.verdict.ok { border-color: #2e7d32; background: #eef8ee; }
.verdict.bad { border-color: #b71c1c; background: #fdeeee; }
.legend span { padding: 0.1em 0.5em; margin-right: 0.3em; }
small { color: #555; }
img { max-width: 100%; }
.partial { background: #e4f4d4; }
.fallback { background: #dde6f0; }
.family { margin-bottom: 1em; }
.family h4 { margin: 0.6em 0 0.2em; }
/* One block per op family; the header row stays on screen while its block scrolls. */
table.card thead th { position: sticky; top: 0; z-index: 1; }
table.card td { min-width: 9em; }
/* The suite's blocks line up: the same width whatever the op names. */
table.verdicts { min-width: 60em; }
table.verdicts td { min-width: 0; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _table(header: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _outcome(row: dict) -> str:
    return next(o for o in _SEVERITY if row[o])


def _verdict_blocks(rows: list[dict]) -> str:
    """The suite's table (``report["table"]`` rows), one block per op family (in the
    mustpass's family order): a row per op x dtype[/scheme] x backend it ran on, only
    those that ran, with the worst outcome (coloured), the counts per outcome and the
    worst err/tol. Six columns at most, so a block fits a laptop screen."""
    families: dict[str, list[dict]] = {f: [] for f in dict.fromkeys(OP_FAMILIES.values())}
    for r in rows:
        families.setdefault(OP_FAMILIES.get(r["op"], "other"), []).append(r)
    head = "".join(
        f"<th>{h}</th>" for h in ("op", "dtype", "ran on", "outcome", "checks", "worst err/tol")
    )
    blocks = []
    for family, mine in families.items():
        if not mine:
            continue
        trs = []
        for op in dict.fromkeys(r["op"] for r in mine):
            of_op = [r for r in mine if r["op"] == op]  # sorted by dtype, ran on
            for i, r in enumerate(of_op):
                outcome = _outcome(r)
                counts = ", ".join(f"{r[o]} {o}" for o in OUTCOMES if r[o])
                op_cell = f'<th rowspan="{len(of_op)}">{_e(op)}</th>' if i == 0 else ""
                trs.append(
                    f"<tr>{op_cell}<td>{_e(r['dtype'])}</td><td>{_e(r['ran_on'])}</td>"
                    f'<td class="{outcome}">{outcome}</td><td>{_e(counts)}</td>'
                    f'<td class="num">{_e(worst_text(r["worst"]))}</td></tr>'
                )
        blocks.append(
            f'<div class="family suite"><h4>{_e(family)}</h4><table class="card verdicts">'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table></div>"
        )
    return "\n".join(blocks)


def _problems(cases: list[dict]) -> str:
    rows = [
        f'<tr><td><code>{_e(c["id"])}</code></td><td class="{_e(c["outcome"])}">'
        f"{_e(c['outcome'])}</td><td>{_e(c['ran_on'])}</td><td>{_e(shapes_text(c['params']))}</td>"
        f'<td class="num">{_e(worst_text(worst_ratio(c["metrics"], c["tolerance"])))}</td>'
        f"<td>{_e(c['reason'])}</td></tr>"
        for c in cases
    ]
    return _table(["check", "outcome", "ran on", "shapes", "worst err/tol", "reason"], rows)


def _card_blocks(rows: list[dict], backends: list[dict]) -> str:
    """The scorecard: one block per op family, rows op x dtype[/scheme], a column per
    backend (``backends``: ``{name, emulated}``), each cell coloured by
    :func:`~.scorecard.cell_class`."""
    columns = [(b["name"], b["emulated"]) for b in backends]
    head = "".join(f"<th>{_e(h)}</th>" for h in ("op", "dtype", *map(column, backends)))
    blocks = []
    for family, cells in family_blocks(rows, columns):
        trs = []
        for op, dtype, row in cells:
            tds = []
            for r in row:
                coverage, details = cell_parts(r)
                tds.append(
                    f'<td class="{cell_class(r)}">{_e(coverage)}'
                    + (f"<br><small>{_e(details)}</small>" if details else "")
                    + "</td>"
                )
            trs.append(f"<tr><th>{_e(op)}</th><td>{_e(dtype)}</td>{''.join(tds)}</tr>")
        blocks.append(
            f'<div class="family"><h4>{_e(family)}</h4><table class="card"><thead><tr>{head}'
            f"</tr></thead><tbody>{''.join(trs)}</tbody></table></div>"
        )
    return "\n".join(blocks)


# Scorecard cell colours (scorecard.cell_class) in words.
_CARD_COLOURS = (
    ("pass", "all own, passed"),
    ("partial", "partly own"),
    ("fail", "failed"),
    ("fallback", "on fallbacks"),
    ("unsupported", "unsupported / skipped"),
    ("na", "not run"),
)
_CARD_LEGEND = (
    "Cells: the mustpass's checks of that op and dtype that ran on the backend's own kernels "
    "/ the checks it requires there, what else happened to them, the worst error / tolerance "
    "among the own ones (1.0 = at the limit) and the fraction of the hardware's peak "
    "(measured only by a benchmark on the hardware). Colours: "
    + "".join(f'<span class="{c}">{w}</span>' for c, w in _CARD_COLOURS)
)


def _mustpass_verdict(report: dict) -> list[str]:
    """The mustpass line, green when the run meets the version ([] without one)."""
    result = report.get("mustpass")
    if not result:
        return []
    colour = "ok" if result["met"] else "bad"
    return [f'<p class="verdict {colour}">{_e(mustpass_line(report))}</p>']


def _mustpass_part(report: dict) -> list[str]:
    """The run's mustpass verdict, its families, the required checks that did not pass
    on the backend's own kernels (with reasons), and its scorecard."""
    result = report.get("mustpass")
    if not result:
        return []
    head = ["family", "ops", "required", "status", *STATUSES]
    fam_rows = [
        f'<tr><th>{_e(f)}</th><td>{_e(", ".join(v["ops"]))}</td><td class="num">'
        f"{v['required']}</td><td>{_e(v['status'])}</td>"
        + "".join(f'<td class="num">{v["counts"][st]}</td>' for st in STATUSES)
        + "</tr>"
        for f, v in result["families"].items()
    ]
    parts = [
        f"<h3>Mustpass {_e(result['version'])}</h3>",
        _table(head, fam_rows),
    ]
    shown = [p for p in result["not_passed"] if p["status"] != "fallback_pass"]
    if shown:
        rows = [
            f'<tr><td><code>{_e(p["id"])}</code></td><td class="{_e(p["status"])}">'
            f"{_e(p['status'])}</td><td>{_e(p['ran_on'] or '-')}</td><td>{_e(p['reason'])}</td>"
            "</tr>"
            for p in shown
        ]
        parts += ["<p>Required checks not passed on its own kernels:</p>",
                  _table(["check", "status", "ran on", "reason"], rows)]  # fmt: skip
    card = report["scorecard"]
    parts += [
        f"<h3>Scorecard (mustpass {_e(card['mustpass'])})</h3>",
        f'<p class="legend">{_CARD_LEGEND}</p>',
        _card_blocks(card["rows"], [{"name": report["backend"], "emulated": report["emulate"]}]),
    ]
    return parts


def _scorecard_section(card: dict) -> str:
    """``scorecard.json``: the backends and their sources, then the blocks."""
    rows = [
        f"<tr><th>{_e(column(b))}</th><td>{_e(b['source'])}</td><td>{_e(b['mode'])}</td>"
        f"<td>{_e(b['ops'] if b['ops'] == 'all' else ', '.join(b['ops']))}</td>"
        f"<td>{_e(b['glmport'])}</td><td>{_e(b['device'])} ({_e(b['device_name'])})</td>"
        f'<td class="{"pass" if b["run_ok"] else "fail"}">{"ok" if b["run_ok"] else "FAILED"}</td>'
        f'<td class="{"pass" if b["mustpass_met"] else "fail"}">'
        f'{_e(met_text(b))}</td><td class="num">{_e(coverage_text(b))}</td></tr>'
        for b in card["backends"]
    ]
    head = ["backend", "source", "mode", "ops", "glmport", "device", "suite", "mustpass",
            "own kernels"]  # fmt: skip
    peaks = "".join(
        f"<li>peaks of {_e(b['backend'])}: {_e(b['file'])} ({_e(b['device'])}, "
        f"{b['rows']} rows)"
        + (f"; on no cell of the table: {_e('; '.join(b['unplaced']))}" if b["unplaced"] else "")
        + "</li>"
        for b in card["bench"]
    )
    return "\n".join(
        [
            f"<h2>Scorecard: mustpass {_e(card['mustpass'])}</h2>",
            _table(head, rows),
            f"<ul>{peaks}</ul>"
            if peaks
            else "<p>No benchmark on the hardware given: every peak is not measured.</p>",
            f'<p class="legend">{_CARD_LEGEND}</p>',
            _card_blocks(card["rows"], card["backends"]),
        ]
    )


def _suite_section(report: dict) -> str:
    env, name = report["environment"], report["backend"]
    ok = report["verdict"]["run_ok"]
    stack = stack_text(env)
    legend = "".join(f'<span class="{o}">{o}</span>' for o in OUTCOMES)
    parts = [
        f"<h2>Conformance suite: <code>{_e(name)}</code></h2>",
        f'<p class="verdict {"ok" if ok else "bad"}">{_e(verdict_line(report))}</p>',
        *_mustpass_verdict(report),
        "<ul>",
        f"<li>device: {_e(env['device'])} ({_e(env['device_name'])}); "
        f"emulated: {_e(report['emulate'])}; mode: {_e(report['mode'])}</li>",
        f"<li>glmport {_e(env['glmport'])}, torch {_e(env['torch'])}, python "
        f"{_e(env['python'])}{', ' + _e(stack) if stack else ''}</li>",
        f"<li>backend implements: {_e(', '.join(report['manifest']['ops']) or 'no op')}; "
        f"falls back to: {_e(' -> '.join(report['manifest']['fallback']) or '-')}</li>",
        "</ul>",
        f'<p class="legend">Rows: an op x dtype[/scheme] x the backend it ran on; its worst '
        f"outcome (coloured), the counts per outcome and the worst error / tolerance "
        f"(1.0 = at the limit): {legend}</p>",
    ]
    own = [r for r in report["table"] if r["own"]]
    parts.append(f"<h3>Its own kernels: {report['summary']['total']} checks ran on {_e(name)}</h3>")
    parts.append(_verdict_blocks(own) if own else f"<p>None: {_e(report['verdict']['why'])}.</p>")
    fallback = [r for r in report["table"] if not r["own"]]
    if fallback:
        fb = report["fallback_summary"]
        parts += [
            f"<h3>On fallbacks: {fb['total']} checks ran on {_e(', '.join(fb['backends']))}</h3>",
            f"<p>These judge the fallback backends, not {_e(name)}; a failure here is the "
            "fallback's bug, and it still fails the run.</p>",
            _verdict_blocks(fallback),
        ]
    problems = [c for c in report["cases"] if c["outcome"] != "pass"]
    for title, mine in (("its own kernels", True), ("on fallbacks", False)):
        shown = [c for c in problems if c["own"] is mine]
        if shown:
            parts += [f"<h3>Not passed: {title}</h3>", _problems(shown)]
    return "\n".join(parts + _mustpass_part(report))


def _grid_table(result: dict, dtype: str) -> str:
    names, cells = grid(result, dtype)
    rows = []
    for a, row in zip(names, cells, strict=True):
        tds = "".join(
            f'<td class="{"na" if p == NO_PAIR else "num"}">'
            f"{_e(p if isinstance(p, str) else pair_text(p, ' / '))}</td>"
            for p in row
        )
        rows.append(f"<tr><th>{_e(a)}</th>{tds}</tr>")
    return _table(["", *names], rows)


def _heatmap(directory: Path, result: dict) -> str:
    heatmap = result.get("heatmap") or {}
    png = directory / "matrix.png"
    if heatmap.get("file") and png.exists():
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        return f'<img alt="mismatch matrix heatmap" src="data:image/png;base64,{data}">'
    why = heatmap.get("why") or f"{png.name} is missing"
    return f"<p>No heatmap: {_e(why)}.</p>"


def _matrix_section(directory: Path, result: dict) -> str:
    env = result["environment"]
    parts = [
        "<h2>Mismatch matrix</h2>",
        f"<p>Tiny GLM-5, float weights, {_e(result['tokens'])} next tokens of a fixed prompt "
        f"set, temperature 1. Cells: mean |&Delta; logp| / greedy-token agreement; IcePop "
        f"beta {result['icepop_beta']:g}. glmport {_e(env['glmport'])}, torch "
        f"{_e(env['torch'])}; {_e(env['host'])}.</p>",
        _heatmap(directory, result),
    ]
    for dtype in result["dtypes"]:
        parts += [f"<h3>{_e(dtype)}</h3>", _grid_table(result, dtype)]
    pair_rows = [
        f"<tr><td>{_e(p['dtype'])}</td><td>{_e(p['a'])}</td><td>{_e(p['b'])}</td>"
        f'<td class="num">{_e(sci(p["mean_abs_dlogp"]))}</td>'
        f'<td class="num">{_e(sci(p["max_abs_dlogp"]))}</td>'
        f'<td class="num">{p["icepop_pop_fraction"]:.1%}</td>'
        f'<td class="num">{p["greedy_agreement"]:.1%}</td></tr>'
        for p in result["pairs"]
    ]
    header = ["dtype", "a", "b", "mean |Δ logp|", "max |Δ logp|", "IcePop pop", "greedy agree"]
    parts += ["<h3>Pairs</h3>", _table(header, pair_rows)]
    backend_rows = []
    for b in result["backends"]:
        runs = [b["runs"][d] for d in result["dtypes"]]
        errors = backend_errors(result, b)
        backend_rows.append(
            f"<tr><td>{_e(b['name'])}</td><td>{'yes' if b['emulated'] else 'no'}</td>"
            f"<td>{_e(b['device'])}</td>"
            + "".join(f'<td class="num">{r["seconds"]:.1f}</td>' for r in runs)
            + f'<td class="{"error" if errors else ""}">{_e(errors or "-")}</td></tr>'
        )
    header = ["backend", "emulated", "device", *(f"{d} s" for d in result["dtypes"]), "errors"]
    parts += ["<h3>Backends</h3>", _table(header, backend_rows)]
    if any(r["error"] for b in result["backends"] for r in b["runs"].values()):
        parts.append("<p>A backend that raised on the model is left out of that dtype's pairs.</p>")
    if result["unavailable"]:
        items = "".join(
            f"<li>{_e(u['name'])}: {_e(u['reason'])}</li>" for u in result["unavailable"]
        )
        parts.append(f"<p>Not available here:</p><ul>{items}</ul>")
    return "\n".join(parts)


def write_html(directory: str | Path) -> Path:
    """Write ``conformance.html`` into ``directory`` from the ``scorecard.json``,
    ``conformance.json`` and ``matrix.json`` / ``matrix.png`` there (any may be
    missing; ConfigError when no JSON file is there, or one cannot be read). Returns
    its path."""
    out = Path(directory)
    report = read_json(out / "conformance.json", REPORT_SCHEMA)
    matrix = read_json(out / "matrix.json", MATRIX_SCHEMA)
    card = read_json(out / "scorecard.json", SCORECARD_SCHEMA)
    if report is None and matrix is None and card is None:
        raise ConfigError(
            f"{out}: no conformance.json and no matrix.json (nor a scorecard.json) to make a "
            "report of"
        )
    if report is not None:
        title = f"glmport conformance: {report['backend']}"
    else:
        title = "glmport scorecard" if card is not None else "glmport mismatch matrix"
    body = [f"<h1>{_e(title)}</h1>"]
    if card is not None:
        body.append(_scorecard_section(card))
    if report is not None:
        body.append(_suite_section(report))
    if matrix is not None:
        body.append(_matrix_section(out, matrix))
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    path = out / "conformance.html"
    path.write_text(page, encoding="utf-8")
    return path


def write_reports(report: dict, directory: str | Path) -> tuple[Path, Path, Path]:
    """Write ``conformance.json``, ``conformance.md`` (:func:`.report.markdown`) and
    ``conformance.html`` (which also shows a mismatch matrix left in ``directory`` by
    ``--matrix``) of a report of :func:`.report.build_report`. Returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "conformance.json", out / "conformance.md"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    md_path.write_text(markdown(report))
    return json_path, md_path, write_html(out)
