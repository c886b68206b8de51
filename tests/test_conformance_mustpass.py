"""Mustpass lists and the scorecard: every shipped list is well formed and names checks
the suite still defines; ``glmport conformance --mustpass`` runs exactly a list's
checks, passes on generic, fails on a planted bug naming the check, records a declared
limit as unsupported with its reason; an unknown version is one clear error; a new
case joins no old version; scorecard figures match hand-computed ones; peaks come only
from benchmarks on the hardware; the HTML is one escaped block per op family."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hang_guard import guard_s
from hypothesis import event, given, settings
from hypothesis import strategies as st

from glmport.cli import main
from glmport.conformance import mustpass
from glmport.conformance.html import write_html, write_reports
from glmport.conformance.mustpass import (
    OP_FAMILIES,
    evaluate,
    load,
    not_passed_lines,
    parse,
    select_checks,
    versions,
)
from glmport.conformance.report import build_report, mustpass_line
from glmport.conformance.runner import MODEL_OP, Record, suite_checks
from glmport.conformance.scorecard import (
    cell_text,
    combine,
    markdown,
    read_bench,
    scorecard_rows,
    write_scorecard,
)
from glmport.core.errors import ConfigError
from glmport.core.specs import INTERFACE_NAMES

REPO = Path(__file__).resolve().parents[1]
GLMPORT = Path(sys.executable).with_name("glmport")
TESTS = Path(__file__).resolve().parent


def _glmport(args: list[str], cwd: Path, pythonpath: Path | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(  # a mustpass run of one op, a few seconds
        [str(GLMPORT), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=guard_s(60),
    )  # fmt: skip


def _listed(version: str, op: str) -> dict[str, str]:
    """A version's checks of ``op`` read straight from its file: id -> dtype."""
    data = json.loads((REPO / "conformance" / "mustpass" / f"{version}.json").read_text())
    dtypes = data["families"][OP_FAMILIES[op]][op]
    return {i: dt for dt, ids in dtypes.items() for i in ids}


# -- the lists -----------------------------------------------------------------------


def test_every_op_family_is_named():
    assert set(OP_FAMILIES) == {*INTERFACE_NAMES, MODEL_OP}


@pytest.mark.parametrize("version", versions())
def test_every_listed_check_is_defined_by_the_suite_where_the_list_says(version):
    listing = load(version)
    suite = {c.id: c for c in suite_checks(full=True)}
    gone = [r.id for r in listing.checks if r.id not in suite]
    assert gone == [], f"mustpass {version} lists checks the suite no longer defines"
    for req in listing.checks:
        check = suite[req.id]
        assert (req.op, req.dtype, req.family) == (
            check.op, check.dtype_column, OP_FAMILIES[check.op]
        ), req.id  # fmt: skip


def test_version_1_is_every_check_of_the_quick_suite_it_was_cut_from():
    listing = load("1")
    assert listing.cut_from.startswith("the quick suite of glmport")
    quick = {c.id for c in suite_checks()}
    listed = {r.id for r in listing.checks}
    assert listed <= quick  # later cases may join the quick suite, never version 1
    assert len(listed) == 841 and {r.family for r in listing.checks} == set(OP_FAMILIES.values())


