"""The synchronous RL trainer: resume reproduces a run, cross-backend rollouts report
the mismatch (smaller with replay), on-policy distillation, the control, the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from glmport.cli import main
from glmport.core.errors import ConfigError, UnknownBackendError
from glmport.model import GlmMoeDsaForCausalLM
from glmport.rl.config import RLConfig, policy_config
from glmport.rl.report import MetricsLog
from glmport.rl.run import train
from glmport.rl.tasks import make_task
from glmport.rl.trainer import Trainer

TIMING = ("rollout_tokens_per_s", "train_tokens_per_s", "step_seconds")


def small(**changes) -> RLConfig:
    base = dict(
        task="reverse",
        task_args={"digits": 3},
        steps=4,
        prompts_per_step=4,
        group_size=4,
        minibatches=2,
        seed=7,
        checkpoint_every=2,
        rollout_backend="generic",
        train_backend="generic",
    )
    return RLConfig(**{**base, **changes})


def _untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_resumed_run_reproduces_the_uninterrupted_one(tmp_path):
    # An evaluation every step: a run's last step is always evaluated, so only then do
    # a 2-step and a 4-step run report the same keys at step 2.
    full = train(small(eval_every=1), tmp_path / "full", progress=False)
    assert len(full) == 4
    half = train(small(steps=2, eval_every=1), tmp_path / "half", progress=False)
    assert _untimed(half) == _untimed(full[:2])
    resumed = train(None, tmp_path / "half", resume=True, steps=4, progress=False)
    assert _untimed(resumed) == _untimed(full)
    # The weights too, bit for bit.
    a = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "full" / "checkpoint" / "policy")
    b = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "half" / "checkpoint" / "policy")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    state = json.loads((tmp_path / "half" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and state["policy_version"] == 4
    assert (tmp_path / "full" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_metrics_are_consistent():
    trainer = Trainer(small(steps=1))
    m = trainer.step()
    # Same backend, same dtype: the cached (absorbed) rollout and the packed training
    # forward agree to rounding; nothing popped, ratio 1 at step 0.
    assert m["mismatch_max"] < 1e-5 and m["pop_fraction"] == 0
    assert abs(m["rho_p01"] - 1) < 1e-5 and abs(m["rho_p99"] - 1) < 1e-5
    assert 0 <= m["reward"] <= 1 and 0 <= m["clip_fraction"] <= 1
    assert 0 < m["entropy"] <= torch.log(torch.tensor(float(trainer.task.vocab_size)))
    assert m["policy_version"] == 0 and trainer.version == 1
    # The rollout copy follows the trained policy after the step.
    for x, y in zip(trainer.policy.parameters(), trainer.rollout_policy.parameters(), strict=True):
        assert torch.equal(x, y)


def test_cross_backend_rollout_reports_mismatch_and_replay_shrinks_it():
    """bf16 rollout on generic, fp32 training on cpu, DSA really selecting (index_topk
    below the sequence length): the mismatch is measured, and replaying the rollout's
    choices brings it down."""
    config = dict(
        rollout_backend="generic",
        train_backend="cpu",
        rollout_dtype="bf16",
        prompts_per_step=8,
        task_args={"digits": 6},
        model={"index_topk": 3},
        steps=1,
    )
    free = Trainer(small(**config)).step()
    replayed = Trainer(small(**config, replay=("routing", "indices"))).step()
    assert free["mismatch_mean"] > 0
    assert replayed["mismatch_mean"] < free["mismatch_mean"]
    assert replayed["mismatch_max"] < free["mismatch_max"]


def test_on_policy_distillation_moves_the_student_toward_the_teacher(tmp_path):
    task = make_task("reverse", digits=3)
    teacher = GlmMoeDsaForCausalLM.from_config(policy_config(task, {}), seed=1)
    with torch.no_grad():  # a confident teacher: far from the near-uniform student
        teacher.lm_head.weight.mul_(40)
    teacher.save_pretrained(tmp_path / "teacher")
    trainer = Trainer(small(steps=10, lr=3e-3, opd_teacher=str(tmp_path / "teacher")))
    history = trainer.run()
    first, last = history[0]["reverse_kl"], history[-1]["reverse_kl"]
    assert last < 0.5 * first


def test_a_teacher_equal_to_the_student_gives_zero_advantage(tmp_path):
    trainer = Trainer(small(steps=1))
    trainer.policy.save_pretrained(tmp_path / "same")
    twin = Trainer(small(steps=1, opd_teacher=str(tmp_path / "same")))
    m = twin.step()
    assert m["reverse_kl"] == 0 and m["loss"] == 0 and m["grad_norm"] == 0


def test_shuffled_control_reports_the_true_reward():
    a = Trainer(small(steps=1)).step()
    b = Trainer(small(steps=1, shuffle_rewards=True)).step()
    # Same seed, same rollout: the reported reward is the task's, not the shuffled one.
    assert a["reward"] == b["reward"]
    assert a["loss"] != b["loss"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": -1}, "steps must be an int >= 0"),
        ({"group_size": 0}, "group_size must be an int >= 1"),
        ({"minibatches": 100}, "exceeds the samples per step"),
        ({"rollout_dtype": "int8"}, "rollout_dtype must be one of"),
        ({"replay": ("experts",)}, "unknown replay kinds"),
        ({"opd_teacher": "/nonexistent"}, "not a checkpoint folder"),
        ({"lr": 0.0}, r"lr must be a number in \(0, inf\)"),
        ({"kl_coef": -1.0}, r"kl_coef must be a number in \[0, inf\)"),
    ],
)
def test_bad_config_is_a_clear_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        small(**changes)


def test_the_kl_anchor_defaults_off_when_distilling(tmp_path):
    assert small().kl_coef == 0.1
    Trainer(small(steps=1)).policy.save_pretrained(tmp_path / "teacher")
    assert small(opd_teacher=str(tmp_path / "teacher")).kl_coef == 0
    assert small(opd_teacher=str(tmp_path / "teacher"), kl_coef=0.2).kl_coef == 0.2


def test_kl_coefficient_decays_linearly_to_its_floor():
    trainer = Trainer(small(kl_decay_steps=4))
    weights = [trainer.kl_weight(s) for s in (0, 2, 3, 4, 9)]
    assert weights == pytest.approx([0.1, 0.05, 0.025, 0.02, 0.02])
    assert Trainer(small(kl_decay_steps=0)).kl_weight(100) == 0.1


def test_greedy_evaluation_runs_on_schedule():
    trainer = Trainer(small(steps=3, eval_every=2))
    history = trainer.run()
    assert ["eval_reward" in m for m in history] == [False, True, True]
    assert 0 <= history[-1]["eval_reward"] <= 1
    assert trainer.evaluate() == history[-1]["eval_reward"]  # same prompts, same policy


def test_unknown_task_and_backend_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown task 'sort'"):
        Trainer(small(task="sort"))
    with pytest.raises(UnknownBackendError, match="nope"):
        Trainer(small(rollout_backend="nope"))


def test_cli_trains_writes_outputs_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["rl", "train", "--task", "add", "--digits", "1", "--steps", "2", "--prompts", "2"]
    args += ["--group-size", "4", "--out", str(out), "--quiet", "--seed", "3"]
    assert main(args) == 0
    assert "run folder" in capsys.readouterr().out
    records = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert (out / "curves.png").stat().st_size > 1000
    assert main(["rl", "train", "--out", str(out), "--resume", "--steps", "3", "--quiet"]) == 0
    assert [r["step"] for r in MetricsLog.read(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "sort"], "invalid choice: 'sort'"),
        (["--steps", "-3"], "steps must be an int >= 0, got -3"),
        (["--opd-teacher", "/no/such/dir"], "not a checkpoint folder"),
        (["--rollout-backend", "nope"], "nope"),
        (["--replay", "experts"], "unknown replay kinds"),
        (["--model", "hidden_sizes=3"], "unknown GlmMoeDsaConfig fields"),
        (["--resume"], "not an RL checkpoint"),
        (["--group-size", "1"], "group_size must be an int >= 2"),
        (["--replay", "routing,routing"], "replay names a kind twice"),
        (["--seed", str(1 << 64)], "64 bits"),
        (["--steps", "1e30"], "invalid int value: '1e30'"),
        (["--steps", str(10**30)], "steps must be an int <= 1000000000"),
        (["--prompts", str(10**11)], "prompts_per_step must be an int <= 65536"),
        (["--prompts", "4096", "--group-size", "64"], "exceeds 65536 samples a step"),
        (["--digits", "100000"], "--digits: expected an integer from 1 to 64"),
        (["--digits", "64", "--prompts", "4096", "--group-size", "16"], "exceeds 4194304 tokens"),
        (["--temperature", "1e-300"], "temperature must be a number in [1e-06, 1e+06]"),
        (["--eval-every", str(10**12)], "eval_every must be an int <= 1000000000"),
        (["--kl-decay-steps", str(1 << 70)], "kl_decay_steps must be an int <= 1000000000"),
        (["--model", "hidden_size=-1"], "hidden_size"),
    ],
)
def test_cli_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    code = None
    try:
        code = main(["rl", "train", "--out", str(tmp_path / "x"), "--quiet", *argv])
    except SystemExit as exit_:  # argparse's own errors exit like argparse does
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("glmport: error:") and err.count("\n") == 1
    assert message in err
    assert not (tmp_path / "x").exists()  # refused before any work


def test_cli_resume_refuses_changed_settings_and_keeps_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["rl", "train", "--out", str(out), "--quiet", "--steps", "1", "--prompts", "2"]
    args += ["--group-size", "2", "--digits", "2", "--eval-every", "0", "--seed", "5"]
    assert main(args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    resume = ["rl", "train", "--out", str(out), "--quiet", "--resume"]
    for changed, flag in (
        (["--seed", "6"], "--seed 6 (the run: 5)"),
        (["--lr", "0.01"], "--lr 0.01 (the run: 0.002)"),
        (["--prompts", "3"], "--prompts 3 (the run: 2)"),
        (["--digits", "3"], "--digits {'digits': 3}"),
        (["--no-normalize-std"], "--normalize-std False"),
        (["--max-staleness", "4"], "--max-staleness: options of --mode async"),
    ):
        assert main([*resume, *changed]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err, err
    # The same values as the run's, and a new --steps, are a resume.
    assert main([*resume, "--seed", "5", "--prompts", "2", "--digits", "2", "--steps", "2"]) == 0
    assert [r["step"] for r in MetricsLog.read(out / "metrics.jsonl")] == [1, 2]
    assert before["metrics.jsonl"] == (out / "metrics.jsonl").read_bytes().splitlines(True)[0]


def test_a_fresh_run_never_overwrites_a_run(tmp_path):
    out = tmp_path / "run"
    config = small(steps=1, eval_every=0, prompts_per_step=2, group_size=2)
    train(config, out, progress=False)
    metrics = (out / "metrics.jsonl").read_bytes()
    # A crash mid-save left the checkpoint moved aside: the run is still there.
    (out / "checkpoint").rename(out / ".checkpoint.old-0123456789abcdef0123456789abcdef")
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoint, metrics.jsonl\)"):
        train(config, out, progress=False)
    assert (out / "checkpoint" / "state.json").is_file()
    shutil.rmtree(out / "checkpoint")  # metrics alone are a run too
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl\)"):
        train(config, out, progress=False)
    assert (out / "metrics.jsonl").read_bytes() == metrics
    (out / "metrics.jsonl").write_text("")  # an empty log (a start that failed) is not
    assert len(train(config, out, progress=False)) == 1
