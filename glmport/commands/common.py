"""What several ``glmport`` commands share: the bounded argument types (``integer``,
``real``, ``seed``, ``workers``), the flags declared alike by several commands
(``add_model``, ``add_backend``, ``add_dtype``, ``add_json``, ``add_emulate``,
``add_plugin``), the checks made before any work (``check_environment``,
``check_out``, ``select_backend``, ``fits_model``) and ``--model``'s loader.

Everything here is cheap to import: torch, the model and the rest are imported inside
the functions that need them, so ``glmport --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmport.core import environment
from glmport.core.errors import ConfigError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from glmport.model import GlmMoeDsaForCausalLM

# Upper bounds of the command line's counts: far above any real use, low enough that a
# typo (an extra digit, 1000000000 for 1000) is one error line here instead of a hang
# or an allocator failure later. Token counts are checked again against the model's
# max_position_embeddings once it is loaded (fits_model).
MAX_TOKENS = 1 << 24  # tokens of one sequence or request
MAX_WORKERS = 256  # processes or actors, each with its own copy of the model
MAX_COUNT = 1 << 20  # episodes, turns, sessions, calibration sequences, layers
# Plain ASCII integers only: int() also takes "1_000", other scripts' digits and
# strings of any length (and a 5000-digit one raises ValueError).
_INTEGER = re.compile(r"[+-]?[0-9]{1,40}", re.ASCII)


def integer(low: int, high: int, why: str = "", *, shown: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` in ASCII digits, or one
    error line naming the range (``shown`` instead of the numbers) and ``why``. The
    bounds stay readable on it (``.low``, ``.high``) for help and tests."""
    span = shown or f"from {low} to {high}"
    reason = f" ({why})" if why else ""

    def parse(text: str) -> int:
        if not _INTEGER.fullmatch(text) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"expected an integer {span}{reason}, got {text!r}")
        return int(text)

    parse.low, parse.high = low, high
    return parse


