"""The HTML report's layout: the suite's table is one narrow block per op family with a
row per op x dtype[/scheme] x backend it ran on (no blank cells, no column per dtype),
under sticky headers, so one screen shows an op's whole verdict. Parsed with the
standard library's ``html.parser``, no browser."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from glmport.conformance.html import write_reports
from glmport.conformance.mustpass import OP_FAMILIES
from glmport.conformance.report import build_report
from glmport.conformance.runner import Record, suite_checks

OPS = ("rms_norm", "moe_gate", "quant_gemm")
FAILED = "quant_gemm-tiny-bfloat16-w8a8"


class _Page(HTMLParser):
    """The page's CSS, every table's column count, and the suite's family blocks:
    ``[(family, header, rows)]``, each row its cells' text with a spanned op cell
    repeated into the rows it spans."""

    def __init__(self) -> None:
        super().__init__()
        self.css = ""
        self.widths: list[int] = []
        self.blocks: list[tuple[str, list[str], list[list[str]]]] = []
        self.blank_cells = 0
        self._in: list[str] = []
        self._suite = False
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._span: tuple[str, int] | None = None  # (op, rows left)
        self._cell_span = 1

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self._in.append(tag)
        if tag == "div" and "family" in (a.get("class") or "").split():
            self._suite = "suite" in a["class"].split()
            if self._suite:
                self.blocks.append(("", [], []))
        elif tag == "table":
            self.widths.append(0)
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []
            self._cell_span = int(a.get("rowspan", 1))

    def handle_endtag(self, tag: str) -> None:
        self._in.pop()
        if tag == "div":
            self._suite = False
        elif tag in ("td", "th") and self._cell is not None and self._row is not None:
            text = "".join(self._cell).strip()
            self._row.append(text)
            if self._suite and tag == "td" and not text:
                self.blank_cells += 1
            if self._cell_span > 1:
                self._span = (text, self._cell_span)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.widths[-1] = max(self.widths[-1], len(self._row))
            if self._suite:
                self._suite_row(self._row)
            self._row = None

    def _suite_row(self, row: list[str]) -> None:
        _, header, rows = self.blocks[-1]
        if not header:
            header.extend(row)
            return
        if len(row) < len(header) and self._span is not None:
            row = [self._span[0], *row]
        if self._span is not None:
            self._span = (self._span[0], self._span[1] - 1) if self._span[1] > 1 else None
        rows.append(row)

    def handle_data(self, data: str) -> None:
        if self._in and self._in[-1] == "style":
            self.css += data
        elif self._in and self._in[-1] == "h4" and self._suite:
            _, header, rows = self.blocks[-1]
            self.blocks[-1] = (data, header, rows)
        elif self._cell is not None:
            self._cell.append(data)


def _records() -> list[dict]:
    """A passing quick run of ``OPS`` on cpu with one failure, as the suite records it."""
    out = []
    for check in suite_checks(ops=OPS):
        c = check.case
        outcome = "fail" if check.id == FAILED else "pass"
        out.append(
            Record(
                id=check.id, op=c.op, kind=check.kind, family=c.family,
                dtype=str(c.dtype).removeprefix("torch."), scheme=c.scheme, params=dict(c.params),
                outcome=outcome, metrics={"max_rel": 0.25}, tolerance={"max_rel": 1.0},
                ran_on="cpu", own=True,
            ).to_dict()
        )  # fmt: skip
    return out


def test_the_suite_table_is_one_narrow_block_per_op_family(tmp_path):
    report = build_report(_records(), backend="cpu", full=False, emulate=False, ops=OPS)
    page = _Page()
    page.feed(write_reports(report, tmp_path)[2].read_text())

    order = list(dict.fromkeys(OP_FAMILIES.values()))  # the mustpass's family order
    families = sorted({OP_FAMILIES[op] for op in OPS}, key=order.index)
    assert [f for f, _, _ in page.blocks] == families
    assert re.search(r"table\.card thead th \{ position: sticky; top: 0;", page.css)
    assert page.blank_cells == 0
    assert max(page.widths) <= 11  # the widest: the mustpass's families, 4 + 7 statuses
    header = ["op", "dtype", "ran on", "outcome", "checks", "worst err/tol"]
    shown = {}
    for family, head, rows in page.blocks:
        assert head == header
        for op, dtype, ran_on, *rest in rows:
            assert OP_FAMILIES[op] == family
            shown[(op, dtype, ran_on)] = rest
    # Every row of the report's table, each op's dtypes[/schemes] as rows of its block.
    assert shown.keys() == {(r["op"], r["dtype"], r["ran_on"]) for r in report["table"]}
    assert len(shown) == len(report["table"]) > len(OPS)
    for r in report["table"]:
        outcome = "fail" if r["fail"] else "pass"
        counts = ", ".join(f"{r[o]} {o}" for o in ("pass", "fail") if r[o])
        assert shown[(r["op"], r["dtype"], r["ran_on"])] == [outcome, counts, "0.250"]
    assert shown[("quant_gemm", "bfloat16/w8a8", "cpu")][0] == "fail"
    # moe_gate runs in float32 only: its verdict is in the moe block, not a blank row.
    moe = next(rows for family, _, rows in page.blocks if family == "moe")
    gate = [row for row in moe if row[0] == "moe_gate"]
    n = sum(1 for r in report["cases"] if r["op"] == "moe_gate")
    assert gate == [["moe_gate", "float32", "cpu", "pass", f"{n} pass", "0.250"]]
