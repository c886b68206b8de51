"""The scorecard: per backend, op and dtype[/scheme], how much of a mustpass version
ran on the backend's own kernels, the worst error against tolerance there, and the
fraction of the hardware's peak where a benchmark measured one on the hardware.

Every conformance report carries its backend's rows (``scorecard`` in
``conformance.json``); ``glmport conformance --scorecard RUN ...`` combines the reports
of several runs (one per backend, each on its own machine or emulated) into one table,
``scorecard.json`` / ``scorecard.md`` and a section of ``conformance.html``.

Peaks come only from benchmark result files given with ``--bench`` (a run of a
backend benchmark on real hardware, :func:`read_bench`); without one, or for an
emulated run, a cell says "not measured".
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from glmport.core.errors import ConfigError

from .mustpass import Mustpass, Required, evaluate

SCHEMA_VERSION = 1
NOT_MEASURED = "not measured"
BENCH_KEYS = ("op", "dtype", "peak_fraction")  # a benchmark row the scorecard takes
# A cell's counts of required checks (see scorecard_rows).
CELL_COUNTS = ("required", "own", "passed", "failed", "unsupported", "skipped", "fallback",
               "missing")  # fmt: skip


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


def scorecard_rows(
    records: list[dict], listing: Mustpass, *, backend: str, emulated: bool, ops=None
) -> list[dict]:
    """One row per (op, dtype[/scheme]) of ``listing``'s checks (of ``ops``): how many
    it requires (``required``), how many of them ran on the backend's own kernels
    (``own``: passed, failed or raised there; ``coverage`` = own / required), the own
    ones' outcomes (``passed``, ``failed``), the rest (``unsupported``, ``skipped``,
    ``fallback``: ran on another backend, ``missing``: no record), and the worst error /
    tolerance among the own ones (``worst``, None when none has a tolerance). The
    fraction of the hardware's peak is ``peak_fraction`` None / ``peak`` "not measured":
    only a benchmark on the hardware fills it in (:func:`combine`)."""
    by_id = {r["id"]: r for r in records}
    cells: dict[tuple[str, str], dict] = {}
    for req in listing.required(ops):
        cell = cells.setdefault((req.op, req.dtype), _empty_cell(backend, emulated, req))
        cell["required"] += 1
        rec = by_id.get(req.id)
        if rec is None:
            cell["missing"] += 1
        elif rec["outcome"] in ("unsupported", "skipped"):
            cell[rec["outcome"]] += 1
        elif not rec["own"]:
            cell["fallback"] += 1
        else:
            cell["own"] += 1
            cell["passed" if rec["outcome"] == "pass" else "failed"] += 1
            r = worst_ratio(rec["metrics"], rec["tolerance"])
            if r is not None and (cell["worst"] is None or r > cell["worst"]):
                cell["worst"] = r
    return [
        {**c, "coverage": c["own"] / c["required"], "peak_fraction": None, "peak": NOT_MEASURED}
        for c in cells.values()
    ]


def _empty_cell(backend: str, emulated: bool, req: Required) -> dict:
    where = {"backend": backend, "emulated": emulated, "family": req.family, "op": req.op}
    return {**where, "dtype": req.dtype, **dict.fromkeys(CELL_COUNTS, 0), "worst": None}


# -- one table across backends -------------------------------------------------------


def read_json(path: Path, schema: int) -> dict | None:
    """The JSON object in ``path`` (written with ``schema_version`` ``schema``), None
    when there is no such file; ConfigError when it cannot be read or is another
    version's."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    found = data.get("schema_version") if isinstance(data, dict) else None
    if found != schema:  # another version's keys: rendering would fail or mislead
        raise ConfigError(
            f"{path} has schema_version {found!r}; this glmport writes and reads {schema}: "
            "run the command again to replace it"
        )
    return data