def real(low: float, why: str) -> Callable[[str], float]:
    """An argparse type: a finite number of at least ``low``, or one error line saying
    ``why``. The bound stays readable on it (``.low``) for help and tests."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(
                f"expected a finite number >= {low:g} ({why}), got {text!r}"
            )
        return value

    parse.low = low
    return parse


seed = integer(-(1 << 63), (1 << 64) - 1, "64 bits", shown="from -2**63 to 2**64-1")
_xdist_count = integer(0, MAX_WORKERS)


def workers(text: str) -> str:
    """pytest-xdist's -n: auto, logical, or a number of workers (0: none)."""
    if text in ("auto", "logical"):
        return text
    try:
        return str(_xdist_count(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected auto, logical or a number of workers from 0 (none) to {MAX_WORKERS}, "
            f"got {text!r}"
        ) from None


def add_model(
    parser: argparse.ArgumentParser,
    *,
    required: bool = True,
    default: str | None = None,
    help: str = "'tiny' (random, seed 0) or a checkpoint folder",
    layers: bool = False,
) -> None:
    """``--model``, loaded by :func:`load_model`; with ``layers``, ``--layers`` too."""
    parser.add_argument("--model", required=required, default=default, help=help)
    if layers:
        parser.add_argument(
            "--layers",
            default=None,
            help="load only these decoder layers of a checkpoint folder, e.g. 0-1 or 3 "
            "(the embedding, these layers and the head, without MTP; only their tensors "
            "are read)",
        )


def parse_layers(text: str | None, flag: str = "--layers") -> range | None:
    """``"0-1"`` -> ``range(0, 2)``, ``"3"`` -> ``range(3, 4)``, None -> None."""
    if text is None:
        return None
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ConfigError(
            f"{flag} must be a layer or a range of layers such as 0-1, got {text!r}"
        ) from None
    if lo < 0 or hi < lo:
        raise ConfigError(f"{flag} must name layers a-b with 0 <= a <= b, got {text!r}")
    return range(lo, hi + 1)


def add_backend(
    parser: argparse.ArgumentParser,
    help: str = "glmport backend (default: the selection)",
) -> None:
    """``--backend``: a backend name, checked by :func:`select_backend` (None: the
    selection in force)."""
    parser.add_argument("--backend", default=None, help=help)


def add_dtype(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--dtype``: the model's, fp32 or bf16 (fp32 by default)."""
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help=help)


def add_json(
    parser: argparse.ArgumentParser,
    help: str = "print machine-readable JSON",
) -> None:
    """``--json``: the report as JSON on stdout."""
    parser.add_argument("--json", action="store_true", help=help)


def add_emulate(parser: argparse.ArgumentParser, help: str) -> None:
    """``--emulate``: vendor backends run their CPU emulation."""
    parser.add_argument("--emulate", action="store_true", help=help)


def add_plugin(parser: argparse.ArgumentParser, help: str) -> None:
    """``--plugin MODULE:ATTR`` (repeatable): a backend defined in code, to register
    with ``register_backend_target`` before anything is checked."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR", help=help)


def check_environment() -> None:
    """Parse every ``GLMPORT_*`` variable (the tile budget too, which the library reads
    only when the generic backend tiles) and check that ``GLMPORT_DEVICE`` exists here,
    so a malformed one fails before any work (ConfigError naming it)."""
    from glmport.core.selection import current_settings, selected_device

    environment.read_all()
    selected_device(current_settings())


def check_out(path: str, flag: str, *, folder: bool = True, empty: bool = False) -> Path:
    """Check, before any work, that ``flag``'s ``path`` can be written: nothing there
    yet, or a folder (``folder=False``: a file), inside a folder that lets a file be
    created (tried: permissions alone do not say it for root or a read-only mount);
    with ``empty``, an existing folder must hold nothing a run would overwrite. Creates
    nothing. A ConfigError naming ``flag`` otherwise."""
    if not path:
        raise ConfigError(f"{flag} must name a path, got ''")
    out = Path(path)
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"{flag} {out} is a link to nothing ({os.readlink(out)})")
    if out.exists():
        if folder and not out.is_dir():
            raise ConfigError(f"{flag} {out} exists and is not a folder")
        if not folder and out.is_dir():
            raise ConfigError(f"{flag} {out} is a folder; expected a file to write")
        if empty and any(out.iterdir()):
            raise ConfigError(
                f"{flag} {out} already holds files this would overwrite; choose another {flag}"
            )
    where = out if out.is_dir() else out.parent
    while not where.exists():  # the nearest folder that exists: the rest is made later
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"{flag} {out}: {where} is a file, so nothing can be made under it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".glmport-probe-", dir=where)
    except OSError as err:
        raise ConfigError(f"{flag} {out}: cannot write in {where} ({err.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return out


def select_backend(name: str | None, flag: str) -> AbstractContextManager[Any]:
    """``use_backend`` for the backend a command-line ``flag`` named (None: the
    selection in force), so an unknown, unavailable or empty one is reported as
    ``flag``'s."""
    from glmport.core.selection import use_backend

    if name == "":  # not "the selection": a flag given must name something
        raise ConfigError(f"{flag} must name a backend, got ''")
    return use_backend(name, source=flag)


def fits_model(model: GlmMoeDsaForCausalLM, flag: str, tokens: int) -> None:
    """``tokens`` (from ``flag``) must fit the loaded model's context."""
    limit = model.config.max_position_embeddings
    if tokens > limit:
        raise ConfigError(
            f"{flag}: {tokens} tokens exceed the model's max_position_embeddings {limit}"
        )


def parse_ids(text: str, flag: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"{flag} must be comma-separated integers such as 1,2,3, got {text!r}"
        ) from None


def load_model(spec: str, dtype: str = "fp32", layers: str | None = None) -> GlmMoeDsaForCausalLM:
    """``--model``: "tiny" (random, seed 0) or a checkpoint folder, in ``dtype``;
    ``layers`` (``--layers``, a checkpoint folder only): a slice of its decoder layers.
    Commands call it as ``common.load_model`` so that tests can replace it here."""
    import torch

    from glmport.model import GlmMoeDsaForCausalLM

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    sliced = parse_layers(layers)
    if spec == "tiny" and sliced is not None:
        raise ConfigError("--layers slices a checkpoint folder; --model tiny has no file to read")
    if spec == "tiny":
        model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    elif Path(spec).is_dir():  # cast as read: a checkpoint of mixed dtypes loads as one
        model = GlmMoeDsaForCausalLM.from_pretrained(spec, dtype=torch_dtype, layers=sliced)
    else:
        raise ConfigError(
            f"--model must be 'tiny' or a checkpoint folder with config.json, got {spec!r}"
        )
    return model.to(torch_dtype).eval()
