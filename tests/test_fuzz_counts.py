"""The fuzz outcome counts (tests/fuzz_counts.py): what the writer appends and what the
summary, the command docs/reliability.md documents, lets pass."""

from __future__ import annotations

import json
import re

import pytest
from fuzz_counts import (
    CORRECT,
    FAILURES,
    OUTCOMES,
    REFUSED,
    SURFACES,
    Counts,
    Outcome,
    main,
)


def _every_surface(tmp_path, extra: tuple[dict, ...] = ()) -> str:
    """A counts file with 3 correct and 2 refused inputs for every row of the summary,
    plus ``extra`` rows; its path."""
    path = tmp_path / "counts.jsonl"
    for surface, split in SURFACES.items():
        counts = Counts(surface)
        for value in split.values if split else [None]:
            where = {split.field: value} if split else {}
            for kind in [CORRECT] * 3 + [REFUSED] * 2:
                counts.add(Outcome(kind), **where, **{"class": "x"})
        counts.write(str(path))
    with path.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in extra)
    return str(path)


def _table(out: str) -> dict[str, list[int]]:
    """The summary's rows: label -> the numbers in its cells."""
    rows = {}
    for line in out.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [int(c) for c in cells[1:]]
    return rows


def test_a_clean_run_of_every_surface_passes(tmp_path, capsys):
    assert main([_every_surface(tmp_path)]) == 0
    rows = _table(capsys.readouterr().out)
    labels = len(rows) - 1  # and the total
    assert labels == sum(len(s.values) if s else 1 for s in SURFACES.values())
    assert rows["ops: tvm"] == [5, 3, 2] + [0] * len(FAILURES)
    assert rows["**total**"] == [5 * labels, 3 * labels, 2 * labels] + [0] * len(FAILURES)


@pytest.mark.parametrize("kind", FAILURES)
def test_any_failure_fails_the_summary(tmp_path, capsys, kind):
    row = {"surface": "gateway", "class": "valid", "outcome": kind, "n": 1}
    assert main([_every_surface(tmp_path, (row,))]) == 1
    out, err = capsys.readouterr()
    assert _table(out)["gateway"][1 + OUTCOMES.index(kind)] == 1
    assert "1 inputs ended in a failure" in err


@pytest.mark.parametrize("missing", ["cli", "ops: cuda", "export: tvm"])
def test_a_missing_surface_fails_the_summary(tmp_path, capsys, missing):
    path = _every_surface(tmp_path)
    kept = []
    for line in (tmp_path / "counts.jsonl").read_text().splitlines():
        row = json.loads(line)
        split = SURFACES[row["surface"]]
        label = row["surface"] + (f": {row[split.field]}" if split else "")
        kept += [line] if label != missing else []
    (tmp_path / "counts.jsonl").write_text("\n".join(kept) + "\n")
    assert main([path]) == 1
    assert f"no counts for {missing!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line",
    [
        "{not json",
        json.dumps({"surface": "ops", "backend": "cpu", "outcome": "FAILED", "n": 1}),
        json.dumps({"surface": "fuzz", "outcome": "correct", "n": 1}),
        json.dumps({"surface": "ops", "outcome": "correct", "n": 1}),  # no backend
        json.dumps({"surface": "cli", "outcome": "correct", "n": 0}),
        json.dumps({"surface": "cli", "outcome": "correct", "n": True}),
        json.dumps({"surface": "cli", "outcome": "correct"}),
    ],
)
def test_a_malformed_line_fails_the_summary(tmp_path, capsys, line):
    path = _every_surface(tmp_path)
    with (tmp_path / "counts.jsonl").open("a") as f:
        f.write(line + "\n")
    assert main([path]) == 1
    assert re.search(r"counts\.jsonl:\d+: ", capsys.readouterr().err)


def test_an_empty_or_absent_file_fails_the_summary(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert main([str(tmp_path / "empty.jsonl")]) == 1
    assert main([str(tmp_path / "absent.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_counts_take_only_the_vocabulary_and_the_split_field():
    with pytest.raises(ValueError, match="FAILED"):
        Outcome("FAILED")
    with pytest.raises(ValueError, match="surface"):
        Counts("fuzz")
    with pytest.raises(ValueError, match="backend"):
        Counts("ops").add(Outcome(CORRECT), op="rope")


def test_a_write_appends_what_was_counted_since_the_last(tmp_path):
    """A module a pytest-xdist worker runs in two stretches writes twice: each input is
    in one of the writes only."""
    path = str(tmp_path / "counts.jsonl")
    counts = Counts("cli")
    for _ in range(3):
        counts.add(Outcome(REFUSED, "detail"), command="info")
    counts.write(path)
    counts.add(Outcome(CORRECT), command="info")
    counts.write(path)
    rows = [json.loads(line) for line in (tmp_path / "counts.jsonl").read_text().splitlines()]
    assert rows == [
        {"surface": "cli", "command": "info", "detail": "detail", "outcome": REFUSED, "n": 3},
        {"surface": "cli", "command": "info", "outcome": CORRECT, "n": 1},
    ]


def test_observe_counts_an_exception_as_a_traceback_and_fails():
    counts = Counts("cli")

    def crash() -> Outcome:
        raise KeyError("x")

    with pytest.raises(AssertionError, match="tried: untyped KeyError"):
        counts.observe(crash, "tried", command="info")
    with pytest.raises(AssertionError, match="wrong value"):
        counts.observe(lambda: Outcome("silent wrong", problem="wrong value"), "tried")
    assert counts.observe(lambda: Outcome(CORRECT), "tried").kind == CORRECT
    assert [(r["outcome"], r.get("detail")) for r in counts.rows()] == [
        ("traceback", "KeyError"),
        ("silent wrong", None),
        ("correct", None),
    ]
