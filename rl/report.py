"""Run outputs of the RL demonstrations: a metrics JSONL file and a PNG of the curves."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from glmport.core.errors import ConfigError
from glmport.core.extras import install_command

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MetricsLog", "curves_figure", "plot_curves", "rewrite_jsonl"]


def _plain(value: Any, key: str) -> Any:
    """``value`` as a JSON-ready Python object; non-finite floats become None (null)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"metric '{key}' must be a scalar, got a tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    elif hasattr(value, "item") and hasattr(value, "dtype"):
        # numpy scalars and 0-d arrays, without importing numpy here
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    raise ConfigError(
        f"metric '{key}' must be a number, string, scalar tensor, list or dict, "
        f"got {type(value).__name__}"
    )


def rewrite_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the JSON-lines file ``path`` with ``records``, atomically: they are
    written to a temporary file beside it, flushed, and renamed over it, so a process
    killed meanwhile leaves the old file or the new one, never a cut one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """Append-only JSON-lines metrics file, one record per line, flushed on every write.

    NaN and infinities are written as ``null`` (JSON has no NaN) so a diverging run
    keeps logging. Usable as a context manager, which closes the file.
    """

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line.

        Values may be Python numbers, strings, None, 0-d / one-element tensors, numpy
        scalars, or lists / dicts of those; non-finite floats are written as null.
        """
        if not isinstance(record, dict):
            raise ConfigError(f"argument 'record' must be a dict, got {type(record).__name__}")
        if self._file.closed:
            raise ConfigError(f"MetricsLog for {self.path} is closed; open a new one to write")
        line = {str(k): _plain(v, str(k)) for k, v in record.items()}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """All records of a metrics file, in order; blank lines are skipped, null stays None."""
        records = []
        with Path(path).open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ConfigError(
                        f"metrics file {path} line {lineno} is not valid JSON: {err}"
                    ) from err
        return records


# The reward panel's series: the rollouts' mean reward, the greedy held-out evaluation.
REWARD_KEYS = ("reward", "eval_reward")


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        out.append(float(v) if ok else math.nan)
    return out


def _present(records: list[dict[str, Any]], key: str) -> bool:
    return any(not math.isnan(v) for v in _series(records, key))


def _from_zero(ax, values: list[float]) -> None:
    """Start ``ax``'s linear y axis at 0 for a series that is never negative; an
    all-zero one gets ``[0, 1]`` (matplotlib would centre it on 0, half the axis
    below any value it can take)."""
    drawn = [v for v in values if not math.isnan(v)]
    if not drawn or min(drawn) < 0:
        return
    if max(drawn) == 0:
        ax.set_ylim(0, 1)
    else:
        ax.set_ylim(bottom=0)


def _twin_and_legend(
    ax,
    xs: list[float],
    records: list[dict[str, Any]],
    key: str,
    color: str,
    label: str,
    *,
    fraction: bool = False,
) -> None:
    """Draw ``key`` on a twin y axis of ``ax`` when present (from 0 when a
    ``fraction``); one legend for both axes."""
    handles, labels = ax.get_legend_handles_labels()
    if _present(records, key):
        twin = ax.twinx()
        ys = _series(records, key)
        twin.plot(xs, ys, color=color, label=key)
        twin.set_ylabel(label)
        if fraction:
            _from_zero(twin, ys)
        h, lab = twin.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        ax.legend(handles, labels, loc="best")


def curves_figure(records: list[dict[str, Any]], *, title: str = "") -> Figure:
    """The matplotlib ``Figure`` of the training curves (Agg canvas, no pyplot).

    Two stacked panels sharing the x axis ``step`` (a record without ``step`` uses its
    index): (1) :data:`REWARD_KEYS` (sparse ones, like ``eval_reward``, as joined points)
    and ``reverse_kl`` (distillation) on a twin axis; (2) ``mismatch_mean`` and
    ``mismatch_max`` (|delta logp| between training and rollout log-probs; log-scale y
    when every drawn value is positive, else from 0) with ``pop_fraction`` on a twin
    axis from 0 (``[0, 1]`` while it is 0 throughout). Missing keys and null values are
    not drawn. ``title``: the figure's suptitle (none if empty).

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ConfigError(
            "plot_curves needs matplotlib, which is not installed: "
            + install_command(["matplotlib"])
        ) from err

    xs = [
        float(r["step"]) if isinstance(r.get("step"), (int, float)) else float(i)
        for i, r in enumerate(records)
    ]
    # Figure + Agg canvas directly (no pyplot): no display and no global backend switch.
    fig = Figure(figsize=(7, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_reward, ax_mis = fig.subplots(2, 1, sharex=True)

    for key in REWARD_KEYS:
        if _present(records, key):
            # Sparse series (an evaluation every few steps) as points joined over gaps.
            pts = [(x, y) for x, y in zip(xs, _series(records, key), strict=True) if y == y]
            ax_reward.plot(*zip(*pts, strict=True), label=key, marker="." if len(pts) < 100 else "")
    ax_reward.set_ylabel("reward")
    _twin_and_legend(
        ax_reward, xs, records, "reverse_kl", "tab:purple", "reverse KL to the teacher"
    )

    drawn: list[float] = []
    for key in ("mismatch_mean", "mismatch_max"):
        if _present(records, key):
            ys = _series(records, key)
            ax_mis.plot(xs, ys, label=key)
            drawn += [y for y in ys if not math.isnan(y)]
    if drawn and all(y > 0 for y in drawn):
        ax_mis.set_yscale("log")
    else:
        _from_zero(ax_mis, drawn)
    ax_mis.set_ylabel("|delta logp|")
    _twin_and_legend(ax_mis, xs, records, "pop_fraction", "tab:red", "pop_fraction", fraction=True)
    ax_mis.set_xlabel("step")
    if title:
        fig.suptitle(title)
    return fig


def plot_curves(records: list[dict[str, Any]], out: Path, *, title: str = "") -> Path:
    """Write a PNG of the training curves (:func:`curves_figure`) and return its path.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    out = Path(out)
    fig = curves_figure(records, title=title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
