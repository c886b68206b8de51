"""Backends: the contract a vendor implements, and the registry that finds them.

A backend is a small object: a frozen :class:`BackendManifest` (what it is, what it
can do, which role it plays), ``probe`` (can it run here, and if not why),
``load_kernels`` (its op implementations for one emulation setting, imported only
when first needed) and optionally ``prepare_weight`` (convert a canonical quantised
weight into its native layout, once). Every backend, built-in or third-party,
arrives through the entry-point group ``glmport.backends`` (see
``docs/backends.md``); nothing here names one. Nothing is imported or probed at
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

from .errors import BackendUnavailableError, ConfigError, GlmportError, UnknownBackendError
from .specs import INTERFACE_NAMES, OP_NAMES, SPECS

log = logging.getLogger("glmport")

ENTRY_POINT_GROUP = "glmport.backends"
ANY_DEVICE = "any"

# What a backend is to the others. ``reference``: the golden reference every backend
# is judged by, and the last stop of every fallback chain (exactly one is expected).
# ``composite``: device-neutral torch code, tried before the reference; its kernels
# are also the differentiable composites that backward passes fall back to.
# ``vendor``: everything else.
VENDOR, COMPOSITE, REFERENCE = "vendor", "composite", "reference"
ROLES = (VENDOR, COMPOSITE, REFERENCE)

# Extra kernel-table keys: ``"<op>:backward"`` (a fused backward) and
# ``"<op>:prepared"`` (the op on weights from :meth:`Backend.prepare_weight`).
BACKWARD_SUFFIX = ":backward"
PREPARED_SUFFIX = ":prepared"
PREPARABLE_OPS = ("quant_gemm", "grouped_gemm")

Kernel = Callable[..., object]


def _accepts(accepted: tuple, value: object) -> bool:
    return any(value in a if isinstance(a, range) else value == a for a in accepted)


def _show(accepted: tuple) -> str:
    def one(a: object) -> str:
        if isinstance(a, range):
            step = f" step {a.step}" if a.step != 1 else ""
            return f"{a.start}..{a.stop - 1}{step}"
        return str(a).removeprefix("torch.")

    return ", ".join(one(a) for a in accepted)


class Capability:
    """Limits on the features of one op's calls: ``feature name -> accepted values``.

    Feature names are the ones the op's spec declares (``SPECS[op].feature_names``,
    listed in ``docs/ops.md``); a value is accepted if it equals one of the given
    values or lies in one of the given ``range``\\ s::

        Capability(q_heads=range(1, 65), head_dim=(128,),
                   topk=(range(1, 2049), range(3072, 8193, 1024)))

    A feature the call does not have (``None``, e.g. no scheme) is not limited.
    """

    __slots__ = ("limits",)

    def __init__(self, **limits: object) -> None:
        norm = {}
        for name, accepted in limits.items():
            if isinstance(accepted, (range, str, torch.dtype, int, bool)):
                accepted = (accepted,)
            norm[name] = tuple(accepted)
        self.limits: Mapping[str, tuple] = MappingProxyType(norm)

    def refusal(self, features: Mapping[str, object]) -> str | None:
        """Why a call with ``features`` is outside these limits (None: it is inside)."""
        for name, accepted in self.limits.items():
            value = features.get(name)
            if value is not None and not _accepts(accepted, value):
                shown = str(value).removeprefix("torch.")
                return f"{name} {shown} (it takes {_show(accepted)})"
        return None

    def describe(self) -> dict[str, str]:
        """``{feature: accepted values}`` in words, for reports."""
        return {name: _show(accepted) for name, accepted in self.limits.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}=({v})" for k, v in self.describe().items())
        return f"Capability({inner})"


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
        name: the name users select it by (``GLMPORT_BACKEND``); equals its entry-point name.
        device_type: the torch device type its kernels take (``"cpu"``, ``"cuda"``,
            ``"npu"``...), or ``"any"`` for device-neutral torch code.
        ops: the interface entries it implements itself (op names, and
            ``"expert_parallel"``).
        role: ``"vendor"`` (default), ``"composite"`` or ``"reference"`` (see ROLES).
        fallback: backends to try, in order, for ops it lacks or inputs outside its
            capabilities, before the composite backends and then the reference.
        capabilities: per-op :class:`Capability`; an op absent here takes whatever its
            spec allows.
        priority: rank for ``GLMPORT_BACKEND=auto`` among available backends of a device.
        auto: whether ``GLMPORT_BACKEND=auto`` may pick it at all (False: selected by
            name only, like the export runtimes, which export every call).
        emulation: how it runs on a CPU under ``GLMPORT_EMULATE=1`` ("" if it cannot).
        verified: on what hardware it has really been checked, in plain words.
        stack: the vendor software it runs on, for environment reports: distribution
            names (``"triton"``, ``"torch-npu"``) and ``"$VAR"`` for a toolkit found
            through an environment variable (``"$ASCEND_TOOLKIT_HOME"``).
    """

    name: str
    device_type: str
    description: str
    ops: tuple[str, ...]
    role: str = VENDOR
    fallback: tuple[str, ...] = ()
    capabilities: Mapping[str, Capability] = field(default_factory=dict)
    priority: int = 0
    auto: bool = True
    emulation: str = ""
    verified: str = "not verified on real hardware"
    stack: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = f"backend {self.name!r}"
        unknown = sorted(set(self.ops) - set(INTERFACE_NAMES))
        if unknown:
            raise ValueError(f"{where} declares unknown ops {unknown}; known: {INTERFACE_NAMES}")
        if self.role not in ROLES:
            raise ValueError(f"{where}: role {self.role!r} is not one of {ROLES}")
        for op, cap in self.capabilities.items():
            if op not in OP_NAMES or op not in self.ops:
                raise ValueError(
                    f"{where}: capabilities for {op!r}, which is not one of its ops {self.ops}"
                )
            if not isinstance(cap, Capability):
                raise ValueError(f"{where}: capabilities[{op!r}] must be a Capability")
            bad = sorted(set(cap.limits) - set(SPECS[op].feature_names))
            if bad:
                raise ValueError(
                    f"{where}: capabilities[{op!r}] limits unknown features {bad}; "
                    f"{op} has {', '.join(SPECS[op].feature_names)}"
                )
        object.__setattr__(self, "capabilities", MappingProxyType(dict(self.capabilities)))