def test_an_unknown_version_is_one_error_listing_the_known_ones(capsys):
    with pytest.raises(ConfigError, match=r"unknown mustpass version '7'; known versions: 1"):
        load("7")
    assert main(["conformance", "--mustpass", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mustpass: unknown mustpass version '7'" in err
    assert "known versions: 1" in err
    assert main(["conformance", "--mustpass", "1", "--full"]) == 2
    assert "--full: not with --mustpass" in capsys.readouterr().err


def _valid(**over) -> dict:
    data = {
        "format": "glmport-mustpass",
        "version": "3",
        "families": {"norm_rope": {"rms_norm": {"float32": ["rms_norm-a-float32"]}}},
    }
    return data | over


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "not a mustpass list"),
        (_valid(format="other"), "not a mustpass list"),
        (_valid(version=3), "version must be a string of digits"),
        (_valid(version="1.0"), "version must be a string of digits"),
        (_valid(families={}), "families must be a non-empty object"),
        (_valid(families={"moe": {"rms_norm": {"float32": ["rms_norm-a"]}}}), "not of family"),
        (_valid(families={"norm_rope": {"rms_norm": ["x"]}}), "must map dtypes"),
        (_valid(families={"norm_rope": {"rms_norm": {"f": "rms_norm-a"}}}), "list of check ids"),
        (_valid(families={"norm_rope": {"rms_norm": {"f": ["rope-a"]}}}), "not one of its"),
        (
            _valid(
                families={"norm_rope": {"rms_norm": {"a": ["rms_norm-x"], "b": ["rms_norm-x"]}}}
            ),
            "listed twice",
        ),
    ],
)
def test_a_malformed_list_is_an_error_naming_the_entry(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(data, "lists/3.json")


def test_a_file_must_hold_the_version_it_is_named_by():
    with pytest.raises(ConfigError, match=r"lists/4.json: holds version '3'"):
        parse(_valid(), "lists/4.json")
    # the name the edits below parse under: unedited, the list parses there
    assert [r.id for r in parse(_valid(), "edits/3.json").checks] == ["rms_norm-a-float32"]


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    path=st.lists(st.sampled_from(["families", "norm_rope", "rms_norm", "float32", 0]), max_size=4),
    value=_JSONISH,
)
def test_any_edit_of_a_list_parses_or_is_a_config_error(path, value):
    """A hand edit anywhere in a list: parsed consistently, or one ConfigError; never a
    crash of another type."""
    data = _valid()
    node = data
    for key in path[:-1]:
        if not isinstance(node, (dict, list)):
            break
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
    if path and isinstance(node, dict):
        node[path[-1]] = value
    try:
        listing = parse(data, "edits/3.json")
    except ConfigError:
        event("refused with a ConfigError")  # --hypothesis-show-statistics counts them
        return
    event("parsed")
    assert all(
        r.id.startswith(f"{r.op}-") and OP_FAMILIES[r.op] == r.family for r in listing.checks
    )
    assert len({r.id for r in listing.checks}) == len(listing.checks)


def test_cutting_writes_the_next_version_and_says_what_changed(tmp_path):
    (tmp_path / "1.json").write_text(
        json.dumps(_valid(version="1") | {"families": {"norm_rope": {"rms_norm": {
            "float32": ["rms_norm-tiny-float32", "rms_norm-gone-float32"]}}}})
    )  # fmt: skip
    path, change = mustpass.cut(tmp_path)
    assert path == tmp_path / "2.json"
    listing = parse(json.loads(path.read_text()), str(path))
    assert listing.version == "2" and {r.id for r in listing.checks} == {
        c.id for c in suite_checks()
    }
    assert change["removed"] == ["rms_norm-gone-float32"]
    assert "rms_norm-tiny-float32" not in change["added"] and change["added"]


def test_cutting_never_rewrites_a_version_nor_cuts_one_twice(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mustpass, "DIRECTORY", tmp_path)
    assert mustpass.main(["cut"]) == 0  # the first version of an empty folder
    first = (tmp_path / "1.json").read_text()
    assert "wrote" in capsys.readouterr().out
    for argv, message in [
        (["cut", "--version", "1"], "version 1 exists"),
        (["cut"], "requires exactly what version 1 does: nothing to cut"),
        (["cut", "--version", "3"], "version '3': the next version is 2"),
        (["cut", "--version", "x"], "version 'x': the next version is 2"),
    ]:
        assert mustpass.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("glmport: error: mustpass cut: ") and err.count("\n") == 1, err
        assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.json"]
    assert (tmp_path / "1.json").read_text() == first  # untouched


def test_a_case_added_later_joins_no_existing_version():
    listing = parse(_valid(families={"norm_rope": {"rms_norm": {"float32": [
        "rms_norm-tiny-float32", "rms_norm-glm5-float32"]}}}), "lists/3.json")  # fmt: skip
    chosen = select_checks(listing, ("rms_norm", "rope"))
    assert [c.id for c in chosen] == ["rms_norm-tiny-float32", "rms_norm-glm5-float32"]
    more = [_rec("rms_norm-new-float32", "fail"), _rec("rms_norm-tiny-float32", "pass")]
    result = evaluate(listing, [*more, _rec("rms_norm-glm5-float32", "pass")])
    assert result["met"] and result["required"] == 2  # the new, failing case is not required


# -- judging a run against a list ----------------------------------------------------


