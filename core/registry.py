"""Backends: the contract a vendor implements, and the registry that finds them.

A backend is a small object: a frozen :class:`BackendManifest` (what it is and what
it can do), ``probe`` (can it run here, and if not why) and ``load_kernels`` (its op
implementations, imported only when first needed). Built-ins are listed below by
module path; third-party backends arrive through the entry-point group
``glmport.backends`` (see ``docs/backends.md``). Nothing is imported or probed at
import time.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType

import torch

from .errors import BackendUnavailableError, UnknownBackendError
from .specs import OP_NAMES, Features

log = logging.getLogger("glmport")

ENTRY_POINT_GROUP = "glmport.backends"
ANY_DEVICE = "any"

# Built-in backends: name -> "module:attribute" of a Backend instance.
BUILTINS: Mapping[str, str] = MappingProxyType(
    {
        "cpu": "glmport.backends.cpu:BACKEND",
        "generic": "glmport.backends.generic:BACKEND",
        "cuda": "glmport.backends.cuda:BACKEND",
        "ascend": "glmport.backends.ascend:BACKEND",
    }
)

Kernel = Callable[..., object]


@dataclass(frozen=True)
class Capability:
    """What one op of a backend accepts; ``None`` means whatever the op spec allows."""

    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    schemes: tuple[str, ...] | None = None

    def refusal(self, f: Features) -> str | None:
        """Why this capability cannot take a call with features ``f`` (None: it can)."""
        if self.dtypes is not None and f.dtype not in self.dtypes:
            return f"dtype {f.dtype} (it takes {', '.join(map(str, self.dtypes))})"
        if (
            self.head_dims is not None
            and f.head_dim is not None
            and f.head_dim not in self.head_dims
        ):
            return f"head dim {f.head_dim} (it takes {', '.join(map(str, self.head_dims))})"
        if self.schemes is not None and f.scheme is not None and f.scheme not in self.schemes:
            return f"scheme {f.scheme!r} (it takes {', '.join(self.schemes)})"
        return None


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; ``reason`` says why not, or how (e.g. emulated)."""

    ok: bool
    reason: str = ""
    emulated: bool = False


@dataclass(frozen=True)
class BackendManifest:
    """A backend's declaration.

    Attributes:
        name: the name users select it by (``GLMPORT_BACKEND``).
        device_type: the torch device type its kernels take (``"cpu"``, ``"cuda"``,
            ``"npu"``...), or ``"any"`` for device-neutral torch code.
        ops: the ops it implements itself.
        fallback: where ops it lacks go, in order (e.g. ``("generic", "cpu")``).
        capabilities: per-op limits; an op absent here takes whatever its spec allows.
        priority: rank for ``GLMPORT_BACKEND=auto`` among available backends.
        emulation: how it runs on a CPU under ``GLMPORT_EMULATE=1`` ("" if it cannot).
        verified: on what hardware it has really been checked, in plain words.
    """

    name: str
    device_type: str
    description: str
    ops: tuple[str, ...]
    fallback: tuple[str, ...] = ("generic", "cpu")
    capabilities: Mapping[str, Capability] = field(default_factory=dict)
    priority: int = 0
    emulation: str = ""
    verified: str = "not verified on real hardware"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"backend {self.name!r} declares unknown ops {unknown}")
        object.__setattr__(self, "capabilities", MappingProxyType(dict(self.capabilities)))


