"""``glmport diff``: a bug planted in one op of a registered backend is named, with the
first decoder layer where it bites, its replay file and the float64 verdicts; agreeing
backends report no divergence; ``--follow`` replays the first backend's choices;
``row_overlap`` / ``fingerprint`` on hand-made inputs; the CLI's exits and errors.

Every planted bug is a function of the kernel's inputs only (diff reruns the second
backend's op on the first's inputs after both forwards). The expected layers come from
the model's structure and from this file's own hooks on a plain cpu forward, not from
the diff under test.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import glmport
from glmport.cli import main
from glmport.conformance.diff import diff_backends, format_report, row_overlap
from glmport.conformance.paging import in_packed_form
from glmport.conformance.replay import REPLAY_FORMAT, fingerprint, replay_call
from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.attention import Attention, Indexer
from glmport.model.blocks import Experts, MoE, RMSNorm, Router

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 24  # > index_topk (4): the indexer runs in every layer


def _ref(op: str) -> Callable:
    return REGISTRY.kernels("cpu", False)[op]


# Each planted bug: op -> (the module class that calls the op, a kernel wrapping the
# reference one). Realistic slips, all stateless and far outside fp32 tolerances.
def _wrong_weight_scale(x, w, eps):  # rms_norm: a 1% error in the applied weight
    return _ref("rms_norm")(x, w * 1.01, eps)


def _rotates_backwards(x, cos, sin, interleaved):  # rope: the sign of the sine
    return _ref("rope")(x, cos, -sin, interleaved)


def _double_scale(q, k, v, indices, scale, need_lse=True, k_rope=None):
    # the softmax scale applied twice
    return _ref("sparse_attention")(q, k, v, indices, 2 * scale, need_lse, k_rope)


@in_packed_form  # a paged call: its packed equivalent
def _lowest_keys(q, k, weights, k_start, k_end, topk, q_scale, k_scale, *_):
    # lightning_indexer: negated head weights negate the scores: the lowest-scoring keys
    return _ref("lightning_indexer")(q, k, -weights, k_start, k_end, topk, q_scale, k_scale)


def _least_affine_experts(logits, bias, *rest):  # moe_gate: the logits' sign lost
    return _ref("moe_gate")(-logits, bias, *rest)


def _experts_reversed(x, w, offsets, w_scale, scheme, group_size):
    # grouped_gemm: group g multiplied by expert E-1-g's weight
    return _ref("grouped_gemm")(x, w.flip(0), offsets, w_scale, scheme, group_size)


def _weights_swapped(y_sorted, src_row, weights):  # moe_combine: top-2 weights swapped
    return _ref("moe_combine")(y_sorted, src_row, weights.flip(-1))


PLANTED = {
    "rms_norm": (RMSNorm, _wrong_weight_scale),
    "rope": (Attention, _rotates_backwards),
    "sparse_attention": (Attention, _double_scale),
    "lightning_indexer": (Indexer, _lowest_keys),
    "moe_gate": (Router, _least_affine_experts),
    "grouped_gemm": (Experts, _experts_reversed),
    "moe_combine": (MoE, _weights_swapped),
}


class _Planted(Backend):
    """A cpu backend implementing one op with ``kernel``; every other op falls back to
    the cpu reference: the same kernels as the first backend's."""

    def __init__(self, name: str, op: str, kernel: Callable) -> None:
        self.manifest = BackendManifest(
            name=name,
            device_type="cpu",
            description=f"test double: a bug in {op}",
            ops=(op,),
            fallback=("cpu",),
        )
        self.kernel = kernel

    def probe(self, emulate: bool) -> Availability:
        return Availability(True)

    def load_kernels(self, emulate: bool) -> dict:
        return {self.manifest.ops[0]: self.kernel}


@pytest.fixture
def planted() -> Iterator[Callable[[str, Callable], str]]:
    """``planted(op, kernel)`` registers a one-op backend and returns its name."""
    names = []

    def register(op: str, kernel: Callable) -> str:
        name = f"bug{len(names)}"
        glmport.register_backend(_Planted(name, op, kernel))
        names.append(name)
        return name

    yield register
    for name in names:
        glmport.unregister_backend(name)


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsaForCausalLM.from_config("tiny", seed=0).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0))


def _first_layer_calling(model, cls: type) -> int:
    """The first decoder layer holding a module of type ``cls`` (whatever calls the op)."""
    return next(
        i
        for i, layer in enumerate(model.model.layers)
        if any(isinstance(m, cls) for m in layer.modules())
    )


