"""Mustpass lists: per version, the checks a backend must pass, per op family.

A version is one JSON file, ``conformance/mustpass/<N>.json``, that names every
required check by its exact id (``rms_norm-tiny-bfloat16``, ``rope-tiny_half-float32-
determinism``), grouped by op family, op and dtype[/scheme]::

    {"format": "glmport-mustpass", "version": "1", "cut_from": "...",
     "families": {"norm_rope": {"rms_norm": {"bfloat16": ["rms_norm-tiny-bfloat16", ...]}}}}

Exact ids, never patterns or positions: a case added to the suite later joins no
existing version, so what version N requires stays what it was when it was cut; a
listed check this glmport no longer defines is reported *missing* and fails the
version. A version is cut once from the quick suite (``python -m
glmport.conformance.mustpass cut``) and never edited: new checks go into the next one.

:func:`evaluate` judges a run's records against a version: it is *met* when every
required check in the run's scope ran and none failed or raised, and at least one
passed on the backend's own kernels. A required check the backend declares it cannot
take (its manifest's capabilities) is *unsupported*, with the reason, and does not
fail the version; skipped checks keep their reason. Both are listed, never dropped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from glmport.core.errors import ConfigError, GlmportError

from .runner import MODEL_OP, Check, suite_checks

FORMAT = "glmport-mustpass"
DIRECTORY = Path(__file__).with_name("mustpass")

# Op families: the module names every backend and core/specs share (one module per
# family), expert parallelism with the MoE ops, the model-level check on its own.
OP_FAMILIES = {
    "sparse_attention": "attention",
    "lightning_indexer": "indexer",
    "indexer_logits": "indexer",
    "moe_gate": "moe",
    "moe_dispatch": "moe",
    "moe_combine": "moe",
    "grouped_gemm": "moe",
    "expert_parallel": "moe",
    "quantize": "quant",
    "quant_gemm": "quant",
    "rms_norm": "norm_rope",
    "rope": "norm_rope",
    "token_logprobs": "logprobs",
    "mla_prolog": "attention",
    MODEL_OP: "model",
}
# A required check's outcome in a run: the runner's outcomes, a pass split by whose
# kernels ran it, and no record at all.
STATUSES = ("pass", "fallback_pass", "fail", "error", "unsupported", "skipped", "missing")
_FAILING = ("fail", "error", "missing")
_SEVERITY = ("missing", "error", "fail", "unsupported", "skipped", "fallback_pass")


@dataclass(frozen=True)
class Required:
    """One check a version requires, where it sits in the list."""

    id: str
    family: str
    op: str
    dtype: str  # the reports' dtype column: "bfloat16", "bfloat16/w8a8"


@dataclass(frozen=True)
class Mustpass:
    """One version's list. ``checks`` in the file's order (family, op, dtype, id)."""

    version: str
    cut_from: str
    checks: tuple[Required, ...]

    def required(self, ops: Sequence[str] | None = None) -> tuple[Required, ...]:
        """The checks of ``ops`` (all when None: a run with ``--ops`` covers its ops)."""
        return self.checks if ops is None else tuple(r for r in self.checks if r.op in ops)


def versions() -> list[str]:
    """The versions shipped, oldest first."""
    return [str(n) for n in _numbers(DIRECTORY)]


def _numbers(directory: Path) -> list[int]:
    return sorted(int(p.stem) for p in directory.glob("*.json") if p.stem.isdigit())


def newest() -> str | None:
    known = versions()
    return known[-1] if known else None


def load(version: str, source: str = "--mustpass") -> Mustpass:
    """Version ``version``'s list; ConfigError naming ``source`` and the known versions
    for one that does not exist, naming the file for one that is malformed."""
    known = versions()
    if version not in known:
        raise ConfigError(
            f"{source}: unknown mustpass version {version!r}; known versions: "
            f"{', '.join(known) or 'none'}"
        )
    path = DIRECTORY / f"{version}.json"
    try:
        return parse(json.loads(path.read_text()), str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None


def parse(data: object, where: str) -> Mustpass:
    """A list from its JSON form (see the module docstring); ConfigError naming
    ``where`` and the offending entry for anything malformed: a wrong format or
    version, an op outside its family, an id given twice or not of its op."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}")

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"not a mustpass list (expected an object with format {FORMAT!r})")
    version, families = data.get("version"), data.get("families")
    if not isinstance(version, str) or not version.isdigit():
        raise bad(f"version must be a string of digits, got {version!r}")
    if Path(where).suffix == ".json" and Path(where).stem != version:
        raise bad(f"holds version {version!r}; a version's file is named <version>.json")
    if not isinstance(families, dict) or not families:
        raise bad("families must be a non-empty object: family -> op -> dtype -> [check ids]")
    checks: list[Required] = []
    for family, ops in families.items():
        if not isinstance(ops, dict):
            raise bad(f"family {family!r} must map ops to dtypes")
        for op, dtypes in ops.items():
            if OP_FAMILIES.get(op) != family:
                raise bad(f"op {op!r} is not of family {family!r} ({OP_FAMILIES.get(op)!r})")
            if not isinstance(dtypes, dict):
                raise bad(f"{family}.{op} must map dtypes to lists of check ids")
            for dtype, ids in dtypes.items():
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise bad(f"{family}.{op}.{dtype} must be a list of check ids")
                for check_id in ids:
                    if not check_id.startswith(f"{op}-"):
                        raise bad(f"check {check_id!r} listed under op {op!r} is not one of its")
                    checks.append(Required(check_id, family, op, dtype))
    seen: set[str] = set()
    for r in checks:
        if r.id in seen:
            raise bad(f"check {r.id!r} listed twice")
        seen.add(r.id)
    return Mustpass(version, str(data.get("cut_from", "")), tuple(checks))


