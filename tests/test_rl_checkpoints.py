"""Damaged trainer checkpoints: every one is refused before anything is used.

A systematic damage generator over a synchronous and an asynchronous run folder: every
file of the checkpoint truncated, emptied, filled with garbage, deleted, replaced by a
folder or linked to another run's copy outside the folder; every key of
``state.json`` deleted, given the wrong JSON type or an out-of-range value, extra
keys; every field of the saved RL config deleted or given a wrong type and a bad value;
Adam's state partly missing, of the wrong shape, dtype or value; the policy's tensors
and config; the asynchronous trainer's queue and ledger; the run's metrics. Each case
resumes the run (``glmport.rl.run.train(resume=True)``, the path of ``glmport rl train
--resume``) and must end in a one-line ``ConfigError`` naming the damaged file and
field, with the run folder unchanged (nothing loaded, trained or written).

The outcome of each case (:mod:`fuzz_counts`' ``refused``; ``bad refusal``: a
ConfigError that does not name the file and field in one line, or refused after
changing the folder; ``accepted invalid``; ``traceback``: any other exception) is
counted; ``FUZZ_COUNTS=path`` appends the counts as JSON lines (docs/reliability.md
quotes them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from crash_points import Killed, die_at
from fuzz_counts import ACCEPTED_INVALID, BAD_REFUSAL, REFUSED, TRACEBACK, Counts, Outcome
from safetensors.torch import load_file, save_file

from glmport.cli import main
from glmport.core.errors import ConfigError
from glmport.model import weights as weights_module
from glmport.rl import checkpoint as checkpoint_module
from glmport.rl.async_trainer import LEDGER, AsyncTrainer
from glmport.rl.config import RLConfig
from glmport.rl.report import MetricsLog, rewrite_jsonl
from glmport.rl.run import train
from glmport.rl.staleness import GroupLedger
from glmport.rl.trainer import Trainer

COUNTS = Counts("rl checkpoints")
_write_counts = COUNTS.writer()


def _config(**changes) -> RLConfig:
    base = dict(
        task="reverse",
        task_args={"digits": 2},
        steps=1,
        prompts_per_step=2,
        group_size=2,
        lr=3e-3,
        kl_coef=0.05,
        seed=11,
        checkpoint_every=1,
        eval_every=0,
        rollout_backend="generic",
        train_backend="generic",
        model={"index_topk": 3},
    )
    return RLConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two pristine run folders: ``sync`` (one step trained and checkpointed) and
    ``async`` (a checkpoint at step 0 with a queue of 3 groups, one requeued)."""
    root = tmp_path_factory.mktemp("runs")
    train(_config(), root / "sync", progress=False)
    config = _config(mode="async", steps=0, rollout_workers=1, max_staleness=1)
    out = root / "async"
    trainer = AsyncTrainer(config, out)
    trainer.queue.extend(trainer._issue() for _ in range(3))
    trainer._requeue(trainer.queue.popleft(), "interrupted")
    trainer.save()
    GroupLedger(out / LEDGER, trainer.ledger.records).close()
    (out / "metrics.jsonl").write_text("")
    return {"sync": root / "sync", "async": out}


