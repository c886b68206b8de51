"""``glmport indexcache search``: IndexCache's training-free greedy pattern search
(Bai et al., arXiv 2603.12201). Each step's loss equals an independent recomputation,
each choice is the argmin over its candidates, the saved copy loads with the pattern
and gives the same logits, layer 0 stays full, ``keep`` is bounded, and the command
line prints, saves and refuses bad input with one ``glmport: error:`` line."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from glmport.model.indexcache import (
    apply_indexer_types,
    calibration_loss,
    random_calibration,
    search,
    shared_layer,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 5
# index_topk 4, well below the sequence lengths: the indexers really select.
CONFIG = GlmMoeDsaConfig.tiny(num_hidden_layers=LAYERS, vocab_size=64, index_topk=4)
TOL = 1e-5


def _fresh(types: list[str] | None = None) -> GlmMoeDsaForCausalLM:
    """The seed-0 model, converted to ``types`` when given (on its own copy of the
    config: the conversion changes the model's config in place)."""
    model = GlmMoeDsaForCausalLM.from_config(dataclasses.replace(CONFIG), seed=0).eval()
    if types is not None:
        apply_indexer_types(model, types)
    return model


def _types(pattern: str) -> list[str]:
    return ["full" if c == "F" else "shared" for c in pattern]


def _loss(model: GlmMoeDsaForCausalLM, sequences: list[list[int]]) -> float:
    """The mean next-token cross-entropy, one sequence at a time (no padding)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor(seq)
            logits = model(ids[None]).logits[0]
            total += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
            count += len(seq) - 1
    return total / count


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # Unequal lengths: the batched loss pads, the recomputation does not.
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (24, 32, 28, 30)]


@pytest.fixture(scope="module")
def searched(sequences):
    model = _fresh()
    evaluations = []
    result = search(model, sequences, 1, on_evaluation=evaluations.append)
    return model, result, evaluations


def test_each_step_loss_equals_an_independent_recomputation(searched, sequences):
    _, result, evaluations = searched
    assert result.start == "F" * LAYERS
    assert result.baseline == pytest.approx(_loss(_fresh(), sequences), abs=TOL)
    assert [s.pattern.count("F") for s in result.steps] == list(range(LAYERS - 1, 0, -1))
    previous = result.baseline
    for step in result.steps:
        assert step.loss == pytest.approx(_loss(_fresh(_types(step.pattern)), sequences), abs=TOL)
        assert step.delta == pytest.approx(step.loss - previous, abs=1e-12)
        previous = step.loss
    assert result.pattern == result.steps[-1].pattern == "F" + "S" * (LAYERS - 1)
    # one evaluation for the baseline, then 4 + 3 + 2 + 1 candidates
    assert [e.done for e in evaluations] == list(range(1, 12))
    assert {e.total for e in evaluations} == {11} and evaluations[0].layer is None


def test_each_choice_is_the_argmin_over_its_candidates(searched, sequences):
    _, result, _ = searched
    # sequences longer than index_topk: the candidates really differ
    assert len(set(result.steps[0].candidates.values())) == LAYERS - 1
    before = result.start
    for step in result.steps:
        full = [i for i, c in enumerate(before) if c == "F" and i > 0]
        assert sorted(step.candidates) == full
        recomputed = {}
        for layer in full:
            pattern = before[:layer] + "S" + before[layer + 1 :]
            recomputed[layer] = _loss(_fresh(_types(pattern)), sequences)
            assert step.candidates[layer] == pytest.approx(recomputed[layer], abs=TOL)
        assert recomputed[step.layer] <= min(recomputed.values()) + 2 * TOL
        assert step.layer == min(step.candidates, key=lambda i: (step.candidates[i], i))
        before = step.pattern


def test_the_saved_copy_loads_with_the_pattern_and_the_same_logits(searched, tmp_path):
    model, result, _ = searched
    model.save_pretrained(tmp_path)
    loaded = GlmMoeDsaForCausalLM.from_pretrained(tmp_path).eval()  # no missing / unexpected
    assert loaded.config.indexer_types == _types(result.pattern)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["indexer_types"] == _types(result.pattern)
    keys = set(loaded.state_dict())
    assert keys == set(model.state_dict())
    for i, kind in enumerate(result.pattern):
        has_indexer = any(k.startswith(f"model.layers.{i}.self_attn.indexer.") for k in keys)
        assert has_indexer == (kind == "F")
    ids = torch.tensor(random_calibration(2, 30, 64, seed=5))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(loaded(ids).logits, expected)
        assert torch.equal(_fresh(_types(result.pattern))(ids).logits, expected)


def test_layer_0_stays_full_and_keep_is_bounded(searched, sequences):
    _, result, _ = searched
    assert all(s.layer != 0 and s.pattern[0] == "F" for s in result.steps)
    model = _fresh()
    for keep in (0, LAYERS + 1):
        with pytest.raises(ConfigError, match="--keep"):
            search(model, sequences, keep)
    unchanged = search(model, sequences[:1], LAYERS)
    assert unchanged.steps == [] and unchanged.pattern == "F" * LAYERS
    apply_indexer_types(model, _types("FSFFS"))
    with pytest.raises(ConfigError, match="--keep 4 is above the model's 3 full layers"):
        search(model, sequences, 4)
    with pytest.raises(ConfigError, match="layer 1 full"):
        apply_indexer_types(model, _types("FFFFS"))
    with pytest.raises(ConfigError, match="indexer_types must start with 'full'"):
        apply_indexer_types(model, _types("SSFFS"))


def test_a_deepseek_v32_model_is_refused(sequences):
    config = dataclasses.replace(CONFIG, model_type="deepseek_v32", indexer_types=None)
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    with pytest.raises(ConfigError, match="IndexCache needs model_type 'glm_moe_dsa'"):
        search(model, sequences, 1)


def test_applying_a_pattern_drops_the_keys_that_would_derive_another():
    model = GlmMoeDsaForCausalLM.from_config(
        dataclasses.replace(CONFIG, indexer_types=None, extra={"index_topk_freq": 1}), seed=0
    )
    apply_indexer_types(model, _types("FSFFF"))
    assert model.config.indexer_types == _types("FSFFF")
    assert "index_topk_freq" not in model.config.to_dict()


def test_a_candidate_is_restored_even_when_its_evaluation_fails(sequences):
    model = _fresh()
    indexer = model.model.layers[2].self_attn.indexer
    with pytest.raises(RuntimeError, match="boom"), shared_layer(model, 2):
        assert model.config.indexer_types[2] == "shared"
        assert model.model.layers[2].self_attn.indexer is None
        raise RuntimeError("boom")
    assert model.model.layers[2].self_attn.indexer is indexer
    assert model.config.indexer_types == ["full"] * LAYERS
    assert calibration_loss(model, sequences) == pytest.approx(_loss(_fresh(), sequences), abs=TOL)


# -- command line --------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    _fresh().save_pretrained(path)
    return path


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glmport: error:"), err
    return err[0]


def test_cli_searches_prints_and_saves(checkpoint, tmp_path, capsys, sequences):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(",".join(map(str, s)) for s in sequences[:2]) + "\n\n")
    out = tmp_path / "out"
    args = ["indexcache", "search", "--model", str(checkpoint), "--calib", str(calib)]
    assert main([*args, "--keep", "3", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("baseline: loss ") and lines[0].endswith("pattern FFFFF")
    step = r"layer [1-4] shared: loss \d+\.\d{6} \([+-]\d+\.\d{6}\), pattern F[FS]{4}"
    assert all(re.fullmatch(step, line) for line in lines[1:3]) and len(lines) == 4
    assert lines[-1].startswith(f"pattern {lines[2].split()[-1]} saved to {out}")
    assert len(GlmMoeDsaForCausalLM.from_pretrained(out).config.full_indexer_layers) == 3

    json_out = tmp_path / "json"
    assert main([*args, "--keep", "3", "--out", str(json_out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["steps"]) == 2 and report["out"] == str(json_out)
    assert report["pattern"] == lines[2].split()[-1]
    assert report["baseline"] == pytest.approx(_loss(_fresh(), sequences[:2]), abs=TOL)


def test_cli_random_calibration_and_the_short_sequence_warning(checkpoint, tmp_path, capsys):
    base = ["indexcache", "search", "--model", str(checkpoint), "--random", "2", "--keep"]
    assert main([*base, "5", "--seq-len", "4", "--out", str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    assert "no calibration sequence is longer than index_topk (4)" in captured.err
    assert "no step: the model has 5 full layers already" in captured.out


@pytest.mark.parametrize(
    ("calib", "extra", "expected"),
    [
        (None, ["--keep", "2"], "No such file or directory: {calib}"),
        ("1,2,3\n4 x 5\n", ["--keep", "2"], "--calib {calib} line 2: 'x' is not a token id"),
        ("1,2,64\n", ["--keep", "2"], "{calib} line 1: token id 64 is outside the vocabulary"),
        ("\n7\n", ["--keep", "2"], "{calib} line 2: a sequence needs at least 2 tokens"),
        ("\n\n", ["--keep", "2"], "--calib {calib} holds no sequence"),
        (b"1,2\xff\n", ["--keep", "2"], "--calib {calib} is not UTF-8 text"),
        ("1,2,3\n", ["--keep", "6"], "--keep must be from 1 to num_hidden_layers (5), got 6"),
        ("1,2,3\n", ["--keep", "0"], "argument --keep: expected an integer from 1"),
        ("1,2,3\n", ["--keep", "2", "--out", "{existing}"], "--out {existing} already holds files"),
    ],
)
def test_cli_refuses_bad_input_with_one_line(checkpoint, tmp_path, capsys, calib, extra, expected):
    path = tmp_path / "calib.txt"
    if isinstance(calib, bytes):
        path.write_bytes(calib)
    elif calib is not None:
        path.write_text(calib)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    extra = [e.replace("{existing}", str(existing)) for e in extra]
    if "--out" not in extra:
        extra += ["--out", str(tmp_path / "out")]
    argv = ["indexcache", "search", "--model", str(checkpoint), "--calib", str(path), *extra]
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    assert status == 2
    line = _one_error(capsys)
    assert expected.replace("{calib}", str(path)).replace("{existing}", str(existing)) in line
    assert not (tmp_path / "out").exists()