class Backend:
    """Base class of every backend: a manifest plus small hooks.

    Subclasses set ``manifest`` and override :meth:`probe` and :meth:`load_kernels`;
    :meth:`prepare_weight` only if they keep quantised weights in a layout of their own.
    """

    manifest: BackendManifest

    def probe(self, emulate: bool) -> Availability:
        """Can this backend run here? Called lazily, once per setting, never at import."""
        return Availability(True)

    def load_kernels(self, emulate: bool) -> Mapping[str, Kernel]:
        """Import and return ``{op name: kernel}`` for every entry of ``manifest.ops``,
        for one emulation setting (called once per setting; a Triton backend defines its
        kernels after ``TRITON_INTERPRET`` is set, an NPU backend binds the SDK or its
        emulator).

        A kernel takes the op's arguments in schema order (already validated) and
        returns its outputs. Optional extra keys: ``"<op>:backward"`` (``(inputs,
        grad_outputs) -> one gradient or None per input``), ``"<op>:prepared"`` for
        ops in ``PREPARABLE_OPS`` (the op's arguments with ``w`` replaced by the
        :class:`~glmport.core.prepared.PreparedWeight`), and ``"expert_parallel"``
        (a factory, see :mod:`glmport.core.expert_parallel`).
        """
        raise NotImplementedError

    def prepare_weight(
        self, op: str, w: torch.Tensor, w_scale: torch.Tensor | None, scheme: str, emulate: bool
    ) -> Mapping[str, torch.Tensor] | None:
        """Convert one canonical weight (``core/formats.py``) of ``op`` to this
        backend's native layout, once, at load time: e.g. int4 repacked to int32 x 8,
        pre-transposed or swizzled tiles. Returns the native tensors by name (its
        ``"<op>:prepared"`` kernel reads them), or None to keep the canonical layout."""
        return None

    def model_runner(self, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How the conformance suite's model-level check runs a whole model here:
        ``input_ids [1, S]`` int64 -> ``logits [1, S, V]``. None (the default): the
        model runs eagerly, op by op, on this backend's kernels. A backend that executes
        compiled graphs (an export runtime) returns the exported model's forward."""
        return None

    def device_type(self, emulate: bool) -> str:
        """The device its kernels take: CPU tensors when emulated."""
        if emulate and self.manifest.emulation:
            return "cpu"
        return self.manifest.device_type

    def __repr__(self) -> str:
        return f"<glmport backend {self.manifest.name!r}>"


def _known_kernel_keys() -> frozenset[str]:
    extra = [f"{op}{BACKWARD_SUFFIX}" for op in OP_NAMES]
    extra += [f"{op}{PREPARED_SUFFIX}" for op in PREPARABLE_OPS]
    return frozenset((*INTERFACE_NAMES, *extra))


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded: dict[str, Backend] = {}
        self._extra: dict[str, Backend] = {}
        self._kernels: dict[tuple[str, bool], Mapping[str, Kernel]] = {}
        self._probes: dict[tuple[str, bool], Availability] = {}
        self._entry_points: dict[str, metadata.EntryPoint] | None = None
        self._roles: dict[str, tuple[str, ...]] | None = None
        self._targets: dict[str, Backend] = {}  # "module:attr" -> what it registered
        # Bumped whenever the set of backends changes; selection caches check it.
        self.generation = 0

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        if self._entry_points is None:
            found: dict[str, metadata.EntryPoint] = {}
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in found and found[ep.name].value != ep.value:
                    log.warning(
                        "glmport: two installed backends are named %r (%s and %s); using %s",
                        ep.name,
                        found[ep.name].value,
                        ep.value,
                        found[ep.name].value,
                    )
                    continue
                found.setdefault(ep.name, ep)
            self._entry_points = found
        return self._entry_points

    def names(self) -> list[str]:
        """Every backend name: installed (entry points) and registered in code, sorted."""
        return sorted(set(self.entry_points()) | set(self._extra))

    def get(self, name: str, source: str = "") -> Backend:
        with self._lock:
            if name in self._extra:
                return self._extra[name]
            if name in self._loaded:
                return self._loaded[name]
            if name not in self.entry_points():
                raise UnknownBackendError(name, self.names(), source)
            backend = self._load_plugin(name)
            self._loaded[name] = backend
            return backend

    def _load_plugin(self, name: str) -> Backend:
        ep = self.entry_points()[name]
        where = f"plug-in backend {name!r} ({ep.value})"
        backend = _load_backend(ep.load, where, BackendUnavailableError)
        if backend.manifest.name != name:
            raise BackendUnavailableError(
                f"plug-in backend {name!r}: its manifest is named {backend.manifest.name!r}; "
                "the entry-point name and the manifest name must agree"
            )
        return backend

    def register(self, backend: Backend, *, replace: bool = False) -> None:
        name = backend.manifest.name
        with self._lock:
            if not replace and (name in self._extra or name in self.entry_points()):
                raise ValueError(f"a backend named {name!r} exists already; pass replace=True")
            self._extra[name] = backend
            self.forget(name)

    def register_target(self, target: str) -> str:
        """Import ``"module:attr"`` and register the backend it names; returns its
        name. Registering the same target again in a process does nothing while the
        backend it gave is still registered."""
        with self._lock:
            backend = self._targets.get(target)
            if backend is None or self._extra.get(backend.manifest.name) is not backend:
                backend = _import_backend(target)
                if self._extra.get(backend.manifest.name) is not backend:  # may self-register
                    try:
                        self.register(backend)
                    except ValueError as err:
                        raise ConfigError(f"plug-in {target}: {err}") from None
                self._targets[target] = backend
            return backend.manifest.name

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)
            self.forget(name)

    def forget(self, name: str) -> None:
        """Drop everything cached about ``name`` (kernels, probes, roles)."""
        with self._lock:
            for cache in (self._kernels, self._probes):
                for key in [k for k in cache if k[0] == name]:
                    del cache[key]
            self._roles = None
            self.generation += 1

    def availability(self, name: str, emulate: bool) -> Availability:
        """Whether ``name`` runs here under one emulation setting, probed once: its
        ``probe``, then (if that succeeds) its kernel table, so a table that lacks a
        declared op, has unknown keys or fails to load makes the backend unavailable
        with the reason here rather than at its first call."""
        key = (name, emulate)
        with self._lock:
            if key not in self._probes:
                step = "probe"
                try:
                    avail = self.get(name).probe(emulate)
                    if avail.ok:
                        step = "load_kernels"
                        self.kernels(name, emulate)
                except BackendUnavailableError as err:
                    avail = Availability(False, str(err))
                except Exception as err:  # a probe or a load that crashes means "not here"
                    avail = Availability(False, f"{step} failed: {type(err).__name__}: {err}")
                self._probes[key] = avail
            return self._probes[key]

    def kernels(self, name: str, emulate: bool) -> Mapping[str, Kernel]:
        """The kernel table of ``name`` for one emulation setting, loaded once."""
        key = (name, emulate)
        with self._lock:
            if key not in self._kernels:
                backend = self.get(name)
                kernels = dict(backend.load_kernels(emulate))
                missing = sorted(set(backend.manifest.ops) - set(kernels))
                unknown = sorted(set(kernels) - _known_kernel_keys())
                if unknown:
                    raise BackendUnavailableError(
                        f"backend {name!r}: load_kernels() returned unknown keys {unknown}; "
                        "keys are op names, 'expert_parallel', '<op>:backward' or "
                        f"'<op>:prepared' (for {', '.join(PREPARABLE_OPS)})"
                    )
                if missing:
                    raise BackendUnavailableError(
                        f"backend {name!r} declares ops {missing} but its load_kernels() lacks them"
                    )
                self._kernels[key] = MappingProxyType(kernels)
            return self._kernels[key]

    def with_role(self, role: str) -> tuple[str, ...]:
        """Names of the loadable backends whose manifest declares ``role``, highest
        priority first."""
        with self._lock:
            if self._roles is None:
                found: dict[str, list[tuple[int, str]]] = {r: [] for r in ROLES}
                for name in self.names():
                    try:
                        m = self.get(name).manifest
                    except BackendUnavailableError:
                        continue  # broken plug-ins show up in `glmport info`, not here
                    found[m.role].append((-m.priority, name))
                self._roles = {r: tuple(n for _, n in sorted(v)) for r, v in found.items()}
            return self._roles[role]

    def reference(self) -> str:
        """The name of the reference backend (role ``"reference"``)."""
        refs = self.with_role(REFERENCE)
        if not refs:
            raise BackendUnavailableError(
                "no backend declares role 'reference': is glmport installed (its built-in "
                "backends arrive through the 'glmport.backends' entry points)?"
            )
        return refs[0]

    def stack(self) -> tuple[str, ...]:
        """The vendor software every backend declares (``manifest.stack``), deduplicated."""
        items: list[str] = []
        for name in self.names():
            try:
                items += self.get(name).manifest.stack
            except BackendUnavailableError:
                continue
        return tuple(dict.fromkeys(items))


