"""A fuzz of the whole command line: every flag of every command, given values it must
refuse (out of range, malformed, unwritable, unknown), one at a time on an otherwise
valid command line. Each must end in one ``glmport: error:`` line naming the flag,
exit status 2, no traceback, nothing written, and before the command's first heavy step
(stubbed: reaching it counts as accepting the value).

The counts per command, flag and outcome (:mod:`fuzz_counts`' outcomes) are written as
JSON lines to the file named by ``FUZZ_COUNTS`` when it is set (docs/reliability.md
quotes them)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import fuzz_counts
import pytest
from cli_cases import REFUSED, TRACEBACK, UNCLEAR, WORK_STARTED, outcome, stub_heavy_steps
from fuzz_counts import Counts, Outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glmport.cli as cli
from glmport.commands import common, rl_train
from glmport.model import GlmMoeDsaForCausalLM

COUNTS = Counts("cli")
_write_counts = COUNTS.writer()

# A valid command line of each command ("{out}": a path under the test's folder).
BASE = {
    "info": [],
    "conformance": ["--report-dir", "{out}"],
    "diff": ["--backends", "cpu,generic", "--out", "{out}"],
    "generate": ["--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "1"],
    "indexcache search": ["--model", "tiny", "--random", "2", "--keep", "1", "--out", "{out}"],
    "export onnx": ["--model", "tiny", "--out", "{out}.onnx"],
    "export tvm": ["--model", "tiny", "--out", "{out}"],
    "rl train": ["--steps", "1", "--quiet", "--out", "{out}"],
    "rl serve": ["--model", "tiny", "--local"],
    "rl agent": ["--episodes", "1"],
}

_OUT = ["", "{file}", "{file}/sub", "{dangling}", "/proc/glmport-fuzz/x"]
_BACKEND = ["xyz", "", " ", "cpu,generic", "cpu\ngeneric", "auto,"]
_IDS = ["", ",", "x", "1,,2", "-1", "1e3", "9" * 30, "1 2", "0x1"]
_MODEL = ["", "/no/such/checkpoint", "{file}", "tiny\n"]
# Bad values of the flags that take text, by flag.
TEXT = {
    "--out": _OUT,
    "--report-dir": _OUT,
    "--backend": _BACKEND,
    "--rollout-backend": _BACKEND,
    "--train-backend": _BACKEND,
    "--backends": ["xyz,cpu", "", "cpu", ",", "cpu,cpu,cpu,x"],
    "--follow": ["xyz", ""],
    "--ops": ["nope", "", ",", "rope,rope", "rope=cpu"],
    "--dtypes": ["fp64", "", ","],
    "--mustpass": ["0", "7", "", "1.0", " 1", "x"],
    "--scorecard": ["/no/such/dir", "{file}", "{folder}", ""],
    "--bench": ["/no/such/file", "{file}", ""],
    "--plugin": ["no_such_module:x", "x", ":", ""],
    "--input-ids": _IDS,
    "--stop-tokens": ["x", "1,,2", "1e3", ","],
    "--model": _MODEL,
    "--layers": ["", "x", "1-", "-1", "2-1", "0--1", "0-1"],  # tiny has no file to slice
    "--calib": ["/no/such/file", "{folder}"],
    "--replay": ["/no/such/file", "{file}"],
    "--context": ["bogus", "keep-recent:-1", "keep-recent:x", "hybrid:1", "discard-all:0"],
    "--gateway": ["", "not a url", "ftp://host/x", "http://[::1"],
    "--opd-teacher": ["/no/such/checkpoint", "{file}"],
    "--init": ["/no/such/checkpoint", "{file}"],
    "--host": ["0.0.0.0"],  # beyond loopback without a token
}
# Text flags left out, and why: any value is valid until it is used as the work itself.
NOT_FUZZED = {
    "--token": "any text is a bearer token",
    "--ray-address": "joining a Ray cluster is the work itself",
    "--replay@rl train": "rl train's own flags belong to its run checks",
}
# Not integers to anyone (the bounded type also refuses "1_000" and other scripts'
# digits, which Python's int() and so a bare type=int take).
_INT_MALFORMED = ["", " ", "1e3", "1.5", "0x10", "+", "nan", "9" * 5000]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its words (``"rl train"``)."""
    found = {}

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            found[words] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, f"{words} {name}".strip())

    walk(cli.build_parser(), "")
    return found


