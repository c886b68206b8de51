"""The mutation score: the library's mutants, how one is judged, the report and the
``--mutants`` command.

CI runs a small, fixed sample of the library (one mutant of each op, of different
kinds) and asserts the suite kills each; the whole library's kill rate is measured by
``glmport conformance --mutants`` (docs/conformance.md has the figures)."""

from __future__ import annotations

import json

import pytest
import torch

from glmport.cli import main
from glmport.conformance import mutation, mutation_report
from glmport.conformance.layouts import strided
from glmport.conformance.mutants import LIBRARY, Mutant, identity
from glmport.conformance.mutants.base import on_args
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.errors import ConfigError
from glmport.core.registry import REGISTRY
from glmport.core.specs import OP_NAMES

# One mutant per op, each of a different kind where the op has it; each is killed by
# a tiny or edge case in well under a second.
SAMPLE = (
    "sparse_attention.lse_log2",
    "lightning_indexer.end_off_by_one",
    "indexer_logits.relu_missing",
    "moe_gate.ties_to_higher_expert",
    "moe_dispatch.src_row_is_token",
    "moe_combine.inverse_permutation",
    "grouped_gemm.last_expert_ignored",
    "quantize.pow2_ignored",
    "quant_gemm.int4_nibbles_swapped",
    "rms_norm.weight_ignored",
    "rope.layout_swapped",
    "token_logprobs.ignores_stride_targets",
    "mla_prolog.heads_reversed_in_absorption",
)


def test_the_sample_covers_every_op_with_library_mutants():
    assert sorted(LIBRARY[i].op for i in SAMPLE) == sorted(OP_NAMES)


@pytest.mark.parametrize("mutant_id", SAMPLE)
@pytest.mark.parametrize("base", ["cpu", "generic"])
def test_the_suite_kills_each_sampled_mutant(mutant_id, base):
    result = mutation.run_mutant(LIBRARY[mutant_id], base)
    assert result.status == "killed", result
    assert result.killed_by["outcome"] == "fail", result.killed_by  # a wrong value, no crash
    # The check that killed it passes on the base itself.
    check = next(c for c in suite_checks() if c.id == result.killed_by["check"])
    assert run_check(check, base).outcome == "pass"


def _own_checks(op):
    """``op``'s checks but the model-level ones (which a mutant runs last)."""
    return [c for c in mutation.op_checks(op, False) if c.op == op]


def test_no_check_kills_the_honest_wrapper():
    result = mutation.run_mutant(identity("quantize"), "cpu", checks=_own_checks("quantize"))
    assert result.status == "survived", result
    assert result.own_checks > 0 and not result.base_failures


def _registered(backend):
    REGISTRY.register(backend, replace=True)
    return backend.manifest.name


def test_a_check_that_fails_the_base_kills_nothing():
    # A base whose quantize ignores the power-of-two scales: every check that fails
    # the honest wrapper of that base fails the base too, so none is a kill.
    broken = mutation.MutantBackend(LIBRARY["quantize.pow2_ignored"], "cpu")
    name = _registered(broken)
    try:
        result = mutation.run_mutant(identity("quantize"), name, checks=_own_checks("quantize"))
    finally:
        REGISTRY.unregister(name)
    assert result.status == "survived"
    assert result.base_failures, "the base's failures must be recorded, not dropped"


def test_an_exception_of_the_mutation_itself_is_a_broken_mutant_not_a_kill():
    def wrap(kernel):
        def mutated(x, weight, eps):
            raise NotImplementedError("\"flip_cpu\" not implemented for 'Float8_e4m3fn'")

        return mutated

    result = mutation.run_mutant(Mutant("rms_norm", "raises", "test", "-", "-", wrap), "cpu")
    assert result.status == "broken"
    assert "NotImplementedError" in result.broken_by


def test_an_exception_of_the_base_kernel_on_a_mutated_call_is_a_kill():
    # The mutated call hands the base a weight of the wrong length: the base raises.
    def shorter_weight(args):
        args[1] = args[1][:-1]

    result = mutation.run_mutant(
        Mutant("rms_norm", "short_weight", "test", "-", "-", on_args(shorter_weight)), "cpu"
    )
    assert result.status == "killed"
    assert result.killed_by["outcome"] == "error"


def _strided(arg):
    return strided(arg) if isinstance(arg, torch.Tensor) else arg


