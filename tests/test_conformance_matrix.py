"""The mismatch matrix and the HTML report: pair metrics against hand-computed and
float64 values, a planted bug shows in the pairs with the buggy backend only, a backend
that crashes on the model is reported and left out, the files (JSON schema, heatmap,
one self-contained HTML page that escapes what backends say) and the command line."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch

import glmport
from glmport import Availability, Backend, BackendManifest
from glmport.cli import main
from glmport.conformance.html import write_html, write_reports
from glmport.conformance.matrix import mismatch_matrix, write_matrix
from glmport.conformance.model_case import model_inputs, pair_metrics, tiny_model
from glmport.conformance.report import build_report
from glmport.conformance.runner import Record
from glmport.core.errors import ConfigError, GlmportError
from glmport.core.registry import REGISTRY

LOGIT_BIAS = 1.5  # added to token 0's logit by the ``logitbias`` backend
NORM_SCALE = 1.5  # the ``badnorm`` backend's rms_norm forgets to divide by this


def _ref(op):
    return REGISTRY.kernels(REGISTRY.reference(), False)[op]


class _Code(Backend):
    """A cpu backend registered in code with the kernel table ``table``."""

    def __init__(self, name, table, available=True):
        self.manifest = BackendManifest(
            name=name, device_type="cpu", description="test double", ops=tuple(table)
        )
        self.table, self.available = table, available

    def probe(self, emulate):
        return Availability(True) if self.available else Availability(False, "no such chip here")

    def load_kernels(self, emulate):
        return self.table


def _biased_logprobs(hidden, lm_head, targets, temperature=1.0):
    logits = hidden.float() @ lm_head.float().T / temperature
    logits[:, 0] += LOGIT_BIAS
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets.long()[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(dim=-1)


def _bad_norm(x, weight, eps=1e-6):
    return _ref("rms_norm")(x, weight, eps) * NORM_SCALE


def _crash(x, weight, eps=1e-6):
    raise RuntimeError("kernel <script>alert(1)</script> crashed")


@pytest.fixture
def code_backends():
    """``logitbias`` (token_logprobs adds LOGIT_BIAS to token 0's logit), ``badnorm``
    (rms_norm off by NORM_SCALE), ``refclone`` (every op the reference's kernel, under
    another name), ``crashy`` (rms_norm raises), ``nochip`` (not available here) and
    ``mine`` (the backend of the synthetic suite reports)."""
    ref = REGISTRY.kernels(REGISTRY.reference(), False)
    backends = [
        _Code("logitbias", {"token_logprobs": _biased_logprobs}),
        _Code("badnorm", {"rms_norm": _bad_norm}),
        _Code("refclone", {op: k for op, k in ref.items() if ":" not in op}),
        _Code("crashy", {"rms_norm": _crash}),
        _Code("nochip", {"rms_norm": _bad_norm}, available=False),
        _Code("mine", {"rms_norm": ref["rms_norm"], "rope": ref["rope"]}),  # suite reports
    ]
    for b in backends:
        glmport.register_backend(b)
    yield
    for b in backends:
        glmport.unregister_backend(b.manifest.name)


def _pair(result, a, b, dtype="float32"):
    (found,) = [p for p in result["pairs"] if p["dtype"] == dtype and {p["a"], p["b"]} == {a, b}]
    return found


def _positions(ids, mask):
    valid = mask.bool()
    keep = valid[:, 1:] & valid[:, :-1]
    return keep, ids[:, 1:][keep]


def test_pair_metrics_by_hand():
    got = pair_metrics(
        torch.zeros(4),
        torch.tensor([0.1, -1.0, 0.5, 0.0]),
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([1, 2, 3, 5]),
    )
    assert got["mean_abs_dlogp"] == pytest.approx(0.4)
    assert got["max_abs_dlogp"] == pytest.approx(1.0)
    assert got["icepop_pop_fraction"] == 0.25  # only exp(-1) lies outside [1/2, 2]
    assert got["greedy_agreement"] == 0.75


@pytest.fixture(scope="module")
def float64_cpu():
    """Per real next-token position of the fixed prompts, in float64 from the fp32
    model's final hidden states on the reference: the logits ``[n, V]``, the
    targets ``[n]``, and the model's own greedy tokens ``[n]``."""
    model = tiny_model(torch.float32, "none", "none")
    ids, mask = model_inputs()
    keep, targets = _positions(ids, mask)
    with glmport.use_backend("cpu"), torch.no_grad():
        out = model(ids, mask)
        hidden = model.model.norm(out.hidden_states[:, :-1][keep])
        logits = hidden.double() @ model.lm_head.weight.double().T
    return logits, targets, out.logits[:, :-1][keep].argmax(-1)


def test_the_matrix_against_float64_and_a_planted_bug(code_backends, float64_cpu):
    result = mismatch_matrix(["generic", "logitbias", "badnorm", "refclone"], [torch.float32])
    names = ["cpu", "generic", "logitbias", "badnorm", "refclone"]
    assert [b["name"] for b in result["backends"]] == names  # the reference first
    assert len(result["pairs"]) == 10  # every unordered pair once
    logits, targets, greedy = float64_cpu
    assert result["tokens"] == len(targets) == 66

    # The same kernels under another name: no mismatch at all.
    assert _pair(result, "cpu", "refclone") == {
        "a": "cpu",
        "b": "refclone",
        "dtype": "float32",
        "mean_abs_dlogp": 0.0,
        "max_abs_dlogp": 0.0,
        "icepop_pop_fraction": 0.0,
        "greedy_agreement": 1.0,
    }
    # A logit bias on token 0 moves every log-prob by what float64 math says.
    biased = logits.clone()
    biased[:, 0] += LOGIT_BIAS
    delta = (torch.log_softmax(biased, -1) - torch.log_softmax(logits, -1)).gather(
        1, targets[:, None]
    )[:, 0]
    for other in ("cpu", "generic", "refclone"):
        p = _pair(result, other, "logitbias")
        assert p["mean_abs_dlogp"] == pytest.approx(float(delta.abs().mean()), rel=1e-4)
        assert p["max_abs_dlogp"] == pytest.approx(float(delta.abs().max()), rel=1e-4)
        popped = float((delta.abs() > math.log(2)).double().mean())
        assert p["icepop_pop_fraction"] == pytest.approx(popped)
        assert p["greedy_agreement"] == 1.0  # token_logprobs does not make the logits

    # The broken rms_norm: a large mismatch in its pairs only.
    with glmport.use_backend("badnorm"), torch.no_grad():
        ids, mask = model_inputs()
        keep, _ = _positions(ids, mask)
        bad_greedy = tiny_model(torch.float32, "none", "none")(ids, mask).logits[:, :-1][keep]
    agreement = float((bad_greedy.argmax(-1) == greedy).double().mean())
    assert agreement < 1.0
    for p in result["pairs"]:
        assert 0.0 <= p["greedy_agreement"] <= 1.0
        if "badnorm" in (p["a"], p["b"]):
            assert p["mean_abs_dlogp"] > 0.05 and p["icepop_pop_fraction"] > 0
            if "logitbias" not in (p["a"], p["b"]):
                assert p["greedy_agreement"] == agreement
        elif "logitbias" not in (p["a"], p["b"]):
            assert p["mean_abs_dlogp"] < 1e-5 and p["greedy_agreement"] == 1.0


def test_backend_selection_and_bad_names(code_backends):
    with pytest.raises(GlmportError, match=r"unknown glmport backend 'nope' .*valid backends"):
        mismatch_matrix(["cpu", "nope"])
    with pytest.raises(ConfigError, match="backend 'nochip' cannot run here: no such chip here"):
        mismatch_matrix(["nochip"])
    from glmport.conformance.matrix import select_backends

    chosen, unavailable = select_backends(None)
    assert chosen[0] == ("cpu", False) and ("generic", False) in chosen
    assert {"name": "nochip", "reason": "no such chip here"} in unavailable
    for name, emulated in chosen:  # emulated only where it runs no other way
        assert emulated == (not REGISTRY.availability(name, False).ok)
        assert REGISTRY.availability(name, emulated).ok


def test_a_backend_that_crashes_is_reported_and_left_out(code_backends, tmp_path):
    lines = []
    result = mismatch_matrix(["crashy", "generic"], [torch.float32], progress=lines.append)
    (crashy,) = [b for b in result["backends"] if b["name"] == "crashy"]
    assert crashy["runs"]["float32"]["error"].startswith("RuntimeError: kernel <script>")
    assert [(p["a"], p["b"]) for p in result["pairs"]] == [("cpu", "generic")]
    assert len(lines) == 3 and "matrix: crashy float32: error: RuntimeError" in lines[1]
    write_matrix(result, tmp_path)
    md = (tmp_path / "matrix.md").read_text()
    # cpu vs generic is a measured mismatch (a float, which depends on the threads'
    # reduction order, and printed with 2 significant digits: 9e-07, 8.5e-07); the
    # crashy row and column say "error".
    assert re.search(r"\| \*\*cpu\*\* \| 0 \| error \| \d(\.\d)?e-0\d / 100% \|", md), md
    assert "| **crashy** | error | error | error |" in md
    assert "left out of that dtype's pairs" in md
    page = write_html(tmp_path).read_text()
    assert "<script" not in page and "kernel &lt;script&gt;alert(1)&lt;/script&gt;" in page


def _records():
    """Synthetic suite records: one per outcome, own and on a fallback."""

    def rec(i, op, dtype, outcome, ran_on, reason=""):
        return Record(
            id=f"{op}-{i}", op=op, kind="value", family="tiny", dtype=dtype, scheme=None,
            params={"t": 5}, outcome=outcome, reason=reason, metrics={"max_rel": 0.5},
            tolerance={"max_rel": 1.0}, ran_on=ran_on, own=ran_on == "mine",
        ).to_dict()  # fmt: skip

    return [
        rec(1, "rms_norm", "float32", "pass", "mine"),
        rec(2, "rms_norm", "bfloat16", "fail", "mine", "max_rel <script>x</script> too big"),
        rec(3, "rope", "float32", "error", "mine", "RuntimeError: boom"),
        rec(4, "rope", "bfloat16", "unsupported", "mine", "no bf16"),
        rec(5, "moe_gate", "float32", "skipped", "generic", "no hardware"),
    ]


def test_the_html_page_is_self_contained_coloured_and_escaped(code_backends, tmp_path):
    with pytest.raises(ConfigError, match=r"no conformance\.json and no matrix\.json"):
        write_html(tmp_path)
    (tmp_path / "matrix.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read .*matrix\.json"):
        write_html(tmp_path)
    result = mismatch_matrix(["generic"], [torch.float32])
    paths = write_matrix(result, tmp_path)
    assert [p.name for p in paths] == ["matrix.json", "matrix.md", "matrix.png"]
    assert (tmp_path / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = build_report(_records(), backend="mine", full=False, emulate=False, ops=None)
    written = write_reports(report, tmp_path)
    assert [p.name for p in written] == ["conformance.json", "conformance.md", "conformance.html"]
    page = written[2].read_text()
    assert "http:" not in page and "https:" not in page and 'src="http' not in page
    assert page.count('src="data:image/png;base64,') == 1
    assert "<link" not in page and "<script" not in page
    assert "max_rel &lt;script&gt;x&lt;/script&gt; too big" in page
    assert "DOES NOT CONFORM" in page
    suite = page.split("<h3>Mustpass")[0]  # the suite's tables, before its scorecard
    for op in ("rms_norm", "rope", "moe_gate"):
        assert re.search(rf'<th rowspan="\d+">{op}</th>', suite)
    for outcome in ("pass", "fail", "error", "unsupported", "skipped"):
        assert f'<td class="{outcome}">{outcome}</td><td>1 {outcome}</td>' in suite
    own, fallback = suite.split("<h3>On fallbacks")[:2]
    assert ">moe_gate</th>" in fallback and ">moe_gate</th>" not in own
    assert "<h2>Mismatch matrix</h2>" in page and "<th>generic</th>" in page


def test_without_matplotlib_there_is_no_heatmap_and_the_reports_say_why(tmp_path, monkeypatch):
    result = mismatch_matrix(["generic"], [torch.float32])
    (tmp_path / "matrix.png").write_bytes(b"stale")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    paths = write_matrix(result, tmp_path)
    assert [p.name for p in paths] == ["matrix.json", "matrix.md"]
    assert not (tmp_path / "matrix.png").exists()
    data = json.loads((tmp_path / "matrix.json").read_text())
    assert data["heatmap"] == {"file": None, "why": result["heatmap"]["why"]}
    assert "No heatmap: matplotlib is not installed" in (tmp_path / "matrix.md").read_text()
    page = write_html(tmp_path).read_text()
    assert "No heatmap: matplotlib is not installed" in page and "data:image" not in page


def test_a_report_folder_from_another_version_is_one_clear_error(tmp_path):
    (tmp_path / "matrix.json").write_text(json.dumps({"schema_version": 0, "pairs": []}))
    with pytest.raises(ConfigError, match=r"matrix.json has schema_version 0; this glmport"):
        write_html(tmp_path)
    (tmp_path / "matrix.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"schema_version None"):
        write_html(tmp_path)
    (tmp_path / "matrix.json").unlink()
    with pytest.raises(ConfigError, match=r"no conformance.json and no matrix.json"):
        write_html(tmp_path)


def test_the_json_schema(tmp_path):
    result = mismatch_matrix(["generic"], [torch.float32, torch.bfloat16])
    write_matrix(result, tmp_path)
    data = json.loads((tmp_path / "matrix.json").read_text())
    assert set(data) == {
        "schema_version", "environment", "dtypes", "icepop_beta", "tokens", "backends",
        "unavailable", "pairs", "heatmap",
    }  # fmt: skip
    assert data["schema_version"] == 1 and data["dtypes"] == ["float32", "bfloat16"]
    assert data["environment"]["torch"] == torch.__version__ and data["icepop_beta"] == 2.0
    for b in data["backends"]:
        assert set(b) == {"name", "emulated", "device", "seconds", "runs"}
        assert set(b["runs"]) == {"float32", "bfloat16"}
        assert all(
            set(r) == {"seconds", "error"} and r["error"] is None for r in b["runs"].values()
        )
        assert b["seconds"] == pytest.approx(sum(r["seconds"] for r in b["runs"].values()))
    assert [(p["a"], p["b"], p["dtype"]) for p in data["pairs"]] == [
        ("cpu", "generic", "float32"),
        ("cpu", "generic", "bfloat16"),
    ]
    for p in data["pairs"]:
        assert set(p) == {
            "a", "b", "dtype", "mean_abs_dlogp", "max_abs_dlogp", "icepop_pop_fraction",
            "greedy_agreement",
        }  # fmt: skip


def test_the_command_line(code_backends, tmp_path, capsys):
    report = build_report(_records(), backend="mine", full=False, emulate=False, ops=None)
    write_reports(report, tmp_path)  # a suite's report already there: the page keeps it
    argv = ["conformance", "--matrix", "--backends", "cpu,generic", "--dtypes", "fp32"]
    assert main([*argv, "--report-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "| **generic** | " in out and "## Pairs" in out
    assert re.findall(r"^matrix: \w+ float32: [\d.]+ s$", err, re.M) == err.splitlines()
    assert len(err.splitlines()) == 2
    for name in ("matrix.json", "matrix.md", "matrix.png", "conformance.html"):
        assert (tmp_path / name).exists(), name
    page = (tmp_path / "conformance.html").read_text()
    assert "Conformance suite: <code>mine</code>" in page and "<h2>Mismatch matrix</h2>" in page

    for bad, says in (
        (
            ["--backends", "cpu,nope", "--matrix"],
            "unknown glmport backend 'nope' (from --backends)",
        ),
        (["--backends", "cpu,generic"], "--backends goes with --matrix"),
        (["--matrix", "--dtypes", "fp32,int8"], "--dtypes takes comma-separated dtypes"),
        (["--matrix", "--backend", "cpu"], "--backend: not with --matrix"),
    ):
        assert main(["conformance", *bad, "--report-dir", str(tmp_path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("glmport: error: ") and says in err
