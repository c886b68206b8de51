"""The :class:`OpSpec` record every op of the interface is declared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import GlmportError
from ..validate import Checker


@dataclass(frozen=True)
class Features:
    """What a call asks of a backend, matched against its declared capabilities."""

    dtype: torch.dtype
    head_dim: int | None = None
    scheme: str | None = None


@dataclass(frozen=True)
class OpSpec:
    """One op of the interface.

    ``check(c, *args, values=...)`` raises :class:`~glmport.core.errors.OpInputError`
    on a bad call; ``fake(*args)`` returns empty outputs of the right shapes and dtypes;
    ``features(*args)`` says what the call needs (dtype, head dim, scheme);
    ``differentiable`` names the inputs that receive gradients (empty: no autograd);
    ``backward`` optionally replaces the default vjp-of-the-reference backward with
    closed-form gradients: ``backward(inputs, grad_outputs) -> grads per input``;
    ``tie_outputs`` are integer outputs whose order may legally differ between
    backends when scores tie (compare them through the scores instead).
    """

    name: str
    schema: str
    check: Callable[..., None]
    fake: Callable[..., object]
    features: Callable[..., Features]
    differentiable: tuple[str, ...] = ()
    backward: Callable[..., tuple] | None = None
    tie_outputs: tuple[int, ...] = ()
    arg_names: tuple[str, ...] = field(init=False)
    arg_types: tuple[str, ...] = field(init=False)
    defaults: dict[str, object] = field(init=False)

    def __post_init__(self) -> None:
        parsed = torch._C.parse_schema(f"glmport::{self.name}{self.schema}")
        object.__setattr__(self, "arg_names", tuple(a.name for a in parsed.arguments))
        object.__setattr__(self, "arg_types", tuple(str(a.type) for a in parsed.arguments))
        defaults = {a.name: a.default_value for a in parsed.arguments if a.has_default_value()}
        object.__setattr__(self, "defaults", defaults)

    def complete(self, args: tuple, kwargs: dict) -> tuple:
        """All arguments in schema order: the dispatcher drops trailing ones that equal
        their defaults before calling a Python kernel, so fill them back in."""
        given = dict(zip(self.arg_names, args, strict=False)) | kwargs
        return tuple(given[n] if n in given else self.defaults[n] for n in self.arg_names)

    def validate(self, args: tuple, *, values: bool) -> None:
        """Raise ``OpInputError`` if ``args`` (in schema order) break the contract."""
        self.check(Checker(self.name), *args, values=values)


def invoke(spec: OpSpec, *args: object):
    """Call ``torch.ops.glmport.<spec.name>`` with ``args`` in schema order.

    The dispatcher rejects arguments of the wrong Python type before glmport's checks
    run; in that case the spec's checks are run here so the error names the op and
    the argument in glmport's terms. It also silently converts some scalars (a bool
    into an int or float argument, ``1`` or ``None`` into a bool one) that glmport's
    checks reject, so those calls are checked here first.
    """
    op = getattr(torch.ops.glmport, spec.name)
    if _coerced(spec, args):
        spec.validate(args, values=False)
    try:
        return op(*args)
    except (TypeError, RuntimeError) as err:
        if isinstance(err, GlmportError):
            raise
        spec.validate(args, values=False)
        raise


def _coerced(spec: OpSpec, args: tuple) -> bool:
    """Whether the dispatcher would silently convert a scalar argument of ``args``."""
    for kind, a in zip(spec.arg_types, args, strict=False):
        if kind in ("int", "float") and isinstance(a, bool):
            return True
        if kind == "bool" and not isinstance(a, (bool, torch.SymBool)):
            return True
    return False
