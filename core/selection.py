"""Which backend runs each op: environment variables, an in-code context manager,
per-op overrides, ``auto`` (which follows the inputs' device) and the fallback chain.

Environment (read on use, never at import; a change takes effect on the next call),
parsed and checked by :mod:`.environment`, which lists what each variable accepts:

``GLMPORT_BACKEND``   a backend name | auto (default auto)
``GLMPORT_DEVICE``    the torch device for device-neutral code (``cuda:0``, ``npu:0``...)
``GLMPORT_EMULATE``   1 runs vendor backends on the CPU (Triton interpreter, NPU emulator)
``GLMPORT_OPS``       per-op overrides, ``op=backend,op=backend``
``GLMPORT_SHADOW``    a backend to shadow-check live calls against (the reference)
``GLMPORT_SHADOW_CALLS``  how many calls per op the shadow checks (default 8)
``GLMPORT_VALIDATE``  full (default) | strict: read every check on the host, scan caches |
                      meta: skip checks that read tensor values
``GLMPORT_TILE_MB``   the generic backend's tile budget (read and checked there)

A ``use_backend`` block lives in a context variable: it follows work into
``asyncio.to_thread`` (which copies the context) but not into
``loop.run_in_executor`` or a plain thread pool (see ``docs/backends.md``, "Selecting").

Settings and resolutions are cached: a call reads seven environment entries (one
dict lookup each) and the active ``use_backend`` blocks, and finds its resolution in
a dict held by the settings object; registering a backend invalidates both.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from . import environment
from .environment import parse_op_overrides
from .errors import BackendUnavailableError, ConfigError, UnknownBackendError
from .registry import (
    ANY_DEVICE,
    BACKWARD_SUFFIX,
    COMPOSITE,
    REFERENCE,
    REGISTRY,
    VENDOR,
    Capability,
    Kernel,
    chain_for,
    torch_code,
)
from .validate import Level

log = logging.getLogger("glmport")

AUTO = "auto"


@dataclass(frozen=True)
class Settings:
    """The selection in force: what the environment says, as amended in code."""

    backend: str = AUTO
    # Where ``backend`` came from, for errors: the variable, or the use_backend call
    # (or the command-line flag a caller names in it).
    backend_source: str = "GLMPORT_BACKEND"
    device: str | None = None
    emulate: bool = False
    ops: tuple[tuple[str, str], ...] = ()
    shadow: str | None = None
    shadow_calls: int = 8
    validate: Level = Level.FULL  # GLMPORT_VALIDATE
    # (interface name, device type) -> Resolution under these settings.
    resolved: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def op_override(self, op: str) -> str | None:
        return dict(self.ops).get(op)

    @property
    def validate_values(self) -> bool:
        """Whether checks read tensor values (``full`` and ``strict``)."""
        return self.validate >= Level.FULL


def _parse_device(raw: str, var: str = "GLMPORT_DEVICE") -> str:
    try:
        return str(torch.device(raw.strip()))
    except (RuntimeError, ValueError, TypeError) as err:
        raise ConfigError(f"{var}={raw!r} is not a torch device ({err})") from err


_ENV_VARS = tuple(environment.VARIABLES)
# The tile budget is read (and checked) by the generic backend when it first tiles.
_SELECTION_VARS = tuple(v for v in _ENV_VARS if v != "GLMPORT_TILE_MB")

# os.environ.get() re-encodes its key on every read (~2 us for seven reads on a small
# CPU); the mapping it keeps, keyed by encoded names, is read directly instead.
_environ_data = getattr(os.environ, "_data", None)
if _environ_data is not None and hasattr(os.environ, "encodekey"):
    _ENV_KEYS = tuple(os.environ.encodekey(v) for v in _SELECTION_VARS)

    def _env_snapshot() -> tuple:
        return tuple(map(_environ_data.get, _ENV_KEYS))

else:  # another Python: the public, slower reads

    def _env_snapshot() -> tuple:
        return tuple(map(os.environ.get, _SELECTION_VARS))


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the selection's ``GLMPORT_*`` variables through :mod:`.environment`;
    :class:`ConfigError` names a malformed one, its value and what is accepted."""
    env = {name: environment.read(name, environ) for name in _SELECTION_VARS}
    return Settings(
        backend=env["GLMPORT_BACKEND"],
        device=env["GLMPORT_DEVICE"],
        emulate=env["GLMPORT_EMULATE"],
        ops=env["GLMPORT_OPS"],
        shadow=env["GLMPORT_SHADOW"],
        shadow_calls=env["GLMPORT_SHADOW_CALLS"],
        validate=Level[env["GLMPORT_VALIDATE"].upper()],
    )


