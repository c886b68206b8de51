"""The environment glmport runs in: the ``GLMPORT_*`` variables, parsed and checked in
one place (:data:`VARIABLES`, :func:`read`), and what a report needs to say about where
it ran (versions, platform, device).

Versions come from package metadata instead of importing optional packages, so asking
never imports a vendor SDK; which packages to ask about, the backends' manifests say.
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch

from .errors import ConfigError
from .specs import INTERFACE_NAMES


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """glmport, python and torch, then the vendor software the backends declare in
    their manifests' ``stack``: a distribution's version, or for ``"$VAR"`` the
    toolkit path the variable holds (None: absent)."""
    from .registry import REGISTRY

    found: dict[str, str | None] = {
        "glmport": _version("glmport"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for item in REGISTRY.stack():
        found[item] = os.environ.get(item[1:]) if item.startswith("$") else _version(item)
    return found


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the accelerator model its torch device module
    reports (``torch.<type>.get_device_name``), or the CPU and platform."""
    if device.type == "cpu":
        return f"{platform.machine()} CPU ({platform.system()}, {os.cpu_count()} cores)"
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    try:
        return get_name(device) if get_name is not None else str(device)
    except (RuntimeError, AssertionError):  # the device module exists but no device does
        return str(device)


# --- The GLMPORT_* variables -------------------------------------------------------
#
# Every GLMPORT_* variable is parsed here and only here, whichever module reads it, so a
# value means the same to the selection, the shadow checker and the generic backend's
# tiling, and every malformed value fails the same way: a ConfigError naming the
# variable, the value and what is accepted. Parsed values are cached per raw string:
# a read costs one dict lookup once a value has been seen.

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# Plain ASCII decimals only: Python's int() and float() also take other scripts' digits
# ("١٢"), "_" separators, "inf" and "nan", none of which a setting should mean.
_ASCII_INT = re.compile(r"\+?[0-9]{1,19}", re.ASCII)
_ASCII_DECIMAL = re.compile(r"\+?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?", re.ASCII)
_INT64_MAX = (1 << 63) - 1


def _bool(raw: str) -> bool:
    value = raw.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError


def _name(raw: str) -> str:
    if any(c.isspace() or c == "," for c in raw):
        raise ValueError("one name, no spaces or commas")
    return raw


def _device(raw: str) -> str:
    try:
        return str(torch.device(raw))
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(str(err).splitlines()[0]) from None


def _count(raw: str) -> int:
    if not _ASCII_INT.fullmatch(raw) or int(raw) > _INT64_MAX:
        raise ValueError
    return int(raw)


def _validate_mode(raw: str) -> str:
    mode = raw.lower()
    if mode not in ("strict", "full", "meta"):
        raise ValueError
    return mode


def _mebibytes(raw: str) -> float:
    if not _ASCII_DECIMAL.fullmatch(raw):
        raise ValueError
    mb = float(raw)
    if not math.isfinite(mb):
        raise ValueError("too large")
    if mb * (1 << 20) < 1:
        raise ValueError("less than one byte")
    return mb


def _known_op(op: str, raw: str, source: str) -> str:
    """``op`` when it is an op of the interface; else a ConfigError naming ``source`` and
    its text ``raw`` as given."""
    if op not in INTERFACE_NAMES:
        raise ConfigError(
            f"{source}={raw!r}: unknown op {op!r}; ops are {', '.join(INTERFACE_NAMES)}"
        )
    return op


def parse_op_names(raw: str, source: str) -> tuple[str, ...]:
    """Parse ``"op,op"`` (such as ``glmport conformance --ops``) into op names; an unknown
    op, one named twice or no op at all is a :class:`ConfigError` naming ``source``."""
    ops = [_known_op(op, raw, source) for op in filter(None, (e.strip() for e in raw.split(",")))]
    twice = sorted({op for op in ops if ops.count(op) > 1})
    if twice or not ops:
        why = f"op {twice[0]!r} given twice" if twice else "no op named"
        raise ConfigError(f"{source}={raw!r}: {why}; expected comma-separated op names")
    return tuple(ops)


def parse_op_overrides(raw: str, source: str = "GLMPORT_OPS") -> tuple[tuple[str, str], ...]:
    """Parse ``"op=backend,op=backend"`` into ``((op, backend), ...)``. A malformed
    entry, an unknown op or an op named twice is a :class:`ConfigError` naming
    ``source``; whether each backend exists is checked when the op is resolved."""
    pairs: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        op, sep, backend = (p.strip() for p in entry.partition("="))
        if not sep or not op or not backend:
            raise ConfigError(f"{source}={raw!r}: malformed entry {entry!r}; expected op=backend")
        _known_op(op, raw, source)
        if op in pairs:
            # Which one should win is a guess either way: refuse rather than pick.
            raise ConfigError(
                f"{source}={raw!r}: op {op!r} given twice ({op}={pairs[op]}, {op}={backend}); "
                "expected each op at most once"
            )
        pairs[op] = backend
    return tuple(pairs.items())


