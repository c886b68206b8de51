"""Optional dependencies: which extra installs each, and one message for a missing one.

Heavy or hardware-only packages live in extras and are imported lazily; a command or a
backend that needs one checks for it here first (without importing it), so the user
reads which package is missing and a pip command that installs it where this glmport
came from (:func:`install_command`), not a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

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
# The README's CPU install pins torch with this file at the top of a clone.
CPU_CONSTRAINTS = "constraints-cpu.txt"


def _absent(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _clone() -> tuple[Path, bool] | None:
    """``(folder, editable)`` when this glmport was installed from a local folder (a
    clone: pip's ``direct_url.json`` says ``dir_info``), else None (a wheel, an index,
    or no installed distribution at all)."""
    try:
        text = metadata.distribution("glmport").read_text("direct_url.json")
        record = json.loads(text) if text else {}
    except (metadata.PackageNotFoundError, ValueError):
        return None
    url = urlparse(record.get("url", "")) if isinstance(record, dict) else None
    info = record.get("dir_info") if isinstance(record, dict) else None
    if url is None or url.scheme != "file" or not isinstance(info, dict):
        return None
    folder = Path(unquote(url.path))
    return (folder, bool(info.get("editable"))) if folder.is_dir() else None


def _cpu_torch() -> bool:
    """Whether the installed torch is a CPU build (the README pins those with
    :data:`CPU_CONSTRAINTS`; GPU users install without it)."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _shown(path: Path) -> str:
    """``path`` as the user would type it from the current folder."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return str(path)
    return relative if not relative.startswith("..") else str(path)


def _requirements(distributions: list[str]) -> list[str]:
    """glmport's own requirement strings for ``distributions`` (``"rich>=13"``), the
    bare names where its metadata is not there to ask."""
    try:
        declared = metadata.requires("glmport") or []
    except metadata.PackageNotFoundError:
        declared = []
    found = {}
    for line in declared:
        spec = line.split(";")[0].strip()
        name = re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower()
        found.setdefault(name, spec)
    return [found.get(d.lower(), d) for d in distributions]


def install_command(modules: Sequence[str]) -> str:
    """A pip command that installs ``modules`` (keys of :data:`EXTRAS`) where this
    glmport came from (see :func:`pip_command`)."""
    return pip_command([EXTRAS[m][1] for m in modules], [EXTRAS[m][0] for m in modules])


def pip_command(extras: Sequence[str], distributions: Sequence[str]) -> str:
    """A pip command that installs glmport's ``extras`` (which bring ``distributions``)
    where this glmport came from. glmport is not on the package index, so ``pip install
    'glmport[rl]'`` works nowhere: from a clone the command reinstalls the clone with
    the extras (``pip install -c constraints-cpu.txt -e '.[rl]'``, the README's, with
    the constraints file only for a CPU build of torch); from anywhere else it names
    the distributions with glmport's version bounds (``pip install 'rich>=13'``)."""
    clone = _clone()
    if clone is None:
        wanted = _requirements(list(dict.fromkeys(distributions)))
        return "pip install " + " ".join(map(shlex.quote, wanted))
    folder, editable = clone
    words = ["pip", "install"]
    constraints = folder / CPU_CONSTRAINTS
    if constraints.is_file() and _cpu_torch():
        words += ["-c", shlex.quote(_shown(constraints))]
    if editable:
        words.append("-e")
    words.append(shlex.quote(f"{_shown(folder)}[{','.join(dict.fromkeys(extras))}]"))
    return " ".join(words)


def missing(*modules: str) -> str:
    """``"apache-tvm not installed: pip install ..."`` for the ``modules`` (keys of
    :data:`EXTRAS`) that are not installed (see :func:`install_command`); "" when all
    are."""
    absent = _absent(modules)
    if not absent:
        return ""
    names = ", ".join(EXTRAS[m][0] for m in absent)
    return f"{names} not installed: {install_command(absent)}"


def require(what: str, *modules: str) -> None:
    """Raise a ConfigError saying ``what`` needs the extra of ``modules`` (keys of
    :data:`EXTRAS`) when one of them is not installed."""
    absent = _absent(modules)
    if absent:
        extras = ",".join(dict.fromkeys(EXTRAS[m][1] for m in absent))
        names = ", ".join(EXTRAS[m][0] for m in absent)
        raise ConfigError(
            f"{what} needs the {extras} extra ({names} not installed): {install_command(absent)}"
        )


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