def selected_device(settings: Settings | None = None) -> torch.device:
    """The device device-neutral code puts tensors on: ``GLMPORT_DEVICE`` /
    ``use_backend(device=...)``, checked to exist here (:class:`ConfigError` if not),
    else the CPU. Auto-selection only needs the device's type and does not check."""
    settings = settings or current_settings()
    if settings.device is None:
        return torch.device("cpu")
    return environment.require_device(settings.device, "GLMPORT_DEVICE / use_backend(device=...)")


# Each use_backend block adds one layer: a tuple of (field, value) pairs.
_overrides: contextvars.ContextVar[tuple[tuple[tuple[str, object], ...], ...]] = (
    contextvars.ContextVar("glmport_backend_overrides", default=())
)
_settings_cache: dict[tuple, Settings] = {}
_MAX_CACHED = 256


def current_settings() -> Settings:
    """The environment's settings amended by every active :func:`use_backend` block."""
    key = (_env_snapshot(), _overrides.get(), REGISTRY.generation)
    settings = _settings_cache.get(key)
    if settings is None:
        settings = settings_from_env()
        for layer in key[1]:
            changes = dict(layer)
            if "ops" in changes:
                changes["ops"] = (*settings.ops, *changes["ops"])
            settings = replace(settings, **changes)
        if settings.shadow is not None and settings.shadow not in (names := REGISTRY.names()):
            # A misspelt shadow would otherwise check nothing, call after call. Only the
            # name is checked: an installed but unavailable one is logged by the checker.
            raise UnknownBackendError(
                settings.shadow, names, "GLMPORT_SHADOW / use_backend(shadow=...)"
            )
        if len(_settings_cache) >= _MAX_CACHED:
            _settings_cache.clear()
        _settings_cache[key] = settings
    return settings


@contextlib.contextmanager
def use_backend(
    name: str | None = None,
    *,
    ops: Mapping[str, str] | None = None,
    emulate: bool | None = None,
    device: str | torch.device | None = None,
    shadow: str | None = None,
    validate: str | None = None,
    source: str | None = None,
) -> Iterator[Settings]:
    """Run a block of code with another backend (or per-op overrides) selected.

    Blocks nest (the innermost wins) and are local to the thread / asyncio task, so a
    test or an RL job can run two backends in one process::

        with glmport.use_backend("generic", ops={"sparse_attention": "cpu"}):
            out, lse = glmport.ops.sparse_attention(q, k, v, idx, scale)

    ``validate`` (``"meta"``, ``"full"`` or ``"strict"``) overrides ``GLMPORT_VALIDATE``
    inside the block.

    The selection is checked on entry: an unknown or unavailable backend raises here,
    naming ``source`` as where ``name`` came from (default ``use_backend('<name>')``; a
    command line passes its flag, such as ``"--backend"``).
    """
    layer: list[tuple[str, object]] = []
    if name is not None:
        layer.append(("backend", name))
        layer.append(("backend_source", source or f"use_backend({name!r})"))
    if ops is not None:
        text = ",".join(f"{op}={b}" for op, b in ops.items())
        layer.append(("ops", parse_op_overrides(text, source="use_backend(ops=...)")))
    if emulate is not None:
        layer.append(("emulate", bool(emulate)))
    if device is not None:
        layer.append(("device", _parse_device(str(device), "use_backend(device=...)")))
    if shadow is not None:
        layer.append(("shadow", shadow or None))
    if validate is not None:
        layer.append(("validate", _parse_level(validate)))
    token = _overrides.set((*_overrides.get(), tuple(layer)))
    try:
        settings = current_settings()
        primary_backend(settings)
        for op, backend in settings.ops:
            _require_available(backend, settings, f"use_backend(ops={{{op!r}: {backend!r}}})")
        yield settings
    finally:
        _overrides.reset(token)


def _parse_level(raw: object) -> Level:
    levels = [level.name.lower() for level in Level]
    if not isinstance(raw, str) or raw.lower() not in levels:
        raise ConfigError(
            f"use_backend(validate={raw!r}) is not a validation level; valid levels: "
            f"{', '.join(levels)}"
        )
    return Level[raw.upper()]


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
    """The backend the settings select (``auto`` resolved for ``GLMPORT_DEVICE``, or
    the best accelerator present): what ``glmport info`` and the conformance suite
    name. Op calls under ``auto`` follow their inputs' device instead."""
    settings = settings or current_settings()
    if settings.backend != AUTO:
        _require_available(settings.backend, settings, settings.backend_source)
        return settings.backend
    return _auto(settings, None)