def select_checks(listing: Mustpass, ops: Sequence[str] | None = None) -> list[Check]:
    """The suite's checks that ``listing`` requires (of ``ops``), in the suite's order:
    exactly the list, whichever mode each check belongs to. A listed id the suite no
    longer defines runs nothing; :func:`evaluate` reports it missing."""
    wanted = {r.id for r in listing.required(ops)}
    return [c for c in suite_checks(full=True, ops=ops) if c.id in wanted]


def defined_ids(ops: Sequence[str] | None = None) -> set[str]:
    """Every check id this glmport's suite defines (either mode)."""
    return {c.id for c in suite_checks(full=True, ops=ops)}


def _status(rec: dict | None) -> str:
    if rec is None:
        return "missing"
    if rec["outcome"] == "pass" and not rec["own"]:
        return "fallback_pass"
    return rec["outcome"]


def evaluate(
    listing: Mustpass,
    records: Iterable[dict],
    ops: Sequence[str] | None = None,
    defined: set[str] | None = None,
) -> dict:
    """Judge a run's ``records`` (the report's check dicts) against ``listing``.

    Args:
        ops: the run's ops (None: all); checks of other ops are out of its scope.
        defined: the ids the suite defines, to tell a check this glmport lacks from
            one that did not run (None: not told apart).

    Returns:
        ``{version, scope, required, met, why, counts: {status: n}, families: {family:
        {ops, required, status, counts}}, not_passed: [{id, status, ran_on, reason}]}``:
        statuses as in :data:`STATUSES`; ``not_passed`` lists every required check that
        did not pass on the backend's own kernels, with its reason.
    """
    by_id = {r["id"]: r for r in records}
    required = listing.required(ops)
    counts = dict.fromkeys(STATUSES, 0)
    families: dict[str, dict] = {}
    not_passed = []
    for req in required:
        rec = by_id.get(req.id)
        status = _status(rec)
        counts[status] += 1
        fam = families.setdefault(
            req.family, {"ops": [], "required": 0, "counts": dict.fromkeys(STATUSES, 0)}
        )
        if req.op not in fam["ops"]:
            fam["ops"].append(req.op)
        fam["required"] += 1
        fam["counts"][status] += 1
        if status != "pass":
            not_passed.append(
                {
                    "id": req.id,
                    "status": status,
                    "ran_on": rec["ran_on"] if rec else "",
                    "reason": rec["reason"] if rec else _missing_reason(req.id, defined),
                }
            )
    for fam in families.values():
        fam["status"] = _family_status(fam["counts"])
    not_passed.sort(key=lambda p: _SEVERITY.index(p["status"]))  # stable: list order within
    failing = sum(counts[s] for s in _FAILING)
    if not required:
        why = "it requires no check of the ops run"
    elif failing:
        why = ", ".join(f"{counts[s]} {s}" for s in _FAILING if counts[s]) + " of the required"
    elif counts["pass"] == 0:
        why = "no required check passed on the backend's own kernels"
    else:
        why = ""
    return {
        "version": listing.version,
        "scope": list(ops) if ops else "all",
        "required": len(required),
        "met": not why,
        "why": why,
        "counts": counts,
        "families": families,
        "not_passed": not_passed,
    }


def _missing_reason(check_id: str, defined: set[str] | None) -> str:
    if defined is not None and check_id not in defined:
        return "this glmport's suite defines no check of this id"
    return "required, but no record of it: it did not run"


def _family_status(counts: dict) -> str:
    """A family in a few words: failed, on the backend's own kernels, partly on
    fallbacks, all on fallbacks, or none run (all unsupported or skipped)."""
    if any(counts[s] for s in _FAILING):
        return "failed"
    if counts["pass"] and counts["fallback_pass"]:
        return "partly own"
    if counts["pass"]:
        return "own"
    return "on fallbacks" if counts["fallback_pass"] else "not run"


def summary_line(result: dict, backend: str) -> str:
    """One line naming the version and whether ``backend`` meets it, with counts and
    the first checks that fail it."""
    scope = "all ops" if result["scope"] == "all" else f"ops {', '.join(result['scope'])}"
    c = result["counts"]
    word = "MET" if result["met"] else "NOT MET"
    line = (
        f"mustpass {result['version']} {word} by {backend!r} ({scope}): {result['required']} "
        f"required, {c['pass']} pass on its own kernels, {c['fallback_pass']} on fallbacks, "
        f"{c['unsupported']} unsupported, {c['skipped']} skipped"
    )
    for status in _FAILING:
        if c[status]:
            ids = [p["id"] for p in result["not_passed"] if p["status"] == status]
            more = f" and {len(ids) - 3} more" if len(ids) > 3 else ""
            line += f"; {c[status]} {status}: {', '.join(ids[:3])}{more}"
    if not result["met"] and not any(c[s] for s in _FAILING):
        line += f" ({result['why']})"
    return line


