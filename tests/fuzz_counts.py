"""One vocabulary for the outcomes of every fuzz module, their counts, and the summary
that docs/reliability.md quotes.

Every input a fuzz module tries ends in one outcome:

* ``correct``: the right result (the reference's value, a valid request answered);
* ``refused``: a typed glmport error, a 4xx or one ``glmport: error:`` line that names
  what was wrong, for an input the contract lets it refuse;

or in one of the failure kinds, each of which fails the module's test:

* ``silent wrong``: a wrong value or a wrong shape returned;
* ``traceback``: an untyped exception, a crash, a CLI traceback;
* ``5xx``: a server error from the gateway;
* ``accepted invalid``: a bad input or a damaged checkpoint taken as if valid;
* ``bad refusal``: a refusal that breaks the contract: of a valid input, not naming
  what was wrong, not one line, or after changing files.

A module counts its outcomes on one :class:`Counts` per surface, keyed by the
surface's own fields (op, backend, class ...); a finer detail (the exception type,
which guard stopped a bare runtime) is a ``detail`` field, never a new outcome.
``_write_counts = COUNTS.writer()`` in a module appends its counts to the file named by
``$FUZZ_COUNTS`` at the end of the module, one JSON object a line:
``{"surface": ..., <fields>, "outcome": ..., "n": ...}``.

``python tests/fuzz_counts.py counts.jsonl`` prints the summary table (a row per
surface, per backend for ops and per runtime for export) and exits 1 when any
failure was counted, a surface is missing or the file is empty or malformed.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

CORRECT = "correct"
REFUSED = "refused"
SILENT_WRONG = "silent wrong"
TRACEBACK = "traceback"
SERVER_ERROR = "5xx"
ACCEPTED_INVALID = "accepted invalid"
BAD_REFUSAL = "bad refusal"
FAILURES = (BAD_REFUSAL, SILENT_WRONG, TRACEBACK, SERVER_ERROR, ACCEPTED_INVALID)
OUTCOMES = (CORRECT, REFUSED, *FAILURES)


@dataclass(frozen=True)
class Split:
    """A surface whose summary has a row per value of ``field``; each of ``values``
    must have been tried."""

    field: str
    values: tuple[str, ...]


# The surfaces of the documented fuzz run (None: one summary row).
SURFACES: dict[str, Split | None] = {
    "ops": Split("backend", ("generic", "cpu", "cuda", "ascend", "onnxruntime", "tvm")),
    "ascend adapters": None,
    "cli": None,
    "gateway": None,
    "rl checkpoints": None,
    "export": Split("runtime", ("onnxruntime", "tvm")),
}


@dataclass(frozen=True)
class Outcome:
    """How one input ended: ``kind`` (one of :data:`OUTCOMES`), an optional finer
    ``detail`` (counted as the field ``detail``), and for a failure the ``problem``
    the test fails with."""

    kind: str
    detail: str = ""
    problem: str = ""

    def __post_init__(self) -> None:
        if self.kind not in OUTCOMES:
            raise ValueError(f"outcome {self.kind!r} is none of {OUTCOMES}")

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES

    def __str__(self) -> str:  # "refused (OpInputError)": hypothesis's event statistics
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


class Counts:
    """The outcome counts of one surface, by the surface's fields and the outcome."""

    def __init__(self, surface: str) -> None:
        if surface not in SURFACES:
            raise ValueError(f"unknown fuzz surface {surface!r}: one of {sorted(SURFACES)}")
        self.surface = surface
        self._counts: Counter[tuple[tuple[tuple[str, object], ...], str]] = Counter()

    def add(self, outcome: Outcome, **where: object) -> None:
        """Count one input that ended in ``outcome`` under the fields ``where``."""
        split = SURFACES[self.surface]
        if split is not None and split.field not in where:
            raise ValueError(f"{self.surface} counts need the field {split.field!r}")
        if outcome.detail:
            where["detail"] = outcome.detail
        self._counts[(tuple(where.items()), outcome.kind)] += 1

    def observe(self, attempt: Callable[[], Outcome], what: str, **where: object) -> Outcome:
        """Run ``attempt`` and count its outcome under ``where`` (an exception it lets
        out is a ``traceback``); fail, naming ``what`` was tried, on a failure kind."""
        try:
            outcome = attempt()
        except Exception as err:
            problem = f"{what}: untyped {type(err).__name__}: {err}"
            self.add(Outcome(TRACEBACK, type(err).__name__, problem), **where)
            raise AssertionError(problem) from err
        self.add(outcome, **where)
        assert not outcome.failed, outcome.problem
        return outcome

    def rows(self) -> list[dict]:
        """The counts as the JSON objects :meth:`write` writes."""
        return [
            {"surface": self.surface, **dict(where), "outcome": kind, "n": n}
            for (where, kind), n in self._counts.items()
        ]

    def write(self, path: str) -> None:
        """Append the counts to ``path`` in one append, not line by line (two
        pytest-xdist workers may append to the same file), and start counting afresh,
        so that a module whose tests a worker runs in two stretches is not counted
        twice."""
        text = "".join(json.dumps(row) + "\n" for row in self.rows()).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while text:
                text = text[os.write(fd, text) :]
        finally:
            os.close(fd)
        self._counts.clear()

    def writer(self) -> Callable:
        """A module-scoped autouse fixture that appends the counts to ``$FUZZ_COUNTS``
        (when it is set) after the module's tests: ``_write_counts = COUNTS.writer()``."""

        @pytest.fixture(scope="module", autouse=True)
        def _write_counts():
            yield
            path = os.environ.get("FUZZ_COUNTS")
            if path:
                self.write(path)

        return _write_counts