def _bad_values(command: str, action: argparse.Action) -> list[str]:
    """Values ``action`` of ``command`` must refuse."""
    kind, flag = action.type, action.option_strings[-1]
    if action.choices is not None:
        return ["bogus", "", f"{next(iter(action.choices))} "]
    if hasattr(kind, "high"):  # the bounded integers
        low, high = kind.low, kind.high
        return [str(low - 1), str(high + 1), str(10**40), "1_000", "١٢", *_INT_MALFORMED]
    if hasattr(kind, "low"):  # the bounded reals (at least low)
        return [str(kind.low - 1), "nan", "inf", "-inf", "1e999", "", "abc"]
    if kind is common.workers:
        return ["autox", "AUTO", str(common.MAX_WORKERS + 1), "-1", *_INT_MALFORMED]
    if kind is int:  # bounded elsewhere (another area's checks): the malformed ones here
        return _INT_MALFORMED
    if kind is float:
        return ["", "abc", "1,5"]
    if kind is rl_train._overrides:
        return ["x", "=1", "a=1,b"]
    if f"{flag}@{command}" in NOT_FUZZED or flag in NOT_FUZZED:
        return []
    assert flag in TEXT, f"glmport {command} {flag}: no bad values listed (TEXT / NOT_FUZZED)"
    if command == "export onnx" and flag == "--out":  # a file is written over; a folder not
        return [("{folder}" if v == "{file}" else v) for v in TEXT[flag]]
    return TEXT[flag]


def _partners(parser: argparse.ArgumentParser, action: argparse.Action) -> set[str]:
    """The flags that may not come with ``action`` (its mutually exclusive groups)."""
    out: set[str] = set()
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            out |= {a.option_strings[-1] for a in group._group_actions if a is not action}
    return out


def _command_line(command: str, flag: str, value: str, drop: set[str], tmp: Path) -> list[str]:
    """``BASE[command]`` with ``flag=value`` instead of its own (and without ``drop``),
    the placeholders filled in; the last word is ``flag=value``."""
    base = BASE[command]
    pairs, i = [], 0
    while i < len(base):  # the base line as (flag, value or None)
        has_value = i + 1 < len(base) and not base[i + 1].startswith("--")
        pairs.append((base[i], base[i + 1] if has_value else None))
        i += 2 if has_value else 1
    kept = [(f, v) for f, v in pairs if f != flag and f not in drop]
    words = command.split()
    for f, v in kept:
        words += [f] if v is None else [f, v]
    words.append(f"{flag}={value}")
    fill = {
        "{out}": str(tmp / "out"),
        "{file}": str(tmp / "a-file"),
        "{folder}": str(tmp / "a-folder"),
        "{dangling}": str(tmp / "dangling"),
    }
    for key, path in fill.items():
        words = [w.replace(key, path) for w in words]
    return words


@pytest.fixture
def fuzz_env(monkeypatch, tmp_path):
    """Heavy steps stubbed, the tiny model built once, a folder with the fixtures the
    bad values name; yields the folder."""
    stub_heavy_steps(monkeypatch)
    tiny = GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()
    real = common.load_model
    monkeypatch.setattr(
        common,
        "load_model",
        lambda s, d="fp32", layers=None: (
            tiny if s == "tiny" and layers is None else real(s, d, layers)
        ),
    )
    (tmp_path / "a-file").write_text("not a checkpoint")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_every_valid_base_line_reaches_its_work(fuzz_env):
    """The stubs mark each command's work, and every base line is valid."""
    assert set(BASE) == set(_parsers())
    for command in BASE:
        argv = [
            w.replace("{out}", str(fuzz_env / "out")) for w in [*command.split(), *BASE[command]]
        ]
        got, text = outcome(argv)
        assert got == WORK_STARTED, (argv, got, text)