def _module_inputs(model, ids: torch.Tensor, cls: type) -> dict[str, torch.Tensor]:
    """The first input of every module of type ``cls`` on a plain cpu forward, by
    module path."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, a[0].detach().clone()))
        for n, m in model.named_modules()
        if isinstance(m, cls)
    ]
    try:
        with glmport.use_backend("cpu"), torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _check_replay(report, bug: str, op: str) -> dict:
    """The replay file loads with weights_only, holds the diverging call, and judging it
    again against float64 fails the planted backend and passes cpu, as the report's
    verdicts say."""
    first = report.first_divergence
    path = Path(report.replay_file)
    assert path.is_file()
    data = torch.load(path, weights_only=True)
    assert data["format"] == REPLAY_FORMAT and data["op"] == op
    assert tuple(data["backends"]) == report.backends and data["layer"] == first.layer
    assert fingerprint(op, tuple(data["args"])) == first.fingerprint == data["fingerprint"]
    _, records, pair = replay_call(path)
    expected = [(name, "fail" if name == bug else "pass") for name in report.backends]
    assert [(r.ran_on, r.outcome) for r in records] == expected
    assert pair is not None and not pair.ok
    assert [(v["backend"], v["outcome"]) for v in report.verdicts] == expected
    return data


# -- planted one-op bugs -------------------------------------------------------------------


@pytest.mark.parametrize("bug_first", [False, True], ids=["cpu,bug", "bug,cpu"])
@pytest.mark.parametrize("op", list(PLANTED))
def test_a_planted_bug_is_named_with_the_first_layer_it_bites(
    model, ids, planted, op, bug_first, tmp_path
):
    cls, kernel = PLANTED[op]
    expected = _first_layer_calling(model, cls)
    if cls in (Router, Experts, MoE):
        assert expected == model.config.first_k_dense_replace >= 1
    else:
        assert expected == 0
    bug = planted(op, kernel)
    pair = (bug, "cpu") if bug_first else ("cpu", bug)
    report = diff_backends(model, ids, backends=pair, replay_dir=tmp_path)
    first = report.first_divergence
    assert first is not None and (first.op, first.layer) == (op, expected)
    assert first.ran_on == pair[1]
    # The other ops run on the cpu reference in both: the same kernels agree on the same
    # inputs, so every diverging call is one of the planted op.
    failing = [c for c in report.calls if not c.ok]
    assert {c.op for c in failing} == {op}
    assert min(c.layer for c in failing if c.layer is not None) == expected
    # Until the bug, the second backend's own run repeats the first's kernels exactly.
    own = report.first_own_divergence
    assert own is not None and (own.op, own.layer) == (op, expected)
    assert all(c.own_max_rel == 0 for c in report.calls[: own.index])
    text = format_report(report)
    assert "FIRST DIVERGENCE" in text and op in text and first.fingerprint in text
    _check_replay(report, bug, op)


# The module whose input is the op's ``x``: RMSNorm's for rms_norm; Experts' is the
# first grouped GEMM's (gate_up), so that bug also requires the hidden width.
@pytest.mark.parametrize("op, cls", [("rms_norm", RMSNorm), ("grouped_gemm", Experts)])
def test_a_bug_that_bites_only_on_large_inputs_is_named_at_the_later_layer(
    model, ids, planted, op, cls, tmp_path
):
    inputs = _module_inputs(model, ids, cls)
    peak = {}  # per decoder layer: the largest |x| the op sees there
    for i, layer in enumerate(model.model.layers):
        names = [f"model.layers.{i}.{n}" for n, m in layer.named_modules() if isinstance(m, cls)]
        ran = [inputs[n] for n in names if n in inputs]
        if ran:
            peak[i] = max(float(x.abs().max()) for x in ran)
    # The first layer whose peak exceeds every earlier one; the threshold between.
    first = _first_layer_calling(model, cls)
    assert min(peak) == first
    target = next(
        i for i in sorted(peak) if i > first and peak[i] > max(peak[j] for j in peak if j < i)
    )
    threshold = (peak[target] + max(peak[j] for j in peak if j < target)) / 2
    width = model.config.hidden_size if op == "grouped_gemm" else None

    def wrong_on_large(x, *rest):
        out = _ref(op)(x, *rest)
        large = float(x.abs().max()) > threshold and width in (None, x.shape[-1])
        return out * 1.01 if large else out

    bug = planted(op, wrong_on_large)
    report = diff_backends(model, ids, backends=("cpu", bug), replay_dir=tmp_path)
    found = report.first_divergence
    assert found is not None and (found.op, found.layer) == (op, target)
    # Exactly the calls whose input exceeds the threshold diverge.
    big = {n for n, x in inputs.items() if float(x.abs().max()) > threshold}
    assert {c.scope for c in report.calls if not c.ok} == big
    data = _check_replay(report, bug, op)
    assert torch.equal(data["args"][0], inputs[data["scope"]])


# -- agreeing backends ---------------------------------------------------------------------

# Bounds on the mean |delta logp| of two correct backends: fp32, ~100 units in the last
# place (2**-23 ~ 1.2e-7) of an O(1) log-probability, for the handful of roundings that
# may differ in each of 3 layers; bf16, one bf16 rounding step of an O(1) value (2**-8):
# the backends accumulate in fp32 and round to bf16 at the same places.
LOGP_BOUND = {torch.float32: 1e-5, torch.bfloat16: 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_generic_agree(model, ids, dtype, tmp_path):
    m = model if dtype == torch.float32 else GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    report = diff_backends(
        m.eval().to(dtype), ids, backends=("cpu", "generic"), replay_dir=tmp_path
    )
    assert report.first_divergence is None and report.replay_file is None
    assert report.verdicts == [] and not list(tmp_path.iterdir())
    assert report.dtype == str(dtype).removeprefix("torch.")
    assert report.tokens == TOKENS - 1
    assert all(c.ok for c in report.calls)
    assert report.logits["mean_abs_dlogp"] < LOGP_BOUND[dtype]
    assert report.logits["icepop_pop_fraction"] == 0
    if dtype == torch.float32:
        assert report.logits["greedy_agreement"] == 1.0
    # Every decoder layer and its output is reported, with the same choices.
    layers = [r for r in report.layers if r["layer"].isdigit()]
    assert [int(r["layer"]) for r in layers] == list(range(model.config.num_hidden_layers))
    for row in layers:
        assert row["topk_overlap"] == 1.0
        assert ("expert_agreement" in row) == isinstance(
            model.model.layers[int(row["layer"])].mlp, MoE
        )
    assert "no divergence" in format_report(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_emulated_vendor_backend_agrees_with_cpu(model, ids, dtype):
    assert REGISTRY.availability("ascend", True).ok
    m = model if dtype == torch.float32 else GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    report = diff_backends(
        m.eval().to(dtype), ids[:, :16], backends=("cpu", "ascend"), emulate=(False, True)
    )
    assert report.emulate == (False, True)
    assert report.first_divergence is None
    assert report.logits["mean_abs_dlogp"] < LOGP_BOUND[dtype]
    if dtype == torch.float32:
        assert report.logits["greedy_agreement"] == 1.0
    # Its own kernels ran (in fp32 the MoE ops; the rest falls back), not only fallbacks.
    assert any(c.ran_on == "ascend" for c in report.calls)


# -- --follow ------------------------------------------------------------------------------


def test_follow_replays_the_choices_so_the_comparison_goes_on(model, ids, planted):
    bug = planted("lightning_indexer", _lowest_keys)
    alone = diff_backends(model, ids, backends=("cpu", bug))
    followed = diff_backends(model, ids, backends=("cpu", bug), follow=True)
    for report in (alone, followed):
        first = report.first_divergence
        assert first is not None and (first.op, first.layer) == ("lightning_indexer", 0)
        assert first.choice_agreement < 1
    rows = {r["layer"]: r for r in alone.layers if "output_max_rel" in r}
    # On its own, the lowest-scoring keys change every layer's output far beyond rounding.
    assert all(r["output_max_rel"] > 1e-2 for r in rows.values())
    assert all(r["topk_overlap"] < 1 for r in rows.values())
    # Replaying cpu's top-k, the buggy backend runs the same kernels on the same keys.
    rows = [r for r in followed.layers if "output_max_rel" in r]
    assert len(rows) == model.config.num_hidden_layers
    assert all(r["output_max_rel"] < 1e-5 for r in rows)
    assert followed.logits["greedy_agreement"] == 1.0
    assert alone.logits["mean_abs_dlogp"] > 100 * followed.logits["mean_abs_dlogp"]


def _json_diff(argv: list[str], capsys) -> tuple[int, dict]:
    code = main(["diff", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("followed", [0, 1])
def test_follow_on_the_command_line_names_the_backend_replayed(planted, followed, capsys, tmp_path):
    bug = planted("lightning_indexer", _lowest_keys)
    pair = ["cpu", bug]
    argv = ["--backends", ",".join(pair), "--follow", pair[followed], "--random", str(TOKENS)]
    code, out = _json_diff([*argv, "--out", str(tmp_path)], capsys)
    assert code == 1
    # The followed backend runs first; the other replays its choices.
    assert out["backends"] == [pair[followed], pair[1 - followed]] and out["follow"]
    assert out["first_divergence"]["op"] == "lightning_indexer"
    assert out["first_divergence"]["layer"] == 0
    rows = [r for r in out["layers"] if "output_max_rel" in r]
    assert rows and all(r["output_max_rel"] < 1e-5 for r in rows)
    assert Path(out["replay_file"]).parent == tmp_path


# -- row_overlap and fingerprint ------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([[0, 1, -1], [2, 3, 4]], [[1, 0, -1], [2, 9, 9]], (1 + 1 / 3) / 2),
        ([[-1, -1], [5, 6]], [[7, 8], [5, 7]], 0.5),  # a row of a without choices: skipped
        ([[0, -1]], [[-1, -1]], 0.0),  # -1 in b is no choice, not a match
        ([[-1, -1]], [[1, 2]], 1.0),  # nothing chosen anywhere
        ([[[3, 1]], [[2, 0]]], [[[1, 3]], [[0, 5]]], 0.75),  # leading dims flattened
    ],
)
def test_row_overlap(a, b, expected):
    got = row_overlap(torch.tensor(a, dtype=torch.int32), torch.tensor(b, dtype=torch.int32))
    assert got == pytest.approx(expected, abs=1e-6)  # a float32 mean


def test_fingerprint_follows_every_input():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(8, generator=gen)
    base = fingerprint("rms_norm", (x, w, 1e-6))
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint("rms_norm", (x.clone(), w.clone(), 1e-6)) == base
    changed = x.clone()
    changed[3, 7] = torch.nextafter(changed[3, 7], torch.tensor(10.0))  # one ulp, one element
    others = [
        fingerprint("rms_norm", (changed, w, 1e-6)),
        fingerprint("rms_norm", (x, w, 1e-5)),
        # The same bytes as another shape or dtype.
        fingerprint("rms_norm", (x.reshape(2, 16), w, 1e-6)),
        fingerprint("rms_norm", (x.view(torch.int32), w, 1e-6)),
    ]
    assert len({base, *others}) == 1 + len(others)


# -- the command line -------------------------------------------------------------------------


def test_cli_agreeing_backends_exit_0(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["diff", "--backends", "cpu,generic", "--random", "16"]) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out and "cpu vs generic" in out
    assert not list(tmp_path.iterdir())  # nothing to replay, nothing written


@pytest.mark.parametrize("dtype, name", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_cli_json(dtype, name, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out = _json_diff(
        ["--backends", "cpu,generic", "--dtype", dtype, "--input-ids", "5,17,3,99,0,127,64,8"],
        capsys,
    )
    assert code == 0
    assert set(out) >= {
        "backends",
        "dtype",
        "follow",
        "tokens",
        "calls",
        "layers",
        "logits",
        "first_divergence",
        "first_own_divergence",
        "replay_file",
        "verdicts",
    }
    assert out["backends"] == ["cpu", "generic"] and out["dtype"] == name
    assert out["tokens"] == 7 and out["first_divergence"] is None and not out["follow"]
    assert out["logits"]["mean_abs_dlogp"] < LOGP_BOUND[getattr(torch, name)]
    assert {"greedy_agreement", "icepop_pop_fraction", "max_abs_dlogp"} <= set(out["logits"])


def test_cli_names_a_planted_bug_and_replays_it(planted, capsys, tmp_path):
    bug = planted("moe_combine", _weights_swapped)
    code = main(["diff", "--backends", f"cpu,{bug}", "--random", "12", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "FIRST DIVERGENCE" in out and "moe_combine" in out and "layer 1" in out
    (replay,) = tmp_path.iterdir()
    assert replay.name.startswith("call-moe_combine-") and str(replay) in out
    assert main(["diff", "--replay", str(replay)]) == 1
    out = capsys.readouterr().out
    assert f"{bug} (ran on {bug}) against the float64 reference: FAIL" in out
    assert "cpu (ran on cpu) against the float64 reference: PASS" in out
    # Two correct backends pass the same call.
    assert main(["diff", "--replay", str(replay), "--backends", "cpu,generic"]) == 0
    out = capsys.readouterr().out
    assert "generic (ran on generic) against the float64 reference: PASS" in out
    assert "generic against cpu on these inputs: agree" in out
    # One backend alone: judged against float64 only.
    assert main(["diff", "--replay", str(replay), "--backends", bug]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "on these inputs" not in out
    code, out = _json_diff(["--replay", str(replay)], capsys)
    assert code == 1 and out["call"]["op"] == "moe_combine" and not out["pair"]["ok"]
    assert [v["outcome"] for v in out["verdicts"]] == ["pass", "fail"]


# A backend for ``--plugin test_diff:PLUGGED`` (this module, imported by pytest from
# tests/, is importable under that name).
PLUGGED = _Planted("plugged_gate", "moe_gate", _least_affine_experts)


def test_cli_plugin_registers_a_planted_bug(capsys, tmp_path):
    argv = ["--backends", "cpu,plugged_gate", "--random", "12", "--out", str(tmp_path)]
    try:
        code = main(["diff", "--plugin", f"{__name__}:PLUGGED", *argv])
    finally:
        if "plugged_gate" in REGISTRY.names():
            glmport.unregister_backend("plugged_gate")
    out = capsys.readouterr().out
    assert code == 1 and "FIRST DIVERGENCE" in out and "moe_gate" in out and "layer 1" in out


def test_the_documented_example_backend_is_found_in_layer_0(capsys, monkeypatch, tmp_path):
    """docs/conformance.md's session: examples/planted_bug_backend.py's sparse_attention
    reads slot N-1 where an index is -1; in layer 0 the first queries see fewer keys
    than index_topk, so their rows hold -1s there."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples"))
    argv = ["--backends", "cpu,mychip", "--random", "24", "--out", str(tmp_path)]
    try:
        code = main(["diff", "--plugin", "planted_bug_backend:BACKEND", *argv])
    finally:
        if "mychip" in REGISTRY.names():
            glmport.unregister_backend("mychip")
    out = capsys.readouterr().out
    assert code == 1
    assert "FIRST DIVERGENCE: op call #7 sparse_attention (float32) in layer 0" in out
    assert "mychip (ran on mychip) FAIL" in out and "cpu (ran on cpu) PASS" in out


