"""Tests of glmport.rl.tasks (toy tasks, rewards, control) and glmport.rl.report."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from glmport.core.errors import ConfigError
from glmport.core.extras import install_command
from glmport.rl.report import MetricsLog, curves_figure, plot_curves
from glmport.rl.run import curves_title
from glmport.rl.tasks import (
    TASKS,
    AdditionTask,
    Problem,
    ReverseTask,
    chance_reward,
    make_task,
    shuffled_rewards,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- reverse


def test_reverse_layout_and_answers():
    task = ReverseTask(digits=5, base=7)
    assert (task.vocab_size, task.prompt_len, task.response_len) == (9, 6, 5)
    problems = task.sample(200, gen(0))
    assert len(problems) == 200
    for p in problems:
        assert len(p.prompt) == 6 and len(p.answer) == 5
        assert p.prompt[-1] == 7  # SEP = base
        digits = list(p.prompt[:-1])
        assert all(0 <= d < 7 for d in digits)
        assert list(p.answer) == digits[::-1]
    # all digit values actually occur (not a constant sampler)
    assert {d for p in problems for d in p.prompt[:-1]} == set(range(7))


def test_reverse_determinism():
    task = ReverseTask()
    assert task.sample(16, gen(3)) == task.sample(16, gen(3))
    assert task.sample(16, gen(3)) != task.sample(16, gen(4))
    g = gen(3)
    first, second = task.sample(8, g), task.sample(8, g)
    assert first != second  # the generator advances
    assert task.sample(0, gen(0)) == []


# ---------------------------------------------------------------- addition


def test_addition_layout_and_sums():
    task = AdditionTask(digits=3, base=10)
    assert (task.vocab_size, task.prompt_len, task.response_len) == (12, 8, 4)
    problems = task.sample(500, gen(1))
    carries = 0
    for p in problems:
        assert len(p.prompt) == 8 and len(p.answer) == 4
        assert p.prompt[3] == 11 and p.prompt[7] == 10  # PLUS = base+1, SEP = base
        a = int("".join(str(d) for d in p.prompt[0:3]))
        b = int("".join(str(d) for d in p.prompt[4:7]))
        assert all(0 <= d < 10 for d in p.answer)
        assert int("".join(str(d) for d in reversed(p.answer))) == a + b
        carries += a + b >= 1000
    assert 0 < carries < 500  # both the carry-out digit 1 and 0 occur


def test_addition_other_base():
    task = AdditionTask(digits=2, base=3)
    for p in task.sample(100, gen(2)):
        a = p.prompt[0] * 3 + p.prompt[1]
        b = p.prompt[3] * 3 + p.prompt[4]
        total = p.answer[0] + 3 * p.answer[1] + 9 * p.answer[2]
        assert total == a + b
        assert p.prompt[2] == 4 and p.prompt[5] == 3


# ---------------------------------------------------------------- reward


def test_reward_fractions():
    task = ReverseTask(digits=4)
    p = Problem(prompt=(1, 2, 3, 4, 10), answer=(4, 3, 2, 1))
    assert task.reward(p, [4, 3, 2, 1]) == 1.0
    assert task.reward(p, [4, 0, 0, 0]) == 0.25
    assert task.reward(p, [0, 3, 0, 1]) == 0.5
    assert task.reward(p, [4, 3]) == 0.5  # missing positions are wrong
    assert task.reward(p, []) == 0.0
    assert task.reward(p, [4, 3, 2, 1, 7, 7]) == 1.0  # extra tokens ignored
    assert task.reward(p, [10, 11, 50, 1]) == 0.25  # SEP/PLUS/out-of-vocab: wrong
    assert task.reward(p, torch.tensor([4, 3, 9, 9])) == 0.5


def test_reward_addition():
    task = AdditionTask(digits=2)
    p = Problem(prompt=(9, 7, 11, 0, 5, 10), answer=(2, 0, 1))
    assert task.reward(p, [2, 0, 1]) == 1.0
    assert task.reward(p, [1, 0, 2]) == pytest.approx(1 / 3)


def test_reward_rejects_bad_inputs():
    task = ReverseTask(digits=4)
    p = Problem(prompt=(1, 2, 3, 4, 10), answer=(4, 3, 2, 1))
    with pytest.raises(ConfigError, match="response"):
        task.reward(p, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="problem"):
        task.reward(Problem(prompt=(1, 10), answer=(1,)), [1])


# ---------------------------------------------------------------- control and chance


def test_shuffled_rewards_is_a_permutation():
    rewards = torch.arange(32, dtype=torch.float32) / 32
    shuffled = shuffled_rewards(rewards, gen(0))
    assert shuffled.shape == rewards.shape and shuffled.dtype == rewards.dtype
    assert torch.equal(torch.sort(shuffled).values, rewards)
    assert not torch.equal(shuffled, rewards)
    assert torch.equal(shuffled, shuffled_rewards(rewards, gen(0)))
    grid = rewards.reshape(4, 8)
    shuffled_grid = shuffled_rewards(grid, gen(1))
    assert shuffled_grid.shape == (4, 8)
    assert torch.equal(torch.sort(shuffled_grid.reshape(-1)).values, rewards)
    with pytest.raises(ConfigError, match="rewards"):
        shuffled_rewards([0.1, 0.2], gen(0))


def test_chance_reward_closed_form_and_monte_carlo():
    assert chance_reward(ReverseTask(digits=4, base=10)) == pytest.approx(1 / 12)
    assert chance_reward(AdditionTask(digits=2, base=5)) == pytest.approx(1 / 7)
    task = AdditionTask(digits=2, base=10)
    g = gen(7)
    problems = task.sample(4000, g)
    responses = torch.randint(0, task.vocab_size, (4000, task.response_len), generator=g)
    mc = sum(task.reward(p, r.tolist()) for p, r in zip(problems, responses, strict=True)) / 4000
    # 12000 Bernoulli(1/12) positions: std ~0.0025, so 0.01 is 4 sigma and excludes 1/10
    assert abs(mc - chance_reward(task)) < 0.01
    assert abs(mc - 1 / 12) < 0.01


# ---------------------------------------------------------------- registry and errors


def test_make_task():
    assert set(TASKS) == {"reverse", "add"}
    t = make_task("reverse", digits=3, base=4)
    assert isinstance(t, ReverseTask) and (t.prompt_len, t.response_len, t.vocab_size) == (
        4,
        3,
        6,
    )
    assert isinstance(make_task("add"), AdditionTask)
    assert "reverse" in t.describe() and "\n" not in t.describe()
    for name in TASKS:  # a run's curves title starts with it: the task named once
        words = make_task(name).describe().replace(":", " ").split()
        assert words[0] == name and words.count(name) == 1, make_task(name).describe()


@pytest.mark.parametrize(
    ("name", "kwargs", "pattern"),
    [
        ("sort", {}, r"'sort'.*add, reverse"),
        ("reverse", {"digits": 0}, "digits"),
        ("add", {"base": 1}, "base"),
        ("add", {"digits": 2.0}, "digits.*float"),
        ("reverse", {"digits": True}, "digits"),
        ("reverse", {"width": 3}, "width"),
    ],
)
def test_make_task_errors(name, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_task(name, **kwargs)


def test_sample_rejects_negative_n():
    with pytest.raises(ConfigError, match="'n'"):
        ReverseTask().sample(-1, gen(0))


# ---------------------------------------------------------------- report


def test_metrics_log_round_trip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLog(path) as log:
        log.write({"step": 0, "reward": torch.tensor(0.25), "name": "a"})
        log.write({"step": 1, "reward": float("nan"), "loss": np.float32(1.5), "ok": True})
    assert log._file.closed
    records = MetricsLog.read(path)
    assert records == [
        {"step": 0, "reward": 0.25, "name": "a"},
        {"step": 1, "reward": None, "loss": 1.5, "ok": True},
    ]
    # every line is strict JSON (no NaN literal)
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    with MetricsLog(path, append=True) as log:
        log.write({"step": 2, "reward": torch.tensor([0.5])})
    assert [r["step"] for r in MetricsLog.read(path)] == [0, 1, 2]
    with MetricsLog(path) as log:  # append=False truncates
        log.write({"step": 9})
    assert MetricsLog.read(path) == [{"step": 9}]


def test_metrics_log_rejects(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log:
        with pytest.raises(ConfigError, match="'r'"):
            log.write({"r": torch.ones(3)})
        with pytest.raises(ConfigError, match="'o'"):
            log.write({"o": object()})
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2"):
        MetricsLog.read(tmp_path / "bad.jsonl")


def _records():
    return [
        {
            "step": s,
            "reward": 0.1 + 0.02 * s,
            "reward_shuffled": 0.1,
            "mismatch_mean": 1e-3 * (s + 1),
            "mismatch_max": 1e-2 * (s + 1),
            "pop_fraction": 0.01 * s,
        }
        for s in range(10)
    ]


def test_plot_curves_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_curves(_records(), tmp_path / "plots" / "curves.png", title="demo")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    # missing keys, null values, no step, zero mismatch (linear scale)
    sparse = [{"reward": 0.1}, {"reward": None, "mismatch_mean": 0.0}, {}]
    out2 = plot_curves(sparse, tmp_path / "sparse.png")
    assert out2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out3 = plot_curves([], tmp_path / "empty.png")
    assert out3.stat().st_size > 0


def _axis(fig, label: str):
    (ax,) = [ax for ax in fig.axes if ax.get_ylabel() == label]
    return ax


def test_curves_title_names_the_task_once_and_zero_series_start_at_zero():
    pytest.importorskip("matplotlib")
    title = curves_title(make_task("reverse"), 3)
    assert title == (
        "reverse: 3 base-10 digits, answered back to front (prompt 4 tokens, response 3, "
        "vocab 12), seed 3"
    )
    # One backend and dtype for rollout and training: no mismatch, nothing popped.
    flat = [{"step": s, "reward": 0.1, "mismatch_mean": 0.0, "pop_fraction": 0.0} for s in range(5)]
    fig = curves_figure(flat, title=title)
    assert fig.get_suptitle() == title
    assert _axis(fig, "pop_fraction").get_ylim() == (0.0, 1.0)
    mismatch = _axis(fig, "|delta logp|")
    assert mismatch.get_yscale() == "linear" and mismatch.get_ylim() == (0.0, 1.0)
    # A non-zero fraction keeps matplotlib's top, from 0; a positive mismatch is log-scale.
    fig = curves_figure(_records())
    assert fig.get_suptitle() == ""
    low, high = _axis(fig, "pop_fraction").get_ylim()
    assert low == 0.0 and 0.09 <= high < 0.2
    assert _axis(fig, "|delta logp|").get_yscale() == "log"


def test_plot_curves_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match=re.escape(install_command(["matplotlib"]))):
        plot_curves(_records(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
