"""Asynchronous RL: AReaL's capacity rule, the group ledger's audit, rollout workers
(in-process), and the Ray trainer: weight updates, a worker killed mid-run and a
restart of the trainer in one run lose no group and train none twice, a resumed run
continues the ledger, the CLI."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from hang_guard import guard_s

from glmport.cli import main
from glmport.core.errors import ConfigError, GlmportError
from glmport.core.extras import install_command
from glmport.model.generation import generate
from glmport.rl.config import RLConfig, policy_config
from glmport.rl.staleness import GroupLedger, LedgerError, StalenessManager, audit
from glmport.rl.tasks import Problem, make_task
from glmport.rl.workers import GroupSampling, GroupSpec, Interrupted, RolloutWorker


def small(**changes) -> RLConfig:
    base = dict(
        task="reverse",
        steps=6,
        prompts_per_step=4,
        group_size=4,
        seed=3,
        mode="async",
        max_staleness=2,
        rollout_workers=2,
        eval_every=0,
        checkpoint_every=2,
        rollout_backend="generic",
        train_backend="generic",
    )
    return RLConfig(**{**base, **changes})


# -- the capacity rule and the ledger ----------------------------------------------------


def test_capacity_rule_bounds_groups_ahead_of_training():
    m = StalenessManager(batch=4, max_staleness=1, max_concurrent=6)
    # Version 0: (1 + 0 + 1) * 4 = 8 groups may be accepted or running; 6 may run.
    assert m.capacity(0) == 6
    for _ in range(6):
        m.on_dispatch()
    assert m.capacity(0) == 0
    for _ in range(5):
        m.on_accept()
    m.on_reject()  # a group came back unusable: it no longer counts
    assert (m.accepted, m.running) == (5, 0)
    assert m.capacity(0) == 3  # min(6 - 0, 8 - 5)
    assert m.capacity(1) == 6  # min(6, 12 - 5)
    m.on_discard(2)
    assert m.accepted == 3 and m.capacity(0) == 5


@pytest.mark.parametrize(
    "field, value", [("batch", 0), ("max_staleness", -1), ("max_concurrent", True)]
)
def test_capacity_rule_refuses_bad_settings(field, value):
    settings = dict(batch=2, max_staleness=1, max_concurrent=2)
    with pytest.raises(ConfigError, match=field):
        StalenessManager(**{**settings, field: value})


def _events(*pairs):
    return [{"event": e, "group": g} for e, g in pairs]


def test_audit_accepts_exactly_once_and_counts_events():
    records = _events(
        ("issued", 0), ("returned", 0), ("trained", 0),
        ("issued", 1), ("failed", 1), ("returned", 1), ("trained", 1),
        ("issued", 2), ("pending", 2),
    )  # fmt: skip
    assert audit(records) == {"issued": 3, "returned": 2, "trained": 2, "failed": 1, "pending": 1}


@pytest.mark.parametrize(
    "records, message",
    [
        (_events(("issued", 0), ("returned", 0), ("trained", 0), ("trained", 0)), "twice|more"),
        (_events(("issued", 0), ("returned", 0)), "neither trained nor pending"),
        (_events(("issued", 0), ("trained", 0)), "without being sampled"),
    ],
)
def test_audit_catches_a_group_trained_twice_lost_or_unsampled(records, message):
    with pytest.raises(LedgerError, match=message):
        audit(records)


def test_ledger_writes_json_lines_and_refuses_unknown_events(tmp_path):
    ledger = GroupLedger(tmp_path / "ledger.jsonl")
    ledger.record("issued", 4, prompt=[1, 2])
    with pytest.raises(ConfigError, match="unknown ledger event 'lost'"):
        ledger.record("lost", 4)
    ledger.close()
    assert GroupLedger.read(tmp_path / "ledger.jsonl") == [
        {"event": "issued", "group": 4, "prompt": [1, 2]}
    ]


# -- rollout workers, in-process -----------------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    from glmport.model import GlmMoeDsaForCausalLM

    task = make_task("reverse")
    return task, GlmMoeDsaForCausalLM.from_config(policy_config(task, {}), seed=5)


def _worker(policy, **kw):
    task, model = policy
    sampling = GroupSampling(group_size=3, max_new_tokens=task.response_len, temperature=1.0)
    worker = RolloutWorker(
        model.config.to_dict(), backend="generic", sampling=sampling, index=1, **kw
    )
    return worker, model.state_dict()


def test_worker_samples_groups_as_generate_does(policy):
    task, model = policy
    worker, state = _worker(policy)
    specs = [
        GroupSpec(0, 0, Problem((1, 2, 3, 10), (3, 2, 1)), seed=11),
        GroupSpec(1, 0, Problem((4, 5, 6, 10), (6, 5, 4)), seed=12),
    ]
    groups = worker.rollout(specs, 7, [state])
    assert worker.version == 7
    prompts = [list(s.problem.prompt) for s in specs for _ in range(3)]
    want = generate(model, prompts, task.response_len, greedy=False, seed=11, return_logprobs=True)
    assert [g.spec for g in groups] == specs
    assert [o for g in groups for o in g.output_ids] == want.output_ids
    got = torch.cat([lp for g in groups for lp in g.logprobs])
    torch.testing.assert_close(got, torch.cat(want.logprobs), rtol=0, atol=1e-6)
    assert all(g.version == 7 and g.worker == 1 for g in groups)


def test_worker_interrupted_by_a_newer_version_returns_its_groups(policy):
    worker, state = _worker(policy)
    spec = GroupSpec(0, 0, Problem((1, 2, 3, 10), (3, 2, 1)), seed=1)
    worker.notify(4)  # version 4 was published before version 3's rollout ran
    result = worker.rollout([spec], 3, [state])
    assert result == Interrupted((spec,), 3, 1)


def test_worker_without_sampling_refuses_rollouts(policy):
    _, model = policy
    worker = RolloutWorker(model.config.to_dict(), backend="generic")
    with pytest.raises(ConfigError, match="without group sampling"):
        worker.rollout([], 0, [model.state_dict()])


def test_interruptions_never_stop_a_run_but_a_group_losing_workers_does():
    from glmport.rl.async_trainer import MAX_FAILURES, AsyncTrainer

    trainer = AsyncTrainer(small())  # Ray starts with the first step: not here
    spec = trainer._issue()
    for event in ["interrupted", "stale"] * 10:
        trainer._requeue(spec, event)
        spec = trainer.queue.popleft()
    assert spec.attempt == 20 and len({trainer._issue().group_id, spec.group_id}) == 2
    for _ in range(MAX_FAILURES - 1):
        trainer._requeue(spec, "failed", worker=0)
        spec = trainer.queue.popleft()
    with pytest.raises(GlmportError, match=f"lost its worker {MAX_FAILURES} times"):
        trainer._requeue(spec, "failed", worker=0)


# -- the trainer on Ray ----------------------------------------------------------------------


def _ledger(folder):
    return GroupLedger.read(folder / "ledger.jsonl")


def test_a_weight_update_a_worker_kill_and_a_restart_lose_no_group_and_train_none_twice(
    ray_local, tmp_path
):
    """One run through the three events: weight updates every step (each interrupts
    the rollouts of the older version), worker 0 killed while a rollout runs, and the
    trainer process dying after a checkpoint (its workers with it, no clean shutdown),
    then restarted with --resume on fresh workers. The ledger over the whole run
    trains every group at most once and loses none."""
    from glmport.rl.async_trainer import AsyncTrainer

    # Rollout calls of 4 groups x 8 samples x 6 tokens: long enough for a kill to land
    # while one runs.
    config = small(steps=1000, task_args={"digits": 6}, group_size=8)
    options = dict(max_restarts=2, groups_per_call=4)
    trainer = AsyncTrainer(config, tmp_path, **options)
    trainer.step()
    on_victim = []
    while not on_victim and trainer.step_index < 20:
        trainer.step()
        mine = [ref for ref, (_, i) in trainer._in_flight.items() if i == 0]
        if mine:
            _, running = ray_local.wait(mine, num_returns=len(mine), timeout=0)
            on_victim = [g for ref in running for g in trainer._in_flight[ref][0]]
    assert on_victim, "worker 0 has groups in flight"
    killed_at = len(trainer.ledger.records)
    ray_local.kill(trainer.workers[0], no_restart=False)

    def came_back() -> bool:
        """The kill cost worker 0's call (``failed``) and the restarted worker sampled."""
        events = [(r["event"], r.get("worker")) for r in trainer.ledger.records[killed_at:]]
        if ("failed", 0) not in events:
            return False
        return ("returned", 0) in events[events.index(("failed", 0)) :]

    # Train on until Ray has restarted worker 0 and it sampled again (seconds; under
    # load, a new process takes a while to import torch).
    deadline = time.monotonic() + guard_s(30)
    while not (came_back() and trainer.step_index > 4) and time.monotonic() < deadline:
        trainer.step()
    assert came_back(), "worker 0 came back after the kill"
    trainer.save()  # the failures are in the checkpoint's part of the ledger
    saved_step, saved_records = trainer.step_index, len(trainer.ledger.records)
    trainer.step()  # trained, then lost with the process: the resumed run redoes it
    for worker in trainer.workers:  # the process dies: its actors go, nothing is closed
        ray_local.kill(worker, no_restart=True)
    trainer.ledger.close()

    with AsyncTrainer.resume(tmp_path / "checkpoint", tmp_path, options=options) as again:
        assert again.step_index == saved_step
        while again.step_index < saved_step + 2:
            again.step()
        steps = again.step_index
    records = _ledger(tmp_path)
    counts = audit(records)  # raises on a group trained twice, or issued and lost
    assert counts["trained"] == steps * config.prompts_per_step
    failed = {r["group"] for r in records[killed_at:] if r["event"] == "failed"}
    assert failed, "the kill cost the groups in flight on worker 0"
    trained = {r["group"] for r in records if r["event"] == "trained"}
    pending = {r["group"] for r in records if r["event"] == "pending"}
    assert failed | {s.group_id for s in on_victim} <= trained | pending
    # Weights were published every step before the restart, and the resumed run
    # published its checkpoint's to the fresh workers.
    versions = [r["version"] if r["event"] == "returned" else None for r in records]
    assert len(set(versions[:saved_records]) - {None}) > 2
    assert saved_step in versions[saved_records:]
    # Nothing trained was staler than the bound.
    stale = [r["staleness"] for r in records if r["event"] == "trained"]
    assert max(stale) <= config.max_staleness