# How a command line ended (cli_cases' outcomes) for a value the flag must refuse.
_OF_A_BAD_VALUE = {
    REFUSED: fuzz_counts.REFUSED,
    WORK_STARTED: fuzz_counts.ACCEPTED_INVALID,
    TRACEBACK: fuzz_counts.TRACEBACK,
    UNCLEAR: fuzz_counts.BAD_REFUSAL,  # not one error line, or another exit status
}


def _bad_value_outcome(got: str, text: str, named: bool, wrote: bool) -> Outcome:
    """A bad value's command line that ended in ``got`` (``text``: its stderr or the
    exception): the refusal must name the flag (``named``) and write nothing."""
    kind = _OF_A_BAD_VALUE[got]
    if kind == fuzz_counts.REFUSED and (wrote or not named):
        return Outcome(fuzz_counts.BAD_REFUSAL, "wrote files" if wrote else "unnamed", text)
    return Outcome(kind, problem=text if kind != fuzz_counts.REFUSED else "")


def test_every_bad_value_of_every_flag_is_refused_up_front(fuzz_env):
    before = _listing(fuzz_env)
    refused = 0
    findings = []
    for command, parser in _parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            flag = action.option_strings[-1]
            # "--": argparse drops it and hands the flag [] without calling its type
            for value in [*_bad_values(command, action), "--"]:
                argv = _command_line(command, flag, value, _partners(parser, action), fuzz_env)
                got, text = outcome(argv)
                given = argv[-1].partition("=")[2]
                # The message names the flag, or the value it was given (plug-ins, files)
                named = flag in text or flag.lstrip("-") in text or repr(given) in text
                named = named or (given != "" and given in text)
                result = _bad_value_outcome(got, text, named, _listing(fuzz_env) != before)
                COUNTS.add(result, **{"class": "bad value", "command": command, "flag": flag})
                refused += got == REFUSED
                if result.failed:
                    findings.append((argv, got, text[:300]))
    assert refused > 500
    assert not findings, "\n".join(map(str, findings[:20]))


def _integer_flags() -> list[tuple[str, str, object]]:
    return [
        (command, a.option_strings[-1], a.type)
        for command, parser in _parsers().items()
        for a in parser._actions
        if a.option_strings and hasattr(a.type, "high") and not _partners(parser, a) - {"--calib"}
    ]


def _valid_integer(text: str, low: int, high: int) -> bool:
    """The specification, written again: optional sign, 1 to 40 ASCII digits, in range."""
    return bool(re.fullmatch(r"[+-]?[0-9]{1,40}", text)) and low <= int(text) <= high


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    case=st.sampled_from(_integer_flags()),
    text=st.one_of(
        st.integers(min_value=-(10**45), max_value=10**45).map(str),
        st.integers(min_value=-3, max_value=5000).map(str),
        st.text(alphabet="0123456789+-eE._ x١", max_size=12),
    ),
)
def test_an_integer_flag_takes_exactly_the_integers_in_its_range(fuzz_env, case, text):
    command, flag, kind = case
    argv = _command_line(command, flag, text, set(), fuzz_env)
    got, message = outcome(argv)
    result = _integer_outcome(got, message, flag, _valid_integer(text, kind.low, kind.high))
    COUNTS.add(result, **{"class": "integer", "command": command, "flag": flag})
    assert not result.failed, (argv, got, result.problem)


def _integer_outcome(got: str, message: str, flag: str, valid: bool) -> Outcome:
    """An integer flag's command line that ended in ``got``: a valid integer passes the
    parser (refused later, if at all, for another reason), any other text is refused by
    the parser's own check."""
    if got in (TRACEBACK, UNCLEAR):
        return Outcome(_OF_A_BAD_VALUE[got], problem=message)
    type_error = f"argument {flag}: expected" in message  # the parser's own refusal
    if valid:
        if type_error:
            return Outcome(fuzz_counts.BAD_REFUSAL, "a valid integer", message)
        later = "refused later for another reason" if got == REFUSED else ""
        return Outcome(fuzz_counts.CORRECT, later)
    if got == WORK_STARTED:
        return Outcome(fuzz_counts.ACCEPTED_INVALID, problem=message)
    if not type_error:
        return Outcome(fuzz_counts.BAD_REFUSAL, "not by the parser's check", message)
    return Outcome(fuzz_counts.REFUSED)