def _load_backend(load: Callable[[], object], where: str, error: type[GlmportError]) -> Backend:
    """The :class:`Backend` that ``load`` (an import) gives: an instance, or a callable
    returning one. A failing import or factory, or anything else, raises ``error``
    naming ``where``: a broken plug-in must not take the process down."""
    try:
        obj = load()
        backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
    except Exception as err:
        raise error(f"{where} failed to load: {type(err).__name__}: {err}") from err
    if not isinstance(backend, Backend):
        raise error(
            f"{where} gave {type(backend).__name__}, expected a "
            "glmport.core.registry.Backend instance (or a callable returning one)"
        )
    return backend


def _import_backend(target: str) -> Backend:
    """The :class:`Backend` that ``"module:attr"`` names (:class:`ConfigError` says
    what is wrong with the target)."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"plug-in {target!r}: expected module:attr, e.g. mychip_glmport:BACKEND")

    def load() -> object:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    return _load_backend(load, f"plug-in {target}", ConfigError)


REGISTRY = _Registry()


def backend_names() -> list[str]:
    """Every selectable backend name (installed through entry points, or in code)."""
    return REGISTRY.names()


def get_backend(name: str) -> Backend:
    """The backend called ``name``; :class:`UnknownBackendError` lists the valid names."""
    return REGISTRY.get(name)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register a backend object in code (tests, notebooks, a vendor's own harness)."""
    REGISTRY.register(backend, replace=replace)


def register_backend_target(target: str) -> str:
    """Register the backend that ``"module:attr"`` names (a :class:`Backend` instance
    or a callable returning one) and return its name; what ``--plugin`` and
    ``--glmport-plugin`` do in every conformance process. Idempotent per target."""
    return REGISTRY.register_target(target)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend`."""
    REGISTRY.unregister(name)


def torch_code() -> tuple[str, ...]:
    """The composite backends then the reference, each by priority: the torch code that
    ends every vendor's fallback chain and differentiates what has no fused backward."""
    return (*REGISTRY.with_role(COMPOSITE), *REGISTRY.with_role(REFERENCE))


def chain_for(name: str) -> tuple[str, ...]:
    """The fallback chain starting at ``name``: itself, its declared fallbacks, then
    the composite backends (unless it is the reference) and the reference, each once."""
    m = REGISTRY.get(name).manifest
    tail = REGISTRY.with_role(REFERENCE) if m.role == REFERENCE else torch_code()
    return tuple(dict.fromkeys((name, *m.fallback, *tail)))
