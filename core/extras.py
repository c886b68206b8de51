"""Optional dependencies: which extra installs each, and one message for a missing one.

Heavy or hardware-only packages live in extras and are imported lazily; a command or a
backend that needs one checks for it here first (without importing it), so the user
reads which package is missing and the pip command that installs it, not a
``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib.util

from .errors import ConfigError

# import name -> (distribution, extra)
EXTRAS: dict[str, tuple[str, str]] = {
    "onnx": ("onnx", "export"),
    "onnxruntime": ("onnxruntime", "export"),
    "onnxscript": ("onnxscript", "export"),
    "tvm": ("apache-tvm", "export"),
    "ray": ("ray", "rl"),
    "fastapi": ("fastapi", "rl"),
    "uvicorn": ("uvicorn", "rl"),
    "httpx": ("httpx", "rl"),
    "rich": ("rich", "rl"),
    "matplotlib": ("matplotlib", "rl"),
}


def _absent(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _install(absent: list[str]) -> tuple[str, str]:
    """The extras' names and the pip command that installs them."""
    extras = ",".join(dict.fromkeys(EXTRAS[m][1] for m in absent))
    return extras, f"pip install 'glmport[{extras}]'"


def missing(*modules: str) -> str:
    """``"apache-tvm not installed: pip install 'glmport[export]'"`` for the ``modules``
    (keys of :data:`EXTRAS`) that are not installed; "" when all are."""
    absent = _absent(modules)
    if not absent:
        return ""
    names = ", ".join(EXTRAS[m][0] for m in absent)
    return f"{names} not installed: {_install(absent)[1]}"


def require(what: str, *modules: str) -> None:
    """Raise a ConfigError saying ``what`` needs the extra of ``modules`` (keys of
    :data:`EXTRAS`) when one of them is not installed."""
    absent = _absent(modules)
    if absent:
        extras, command = _install(absent)
        names = ", ".join(EXTRAS[m][0] for m in absent)
        raise ConfigError(f"{what} needs the {extras} extra ({names} not installed): {command}")


def progress_bar(label: str, *text_columns: str, console: object = None, transient: bool = False):
    """A rich ``Progress`` in glmport's layout: ``label`` and the task's description, the
    bar, done / total, elapsed and remaining time, then ``text_columns`` (rich format
    strings such as ``"{task.fields[live]}"``). Needs rich (the ``rl`` extra)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(f"[bold]{label}[/] {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        *(TextColumn(text) for text in text_columns),
        console=console,
        transient=transient,
    )