# -- the summary -------------------------------------------------------------------------


def read_rows(path: Path) -> tuple[Counter[tuple[str, str]], list[str]]:
    """The counts in ``path`` per summary row and outcome, and what is wrong with the
    file (malformed lines, unknown surfaces or outcomes, missing surfaces)."""
    totals: Counter[tuple[str, str]] = Counter()
    problems: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        return totals, [f"cannot read {path}: {err}"]
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            surface, kind, n = row["surface"], row["outcome"], row["n"]
        except (ValueError, KeyError, TypeError) as err:
            problems.append(f"{path}:{number}: not a counts row ({err}): {line[:120]}")
            continue
        split = SURFACES.get(surface)
        if surface not in SURFACES or kind not in OUTCOMES:
            problems.append(f"{path}:{number}: unknown surface or outcome: {line[:120]}")
        elif not isinstance(n, int) or isinstance(n, bool) or n < 1:
            problems.append(f"{path}:{number}: n must be a positive integer: {line[:120]}")
        elif split is not None and split.field not in row:
            problems.append(f"{path}:{number}: no {split.field!r}: {line[:120]}")
        else:
            totals[(_label(surface, row), kind)] += n
    tried = {label for label, _ in totals}
    for label in _expected_labels():
        if label not in tried:
            problems.append(f"{path}: no counts for {label!r}")
    return totals, problems


def _label(surface: str, row: dict) -> str:
    split = SURFACES[surface]
    return surface if split is None else f"{surface}: {row[split.field]}"


def _expected_labels() -> list[str]:
    labels = []
    for surface, split in SURFACES.items():
        values = [None] if split is None else split.values
        labels += [_label(surface, {} if split is None else {split.field: v}) for v in values]
    return labels


def summary_table(totals: Counter[tuple[str, str]]) -> str:
    """A Markdown table: a row per surface (split), inputs tried and each outcome."""
    labels = _expected_labels()
    labels += sorted({label for label, _ in totals} - set(labels))
    lines = [
        "| surface | inputs tried | " + " | ".join(OUTCOMES) + " |",
        "|---" * (len(OUTCOMES) + 2) + "|",
    ]

    def line(name: str, counts: list[int]) -> str:
        return f"| {name} | {sum(counts)} | " + " | ".join(map(str, counts)) + " |"

    for label in labels:
        lines.append(line(label, [totals[(label, kind)] for kind in OUTCOMES]))
    every = [sum(totals[(label, kind)] for label in labels) for kind in OUTCOMES]
    lines.append(line("**total**", every))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/fuzz_counts.py COUNTS.jsonl", file=sys.stderr)
        return 2
    totals, problems = read_rows(Path(argv[0]))
    print(summary_table(totals))
    failed = sum(n for (_, kind), n in totals.items() if kind in FAILURES)
    if failed:
        problems.append(f"{failed} inputs ended in a failure ({', '.join(FAILURES)})")
    for problem in problems:
        print(f"fuzz_counts: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