def _structure(outputs) -> list[tuple]:
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [(t.shape, t.dtype) for t in outputs]


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_mutant_keeps_the_op_s_output_structure(op):
    """A mutant is the op with a bug, not a crash: on each of the op's tiny calls
    (every dtype and scheme), with contiguous and with strided tensors, it returns
    what the op returns (as many outputs, of the same shapes and dtypes), whatever
    values it changes."""
    base = REGISTRY.kernels("cpu", False)[op]
    tiny = [c.case.args() for c in suite_checks(ops=(op,)) if c.case.family == "tiny"]
    calls = tiny + [tuple(_strided(a) for a in args) for args in tiny]
    mutants = [m for m in LIBRARY.values() if m.op == op]
    assert calls and mutants
    for args in calls:
        expected = _structure(base(*args))
        for m in mutants:
            assert _structure(m.wrap(base)(*args)) == expected, m.id


def test_a_mutant_of_an_op_the_backend_borrows_does_not_apply():
    name = _registered(mutation.MutantBackend(identity("rms_norm"), "cpu"))  # rms_norm alone
    try:
        chosen, left_out = mutation.mutants_for(name)
    finally:
        REGISTRY.unregister(name)
    assert {m.op for m in chosen} == {"rms_norm"}
    assert "does not implement rope itself" in left_out["rope.layout_swapped"]


def test_a_backend_whose_model_check_never_reaches_its_kernels_is_refused():
    with pytest.raises(ConfigError, match="whole-model runner"):
        mutation.check_mutable("onnxruntime", False)


def _result(status, op="rms_norm", family="tiny", outcome="fail"):
    killed_by = {"family": family, "outcome": outcome} if status == "killed" else None
    return {"id": f"{op}.{status}-{family}-{outcome}", "op": op, "kind": "k", "breaks": "b",
            "needs": "n", "status": status, "killed_by": killed_by, "broken_by": "",
            "base_failures": ["a check"] if status == "survived" else []}  # fmt: skip


def test_the_kill_rate_counts_killed_over_killed_and_survived():
    results = [
        _result("killed"),
        _result("killed", op="rope", family="edge", outcome="error"),
        _result("killed", op="rope"),
        _result("survived", op="rope"),
        _result("unexercised"),
    ]
    report = mutation_report.build_report(
        results, base="cpu", emulate=False, full=False, inapplicable={"x.y": "why"},
        command="c", workers="2", seconds=1.0,
    )  # fmt: skip
    assert report["summary"]["kill_rate"] == pytest.approx(3 / 4)
    assert report["per_op"]["rope"]["kill_rate"] == pytest.approx(2 / 3)
    assert report["per_op"]["rms_norm"]["kill_rate"] == 1.0
    assert report["killed_by_family"] == {"tiny": 2, "edge": 1}
    assert report["killed_by_error"] == ["rope.killed-edge-error"]
    assert [s["id"] for s in report["survivors"]] == ["rope.survived-tiny-fail"]
    text = mutation_report.markdown(report)
    assert "| `rope.survived-tiny-fail` | b | n | 1 |" in text and "75.0%" in text


def test_conformance_mutants_end_to_end(tmp_path, capsys):
    # The whole command on the cheapest op, in this process (-n 0).
    out = tmp_path / "r"
    code = main(["conformance", "--mutants", "--backend", "cpu", "--ops", "rms_norm",
                 "-n", "0", "--report-dir", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "mutants.json").read_text())
    expected = {m for m in LIBRARY if m.startswith("rms_norm.")}
    assert {r["id"] for r in report["results"]} == expected
    assert report["summary"]["killed"] == len(expected)  # every rms_norm mutant dies
    assert report["command"].startswith("glmport conformance --mutants --backend cpu")
    assert "kill rate 100.0%" in (out / "mutants.md").read_text()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--matrix"], "--matrix: not with --mutants"),
        (["--backend", "onnxruntime"], "cannot be mutated"),
        (["--ops", "nope"], "nope"),
        (["--backend", "ascend", "--emulate", "--ops", "quantize"], "no mutant applies"),
    ],
)
def test_conformance_mutants_refuses_bad_combinations_in_one_line(extra, message, capsys, tmp_path):
    code = main(["conformance", "--mutants", "--report-dir", str(tmp_path / "r"), *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.startswith("glmport: error:") and err.count("\n") == 1