def _auto(settings: Settings, device_type: str | None) -> str:
    """The fastest available backend on real (not emulated) hardware for
    ``device_type``: the highest priority among the backends made for that device type
    and the device-neutral composites (``generic``, priority 0); equal priorities go to
    the composites, so a vendor backend takes over only by declaring a higher one. The
    reference is the judge, not a runtime choice: it is picked only when nothing else
    runs there. A backend whose manifest says ``auto=False`` is never picked. With no
    device type (no tensors to follow): ``GLMPORT_DEVICE``'s type, else the
    highest-priority accelerator present, else the CPU's."""
    ranked: list[tuple[int, bool, str, str, str]] = []
    for name in REGISTRY.names():
        avail = REGISTRY.availability(name, settings.emulate)
        if avail.ok and not avail.emulated:
            m = REGISTRY.get(name).manifest
            if m.auto:
                ranked.append((m.priority, m.role != VENDOR, name, m.device_type, m.role))
    want = device_type
    if want is None and settings.device is not None:
        want = torch.device(settings.device).type
    if want is None:
        hardware = [r for r in ranked if r[3] not in ("cpu", ANY_DEVICE)]
        if hardware:
            return max(hardware)[2]
        want = "cpu"
    runs_there = [r for r in ranked if r[3] in (want, ANY_DEVICE)]
    pool = [r for r in runs_there if r[4] != REFERENCE] or runs_there
    if pool:
        return max(pool)[2]
    raise BackendUnavailableError(
        f"GLMPORT_BACKEND=auto: no available backend runs on {want} tensors "
        f"(available: {', '.join(sorted(r[2] for r in ranked)) or 'none'})"
    )


@dataclass(frozen=True)
class Candidate:
    """One backend along a chain that implements an op."""

    backend: str
    kernel: Kernel
    device_type: str
    capability: Capability | None
    emulated: bool

    def takes(self, device_type: str) -> bool:
        return self.device_type == ANY_DEVICE or self.device_type == device_type


@dataclass(frozen=True)
class Resolution:
    """Where one interface entry runs: the first backend along the fallback ``chain``
    from ``requested`` that implements it; ``alternatives`` are the later ones, tried
    for inputs outside its capabilities."""

    op: str
    requested: str
    backend: str
    chain: tuple[str, ...]
    kernel: Kernel
    device_type: str
    emulated: bool
    capability: Capability | None = None
    alternatives: tuple[Candidate, ...] = ()

    @property
    def fell_back(self) -> bool:
        return self.backend != self.requested

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        first = Candidate(
            self.backend, self.kernel, self.device_type, self.capability, self.emulated
        )
        return (first, *self.alternatives)

    def taker(
        self, device_type: str, features: Mapping[str, object]
    ) -> tuple[Candidate | None, list[tuple[str, str]]]:
        """The first candidate that runs on ``device_type`` and whose capabilities take
        a call with ``features`` (None if none does), and ``(backend, refusal)`` of
        each candidate on that device that declined before it."""
        refusals: list[tuple[str, str]] = []
        for cand in self.candidates:
            if not cand.takes(device_type):
                continue
            refusal = cand.capability.refusal(features) if cand.capability is not None else None
            if refusal is None:
                return cand, refusals
            refusals.append((cand.backend, refusal))
        return None, refusals


_logged_fallbacks: set[tuple[str, str, str]] = set()


# Where :func:`recording_fallbacks` collects the fallbacks of the calls inside it.
_fallback_sink: contextvars.ContextVar[list[tuple[str, str, str]] | None] = contextvars.ContextVar(
    "glmport_fallback_sink", default=None
)


def log_fallback_once(requested: str, op: str, used: str, why: str) -> None:
    """One log line per (requested backend, op, backend used); every call is also
    recorded inside :func:`recording_fallbacks` (a backend's kernel that hands a call
    to another backend says so here, so the call is not credited to it)."""
    sink = _fallback_sink.get()
    if sink is not None:
        sink.append((requested, op, used))
    if (requested, op, used) not in _logged_fallbacks:
        _logged_fallbacks.add((requested, op, used))
        log.warning("glmport: backend %r %s %r; falling back to %r", requested, why, op, used)


@contextlib.contextmanager
def recording_fallbacks() -> Iterator[list[tuple[str, str, str]]]:
    """Collect ``(requested backend, op, backend used)`` for every fallback that the
    calls inside the block take, resolution-time and inside a kernel alike."""
    sink: list[tuple[str, str, str]] = []
    token = _fallback_sink.set(sink)
    try:
        yield sink
    finally:
        _fallback_sink.reset(token)