def read_bench(path: Path) -> dict:
    """A benchmark's result file as the scorecard takes it::

        {"backend": "cuda", "smoke": false, "environment": {"device": "NVIDIA H200"},
         "rows": [{"op": "sparse_attention", "dtype": "bfloat16", "peak_fraction": 0.62,
                   "peak": "HBM 4.8 TB/s", "name": "decode B=64 N=65536"}, ...]}

    Rows without ``op``, ``dtype`` and ``peak_fraction`` (a benchmark's other rows) are
    left out. ConfigError for a smoke run (not the hardware), no row with a peak
    fraction, or a fraction outside (0, 1]: a figure beyond the peak means the
    benchmark's peak is wrong, and no figure is better than a wrong one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--bench: cannot read {path}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("backend"), str):
        raise ConfigError(f"--bench {path}: expected an object naming its 'backend'")
    if data.get("smoke") is not False:
        raise ConfigError(
            f"--bench {path}: not a run on the hardware (smoke is {data.get('smoke')!r}, "
            "expected false): its timings say nothing about a peak"
        )
    rows = [
        r for r in data.get("rows") or [] if isinstance(r, dict) and all(k in r for k in BENCH_KEYS)
    ]
    if not rows:
        raise ConfigError(f"--bench {path}: no row with {', '.join(BENCH_KEYS)}")
    for r in rows:
        f = r["peak_fraction"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(
                f"--bench {path}: row {r.get('name', r['op'])!r} has peak_fraction {f!r}; "
                "expected a number in (0, 1]"
            )
    device = (data.get("environment") or {}).get("device", "")
    return {"file": str(path), "backend": data["backend"], "device": device, "rows": rows}


def _best_peaks(benches: Sequence[dict]) -> dict[tuple[str, str, str], dict]:
    """(backend, op, dtype) -> the benchmark row with the highest peak fraction."""
    best: dict[tuple[str, str, str], dict] = {}
    for bench in benches:
        for r in bench["rows"]:
            key = (bench["backend"], r["op"], r["dtype"])
            if key not in best or r["peak_fraction"] > best[key]["peak_fraction"]:
                best[key] = {**r, "file": bench["file"], "device": bench["device"]}
    return best


def _peak_text(row: dict) -> str:
    what = f" of {row['peak']}" if row.get("peak") else " of peak"
    case = f", {row['name']}" if row.get("name") else ""
    return f"{row['peak_fraction']:.0%}{what} ({row['device'] or 'device'}{case})"


def combine(
    reports: Sequence[tuple[str, dict]], listing: Mustpass, benches: Sequence[dict] = ()
) -> dict:
    """One scorecard across the runs in ``reports`` (``(source, conformance report)``,
    one per backend and emulation setting) against ``listing``, with peaks from
    ``benches`` (:func:`read_bench`) placed on the backends' native runs.

    Returns ``{schema_version, mustpass, backends: [{name, emulated, source, mode, ops,
    glmport, device, device_name, run_ok, mustpass_met, mustpass_why, own, required}],
    bench: [{file, backend, device, rows, unplaced}], rows}``, rows as
    :func:`scorecard_rows` gives them, every listed (op, dtype) of every backend: a run
    of fewer ops shows the others missing; ``own`` / ``required``: the backend's totals.
    ConfigError for two runs of one backend and setting, or a benchmark of a backend
    with no native run among them."""
    backends, rows, seen = [], [], {}
    for source, report in reports:
        key = (report["backend"], bool(report["emulate"]))
        if key in seen:
            raise ConfigError(
                f"--scorecard: {seen[key]} and {source} are both runs of {key[0]!r}"
                f"{' emulated' if key[1] else ''}: give one run per backend"
            )
        seen[key] = source
        ops = None if report["ops"] == "all" else report["ops"]
        verdict = evaluate(listing, report["cases"], ops)
        env = report["environment"]
        mine = scorecard_rows(report["cases"], listing, backend=key[0], emulated=key[1])
        rows += mine
        backends.append(
            {
                "name": key[0],
                "emulated": key[1],
                "source": source,
                **{k: report[k] for k in ("mode", "ops")},
                **{k: env[k] for k in ("glmport", "device", "device_name")},
                "run_ok": report["verdict"]["run_ok"],
                "mustpass_met": verdict["met"],
                "mustpass_why": verdict["why"],
                "own": sum(r["own"] for r in mine),
                "required": sum(r["required"] for r in mine),
            }
        )
    peaks = _best_peaks(benches)
    natives = {name for name, emulated in seen if not emulated}
    for bench in benches:
        if bench["backend"] not in natives:
            raise ConfigError(
                f"--bench {bench['file']}: a benchmark of {bench['backend']!r} on the "
                "hardware, and no run of it there among the reports (emulated runs take none)"
            )
    for row in rows:
        best = None if row["emulated"] else peaks.get((row["backend"], row["op"], row["dtype"]))
        if best is not None:
            row["peak_fraction"], row["peak"] = best["peak_fraction"], _peak_text(best)
    cells = {(r["backend"], r["op"], r["dtype"]) for r in rows if not r["emulated"]}
    return {
        "schema_version": SCHEMA_VERSION,
        "mustpass": listing.version,
        "backends": backends,
        "bench": [
            {k: b[k] for k in ("file", "backend", "device")}
            | {"rows": len(b["rows"]), "unplaced": _unplaced(b, cells)}
            for b in benches
        ],
        "rows": rows,
    }


def _unplaced(bench: dict, cells: set[tuple[str, str, str]]) -> list[str]:
    """The benchmark's rows whose (op, dtype) is no cell of its backend's native run:
    listed, so a peak measured but not shown is never lost without a word."""
    return [
        f"{r['op']} {r['dtype']}" + (f" ({r['name']})" if r.get("name") else "")
        for r in bench["rows"]
        if (bench["backend"], r["op"], r["dtype"]) not in cells
    ]


def column(backend: dict) -> str:
    """A backend's column title: its name, ``(emulated)`` when it ran so."""
    return backend["name"] + (" (emulated)" if backend["emulated"] else "")


def coverage_text(backend: dict) -> str:
    """A backend's required checks run on its own kernels: ``"565/841 (67%)"``."""
    share = backend["own"] / backend["required"] if backend["required"] else 0.0
    return f"{backend['own']}/{backend['required']} ({share:.0%})"


