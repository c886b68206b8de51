"""Which backend runs each op: environment variables, an in-code context manager,
per-op overrides, ``auto`` and the fallback chain.

Environment (read on use, never at import):

``GLMPORT_BACKEND``   cpu | generic | cuda | ascend | <plug-in> | auto (default auto)
``GLMPORT_DEVICE``    the torch device for device-neutral code (``cuda:0``, ``npu:0``...)
``GLMPORT_EMULATE``   1 runs vendor backends on the CPU (Triton interpreter, NPU emulator)
``GLMPORT_OPS``       per-op overrides, ``op=backend,op=backend``
``GLMPORT_SHADOW``    a backend to shadow-check live calls against (``cpu``)
``GLMPORT_SHADOW_CALLS``  how many calls per op the shadow checks (default 8)
``GLMPORT_VALIDATE``  full (default) | meta: skip checks that read tensor values
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from .errors import BackendUnavailableError, ConfigError, UnknownBackendError
from .registry import ANY_DEVICE, REGISTRY, Kernel
from .specs import OP_NAMES

log = logging.getLogger("glmport")

AUTO = "auto"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """The selection in force: what the environment says, as amended in code."""

    backend: str = AUTO
    device: str | None = None
    emulate: bool = False
    ops: tuple[tuple[str, str], ...] = ()
    shadow: str | None = None
    shadow_calls: int = 8
    validate_values: bool = True

    def op_override(self, op: str) -> str | None:
        return dict(self.ops).get(op)


def _parse_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{var}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def parse_op_overrides(raw: str, source: str = "GLMPORT_OPS") -> tuple[tuple[str, str], ...]:
    """Parse ``"op=backend,op=backend"``; unknown ops or malformed entries are errors."""
    pairs = []
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        op, sep, backend = (p.strip() for p in entry.partition("="))
        if not sep or not op or not backend:
            raise ConfigError(f"{source}: malformed entry {entry!r}; expected op=backend")
        if op not in OP_NAMES:
            raise ConfigError(f"{source}: unknown op {op!r}; ops are {', '.join(OP_NAMES)}")
        pairs.append((op, backend))
    return tuple(pairs)


def _parse_device(raw: str, var: str = "GLMPORT_DEVICE") -> str:
    try:
        return str(torch.device(raw.strip()))
    except (RuntimeError, ValueError) as err:
        raise ConfigError(f"{var}={raw!r} is not a torch device ({err})") from err


_ENV_VARS = (
    "GLMPORT_BACKEND",
    "GLMPORT_DEVICE",
    "GLMPORT_EMULATE",
    "GLMPORT_OPS",
    "GLMPORT_SHADOW",
    "GLMPORT_SHADOW_CALLS",
    "GLMPORT_VALIDATE",
    "GLMPORT_TILE_MB",
)
_env_cache: dict[tuple[str | None, ...], Settings] = {}


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the ``GLMPORT_*`` variables; :class:`ConfigError` names a malformed one."""
    env = os.environ if environ is None else environ
    key = tuple(env.get(v) for v in _ENV_VARS)
    if key in _env_cache:
        return _env_cache[key]
    backend = (env.get("GLMPORT_BACKEND") or AUTO).strip() or AUTO
    device = env.get("GLMPORT_DEVICE")
    shadow = (env.get("GLMPORT_SHADOW") or "").strip() or None
    calls_raw = env.get("GLMPORT_SHADOW_CALLS", "8").strip()
    if not calls_raw.isdigit():
        raise ConfigError(f"GLMPORT_SHADOW_CALLS={calls_raw!r}: expected a non-negative integer")
    validate = (env.get("GLMPORT_VALIDATE") or "full").strip().lower()
    if validate not in ("full", "meta"):
        raise ConfigError(f"GLMPORT_VALIDATE={validate!r}: expected 'full' or 'meta'")
    settings = Settings(
        backend=backend,
        device=_parse_device(device) if device and device.strip() else None,
        emulate=_parse_bool("GLMPORT_EMULATE", env.get("GLMPORT_EMULATE", "")),
        ops=parse_op_overrides(env.get("GLMPORT_OPS", "")),
        shadow=shadow,
        shadow_calls=int(calls_raw),
        validate_values=validate == "full",
    )
    _env_cache[key] = settings
    return settings


_overrides: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar(
    "glmport_backend_overrides", default=()
)


def current_settings() -> Settings:
    """The environment's settings amended by every active :func:`use_backend` block."""
    settings = settings_from_env()
    for layer in _overrides.get():
        if "ops" in layer:
            layer = {**layer, "ops": (*settings.ops, *layer["ops"])}
        settings = replace(settings, **layer)
    return settings


@contextlib.contextmanager
def use_backend(
    name: str | None = None,
    *,
    ops: Mapping[str, str] | None = None,
    emulate: bool | None = None,
    device: str | torch.device | None = None,
    shadow: str | None = None,
) -> Iterator[Settings]:
    """Run a block of code with another backend (or per-op overrides) selected.

    Blocks nest (the innermost wins) and are local to the thread / asyncio task, so a
    test or an RL job can run two backends in one process::

        with glmport.use_backend("generic", ops={"sparse_attention": "cpu"}):
            out, lse = glmport.ops.sparse_attention(q, k, v, idx, scale)

    The selection is checked on entry: an unknown or unavailable backend raises here.
    """
    layer: dict = {}
    if name is not None:
        layer["backend"] = name
    if ops is not None:
        text = ",".join(f"{op}={b}" for op, b in ops.items())
        layer["ops"] = parse_op_overrides(text, source="use_backend(ops=...)")
    if emulate is not None:
        layer["emulate"] = bool(emulate)
    if device is not None:
        layer["device"] = _parse_device(str(device), "use_backend(device=...)")
    if shadow is not None:
        layer["shadow"] = shadow or None
    token = _overrides.set((*_overrides.get(), layer))
    try:
        settings = current_settings()
        primary_backend(settings)
        for op, backend in settings.ops:
            _require_available(backend, settings, f"use_backend(ops={{{op!r}: {backend!r}}})")
        yield settings
    finally:
        _overrides.reset(token)