def _rec(check_id, outcome, *, own=True, ran_on="mine", op="rms_norm", dtype="float32",
         ratio=None, reason=""):  # fmt: skip
    return Record(
        id=check_id, op=op, kind="value", family="tiny", dtype=dtype, scheme=None, params={},
        outcome=outcome, reason=reason, metrics={} if ratio is None else {"max_rel": ratio},
        tolerance={} if ratio is None else {"max_rel": 1.0}, ran_on=ran_on, own=own,
    ).to_dict()  # fmt: skip


SIX = _valid(
    families={
        "norm_rope": {"rms_norm": {"float32": [f"rms_norm-{c}" for c in "abcdef"]}},
        "logprobs": {"token_logprobs": {"bfloat16": ["token_logprobs-a"]}},
    }
)


def test_evaluate_against_hand_counted_outcomes():
    listing = parse(SIX, "six/3.json")
    records = [
        _rec("rms_norm-a", "pass"),
        _rec("rms_norm-b", "pass", own=False, ran_on="generic"),
        _rec("rms_norm-c", "fail", reason="output 0 off"),
        _rec("rms_norm-d", "unsupported", own=False, ran_on="generic", reason="declares no bf16"),
        _rec("rms_norm-e", "skipped", reason="no chip"),
        _rec("token_logprobs-a", "pass", op="token_logprobs"),
    ]
    result = evaluate(listing, records, defined={"rms_norm-a"})
    assert result["required"] == 7 and result["met"] is False
    assert result["counts"] == {"pass": 2, "fallback_pass": 1, "fail": 1, "error": 0,
                                "unsupported": 1, "skipped": 1, "missing": 1}  # fmt: skip
    assert result["why"] == "1 fail, 1 missing of the required"
    assert [(p["id"], p["status"]) for p in result["not_passed"]] == [
        ("rms_norm-f", "missing"), ("rms_norm-c", "fail"), ("rms_norm-d", "unsupported"),
        ("rms_norm-e", "skipped"), ("rms_norm-b", "fallback_pass"),
    ]  # fmt: skip
    missing = result["not_passed"][0]
    assert missing["reason"] == "this glmport's suite defines no check of this id"
    assert result["not_passed"][2]["reason"] == "declares no bf16"
    fams = result["families"]
    assert (fams["norm_rope"]["status"], fams["logprobs"]["status"]) == ("failed", "own")
    assert not_passed_lines(result) == [  # the fallback's pass is left to the counts
        "  missing (this glmport's suite defines no check of this id): 1 check: rms_norm-f",
        "  fail (output 0 off): 1 check: rms_norm-c",
        "  unsupported (declares no bf16): 1 check: rms_norm-d",
        "  skipped (no chip): 1 check: rms_norm-e",
    ]
    many = evaluate(listing, [], defined=set())
    assert not_passed_lines(many, shown=2) == [
        "  missing (this glmport's suite defines no check of this id): 7 checks: rms_norm-a, "
        "rms_norm-b and 5 more"
    ]
    assert evaluate(listing, records, ops=("token_logprobs",))["met"] is True
    assert evaluate(listing, records, ops=("rope",))["why"] == (
        "it requires no check of the ops run"
    )


_FATES = ("own_pass", "own_fail", "own_error", "fallback_pass", "fallback_fail", "unsupported",
          "skipped", "missing")  # fmt: skip


def _fated(check_id: str, fate: str, ratio: float) -> dict | None:
    if fate == "missing":
        return None
    where, _, outcome = fate.partition("_")
    if where in ("own", "fallback"):
        return _rec(check_id, outcome, own=where == "own", ran_on="mine", ratio=ratio)
    return _rec(check_id, fate, own=False, ran_on="generic", reason=f"why {fate}")