def met_text(backend: dict) -> str:
    """Whether a backend entry of :func:`combine` meets the version, in the run's scope."""
    if not backend["mustpass_met"]:
        return f"not met: {backend['mustpass_why']}"
    return "met" if backend["ops"] == "all" else "met on the ops run"


def cell_parts(row: dict | None) -> tuple[str, str]:
    """A cell in words, as (coverage, details): ``("22/24 own, 2 on fallbacks", "worst
    0.254, peak not measured")``; ``("not run", "")`` when the run had none of the
    cell's checks; the worst is "-" when no own check has a tolerance (exact checks),
    "none own" when none ran on the backend's own kernels."""
    if row is None or row["missing"] == row["required"]:
        return "not run", ""
    parts = [f"{row['own']}/{row['required']} own"]
    parts += [f"{row[k]} {k}" for k in ("failed", "unsupported", "skipped") if row[k]]
    parts += [f"{row['fallback']} on fallbacks"] if row["fallback"] else []
    parts += [f"{row['missing']} missing"] if row["missing"] else []
    if row["own"] == 0:
        details = "worst: none own"
    else:
        details = "worst -" if row["worst"] is None else f"worst {row['worst']:.3f}"
    peak = row["peak_fraction"]
    details += ", peak " + (NOT_MEASURED if peak is None else f"{peak:.0%}")
    return ", ".join(parts), details


def cell_text(row: dict | None) -> str:
    """:func:`cell_parts` on one line."""
    return ", ".join(p for p in cell_parts(row) if p)


def cell_class(row: dict | None) -> str:
    """A cell's colour: ``fail`` (an own check failed), ``pass`` (every required check
    ran on its own kernels and passed), ``partial`` (some did, the rest unsupported,
    skipped or on fallbacks), ``fallback`` (none ran there), ``unsupported`` (none
    ran at all), ``na`` (not run)."""
    if row is None or row["missing"] == row["required"]:
        return "na"
    if row["failed"] or row["missing"]:
        return "fail"
    if row["own"]:
        return "pass" if row["own"] == row["required"] else "partial"
    return "fallback" if row["fallback"] else "unsupported"


def family_blocks(
    rows: Sequence[dict], columns: Sequence[tuple[str, bool]]
) -> list[tuple[str, list]]:
    """Per op family, in first-seen order: ``(family, [(op, dtype, [row per column, None
    where that backend has no such cell])])``; ``columns`` are (backend, emulated)."""
    by_cell = {(r["backend"], r["emulated"], r["op"], r["dtype"]): r for r in rows}
    families: dict[str, dict[tuple[str, str], None]] = {}
    for r in rows:
        families.setdefault(r["family"], {})[(r["op"], r["dtype"])] = None
    return [
        (family, [(op, dt, [by_cell.get((b, e, op, dt)) for b, e in columns]) for op, dt in cells])
        for family, cells in families.items()
    ]


def markdown(card: dict) -> str:
    """``scorecard.md``: the backends, then one table per op family (rows op x dtype,
    a column per backend)."""
    columns = [(b["name"], b["emulated"]) for b in card["backends"]]
    names = [column(b) for b in card["backends"]]
    lines = [
        f"# glmport scorecard: mustpass {card['mustpass']}",
        "",
        "Each cell: required checks of the mustpass run on the backend's own kernels / "
        "required, what else happened to them, the worst error / tolerance among the own "
        "ones (1.0 = at the limit), and the fraction of the hardware's peak where a "
        "benchmark ran on the hardware.",
        "",
        "| backend | source | mode | ops | glmport | device | suite | mustpass | own kernels |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b, name in zip(card["backends"], names, strict=True):
        ops = b["ops"] if b["ops"] == "all" else ", ".join(b["ops"])
        suite = "ok" if b["run_ok"] else "FAILED"
        lines.append(
            f"| {name} | {b['source']} | {b['mode']} | {ops} | {b['glmport']} | "
            f"{b['device']} ({b['device_name']}) | {suite} | {met_text(b)} | {coverage_text(b)} |"
        )
    for bench in card["bench"]:
        lines.append(f"\nPeaks of {bench['backend']} from {bench['file']} ({bench['device']}).")
        if bench["unplaced"]:
            lines.append(f"Its rows on no cell of the table: {'; '.join(bench['unplaced'])}.")
    if not card["bench"]:
        lines.append(f"\nNo benchmark on the hardware given: every peak is {NOT_MEASURED}.")
    for family, cells in family_blocks(card["rows"], columns):
        header = "| op | dtype | " + " | ".join(names) + " |"
        lines += ["", f"## {family}", "", header, "|---|---|" + "---|" * len(names)]
        for op, dt, row in cells:
            lines.append(f"| {op} | {dt} | " + " | ".join(cell_text(r) for r in row) + " |")
    return "\n".join(lines) + "\n"


def write_scorecard(card: dict, directory: str | Path) -> list[Path]:
    """Write ``scorecard.json`` and ``scorecard.md`` into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "scorecard.json", out / "scorecard.md"
    json_path.write_text(json.dumps(card, indent=2))
    md_path.write_text(markdown(card))
    return [json_path, md_path]