# -- damages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """One damaged checkpoint: ``apply(run, elsewhere)`` damages the copy ``run``
    (``elsewhere``: another run's copy, outside it); the error must name ``file`` and
    ``field``."""

    name: str
    run: str
    apply: Callable[[Path, Path], None]
    file: str
    field: str


CKPT = "checkpoint"
STATE = f"{CKPT}/state.json"
OPTIMIZER = f"{CKPT}/optimizer.safetensors"
POLICY_CONFIG = f"{CKPT}/policy/config.json"
POLICY_WEIGHTS = f"{CKPT}/policy/model.safetensors"
FILES = (STATE, OPTIMIZER, POLICY_CONFIG, POLICY_WEIGHTS)


def _rewrite_bytes(path: str, change: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def apply(run: Path, _: Path) -> None:
        file = run / path
        file.write_bytes(change(file.read_bytes()))

    return apply


def _delete(path: str) -> Callable[[Path, Path], None]:
    def apply(run: Path, _: Path) -> None:
        target = run / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    return apply


def _as_folder(path: str) -> Callable[[Path, Path], None]:
    def apply(run: Path, _: Path) -> None:
        (run / path).unlink()
        (run / path).mkdir()

    return apply


def _link_elsewhere(path: str) -> Callable[[Path, Path], None]:
    """``path`` replaced by a link to the other run's (valid) copy of it."""

    def apply(run: Path, elsewhere: Path) -> None:
        target = run / path
        shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        target.symlink_to(elsewhere / path)

    return apply


def _file_damages(run: str) -> list[Damage]:
    out = []
    for path in FILES:
        name = Path(path).name
        shapes = {
            "missing": _delete(path),
            "empty": _rewrite_bytes(path, lambda b: b""),
            "half": _rewrite_bytes(path, lambda b: b[: len(b) // 2]),
            # (a JSON file's final newline is not part of its value)
            "last-byte-cut": _rewrite_bytes(path, lambda b: b.rstrip(b"\n")[:-1]),
            "garbage": _rewrite_bytes(path, lambda b: b"\xff\xfe" * 40),
            "a-folder": _as_folder(path),
            "linked-out": _link_elsewhere(path),
        }
        for shape, apply in shapes.items():
            out.append(Damage(f"{run}:{path}:{shape}", run, apply, name, name))
    for shape, apply in {
        "missing": _delete(f"{CKPT}/policy"),
        "linked-out": _link_elsewhere(f"{CKPT}/policy"),
    }.items():
        out.append(Damage(f"{run}:policy:{shape}", run, apply, "policy", "policy"))
    out.append(Damage(f"{run}:checkpoint:linked-out", run, _link_elsewhere(CKPT), CKPT, "link"))
    out.append(
        Damage(
            f"{run}:metrics:linked-out", run, _link_elsewhere("metrics.jsonl"), "metrics", "link"
        )
    )
    out.append(
        Damage(
            f"{run}:metrics:garbage",
            run,
            _rewrite_bytes("metrics.jsonl", lambda b: b"{not json\n"),
            "metrics.jsonl",
            "line 1",
        )
    )
    return out


def _edit_state(change: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    """``state.json`` with ``change(state)`` made to it."""

    def apply(run: Path, _: Path) -> None:
        file = run / STATE
        state = json.loads(file.read_text())
        change(state)
        file.write_text(json.dumps(state))

    return apply


def _whole_state(value: object) -> Callable[[Path, Path], None]:
    return lambda run, _: (run / STATE).write_text(json.dumps(value))


def _at(keys: tuple, value: object, *, delete: bool = False) -> Callable[[dict], None]:
    """Set (or delete) the entry at the key path ``keys`` of the state."""

    def change(state: dict) -> None:
        node = state
        for key in keys[:-1]:
            node = node[key]
        if delete:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value

    return change


# Per JSON type of a config field: a value of the wrong type, and one of the right type
# that no run may hold.
_WRONG = {
    int: ("3", -5),
    float: ("x", -1.0),
    str: (5, "nope"),
    bool: (1, "true"),
    dict: ([], {"digits": 0}),
    tuple: ("routing", ["bogus"]),
}


def _config_kind(name: str) -> type:
    value = getattr(RLConfig(), name)
    if name in ("rollout_backend", "train_backend", "opd_teacher", "init"):
        return str
    if name in ("lr", "kl_coef", "icepop_beta"):
        return float
    return type(value)


def _state_damages(run: str) -> list[Damage]:
    out = []

    def add(name: str, change: Callable[[dict], None], field: str) -> None:
        out.append(Damage(f"{run}:state:{name}", run, _edit_state(change), "state.json", field))

    for value in ([], "x", None, 5):
        out.append(Damage(f"{run}:state:whole={value!r}", run, _whole_state(value), STATE, "JSON"))
    keys = ["step", "policy_version", "rl_config", "rng"]
    keys += ["optimizer_param_groups", "optimizer_state_params"]
    for key in keys:
        add(f"{key}:deleted", _at((key,), None, delete=True), key)
    add("extra-key", _at(("surprise",), 1), "surprise")
    for value in (-1, "1", 1.5, True, None, 2**70, 10, 0):
        add(f"step={value!r}", _at(("step",), value), "step" if value != 0 else "policy_version")
    for value in (-1, "1", 7, None):
        add(f"policy_version={value!r}", _at(("policy_version",), value), "policy_version")
    for value in ("x", {}, {"seed": 11}, {"seed": 11, "next_step": 0, "more": 1}):
        add(f"rng={value!r}", _at(("rng",), value), "rng")
    for key, value in (("seed", 12), ("seed", "11"), ("next_step", 5), ("next_step", True)):
        add(f"rng.{key}={value!r}", _at(("rng", key), value), f"rng.{key}")
    groups = ("optimizer_param_groups",)
    for value in ("x", [], [{}]):
        add(f"param_groups={value!r}", _at(groups, value), "optimizer_param_groups")
    for key, value in (
        ("lr", 1.0),
        ("lr", "x"),
        ("betas", [0.5, 0.9]),
        ("eps", -1.0),
        ("params", [0]),
        ("weight_decay", 0.1),
        ("surprise", 1),
    ):
        add(f"param_groups.{key}={value!r}", _at((*groups, 0, key), value), key)
    add("param_groups.amsgrad:deleted", _at((*groups, 0, "amsgrad"), None, delete=True), "amsgrad")
    held = ("optimizer_state_params",)
    for value in ("x", [-1], [999], [True], [1, 0], [0, 0]):
        add(f"state_params={value!r}", _at(held, value), "optimizer_state_params")
    add("state_params:one-dropped", lambda s: s[held[0]].pop(), "state.")
    add("state_params:indexer-added", _add_indexer_param, "state.")
    add("rl_config=x", _at(("rl_config",), "x"), "rl_config")
    add("rl_config.surprise", _at(("rl_config", "surprise"), 1), "surprise")
    for f in fields(RLConfig):
        add(f"rl_config.{f.name}:deleted", _at(("rl_config", f.name), None, delete=True), f.name)
        wrong_type, bad = _WRONG[_config_kind(f.name)]
        if f.name == "seed":
            bad = 2**64
        if f.name == "task_args":
            wrong_type = [2]
        for value in (wrong_type, bad):
            add(f"rl_config.{f.name}={value!r}", _at(("rl_config", f.name), value), f.name)
    add("rl_config.model=bad", _at(("rl_config", "model"), {"hidden_size": -1}), "hidden_size")
    return out


def _add_indexer_param(state: dict) -> None:
    """List a parameter that has no Adam state (the indexer's never gets a gradient)."""
    held = state["optimizer_state_params"]
    state["optimizer_state_params"] = sorted({*held, next(i for i in range(999) if i not in held)})


def _edit_tensors(path: str, change: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def apply(run: Path, _: Path) -> None:
        tensors = load_file(str(run / path))
        change(tensors)
        save_file(tensors, str(run / path))

    return apply


def _first(tensors: dict, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def _set(suffix: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def change(tensors: dict) -> None:
        key = _first(tensors, suffix)
        tensors[key] = make(tensors[key])

    return change


def _drop(suffix: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(_first(tensors, suffix))


def _drop_param(tensors: dict) -> None:
    index = _first(tensors, ".exp_avg").split(".")[1]
    for key in [k for k in tensors if k.startswith(f"state.{index}.")]:
        del tensors[key]


def _poke(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return make


def _tensor_damages() -> list[Damage]:
    out = []

    def add(name: str, path: str, change: Callable[[dict], None], field: str) -> None:
        file = "policy" if "policy" in path else Path(path).name
        out.append(Damage(f"sync:{name}", "sync", _edit_tensors(path, change), file, field))

    for suffix in ("exp_avg", "exp_avg_sq", "step"):
        add(f"optimizer:{suffix}:missing", OPTIMIZER, _drop(f".{suffix}"), f".{suffix}")
    add("optimizer:param-state:missing", OPTIMIZER, _drop_param, "is missing")
    add(
        "optimizer:extra",
        OPTIMIZER,
        lambda t: t.update({"state.999.exp_avg": t[_first(t, ".exp_avg")].clone()}),
        "state.999",
    )
    add(
        "optimizer:garbage-key",
        OPTIMIZER,
        lambda t: t.update({"garbage": torch.zeros(1)}),
        "garbage",
    )
    for name, suffix, make in (
        ("exp_avg:shape", ".exp_avg", lambda t: t.reshape(-1)[:-1].clone()),
        ("exp_avg:float64", ".exp_avg", lambda t: t.double()),
        ("exp_avg:float16", ".exp_avg", lambda t: t.half()),
        ("exp_avg:nan", ".exp_avg", _poke(math.nan)),
        ("exp_avg:inf", ".exp_avg", _poke(math.inf)),
        ("exp_avg_sq:negative", ".exp_avg_sq", _poke(-1.0)),
        ("step:0", ".step", lambda t: torch.tensor(0.0)),
        ("step:fraction", ".step", lambda t: torch.tensor(1.5)),
        ("step:huge", ".step", lambda t: torch.tensor(1e9)),
        ("step:nan", ".step", lambda t: torch.tensor(math.nan)),
        ("step:shape", ".step", lambda t: t.reshape(1)),
    ):
        add(f"optimizer:{name}", OPTIMIZER, _set(suffix, make), suffix)
    add("policy:tensor-missing", POLICY_WEIGHTS, _drop("lm_head.weight"), "lm_head.weight")
    add(
        "policy:tensor-extra",
        POLICY_WEIGHTS,
        lambda t: t.update({"extra.w": torch.zeros(2)}),
        "extra.w",
    )
    for name, make in (
        ("nan", _poke(math.nan)),
        ("shape", lambda t: t[:-1].clone()),
        ("float16", lambda t: t.half()),
        ("int", lambda t: t.int()),
    ):
        add(
            f"policy:lm_head:{name}", POLICY_WEIGHTS, _set("lm_head.weight", make), "lm_head.weight"
        )

    def edit_config(change: Callable[[dict], None]) -> Callable[[Path, Path], None]:
        def apply(run: Path, _: Path) -> None:
            file = run / POLICY_CONFIG
            data = json.loads(file.read_text())
            change(data)
            file.write_text(json.dumps(data))

        return apply

    for name, change, field in (
        ("index_topk=5", lambda d: d.update(index_topk=5), "index_topk"),
        ("index_topk=-1", lambda d: d.update(index_topk=-1), "index_topk"),
        ("rope_theta=1e4", lambda d: d["rope_parameters"].update(rope_theta=1e4), "rope"),
    ):
        out.append(
            Damage(f"sync:policy-config:{name}", "sync", edit_config(change), "policy", field)
        )
    return out


def _async_damages() -> list[Damage]:
    out = []

    def add(name: str, change: Callable[[dict], None], field: str) -> None:
        damage = Damage(f"async:queue:{name}", "async", _edit_state(change), "state.json", field)
        out.append(damage)

    section = ("async",)
    add("async:deleted", _at(section, None, delete=True), "async")
    add("async=x", _at(section, "x"), "async")
    for key in ("next_group", "pending", "ledger_records", "counts"):
        add(f"{key}:deleted", _at((*section, key), None, delete=True), key)
    add("async.surprise", _at((*section, "surprise"), 1), "surprise")
    for value in (-1, "3", 4, 2):
        add(f"next_group={value!r}", _at((*section, "next_group"), value), "next_group")
    for value in (-1, 999):
        add(f"ledger_records={value!r}", _at((*section, "ledger_records"), value), "ledger")
    add("counts:failed:deleted", _at((*section, "counts", "failed"), None, delete=True), "counts")
    for value in (-1, "1"):
        add(f"counts.stale={value!r}", _at((*section, "counts", "stale"), value), "counts.stale")
    pending = (*section, "pending")
    add("pending=x", _at(pending, "x"), "pending")
    add("pending[0]=x", _at((*pending, 0), "x"), "pending[0]")
    add("pending[0].seed:deleted", _at((*pending, 0, "seed"), None, delete=True), "pending[0]")
    for key, value in (
        ("group", 7),
        ("group", -1),
        ("group", 2),
        ("attempt", -1),
        ("attempt", 5),
        ("prompt", [0, 0, 10]),
        ("answer", [9, 9]),
        ("seed", 12345),
        ("seed", "x"),
    ):
        # another group or attempt is refused for its prompt or seed
        add(f"pending[0].{key}={value!r}", _at((*pending, 0, key), value), "pending[0]")
    add(
        "pending:twice", lambda s: s["async"]["pending"].append(s["async"]["pending"][0]), "pending"
    )
    out.append(
        Damage("async:queue:ledger-missing", "async", _delete(LEDGER), LEDGER, "ledger_records")
    )
    out.append(
        Damage(
            "async:queue:ledger-garbage",
            "async",
            _rewrite_bytes(LEDGER, lambda b: b"{cut"),
            LEDGER,
            "ledger",
        )
    )
    out.append(
        Damage("async:queue:ledger-linked-out", "async", _link_elsewhere(LEDGER), LEDGER, "link")
    )
    out.append(
        Damage(
            "async:state:mode=sync",
            "async",
            _edit_state(_at(("rl_config", "mode"), "sync")),
            "state.json",
            "mode",
        )
    )
    out.append(
        Damage(
            "sync:state:mode=async",
            "sync",
            _edit_state(_at(("rl_config", "mode"), "async")),
            "state.json",
            "async",
        )
    )
    return out


DAMAGES = [
    *_file_damages("sync"),
    *_file_damages("async"),
    *_state_damages("sync"),
    *_tensor_damages(),
    *_async_damages(),
]


# -- outcomes ----------------------------------------------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's hash, a link's target, a folder."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "folder"
    return out


def _damaged(runs: dict[str, Path], tmp_path: Path, damage: Damage) -> Path:
    run = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(runs[damage.run], run, symlinks=True)
    shutil.copytree(runs[damage.run], elsewhere, symlinks=True)
    damage.apply(run, elsewhere)
    return run


def outcome(run: Path, damage: Damage) -> Outcome:
    """Resume ``run`` as ``glmport rl train --resume`` does: how it ended."""
    before = _digest(run.parent)
    try:
        train(None, run, resume=True, progress=False)
    except ConfigError as err:
        message = str(err)
        if _digest(run.parent) != before:
            return Outcome(BAD_REFUSAL, "changed the run folder", message)
        if damage.file not in message or damage.field not in message or "\n" in message:
            return Outcome(BAD_REFUSAL, "not one line naming the file and field", message)
        return Outcome(REFUSED)
    except Exception as err:  # counted; the test then fails on it
        return Outcome(TRACEBACK, type(err).__name__, f"{type(err).__name__}: {err}")
    return Outcome(ACCEPTED_INVALID, problem=f"the damaged {damage.name} was resumed as if valid")


def test_the_generator_covers_every_file_and_field():
    names = [d.name for d in DAMAGES]
    assert len(names) == len(set(names))
    assert len(DAMAGES) >= 200
    for f in fields(RLConfig):
        assert any(f"rl_config.{f.name}=" in n for n in names), f.name


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.name for d in DAMAGES])
def test_a_damaged_checkpoint_is_refused_naming_file_and_field(runs, tmp_path, damage):
    run = _damaged(runs, tmp_path, damage)
    result = outcome(run, damage)
    COUNTS.add(result, **{"class": ":".join(damage.name.split(":")[:2])})
    assert not result.failed, f"{result}: {result.problem}"


@pytest.mark.parametrize("run", ["sync", "async"])
def test_the_pristine_runs_resume(runs, tmp_path, run):
    """The generator's baseline: the undamaged copies resume (so each refusal above is
    the damage's doing)."""
    copy = tmp_path / run
    shutil.copytree(runs[run], copy, symlinks=True)
    records = train(None, copy, resume=True, progress=False)
    assert len(records) == (1 if run == "sync" else 0)


@pytest.mark.parametrize(
    "name", ["sync:checkpoint/state.json:garbage", "sync:optimizer:param-state:missing"]
)
def test_the_cli_refuses_a_damaged_checkpoint_in_one_line(runs, tmp_path, capsys, name):
    damage = next(d for d in DAMAGES if d.name == name)
    run = _damaged(runs, tmp_path, damage)
    before = _digest(tmp_path)
    assert main(["rl", "train", "--out", str(run), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmport: error:") and err.count("\n") == 1, err
    assert damage.file in err and damage.field in err
    assert _digest(tmp_path) == before


# -- a save killed at any point ---------------------------------------------------------------


def test_a_trainer_save_killed_at_any_point_keeps_the_run(runs, tmp_path, monkeypatch):
    """``Trainer.save`` killed before each of its filesystem changes (the policy's
    nested save included): a fresh ``rl train`` into the folder is refused (the run is
    still there), ``--resume`` continues from the old checkpoint or, once it was renamed
    in, the new one, and the next save leaves no side folder."""

    def resumed(run: Path) -> Trainer:
        return Trainer.resume(run / CKPT, run)

    probe = tmp_path / "probe"
    shutil.copytree(runs["sync"], probe)
    new = resumed(probe)
    old_head = new.policy.lm_head.weight.detach().clone()
    with torch.no_grad():
        new.policy.lm_head.weight.add_(0.5)  # the new version: other weights
    with monkeypatch.context() as m:
        full = die_at(m, 10**9, weights_module, checkpoint_module)
        new.save()
    renamed_in = full.index("rename", f".{CKPT}.tmp-")
    assert len(full.seen) >= 15
    for k in range(len(full.seen) + 1):
        run = tmp_path / f"kill{k}"
        shutil.copytree(runs["sync"], run)
        with monkeypatch.context() as m:
            die_at(m, k, weights_module, checkpoint_module)
            with contextlib.suppress(Killed):
                new.save(run / CKPT)
        with pytest.raises(ConfigError, match="already holds a run"):
            train(_config(), run, progress=False)
        back = resumed(run)
        want = old_head + 0.5 if k > renamed_in else old_head
        assert torch.equal(back.policy.lm_head.weight, want), k
        back.save()
        assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [], k


def test_metrics_cut_back_on_resume_are_replaced_whole(tmp_path, monkeypatch):
    """Rewriting ``metrics.jsonl`` (a resume drops the records past the checkpoint)
    killed at any point leaves the old file or the new one, never a cut one."""
    old = [{"step": s, "reward": 0.5} for s in range(1, 6)]
    for k in range(3):
        path = tmp_path / f"kill{k}" / "metrics.jsonl"
        path.parent.mkdir()
        rewrite_jsonl(path, old)
        with monkeypatch.context() as m:
            ops = die_at(m, k)
            with contextlib.suppress(Killed):
                rewrite_jsonl(path, old[:2])
        assert [name for name, _ in ops.seen] == ["fsync", "replace"][: k + 1] or k == 2
        assert MetricsLog.read(path) == (old[:2] if k == 2 else old)