@settings(max_examples=200, deadline=None)
@given(
    fates=st.lists(
        st.tuples(st.sampled_from(_FATES), st.floats(0, 5), st.sampled_from(["float32", "bf16"])),
        min_size=1,
        max_size=12,
    ),
)
def test_scorecard_and_verdict_against_a_count_of_the_fates(fates):
    dtypes: dict[str, list[str]] = {}
    records = []
    for i, (fate, ratio, dtype) in enumerate(fates):
        check_id = f"rms_norm-c{i}-{dtype}"
        dtypes.setdefault(dtype, []).append(check_id)
        rec = _fated(check_id, fate, ratio)
        records += [rec] if rec else []
    listing = parse(_valid(families={"norm_rope": {"rms_norm": dtypes}}), "fates/3.json")
    rows = {r["dtype"]: r for r in scorecard_rows(records, listing, backend="mine", emulated=False)}
    assert set(rows) == set(dtypes)
    for dtype, row in rows.items():
        mine = [(f, r) for f, r, d in fates if d == dtype]
        own = [r for f, r in mine if f.startswith("own")]
        assert row["required"] == len(mine)
        assert row["own"] == len(own) and row["coverage"] == len(own) / len(mine)
        assert row["passed"] == sum(f == "own_pass" for f, _ in mine)
        assert row["failed"] == sum(f in ("own_fail", "own_error") for f, _ in mine)
        assert row["fallback"] == sum(f.startswith("fallback") for f, _ in mine)
        for fate in ("unsupported", "skipped", "missing"):
            assert row[fate] == sum(f == fate for f, _ in mine)
        assert row["worst"] == (max(own) if own else None)
        assert (row["peak_fraction"], row["peak"]) == (None, "not measured")
    result = evaluate(listing, records)
    event("met" if result["met"] else "not met")
    kinds = [f for f, _, _ in fates]
    failing = {"own_fail", "own_error", "fallback_fail", "missing"} & set(kinds)
    assert result["met"] == (not failing and "own_pass" in kinds)
    assert sum(result["counts"].values()) == len(fates)


def test_scorecard_cells_by_hand():
    listing = parse(SIX, "six/3.json")
    records = [
        _rec("rms_norm-a", "pass", ratio=0.5),
        _rec("rms_norm-b", "fail", ratio=3.0),
        _rec("rms_norm-c", "unsupported", own=False, ran_on="generic"),
        _rec("rms_norm-d", "pass", own=False, ran_on="generic", ratio=9.0),
        _rec("rms_norm-e", "pass"),  # exact: no ratio
    ]
    norm, logp = scorecard_rows(records, listing, backend="mine", emulated=False)
    assert {k: norm[k] for k in ("op", "dtype", "family", "required", "own", "passed", "failed",
                                 "unsupported", "skipped", "fallback", "missing")} == {
        "op": "rms_norm", "dtype": "float32", "family": "norm_rope", "required": 6, "own": 3,
        "passed": 2, "failed": 1, "unsupported": 1, "skipped": 0, "fallback": 1, "missing": 1,
    }  # fmt: skip
    assert norm["coverage"] == 0.5 and norm["worst"] == 3.0  # the fallback's 9.0 is not its
    assert (logp["required"], logp["missing"], logp["coverage"]) == (1, 1, 0.0)
    assert cell_text(norm) == (
        "3/6 own, 1 failed, 1 unsupported, 1 on fallbacks, 1 missing, worst 3.000, "
        "peak not measured"
    )
    assert cell_text(logp) == "not run"
    (fallen,) = scorecard_rows([records[3]], parse(_valid(families={"norm_rope": {"rms_norm": {
        "float32": ["rms_norm-d"]}}}), "one/3.json"), backend="mine", emulated=True)  # fmt: skip
    assert cell_text(fallen) == "0/1 own, 1 on fallbacks, worst: none own, peak not measured"


# -- peaks ---------------------------------------------------------------------------


def _bench(tmp_path: Path, **over) -> Path:
    data = {
        "backend": "mine",
        "smoke": False,
        "environment": {"device": "Chip 9000"},
        "rows": [
            {"op": "rms_norm", "dtype": "float32", "peak_fraction": 0.4, "name": "small"},
            {"op": "rms_norm", "dtype": "float32", "peak_fraction": 0.62, "peak": "HBM 4 TB/s",
             "name": "big"},
            {"section": "ops", "name": "no op named: not a peak row", "cuda_ms": 1.0},
            {"op": "rms_norm", "dtype": "float64", "peak_fraction": 0.3, "name": "no such cell"},
        ],
    } | over  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def _report(records, backend="cpu", emulate=False, ops=None):
    report = build_report(records, backend=backend, full=False, emulate=emulate, ops=ops)
    return report | {"backend": backend}