def test_resumed_async_run_continues_the_ledger(ray_local, tmp_path):
    from glmport.rl.async_trainer import AsyncTrainer

    config = small(steps=3, checkpoint_every=2)
    with AsyncTrainer(config, tmp_path) as trainer:
        trainer.run()
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3  # the last step checkpoints too
    # Run on from step 3 to 5, with the first run's queue (groups not trained).
    queued = {p["group"] for p in state["async"]["pending"]}
    with AsyncTrainer.resume(tmp_path / "checkpoint", tmp_path, steps=5) as trainer:
        assert {s.group_id for s in trainer.queue} == queued
        trainer.run()
    records = _ledger(tmp_path)
    counts = audit(records)
    assert counts["trained"] == 5 * config.prompts_per_step
    trained_later = {r["group"] for r in records if r["event"] == "trained" and r["step"] > 3}
    assert queued & trained_later, "the checkpoint's queued groups are trained after resume"


def test_async_step_metrics_report_staleness_and_losses(ray_local):
    from glmport.rl.async_trainer import AsyncTrainer

    with AsyncTrainer(small(steps=2, async_loss="pg")) as trainer:
        first = trainer.step()
        second = trainer.step()
    assert first["staleness_max"] == 0  # nothing was published before version 0
    assert 0 <= second["staleness_mean"] <= second["staleness_max"] <= 2
    assert "zeroed_fraction" not in first  # plain policy gradient zeroes nothing
    for m in (first, second):
        assert 0 <= m["reward"] <= 1 and m["rollout_tokens_per_s"] > 0


