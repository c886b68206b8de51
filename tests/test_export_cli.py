"""``glmport export``'s options are checked before any work: ``--tolerance`` finite and
>= 0 (NaN passed every comparison), the fixed sizes of ``--from onnx`` whole numbers in
their range, ``--out`` a path the target can write; each refusal is one ``glmport:
error:`` line naming the option, exit 2, nothing written. A hypothesis property draws
the numeric options' texts and compares the parser's verdict with the rule."""

from __future__ import annotations

import contextlib
import io
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import glmport.cli
import glmport.commands.common
from glmport.model import GlmMoeDsaConfig

MAX_POSITIONS = GlmMoeDsaConfig.tiny().max_position_embeddings


def _one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("glmport: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _parse(argv: list[str]) -> tuple[int | None, str]:
    """The exit status of parsing ``argv`` (None: it parsed) and what it printed on
    stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            glmport.cli.build_parser().parse_args(argv)
        except SystemExit as stop:
            return stop.code, err.getvalue()
    return None, err.getvalue()


def _tolerance_ok(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value >= 0


TOLERANCE_TEXTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "1e400", "-0.0", "-1e-300", "", "x"]),
    st.text(max_size=6),
)


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(text=TOLERANCE_TEXTS)
def test_tolerance_is_a_finite_number_at_least_zero(text):
    status, err = _parse(
        ["export", "onnx", "--model", "tiny", "--out", "x.onnx", "--tolerance", text]
    )
    if _tolerance_ok(text):
        assert status is None
    else:
        assert status == 2
        _one_error_line(err, "--tolerance")


SIZE_TEXTS = st.one_of(
    st.integers(-5, 2000).map(str),
    st.sampled_from(["1e3", "1.0", "0x10", "+3", " 4", "", "٣", "10000000000000"]),
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(axis=st.sampled_from(["batch", "seq", "past"]), text=SIZE_TEXTS)
def test_fixed_sizes_are_whole_numbers_in_their_range(axis, text):
    argv = ["export", "tvm", "--model", "tiny", "--out", "t", "--from", "onnx", f"--{axis}={text}"]
    # ASCII integers (a sign allowed) from 1 to a bound: 1024 sequences, 2**24 tokens
    # (the model's own context is checked once it is loaded).
    high = 1024 if axis == "batch" else glmport.commands.common.MAX_TOKENS
    ok = bool(re.fullmatch(r"[+-]?[0-9]{1,40}", text)) and 1 <= int(text) <= high
    status, err = _parse(argv)
    if ok:
        assert status is None
    else:
        assert status == 2
        _one_error_line(err, f"--{axis}")


def _export(*argv: str) -> int:
    """``glmport export ...``'s exit status (argparse's errors exit through SystemExit)."""
    try:
        return glmport.cli.main(["export", *argv])
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("tolerance", ["nan", "-1e-9", "inf"])
def test_a_bad_tolerance_is_refused_before_the_export(tmp_path, capsys, tolerance):
    out = tmp_path / "m.onnx"
    assert _export("onnx", "--model", "tiny", "--out", str(out), f"--tolerance={tolerance}") == 2
    _one_error_line(capsys.readouterr().err, "--tolerance", repr(tolerance))
    assert not out.exists()


def test_out_is_checked_before_the_work(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [
        ("onnx", tmp_path, "is a folder; expected a file to write"),
        ("tvm", a_file, "exists and is not a folder"),
        ("onnx", a_file / "m.onnx", "is a file, so nothing can be made under it"),
        ("tvm", a_file / "t", "is a file, so nothing can be made under it"),
        ("onnx", "", "must name a path"),
    ]
    for target, out, needle in cases:
        assert _export(target, "--model", "tiny", "--out", str(out)) == 2, (target, out)
        _one_error_line(capsys.readouterr().err, "--out", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_fixed_positions_beyond_the_model_are_refused_before_the_work(tmp_path, capsys):
    base = [
        "tvm",
        "--model",
        "tiny",
        "--out",
        str(tmp_path / "t"),
        "--from",
        "onnx",
        "--batch",
        "1",
    ]
    assert _export(*base, "--seq", str(MAX_POSITIONS + 1)) == 2
    _one_error_line(
        capsys.readouterr().err, f"--seq: {MAX_POSITIONS + 1} tokens", "max_position_embeddings"
    )
    assert _export(*base, "--decode", "--past", str(MAX_POSITIONS)) == 2
    _one_error_line(
        capsys.readouterr().err, f"--past {MAX_POSITIONS} (+ the new token)", "max_position"
    )
    assert not (tmp_path / "t").exists()