def test_a_peak_comes_from_a_benchmark_on_the_hardware_only(tmp_path):
    listing = parse(SIX, "six/3.json")
    records = [_rec("rms_norm-a", "pass", ran_on="cpu")]
    native = ("native", _report(records) | {"backend": "mine"})
    emulated = ("emulated", _report(records, emulate=True) | {"backend": "mine"})
    bench = read_bench(_bench(tmp_path))
    card = combine([native, emulated], listing, [bench])
    cells = {(r["emulated"], r["op"]): r for r in card["rows"]}
    assert cells[(False, "rms_norm")]["peak_fraction"] == 0.62  # the best row
    assert cells[(False, "rms_norm")]["peak"] == "62% of HBM 4 TB/s (Chip 9000, big)"
    assert cells[(True, "rms_norm")]["peak_fraction"] is None  # not the hardware
    assert cells[(False, "token_logprobs")]["peak"] == "not measured"  # no row for it
    assert card["bench"][0]["unplaced"] == ["rms_norm float64 (no such cell)"]  # never lost
    assert "Its rows on no cell of the table: rms_norm float64 (no such cell)." in markdown(card)
    assert "every peak is not measured" in markdown(combine([native], listing))
    with pytest.raises(ConfigError, match="no run of it there"):
        combine([emulated], listing, [bench])
    with pytest.raises(ConfigError, match="both runs of 'mine'"):
        combine([native, native], listing)
    for over, message in [
        ({"smoke": True}, "not a run on the hardware"),
        ({"smoke": None}, "not a run on the hardware"),
        ({"rows": [{"op": "rms_norm", "dtype": "float32", "peak_fraction": 1.3}]}, "in (0, 1]"),
        ({"rows": [{"op": "rms_norm", "dtype": "float32", "peak_fraction": 0}]}, "in (0, 1]"),
        ({"rows": [{"op": "rms_norm", "dtype": "float32", "peak_fraction": True}]}, "in (0, 1]"),
        ({"rows": [{"name": "no peak"}]}, "no row with op, dtype, peak_fraction"),
        ({"backend": None}, "naming its 'backend'"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_bench(_bench(tmp_path, **over))


# -- the HTML ------------------------------------------------------------------------

EVIL = '<img src=x onerror="alert(1)">'


def test_the_scorecard_page_is_one_escaped_block_per_family(tmp_path):
    listing = load(mustpass.newest())  # a run's page is judged against the newest version
    first, second = tmp_path / "cpu", tmp_path / f"gen{EVIL}"
    for backend, folder in (("cpu", first), ("generic", second)):
        recs = [_rec("rms_norm-tiny-float32", "fail", ran_on=backend, reason=f"bad {EVIL}")]
        write_reports(_report(recs, backend=backend, ops=("rms_norm",)), folder)
    page = (first / "conformance.html").read_text()
    assert EVIL not in page and "bad &lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page
    assert f"<h3>Mustpass {listing.version}</h3>" in page
    assert page.count('<div class="family">') == 1
    card = combine([(str(first), json.loads((first / "conformance.json").read_text())),
                    (str(second), json.loads((second / "conformance.json").read_text()))],
                   listing)  # fmt: skip
    required = len(listing.checks)
    assert [(b["own"], b["required"]) for b in card["backends"]] == [(1, required)] * 2
    card["backends"][1]["name"] = EVIL  # whatever a report says is escaped
    write_scorecard(card, tmp_path / "card")
    page = write_html(tmp_path / "card").read_text()
    assert EVIL not in page and "gen&lt;img src=x" in page
    blocks = re.findall(r'<div class="family"><h4>(\w+)</h4>(.*?)</div>', page, re.S)
    assert [f for f, _ in blocks] == list(dict.fromkeys(OP_FAMILIES.values()))
    assert "table.card thead th { position: sticky; top: 0;" in page
    cells = 0
    for _family, block in blocks:
        assert block.count("<thead>") == 1 and block.count("<th>cpu</th>") == 1
        for row in re.findall(r"<tr><th>[^<]*</th>(.*?)</tr>", block.split("</thead>")[1]):
            assert row.count("<td") == 3  # the dtype and one cell per backend
            cells += 2
    assert cells == 2 * len({(r.op, r.dtype) for r in listing.checks})
    listed = sum(1 for r in listing.checks if (r.op, r.dtype) == ("rms_norm", "float32"))
    cpu_cell = f'<td class="fail">1/{listed} own, 1 failed, {listed - 1} missing'
    assert page.count(cpu_cell) == 1  # cpu's column


class _Nesting(HTMLParser):
    """Every element closed, in order (void elements aside): what a browser would
    otherwise repair silently, a cell spilling into the next row or table. ``rows``:
    (th, td) counts of every ``<tr>`` of a ``table.card``."""

    VOID = frozenset({"br", "img", "meta", "hr", "input", "link"})

    def reset(self) -> None:  # HTMLParser.__init__ calls it
        super().reset()
        self.open: list[str] = []
        self.errors: list[str] = []
        self.rows: list[tuple[int, int]] = []
        self.cards: list[bool] = []  # per open <table>: is it a card
        self.cells: list[int] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        self.open.append(tag)
        if tag == "table":
            self.cards.append(("class", "card") in attrs)
        elif tag == "tr" and self.cards and self.cards[-1]:
            self.cells = [0, 0]
        elif tag in ("th", "td") and self.cells is not None:
            self.cells[tag == "td"] += 1

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:] or 'nothing'}")
            return
        self.open.pop()
        if tag == "tr" and self.cells is not None:
            self.rows.append((self.cells[0], self.cells[1]))
            self.cells = None
        elif tag == "table":
            self.cards.pop()


