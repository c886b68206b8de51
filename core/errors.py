"""The glmport error hierarchy.

Every error names what was wrong: the op, the argument, what was expected and what
came, and where it helps, how to fix it. All derive from :class:`GlmportError` and
also from the closest builtin (``ValueError``, ``NotImplementedError``, ``RuntimeError``)
so generic ``except`` clauses keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class GlmportError(Exception):
    """Base class of every error glmport raises on purpose."""


class OpInputError(GlmportError, ValueError):
    """An op was called with an input that breaks its contract.

    Attributes:
        op: the op name, e.g. ``"sparse_attention"``.
        arg: the offending argument, e.g. ``"indices"``.
        expected: what the contract asks for.
        got: what came.
    """

    def __init__(self, op: str, arg: str, expected: str, got: str, hint: str = "") -> None:
        self.op, self.arg, self.expected, self.got = op, arg, expected, got
        msg = f"glmport.ops.{op}: argument '{arg}' must be {expected}, got {got}"
        super().__init__(f"{msg}. {hint}" if hint else msg)


class UnsupportedError(GlmportError, NotImplementedError):
    """A valid input that the selected backend declares it cannot take."""


class KernelSignatureError(GlmportError, TypeError):
    """A backend's kernel does not take an op's arguments the way glmport passes them:
    every argument positionally, in schema order, defaults filled in (a bug of the
    backend, not a limit it declares; the conformance suite reports it as an error)."""


class ConfigError(GlmportError, ValueError):
    """A malformed setting: an environment variable or an argument of the selection API."""


class BackendUnavailableError(GlmportError, RuntimeError):
    """A named backend cannot be used here; the message says why and lists the choices."""


class UnknownBackendError(BackendUnavailableError):
    """A backend name that no built-in and no installed plug-in provides."""

    def __init__(self, name: str, valid: Iterable[str], source: str = "") -> None:
        self.name = name
        self.valid = sorted(valid)
        where = f" (from {source})" if source else ""
        super().__init__(
            f"unknown glmport backend {name!r}{where}; valid backends: "
            f"{', '.join(self.valid)}, or 'auto'"
        )


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` when it is an int (a bool is not: ``True`` as a count is a mistake, not
    a 1) of at least ``minimum`` (and at most ``maximum`` when given); else a
    :class:`ConfigError` saying ``"<name> must be an int >= <minimum>, got <value>"``
    (``"... an int <= <maximum> ..."`` for a value too large)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        # no repr of a huge int: past 4300 digits Python refuses to print one
        got = repr(value) if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
        raise ConfigError(f"{name} must be an int <= {maximum}, got {got}")
    return value