def not_passed_lines(result: dict, shown: int = 3) -> list[str]:
    """The required checks that did not pass on the backend's own kernels, one line per
    status and reason: ``unsupported (backend 'x' declares ...): 9 checks: a, b, c and 6
    more`` (``1 check: a``). Passes on fallbacks are left to the counts."""
    groups: dict[tuple[str, str], list[str]] = {}
    for p in result["not_passed"]:
        if p["status"] != "fallback_pass":
            groups.setdefault((p["status"], p["reason"]), []).append(p["id"])
    lines = []
    for (status, reason), ids in groups.items():
        more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
        checks = "1 check" if len(ids) == 1 else f"{len(ids)} checks"
        lines.append(f"  {status} ({reason}): {checks}: {', '.join(ids[:shown])}{more}")
    return lines


# -- cutting a version ---------------------------------------------------------------


def listing_of(checks: Iterable[Check], version: str, cut_from: str) -> dict:
    """The JSON form of a list requiring ``checks``: family -> op -> dtype -> ids."""
    by_op: dict[str, dict[str, list[str]]] = {}
    for c in checks:
        by_op.setdefault(c.op, {}).setdefault(c.dtype_column, []).append(c.id)
    families: dict[str, dict[str, dict[str, list[str]]]] = {}
    for op, family in OP_FAMILIES.items():  # a stable order, for diffs between versions
        if op in by_op:
            dtypes = by_op[op]
            families.setdefault(family, {})[op] = {d: sorted(dtypes[d]) for d in sorted(dtypes)}
    return {"format": FORMAT, "version": version, "cut_from": cut_from, "families": families}


def cut(directory: Path | None = None, version: str | None = None) -> tuple[Path, dict]:
    """Write version ``version`` (default: the newest plus one) from today's quick
    suite into ``directory`` (default: :data:`DIRECTORY`); returns its path and how it
    differs from the newest (``added``, ``removed`` ids). ConfigError, writing nothing,
    when that version exists already (a version is never rewritten), would leave a gap
    after the newest, or would require exactly what the newest requires (a second cut
    with nothing new)."""
    from glmport.core.environment import versions as stack_versions

    directory = DIRECTORY if directory is None else directory
    known = _numbers(directory)
    following = str(max(known, default=0) + 1)
    version = following if version is None else version
    if version.isdigit() and int(version) in known:
        raise ConfigError(
            f"mustpass cut: version {version} exists ({directory / f'{version}.json'}); a "
            "version is never rewritten: cut the next one"
        )
    if version != following:
        raise ConfigError(f"mustpass cut: version {version!r}: the next version is {following}")
    today = datetime.date.today().isoformat()  # versions of one release told apart
    listing = listing_of(
        suite_checks(),
        version,
        f"the quick suite of glmport {stack_versions()['glmport']}, {today}",
    )
    new = {i for ops in listing["families"].values() for d in ops.values() for ids in d.values()
           for i in ids}  # fmt: skip
    old: set[str] = set()
    if known:
        previous = directory / f"{max(known)}.json"
        old = {r.id for r in parse(json.loads(previous.read_text()), str(previous)).checks}
        if new == old:
            raise ConfigError(
                f"mustpass cut: the quick suite requires exactly what version {max(known)} "
                "does: nothing to cut"
            )
    path = directory / f"{version}.json"
    try:
        with path.open("x") as out:  # "x": never over a file written meanwhile
            out.write(json.dumps(listing, indent=1) + "\n")
    except OSError as err:  # FileExistsError included: another cut got there first
        raise ConfigError(f"mustpass cut: cannot write {path}: {err}") from None
    return path, {"added": sorted(new - old), "removed": sorted(old - new)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m glmport.conformance.mustpass cut|list``."""
    parser = argparse.ArgumentParser(
        prog="python -m glmport.conformance.mustpass", description="glmport's mustpass lists"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cutting = sub.add_parser("cut", help="write the next version from today's quick suite")
    cutting.add_argument(
        "--version", default=None, help="the version to write (default: the newest plus one)"
    )
    sub.add_parser("list", help="the versions and how many checks each requires")
    args = parser.parse_args(argv)
    try:
        if args.command == "cut":
            path, change = cut(version=args.version)
            print(f"wrote {path}: {len(change['added'])} checks added, "
                  f"{len(change['removed'])} removed since the previous version")  # fmt: skip
            for check_id in change["removed"]:
                print(f"  removed: {check_id}")
        else:
            for version in versions():
                listing = load(version, "mustpass list")
                print(f"{version}: {len(listing.checks)} checks ({listing.cut_from})")
    except GlmportError as err:
        print(f"glmport: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