def _nesting(page: str) -> _Nesting:
    parser = _Nesting()
    parser.feed(page)
    parser.close()
    return parser


def test_the_report_pages_are_well_formed_and_every_card_row_is_full(tmp_path):
    listing = load(mustpass.newest())  # what each run's own page is judged against
    folders = []
    for backend, emulate in (("cpu", False), ("generic", False), ("cuda", True)):
        folder = tmp_path / backend
        recs = [_rec("rms_norm-tiny-float32", "pass", ran_on=backend, ratio=0.5),
                _rec("rope-tiny-float32", "unsupported", own=False, ran_on="generic",
                     op="rope", reason="declares no <rope>")]  # fmt: skip
        write_reports(_report(recs, backend=backend, emulate=emulate), folder)
        folders.append(folder)
    card = combine([(str(f), json.loads((f / "conformance.json").read_text())) for f in folders],
                   listing)  # fmt: skip
    write_scorecard(card, folders[0])  # one page: the scorecard, then cpu's own report
    page = write_html(folders[0]).read_text()
    broken = _nesting('<table class="card"><tr><td>x</tr></table>')  # the checker can fail
    assert broken.errors == ["</tr> closes ['td']", "</table> closes ['td']"]
    parser = _nesting(page)
    assert parser.errors == [] and parser.open == []
    cells = len({(r.op, r.dtype) for r in listing.checks})
    # the combined blocks: a header of op, dtype + 3 backends, then one row per cell with
    # the op as its <th>; then cpu's own blocks: op, dtype + 1 column
    combined = [r for r in parser.rows if sum(r) == 5]
    own = [r for r in parser.rows if sum(r) == 3]
    assert len(combined) == cells + len(set(OP_FAMILIES.values()))
    assert len(own) == cells + len(set(OP_FAMILIES.values()))
    assert len(parser.rows) == len(combined) + len(own)  # no row short of a cell


# -- the command line ----------------------------------------------------------------