class Backend:
    """Base class of every backend: a manifest plus two hooks.

    Subclasses set ``manifest`` and override :meth:`probe` and :meth:`load_kernels`.
    """

    manifest: BackendManifest

    def probe(self, emulate: bool) -> Availability:
        """Can this backend run here? Called lazily, once per setting, never at import."""
        return Availability(True)

    def load_kernels(self) -> Mapping[str, Kernel]:
        """Import and return ``{op name: kernel}`` for every op in ``manifest.ops``.

        A kernel takes the op's arguments in schema order (already validated) and
        returns its outputs. Optional ``"<op>:backward"`` entries are backward
        kernels: ``(inputs, grad_outputs) -> one gradient (or None) per input``.
        """
        raise NotImplementedError

    def device_type(self, emulate: bool) -> str:
        """The device its kernels take: CPU tensors when emulated."""
        if emulate and self.manifest.emulation:
            return "cpu"
        return self.manifest.device_type

    def __repr__(self) -> str:
        return f"<glmport backend {self.manifest.name!r}>"


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded: dict[str, Backend] = {}
        self._extra: dict[str, Backend] = {}
        self._kernels: dict[str, Mapping[str, Kernel]] = {}
        self._probes: dict[tuple[str, bool], Availability] = {}
        self._entry_points: dict[str, metadata.EntryPoint] | None = None

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        if self._entry_points is None:
            found = metadata.entry_points(group=ENTRY_POINT_GROUP)
            self._entry_points = {ep.name: ep for ep in found if ep.name not in BUILTINS}
        return self._entry_points

    def names(self) -> list[str]:
        """Every backend name: built-ins first, then plug-ins and in-code ones, sorted."""
        others = sorted(set(self.entry_points()) | set(self._extra))
        return [*BUILTINS, *(n for n in others if n not in BUILTINS)]

    def get(self, name: str, source: str = "") -> Backend:
        with self._lock:
            if name in self._extra:
                return self._extra[name]
            if name in self._loaded:
                return self._loaded[name]
            if name in BUILTINS:
                module, attr = BUILTINS[name].split(":")
                backend = getattr(importlib.import_module(module), attr)
            elif name in self.entry_points():
                backend = self._load_plugin(name)
            else:
                raise UnknownBackendError(name, self.names(), source)
            self._loaded[name] = backend
            return backend

    def _load_plugin(self, name: str) -> Backend:
        ep = self.entry_points()[name]
        try:
            obj = ep.load()
            backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
        except Exception as err:  # a broken plug-in must not take the process down
            raise BackendUnavailableError(
                f"plug-in backend {name!r} ({ep.value}) failed to load: {type(err).__name__}: {err}"
            ) from err
        if not isinstance(backend, Backend):
            raise BackendUnavailableError(
                f"plug-in backend {name!r}: entry point {ep.value} gave {type(backend).__name__}, "
                "expected a glmport.core.registry.Backend instance (or a callable returning one)"
            )
        if backend.manifest.name != name:
            raise BackendUnavailableError(
                f"plug-in backend {name!r}: its manifest is named {backend.manifest.name!r}; "
                "the entry-point name and the manifest name must agree"
            )
        return backend

    def register(self, backend: Backend, *, replace: bool = False) -> None:
        name = backend.manifest.name
        with self._lock:
            if not replace and (
                name in self._extra or name in BUILTINS or name in self.entry_points()
            ):
                raise ValueError(f"a backend named {name!r} exists already; pass replace=True")
            self._extra[name] = backend
            self._forget(name)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)
            self._forget(name)

    def _forget(self, name: str) -> None:
        self._kernels.pop(name, None)
        for key in [k for k in self._probes if k[0] == name]:
            del self._probes[key]

    def availability(self, name: str, emulate: bool) -> Availability:
        key = (name, emulate)
        with self._lock:
            if key not in self._probes:
                try:
                    backend = self.get(name)
                    self._probes[key] = backend.probe(emulate)
                except BackendUnavailableError as err:
                    self._probes[key] = Availability(False, str(err))
                except Exception as err:  # a probe that crashes means "not here"
                    self._probes[key] = Availability(
                        False, f"probe failed: {type(err).__name__}: {err}"
                    )
            return self._probes[key]

    def kernels(self, name: str) -> Mapping[str, Kernel]:
        with self._lock:
            if name not in self._kernels:
                backend = self.get(name)
                kernels = dict(backend.load_kernels())
                missing = sorted(set(backend.manifest.ops) - set(kernels))
                known = {*OP_NAMES, *(f"{op}:backward" for op in OP_NAMES)}
                unknown = sorted(set(kernels) - known)
                if unknown:
                    raise BackendUnavailableError(
                        f"backend {name!r}: load_kernels() returned unknown keys {unknown}; "
                        "keys are op names, or '<op>:backward' for a backward kernel"
                    )
                if missing:
                    raise BackendUnavailableError(
                        f"backend {name!r} declares ops {missing} but its load_kernels() lacks them"
                    )
                self._kernels[name] = MappingProxyType(kernels)
            return self._kernels[name]


REGISTRY = _Registry()


def backend_names() -> list[str]:
    """Every selectable backend name (built-ins, installed plug-ins, in-code)."""
    return REGISTRY.names()


def get_backend(name: str) -> Backend:
    """The backend called ``name``; :class:`UnknownBackendError` lists the valid names."""
    return REGISTRY.get(name)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register a backend object in code (tests, notebooks, a vendor's own harness)."""
    REGISTRY.register(backend, replace=replace)
    from .selection import clear_cache

    clear_cache()


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend`."""
    REGISTRY.unregister(name)
    from .selection import clear_cache

    clear_cache()