def clear_cache() -> None:
    """Forget cached settings and resolutions (tests; the caches also notice
    environment changes and backend registrations by themselves)."""
    _settings_cache.clear()


def resolve(name: str, settings: Settings | None = None, *, device_type: str | None = None):
    """Resolve interface entry ``name`` (an op, or ``"expert_parallel"``) under
    ``settings`` (default: the current ones) for inputs of ``device_type`` (which
    ``auto`` follows; None: the primary backend's). Cached per settings."""
    settings = settings or current_settings()
    key = (name, device_type)
    hit = settings.resolved.get(key)
    if hit is None:
        hit = settings.resolved[key] = _resolve(name, settings, device_type)
    return hit


def _resolve(name: str, settings: Settings, device_type: str | None) -> Resolution:
    override = settings.op_override(name)
    if override is not None:
        _require_available(override, settings, f"GLMPORT_OPS {name}={override}")
        requested = override
    elif settings.backend != AUTO:
        _require_available(settings.backend, settings, settings.backend_source)
        requested = settings.backend
    else:
        requested = _auto(settings, device_type)
    chain = chain_for(requested)
    found = []
    for backend in chain:
        avail = REGISTRY.availability(backend, settings.emulate)
        if not avail.ok or name not in REGISTRY.get(backend).manifest.ops:
            continue
        b = REGISTRY.get(backend)
        found.append(
            Candidate(
                backend,
                REGISTRY.kernels(backend, settings.emulate)[name],
                b.device_type(settings.emulate),
                b.manifest.capabilities.get(name),
                avail.emulated,
            )
        )
    if not found:
        raise BackendUnavailableError(f"no backend along {' -> '.join(chain)} implements {name!r}")
    first = found[0]
    if first.backend != requested:
        log_fallback_once(requested, name, first.backend, "lacks")
    return Resolution(
        op=name,
        requested=requested,
        backend=first.backend,
        chain=chain[: chain.index(first.backend) + 1],
        kernel=first.kernel,
        device_type=first.device_type,
        emulated=first.emulated,
        capability=first.capability,
        alternatives=tuple(found[1:]),
    )


def backward_owner(op: str, chain: tuple[str, ...], emulate: bool) -> str | None:
    """The first backend along the forward's ``chain`` then the composites and the
    reference that is available and has a ``"<op>:backward"`` kernel, if any. A
    forward that ran on the reference is differentiated by the reference's own code:
    its chain is not extended (its gradients are then the reference's, not a
    composite's)."""
    ran_on_reference = REGISTRY.get(chain[-1]).manifest.role == REFERENCE
    for name in dict.fromkeys((*chain, *(() if ran_on_reference else torch_code()))):
        available = REGISTRY.availability(name, emulate).ok
        if available and op + BACKWARD_SUFFIX in REGISTRY.kernels(name, emulate):
            return name
    return None


def backward_kernel(op: str, chain: tuple[str, ...], emulate: bool) -> Kernel | None:
    """The ``"<op>:backward"`` kernel of :func:`backward_owner`, if any. It takes
    ``(inputs, grad_outputs)`` (inputs in schema order) and returns one gradient (or
    None) per input."""
    owner = backward_owner(op, chain, emulate)
    return None if owner is None else REGISTRY.kernels(owner, emulate)[op + BACKWARD_SUFFIX]


def composite_owner(op: str, chain: tuple[str, ...] = ()) -> str:
    """The backend whose torch code is ``op``'s differentiable composite: the one the
    forward ran on (the end of ``chain``) when that is torch code itself (a composite
    or the reference), else the first composite backend implementing it, else the
    reference."""
    if chain and REGISTRY.get(chain[-1]).manifest.role in (COMPOSITE, REFERENCE):
        return chain[-1]
    names = torch_code()
    for name in names:
        if op in REGISTRY.get(name).manifest.ops:
            return name
    raise BackendUnavailableError(f"no composite implementation of {op!r} in {names}")


def composite_kernel(op: str, chain: tuple[str, ...] = ()) -> Kernel:
    """The differentiable torch composite of ``op`` for a forward that ran along
    ``chain`` (:func:`composite_owner`'s kernel): backward passes without a closed form
    are its vector-Jacobian product."""
    return REGISTRY.kernels(composite_owner(op, chain), False)[op]


__all__ = [
    "AUTO",
    "Candidate",
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