def test_cli_an_unavailable_backend_is_one_error_line(capsys):
    class Absent(_Planted):
        def probe(self, emulate: bool) -> Availability:
            return Availability(False, "no such chip here")

    glmport.register_backend(Absent("absent_chip", "rope", _rotates_backwards))
    try:
        code = main(["diff", "--backends", "cpu,absent_chip"])
    finally:
        glmport.unregister_backend("absent_chip")
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("glmport: error:") and "absent_chip" in line
    assert "no such chip here" in line


def _bad_replays(tmp_path: Path) -> dict[str, Path]:
    torch.save({"op": "rms_norm", "args": []}, tmp_path / "dict.pt")
    (tmp_path / "text.pt").write_text("not a tensor file\n")
    return {
        "missing": tmp_path / "missing.pt",
        "dict": tmp_path / "dict.pt",
        "text": tmp_path / "text.pt",
    }


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--backends", "cpu"], "--backends"),
        (["--backends", "cpu,bogus"], "bogus"),
        (["--backends", "cpu,generic", "--follow", "tvm"], "--follow"),
        (["--backends", "cpu,generic", "--input-ids", "1,2,128"], "--input-ids"),
        (["--backends", "cpu,generic", "--input-ids", "1,x"], "--input-ids"),
        (["--backends", "cpu,generic", "--random", "0"], "--random"),
        (["--replay", "{missing}"], "missing.pt"),
        (["--replay", "{dict}"], "not a glmport op-call replay file"),
        (["--replay", "{text}"], "not a glmport op-call replay file"),
    ],
)
def test_cli_bad_input_is_one_error_line(argv, names, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    files = _bad_replays(tmp_path)
    argv = [a.format(**files) for a in argv]
    try:
        code = main(["diff", *argv])
    except SystemExit as exc:  # argparse's own errors exit, as argparse does
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("glmport: error:") and names in lines[0]