@dataclass(frozen=True)
class Variable:
    """One ``GLMPORT_*`` variable: ``parse`` turns its stripped, non-empty text into the
    typed value (raising ValueError, optionally with why, on anything else); unset or
    blank gives ``default``; ``accepted`` says what is accepted, for errors and docs."""

    name: str
    accepted: str
    default: object
    parse: Callable[[str], object]
    doc: str


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(
            "GLMPORT_BACKEND",
            "a backend name (see `glmport info`) or auto",
            "auto",
            _name,
            "the backend that runs every op (auto: the best for the inputs' device)",
        ),
        Variable(
            "GLMPORT_DEVICE",
            "a torch device present here, such as cpu or cuda:0 (npu:0 needs torch_npu)",
            None,
            _device,
            "the torch device for device-neutral code",
        ),
        Variable(
            "GLMPORT_EMULATE",
            "1 or 0 (true/false, yes/no, on/off)",
            False,
            _bool,
            "1 runs vendor backends on the CPU (Triton interpreter, NPU emulator)",
        ),
        Variable(
            "GLMPORT_OPS",
            "comma-separated op=backend entries, each op at most once",
            (),
            parse_op_overrides,
            "per-op overrides of the backend",
        ),
        Variable(
            "GLMPORT_SHADOW",
            "a backend name (see `glmport info`), usually cpu",
            None,
            _name,
            "a backend to shadow-check live calls against",
        ),
        Variable(
            "GLMPORT_SHADOW_CALLS",
            f"a whole number from 0 to {_INT64_MAX} in ASCII digits",
            8,
            _count,
            "how many calls per op the shadow checks",
        ),
        Variable(
            "GLMPORT_VALIDATE",
            "strict, full or meta",
            "full",
            _validate_mode,
            "full (default) also checks index and key ranges, scales and per-query "
            "tensors (device-side asserts off the CPU); strict adds whole-cache scans "
            "(finite keys, float32 overflow bounds) and reads every check on the host; "
            "meta checks shapes, dtypes and devices only",
        ),
        Variable(
            "GLMPORT_TILE_MB",
            "a finite number of MiB above zero in ASCII digits, such as 256 or 0.5",
            256.0,
            _mebibytes,
            "the generic backend's memory budget for one tile of intermediates",
        ),
    )
}

_parsed: dict[tuple[str, str], object] = {}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of ``GLMPORT_*`` variable ``name`` in ``environ`` (default: the
    process environment), its default when unset or blank. Raises :class:`ConfigError`
    naming the variable, its value and what is accepted."""
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return var.default
    key = (name, raw)
    try:
        return _parsed[key]
    except KeyError:
        pass
    try:
        value = var.parse(raw.strip())
    except ConfigError:
        raise
    except ValueError as err:
        why = f" ({err})" if str(err) else ""
        raise ConfigError(f"{name}={raw!r}{why}: expected {var.accepted}") from None
    if len(_parsed) > 1024:  # values that keep changing must not grow it without bound
        _parsed.clear()
    _parsed[key] = value
    return value


def read_all(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every ``GLMPORT_*`` variable's typed value (:func:`read` of each), so one bad
    value fails whichever of them the caller needs."""
    return {name: read(name, environ) for name in VARIABLES}


def require_device(device: str | torch.device, source: str) -> torch.device:
    """``device`` as a torch device, checked to exist here: the CPU and ``meta``
    always do; another type needs its torch device module (``torch.cuda``, or
    ``torch.npu`` once torch_npu is imported) to count a device at its index.
    Raises :class:`ConfigError` naming ``source`` otherwise."""
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return dev
    count_devices = getattr(getattr(torch, dev.type, None), "device_count", None)
    if count_devices is None:
        raise ConfigError(
            f"{source}: device {str(dev)!r}, but torch has no {dev.type!r} device module "
            "here (is the vendor's torch plug-in installed and imported?); expected a "
            "torch device present here, such as cpu"
        )
    try:
        count = int(count_devices())
    except (RuntimeError, AssertionError):  # the module exists but no driver does
        count = 0
    if (dev.index or 0) >= count:
        present = f"{dev.type}:0 to {dev.type}:{count - 1}" if count else "such as cpu"
        raise ConfigError(
            f"{source}: device {str(dev)!r}, but torch sees {count} {dev.type} device(s) "
            f"here; expected a torch device present here, {present}"
        )
    return dev
