"""An RL run with its outputs: a progress bar, ``metrics.jsonl``, ``curves.png`` and
a resumable checkpoint in the out dir (what ``glmport rl train`` does)."""

from __future__ import annotations

from pathlib import Path

from glmport.core.errors import ConfigError
from glmport.model.weights import recover_folder

from .async_trainer import LEDGER
from .checkpoint import read_state
from .config import RLConfig
from .report import MetricsLog, plot_curves, rewrite_jsonl
from .tasks import Task
from .trainer import CHECKPOINT, Trainer

METRICS = "metrics.jsonl"
CURVES = "curves.png"
# Shown beside the progress bar, in this order, when a step reports them.
_LIVE = (
    ("reward", "reward"),
    ("eval_reward", "eval"),
    ("mismatch_mean", "|dlogp|"),
    ("reverse_kl", "rev-KL"),
    ("staleness_mean", "stale"),
)


def train(
    config: RLConfig | None,
    out: str | Path,
    *,
    resume: bool = False,
    steps: int | None = None,
    progress: bool = True,
    options: dict | None = None,
) -> list[dict]:
    """Run ``config`` writing into ``out``, or continue the run in ``out``.

    Args:
        config: the run (ignored with ``resume``, which reads the checkpoint's).
        out: the run folder: ``metrics.jsonl`` (one JSON line per step),
            ``curves.png`` (reward and mismatch against step), ``checkpoint/``.
        resume: continue from ``out/checkpoint`` (checked whole first:
            :mod:`glmport.rl.checkpoint`); metrics past the checkpoint's step (written
            after it, by a run that then stopped) are dropped first. Without it, an
            ``out`` that holds a run (a checkpoint, metrics or a ledger) is refused:
            nothing of a run is overwritten unless resumed.
        steps: with ``resume``, a new total number of steps.
        progress: draw a rich progress bar on the terminal.
        options: keyword arguments of the asynchronous trainer besides its config
            (``ray_address``, ``worker_threads``, ...); mode ``"async"`` only.

    Returns:
        The metrics of every step in ``out/metrics.jsonl``.
    """
    out = Path(out)
    metrics_path = out / METRICS
    for name in (METRICS, LEDGER, CURVES):
        if (out / name).is_symlink():
            raise ConfigError(f"{out / name} is a link; a run's {name} is its own file")
    if resume:
        saved = read_state(out / CHECKPOINT)
        records = _read(metrics_path)
        trainer = trainer_class(saved.config.mode, options).resume(
            out / CHECKPOINT, out, options=options, **({} if steps is None else {"steps": steps})
        )
        kept = [r for r in records if r["step"] <= trainer.step_index]
        if len(kept) < len(records):
            rewrite_jsonl(metrics_path, kept)
    else:
        if config is None:
            raise ConfigError("train: a config is needed unless resuming")
        held = _run_files(out)
        if held:
            raise ConfigError(
                f"{out} already holds a run ({', '.join(held)}); resume it (--resume), "
                "or choose another --out"
            )
        trainer = trainer_class(config.mode, options)(config, out, **(options or {}))
        MetricsLog(metrics_path).close()
    title = curves_title(trainer.task, trainer.config.seed)
    with trainer, MetricsLog(metrics_path, append=True) as log:
        if progress:
            _run_with_progress(trainer, log)
        else:
            trainer.run(log.write)
    records = _read(metrics_path)
    if records:
        plot_curves(records, out / CURVES, title=title)
    return records


def curves_title(task: Task, seed: int) -> str:
    """The title of a run's ``curves.png``: the task's one-line description (which
    names the task once) and the run's seed."""
    return f"{task.describe()}, seed {seed}"


def trainer_class(mode: str, options: dict | None = None) -> type[Trainer]:
    """The trainer of ``mode`` (``"sync"`` or ``"async"``); ``options`` are the
    asynchronous trainer's only."""
    if mode == "async":
        from .async_trainer import AsyncTrainer

        return AsyncTrainer
    if options:
        raise ConfigError(f"{', '.join(sorted(options))}: options of mode 'async' only")
    return Trainer


def _run_files(out: Path) -> list[str]:
    """What in ``out`` belongs to an earlier run: a checkpoint (one an interrupted save
    moved aside is put back first), a non-empty metrics file or ledger."""
    recover_folder(out / CHECKPOINT)
    held = [CHECKPOINT] if (out / CHECKPOINT).exists() else []
    for name in (METRICS, LEDGER):
        if (out / name).is_file() and (out / name).stat().st_size:
            held.append(name)
    return held


def _read(path: Path) -> list[dict]:
    """The metrics records of ``path`` (none when it is absent), each an object with
    its int ``step``."""
    records = MetricsLog.read(path) if path.is_file() else []
    for line, record in enumerate(records, start=1):
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"{path}: record {line} has no int step: {str(record)[:60]}")
    return records


def _run_with_progress(trainer: Trainer, log: MetricsLog) -> None:
    from glmport.core.extras import progress_bar

    with progress_bar("rl", "{task.fields[live]}") as bar:
        task = bar.add_task(
            trainer.config.task,
            total=trainer.config.steps,
            completed=trainer.step_index,
            live="",
        )

        def on_step(metrics: dict) -> None:
            log.write(metrics)
            live = "  ".join(f"{name} {metrics[k]:.3f}" for k, name in _LIVE if k in metrics)
            bar.update(task, completed=trainer.step_index, live=live)

        trainer.run(on_step)