def test_cli_runs_async_training(ray_local, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["rl", "train", "--mode", "async", "--steps", "2", "--prompts", "4"]
    argv += ["--group-size", "2", "--max-staleness", "1", "--rollout-workers", "1"]
    argv += ["--out", str(out), "--quiet", "--eval-every", "0"]
    assert main(argv) == 0
    assert "run folder" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert audit(_ledger(out))["trained"] == 2 * 4


# -- bad settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(mode="later"), "mode must be one of sync, async"),
        (dict(async_loss="ppo"), "async_loss must be one of dsis, pg"),
        (dict(replay=("routing",)), "replay is not supported with mode 'async'"),
        (dict(max_staleness=-1), "max_staleness must be an int >= 0"),
        (dict(rollout_workers=0), "rollout_workers must be an int >= 1"),
        (dict(publish_every=5, max_staleness=3), "publish_every .5. exceeds max_staleness"),
    ],
)
def test_bad_async_settings_are_clear_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        small(**changes)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ray-address", "auto"], "--ray-address: options of --mode async (this run: sync)"),
        (["--max-staleness", "4"], "--max-staleness: options of --mode async"),
        (["--rollout-workers", "3", "--publish-every", "1"], "--rollout-workers, --publish-every"),
        (["--mode", "async", "--worker-threads", "100000"], "worker_threads must be an int <="),
        (["--mode", "async", "--rollout-workers", "1000000"], "rollout_workers must be an int <="),
        (["--mode", "async", "--async-loss", "ppo"], "invalid choice: 'ppo'"),
    ],
)
def test_cli_bad_async_arguments_are_one_line(tmp_path, capsys, argv, message):
    try:
        code = main(["rl", "train", "--out", str(tmp_path / "r"), "--quiet", *argv])
    except SystemExit as exit_:  # argparse's own errors exit like argparse does
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("glmport: error:") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "argv, absent, message",
    [
        (
            ["train", "--mode", "async", "--steps", "1", "--eval-every", "0"],
            "ray",
            "glmport rl train",
        ),
        (["serve", "--model", "tiny"], "ray", "glmport rl serve"),
        (["serve", "--model", "tiny", "--local"], "fastapi", "glmport rl serve"),
        (["agent", "--episodes", "1"], "httpx", "glmport rl agent"),
    ],
)
def test_without_the_rl_extra_each_command_is_one_error_line(
    tmp_path, capsys, monkeypatch, argv, absent, message
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a)
    )
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "run"), "--quiet"]
    assert main(["rl", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmport: error:") and err.count("\n") == 1
    assert f"{message} needs the rl extra ({absent} not installed)" in err
    assert install_command([absent]) in err