def test_mustpass_on_generic_runs_exactly_the_list_and_meets_it(tmp_path):
    report = tmp_path / "report"
    proc = _glmport(["conformance", "--backend", "generic", "--mustpass", "1", "--ops",
                     "rms_norm", "-n", "0", "--report-dir", str(report)], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mustpass 1 MET by 'generic' (ops rms_norm): 21 required" in proc.stdout
    data = json.loads((report / "conformance.json").read_text())
    assert {c["id"] for c in data["cases"]} == set(_listed("1", "rms_norm"))
    assert data["mode"] == "mustpass" and data["mustpass"]["met"] and data["mustpass"]["requested"]
    assert {r["dtype"]: r["coverage"] for r in data["scorecard"]["rows"]} == {
        "bfloat16": 1.0, "float16": 1.0, "float32": 1.0,
    }  # fmt: skip
    card = tmp_path / "card"
    proc = _glmport(
        ["conformance", "--scorecard", str(report), "--mustpass", "1", "--report-dir", str(card)],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| rms_norm | float32 | 9/9 own, worst" in proc.stdout
    assert "| sparse_attention | float32 | not run |" in proc.stdout
    assert "| met on the ops run | 21/841 (2%) |" in proc.stdout
    assert {p.name for p in card.iterdir()} == {
        "scorecard.json",
        "scorecard.md",
        "conformance.html",
    }
    bench = _bench(tmp_path, backend="generic")  # as if generic had been timed on a chip
    proc = _glmport(["conformance", "--scorecard", str(report), "--bench", str(bench),
                     "--mustpass", "1", "--report-dir", str(card)], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| rms_norm | float32 | 9/9 own, worst " in proc.stdout
    assert ", peak 62% |" in proc.stdout and ", peak 62%" in (card / "conformance.html").read_text()
    assert "| rms_norm | bfloat16 | 9/9 own, " in proc.stdout  # no row: stays not measured
    assert proc.stdout.count("peak 62%") == 1


def test_mustpass_on_a_planted_bug_fails_naming_the_check(tmp_path):
    report = tmp_path / "report"
    proc = _glmport(
        ["conformance", "--plugin", "planted_bug_backend:BACKEND", "--mustpass", "1", "--ops",
         "sparse_attention", "-n", "0", "--report-dir", str(report)],
        tmp_path, pythonpath=REPO / "examples",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("mustpass 1"))
    assert line.startswith("mustpass 1 NOT MET by 'mychip' (ops sparse_attention)")
    assert "12 fail: sparse_attention-all_minus_one-bfloat16" in line
    data = json.loads((report / "conformance.json").read_text())
    failed = {p["id"] for p in data["mustpass"]["not_passed"] if p["status"] == "fail"}
    assert "sparse_attention-all_minus_one-float32" in failed and len(failed) == 12
    assert "sparse_attention-all_minus_one-float32" in (report / "conformance.md").read_text()


def test_a_declared_limit_is_unsupported_with_its_reason_never_a_silent_skip(tmp_path):
    report = tmp_path / "report"
    proc = _glmport(
        ["conformance", "--plugin", "code_backends:BACKEND", "--mustpass", "1", "--ops",
         "rms_norm", "-n", "0", "--report-dir", str(report)],
        tmp_path, pythonpath=TESTS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((report / "conformance.json").read_text())
    result = data["mustpass"]
    declined = {i for i, dt in _listed("1", "rms_norm").items() if dt != "float32"}
    shown = {p["id"]: p for p in result["not_passed"]}
    assert {i for i, p in shown.items() if p["status"] == "unsupported"} == declined
    for check_id in declined:
        assert "'codeplug' declares it does not take dtype" in shown[check_id]["reason"]
    assert result["counts"]["unsupported"] == len(declined) == 12
    assert sum(result["counts"].values()) == result["required"] == 21
    assert "  unsupported (backend 'codeplug' declares it does not take dtype bfloat16" in (
        proc.stdout
    )
    md = (report / "conformance.md").read_text()
    assert "| `rms_norm-tiny-bfloat16` | unsupported | generic | backend 'codeplug' declares" in md


def test_a_listed_check_that_never_ran_fails_a_mustpass_run(tmp_path, monkeypatch):
    """A list naming a check this glmport no longer has: the run fails, naming it."""
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "1.json").write_text(
        json.dumps(
            _valid(version="1")
            | {
                "families": {
                    "norm_rope": {
                        "rms_norm": {
                            "float32": ["rms_norm-tiny-float32", "rms_norm-retired-float32"]
                        }
                    }
                }
            }
        )
    )
    monkeypatch.setattr(mustpass, "DIRECTORY", lists)  # fmt: skip
    records = [_rec("rms_norm-tiny-float32", "pass", ran_on="cpu")]
    report = build_report(records, backend="cpu", full=False, emulate=False, ops=None,
                          mustpass="1")  # fmt: skip
    assert report["mustpass"]["met"] is False and report["mustpass"]["requested"]
    assert report["mustpass"]["not_passed"] == [{
        "id": "rms_norm-retired-float32", "status": "missing", "ran_on": "",
        "reason": "this glmport's suite defines no check of this id"}]  # fmt: skip
    assert mustpass_line(report).endswith("; 1 missing: rms_norm-retired-float32")
    # The command, in a process of its own with that list (-n 0: the suite runs there).
    argv = ["conformance", "--backend", "cpu", "--mustpass", "1", "--ops", "rms_norm", "-n", "0",
            "--report-dir", str(tmp_path / "report")]  # fmt: skip
    code = (
        "import sys; from pathlib import Path; from glmport.conformance import mustpass; "
        f"mustpass.DIRECTORY = Path({str(lists)!r}); from glmport.cli import main; "
        f"sys.exit(main({argv!r}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMPORT_")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=guard_s(60))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout  # the one check it has ran, and passed
    assert "mustpass 1 NOT MET by 'cpu' (ops rms_norm): 2 required" in proc.stdout
    assert "missing: rms_norm-retired-float32" in proc.stdout