def _require_available(name: str, settings: Settings, source: str) -> None:
    REGISTRY.get(name, source)  # UnknownBackendError lists the valid names
    avail = REGISTRY.availability(name, settings.emulate)
    if not avail.ok:
        valid = [n for n in REGISTRY.names() if REGISTRY.availability(n, settings.emulate).ok]
        raise BackendUnavailableError(
            f"glmport backend {name!r} ({source}) is not available here: {avail.reason}. "
            f"Available now: {', '.join(valid)}"
        )


def primary_backend(settings: Settings | None = None) -> str:
    """The backend name the settings select (``auto`` resolved)."""
    settings = settings or current_settings()
    if settings.backend != AUTO:
        _require_available(settings.backend, settings, "GLMPORT_BACKEND / use_backend")
        return settings.backend
    return _auto(settings)


def _auto(settings: Settings) -> str:
    """The best available backend on real (not emulated) hardware.

    With ``GLMPORT_DEVICE`` of a non-cpu type: the highest-priority backend for that
    device type, else the device-neutral generic backend. Otherwise the
    highest-priority backend for an accelerator present here, else cpu.
    """
    want = torch.device(settings.device).type if settings.device else "cpu"
    ranked: list[tuple[int, str, str]] = []
    for name in REGISTRY.names():
        avail = REGISTRY.availability(name, settings.emulate)
        if avail.ok and not avail.emulated:
            m = REGISTRY.get(name).manifest
            ranked.append((m.priority, name, m.device_type))
    if want != "cpu":
        exact = [r for r in ranked if r[2] == want]
        return max(exact)[1] if exact else "generic"
    hardware = [r for r in ranked if r[2] not in ("cpu", ANY_DEVICE)]
    return max(hardware)[1] if hardware else "cpu"


@dataclass(frozen=True)
class Resolution:
    """Where one op runs: the backend that implements it, reached from ``requested``
    through the fallback ``chain``."""

    op: str
    requested: str
    backend: str
    chain: tuple[str, ...]
    kernel: Kernel
    device_type: str
    emulated: bool

    @property
    def fell_back(self) -> bool:
        return self.backend != self.requested


_resolved: dict[tuple[Settings, str], Resolution] = {}
_logged_fallbacks: set[tuple[str, str, str]] = set()


def clear_cache() -> None:
    """Forget cached resolutions (after registering or removing a backend)."""
    _resolved.clear()
    _env_cache.clear()


def resolve(op: str, settings: Settings | None = None) -> Resolution:
    """Resolve ``op`` under the current settings; cached per settings."""
    settings = settings or current_settings()
    key = (settings, op)
    hit = _resolved.get(key)
    if hit is not None:
        return hit
    override = settings.op_override(op)
    if override is not None:
        _require_available(override, settings, f"GLMPORT_OPS {op}={override}")
        requested = override
    else:
        requested = primary_backend(settings)
    chain = (requested, *REGISTRY.get(requested).manifest.fallback)
    for name in chain:
        if not REGISTRY.availability(name, settings.emulate).ok:
            continue
        backend = REGISTRY.get(name)
        if op in backend.manifest.ops:
            break
    else:
        raise BackendUnavailableError(f"no backend along {' -> '.join(chain)} implements {op!r}")
    avail = REGISTRY.availability(name, settings.emulate)
    res = Resolution(
        op=op,
        requested=requested,
        backend=name,
        chain=chain[: chain.index(name) + 1],
        kernel=REGISTRY.kernels(name)[op],
        device_type=backend.device_type(settings.emulate),
        emulated=avail.emulated,
    )
    if res.fell_back and (requested, op, name) not in _logged_fallbacks:
        _logged_fallbacks.add((requested, op, name))
        log.warning("glmport: backend %r lacks %r; falling back to %r", requested, op, name)
    _resolved[key] = res
    return res


COMPOSITES = ("generic", "cpu")
BACKWARD_SUFFIX = ":backward"


def backward_kernel(op: str, chain: tuple[str, ...]) -> Kernel | None:
    """The first ``"<op>:backward"`` kernel along ``chain`` then the composites, if any.

    A backward kernel takes ``(inputs, grad_outputs)`` (inputs in schema order) and
    returns one gradient (or None) per input.
    """
    for name in dict.fromkeys((*chain, *COMPOSITES)):
        if REGISTRY.availability(name, current_settings().emulate).ok:
            kernel = REGISTRY.kernels(name).get(op + BACKWARD_SUFFIX)
            if kernel is not None:
                return kernel
    return None


def composite_kernel(op: str) -> Kernel:
    """The differentiable torch composite of ``op`` (generic's, else the cpu
    reference): backward passes without a closed form are its vector-Jacobian product."""
    for name in COMPOSITES:
        if op in REGISTRY.get(name).manifest.ops:
            return REGISTRY.kernels(name)[op]
    raise BackendUnavailableError(f"no composite implementation of {op!r} in {COMPOSITES}")


__all__ = [
    "AUTO",
    "Resolution",
    "Settings",
    "UnknownBackendError",
    "clear_cache",
    "composite_kernel",
    "current_settings",
    "primary_backend",
    "resolve",
    "settings_from_env",
    "use_backend",
]
