"""Input checks shared by every backend: one place that decides what a valid call is.

Checks come in three levels (:class:`Level`, chosen by ``GLMPORT_VALIDATE``). Metadata
checks (ranks, shapes, dtypes, devices, scalar arguments) run everywhere, fake tensors
included. Value checks (``full``, the default) read what a kernel could misuse or what
is as small as the call's queries: index and key ranges, scales, per-query tensors;
they run only on real tensors and ``GLMPORT_VALIDATE=meta`` turns them off. Whole-tensor
scans of caches (finiteness of every key, float32 overflow bounds from a cache's max
magnitude) cost as much as the op at decode shapes, so only ``GLMPORT_VALIDATE=strict``
runs them.

No value check of ``full`` makes the host wait for a device: each forms its verdict as
a 0-d bool tensor on the inputs' device and hands it to :func:`holds`, which queues it
as a device-side assert (``torch._assert_async``). On the CPU the assert runs at once,
and a failed one is read back (free there) into the same :class:`OpInputError` naming
the argument, the expectation and the culprit; on an accelerator a failed check stops
the device with its own device-assert error at the next synchronisation, and
``GLMPORT_VALIDATE=strict``, which reads every verdict on the host, names it. So a
decode step can run without host synchronisation, or be captured in a device graph.

Float32 overflow on finite inputs is refused before the kernel by bounds from the max
magnitudes of the inputs (``within_range``; ``finite`` returns the magnitude it read,
so a bound costs no second scan): at ``full`` from the inputs it scans, at ``strict``
from all. A bound that needs a cache or a weight is therefore strict-only; at ``full``
the op's outputs are checked instead (:func:`first_overflow`), and only a call whose
outputs show an overflow pays for the strict checks, which then refuse it with their
own message; a float16 / bfloat16 output runs the same bounds against its own dtype's
range (see ``OpSpec.validate_result``). That output check reads the outputs: at
``full`` it runs on the CPU only (free there), on an accelerator under ``strict`` (a
device assert would turn a NaN the contract propagates into a dead device).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum

import torch

from .errors import OpInputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
INDEX_DTYPES = (torch.int32, torch.int64)
# The largest int an op's int argument (topk, num_experts, group_size ...) or a count
# it returns in an int32 tensor (slots, rows, experts) may be: kernels take them as
# 32-bit ints and the outputs store them in int32.
INT32_MAX = 2**31 - 1


class Level(IntEnum):
    """What a check may read: the ``values`` argument of every spec's check function.

    ``values`` is truthy from ``FULL`` up (a caller passing ``True`` means ``FULL``);
    whole-tensor scans test ``values >= Level.STRICT``.
    """

    META = 0  # metadata only: shapes, dtypes, devices, scalars
    FULL = 1  # plus indices, ranges, scales and per-query tensors (the default)
    STRICT = 2  # plus whole-cache scans (finiteness, float32 overflow bounds), host reads


def describe(t: object) -> str:
    """A short description of a value for error messages."""
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {list(t.shape)}, dtype {_dtype_name(t.dtype)} on {t.device}"
    return f"{type(t).__name__} {t!r}"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " | ".join(_dtype_name(d) for d in dtypes)


# A largest magnitude a value check read: a Python float where the checks read values
# on the host (``strict``), else a 0-d float64 tensor on the inputs' device.
Magnitude = float | torch.Tensor


def holds(ok: torch.Tensor, message: str, *, reads: bool = False) -> bool:
    """Whether the 0-d bool ``ok`` (a check's verdict) is true, found without making the
    host wait for a device unless ``reads``.

    ``reads``: read ``ok`` on the host (``GLMPORT_VALIDATE=strict``; a sync on an
    accelerator). Else ``torch._assert_async(ok, message)``: on an accelerator the check
    is queued and True comes back (a false verdict stops the device at its next
    synchronisation with its device-assert error, which carries ``message`` where the
    backend reports one); on the CPU it runs at once and a false verdict comes back as
    False, so the caller reads the values (free there) and raises its own error naming
    the culprit. A device whose backend has no ``_assert_async`` kernel gets its
    verdict read on the host.
    """
    if reads:
        return bool(ok)
    try:
        torch._assert_async(ok, message)
    except RuntimeError:  # failed at once (the CPU), or no kernel here (a NotImplementedError)
        return bool(ok)
    return True


def at_least(value: Magnitude, floor: float) -> Magnitude:
    """``max(value, floor)`` of a magnitude, on the device for a tensor (NaN stays NaN)."""
    return value.clamp_min(floor) if isinstance(value, torch.Tensor) else max(value, floor)


class Checker:
    """Check helpers bound to one op, so every message names the op."""

    def __init__(
        self,
        op: str,
        *,
        metadata: bool = True,
        range_dtype: torch.dtype = torch.float32,
        reads: bool = False,
    ) -> None:
        self.op = op
        # False: this call's signature passed the metadata checks before, so they
        # return at once and only the value checks run.
        self.metadata = metadata
        # The dtype whose range the overflow bounds (within_range) are held to.
        self.range_dtype = range_dtype
        # True (strict): value checks read their verdicts and magnitudes on the host.
        # False (full): verdicts become device-side asserts (see holds) and magnitudes
        # stay 0-d tensors on the device.
        self.reads = reads

    def fail(self, arg: str, expected: str, got: str, hint: str = "") -> None:
        raise OpInputError(self.op, arg, expected, got, hint)

    def tensor(
        self,
        arg: str,
        t: object,
        *,
        shape: Sequence[object] | None = None,
        ndim: int | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> torch.Tensor:
        """Check ``t`` is a tensor with the given rank / dtype / shape.

        ``shape`` entries are ints, ``None`` (any size), or a ``(name, size)`` pair
        whose name appears in the message (e.g. ``("T", q.shape[0])``).
        """
        if not self.metadata:
            return t
        if not isinstance(t, torch.Tensor):
            self.fail(arg, "a torch.Tensor", describe(t))
        if dtypes is not None and t.dtype not in dtypes:
            self.fail(arg, f"of dtype {_names(dtypes)}", describe(t))
        if shape is not None:
            ndim = len(shape)
        if ndim is not None and t.dim() != ndim:
            self.fail(arg, f"{ndim}-D{_shape_text(shape)}", describe(t))
        if shape is not None:
            for axis, want in enumerate(shape):
                size = want[1] if isinstance(want, tuple) else want
                if size is not None and t.shape[axis] != size:
                    self.fail(arg, f"of shape {_shape_text(shape).strip()}", describe(t))
        return t

    def same_device(self, **tensors: torch.Tensor | None) -> None:
        """All given tensors (``None`` ignored) must live on one device."""
        if not self.metadata:
            return
        present = {k: v for k, v in tensors.items() if v is not None}
        first_name, first = next(iter(present.items()))
        for name, t in present.items():
            if t.device != first.device:
                self.fail(
                    name,
                    f"on the same device as '{first_name}' ({first.device})",
                    describe(t),
                )

    def same_dtype(self, **tensors: torch.Tensor) -> None:
        if not self.metadata:
            return
        first_name, first = next(iter(tensors.items()))
        for name, t in tensors.items():
            if t.dtype != first.dtype:
                self.fail(name, f"of the same dtype as '{first_name}' ({first.dtype})", describe(t))

    def int_in_range(self, arg: str, value: object, low: int) -> None:
        """``value`` is an int (a bool is not) in ``[low, INT32_MAX]``."""
        if not self.metadata:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT32_MAX:
            self.fail(arg, f"an int >= {low} and <= 2**31 - 1 (a 32-bit int)", describe(value))

    def int32_count(self, arg: str, count: int, what: str) -> None:
        """``count`` (``what``, from ``arg``'s shape) fits the int32 outputs that hold it;
        a symbolic count (tracing with dynamic shapes) is not bounded, so no guard."""
        if self.metadata and type(count) is int and count > INT32_MAX:
            self.fail(arg, f"small enough that {what} fit in int32 (<= 2**31 - 1)", f"{count}")

    def fits_device(self, args: dict[str, object], fake: Callable[..., object]) -> None:
        """Refuse a call whose outputs, or any tensor argument laid out densely, need more
        bytes than the memory of the device the tensors are on: a backend may copy any
        input contiguous (several do) and must allocate the outputs, so such a call can
        only die in the allocator or run for hours over a broadcast (stride-0) view. Reads
        shapes and dtypes only (``fake`` builds the outputs on the meta device); calls
        with symbolic sizes or on a device of unknown memory are not bounded."""
        if not self.metadata:
            return
        tensors = {n: t for n, t in args.items() if isinstance(t, torch.Tensor)}
        if not tensors or not all(_concrete(t.shape) for t in tensors.values()):
            return
        device = next(iter(tensors.values())).device
        limit = device_memory(device)
        if limit is None:
            return
        where = f"the memory of {device} ({_bytes(limit)})"
        for name, t in tensors.items():
            need = _dense_bytes(t)
            if need > limit:
                self.fail(
                    name,
                    f"at most {where} laid out densely (backends may copy an input contiguous; "
                    "a broadcast view is as large as its shape)",
                    f"{describe(t)}: {_bytes(need)}",
                )
        outs = fake(*(_on_meta(a) for a in args.values()))
        outs = outs if isinstance(outs, tuple) else (outs,)
        need = sum(_dense_bytes(o) for o in outs)
        if need > limit:
            self.fail(
                _output_driver(args, outs),
                f"small enough that the call's outputs fit in {where}",
                "outputs "
                + ", ".join(f"{_dtype_name(o.dtype)} {list(o.shape)}" for o in outs)
                + f": {_bytes(need)}",
            )

    def positive_float(self, arg: str, value: object) -> None:
        if not self.metadata:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            self.fail(arg, "a finite float > 0", describe(value))

    def choice(self, arg: str, value: object, choices: Iterable[str]) -> None:
        if not self.metadata:
            return
        choices = list(choices)
        if value not in choices:
            self.fail(arg, f"one of {', '.join(repr(c) for c in choices)}", describe(value))

    # -- value checks: real tensors only --------------------------------------------
    # Each forms its verdict on the tensors' device and passes it to holds(); values
    # are read on the host only under ``reads`` or to name the culprit of a failed
    # check on the CPU.

    def holds(self, ok: torch.Tensor, arg: str, expected: str) -> bool:
        """Whether the verdict ``ok`` (0-d bool) of the check "``arg`` must be
        ``expected``" is true: see the module function :func:`holds`."""
        message = f"glmport.ops.{self.op}: argument '{arg}' must be {expected}"
        return holds(ok, message, reads=self.reads)

    def require(self, ok: torch.Tensor, arg: str, expected: str, got: Callable[[], str]) -> None:
        """Fail on ``arg`` unless the verdict ``ok`` holds; ``got()`` reads the values
        that name the culprit, only once the check has failed on the host."""
        if not self.holds(ok, arg, expected):
            self.fail(arg, expected, got())

    def _magnitude(self, t: torch.Tensor) -> Magnitude:
        """``t`` (0-d) as a magnitude: read on the host under ``reads``, else float64."""
        return float(t) if self.reads else t.double()

    def in_range(self, arg: str, t: torch.Tensor, low: int, high: int) -> None:
        """Every element of integer tensor ``t`` lies in ``[low, high)``."""
        if t.numel() == 0:
            return
        # int64: an int32 tensor compared with a bound past int32 would wrap it.
        lo, hi = (v.long() for v in torch.aminmax(t))
        self.require(
            (lo >= low) & (hi < high),
            arg,
            f"values in [{low}, {high})",
            lambda: f"a value {int(lo) if int(lo) < low else int(hi)}",
        )

    def finite_positive(self, arg: str, t: torch.Tensor) -> Magnitude:
        """Every element of ``t`` is finite and ``> 0``; returns ``max t`` (0 if empty)."""
        if t.numel() == 0:
            return 0.0
        lo, hi = torch.aminmax(t)  # NaN propagates into both

        def culprit() -> str:
            low, high = float(lo), float(hi)
            return f"a value {low if not (math.isfinite(low) and low > 0) else high}"

        ok = torch.isfinite(lo) & torch.isfinite(hi) & (lo > 0)
        self.require(ok, arg, "finite and > 0 everywhere (scales)", culprit)
        return self._magnitude(hi)

    def within_range(self, arg: str, bound: Magnitude, what: str, need: str = "small") -> None:
        """Fail on ``arg`` when ``bound`` (an upper bound of ``what``, from the inputs'
        max magnitudes) exceeds the range of ``range_dtype`` (float32: kernels compute
        ``what`` in float32, where it would overflow to inf and give NaN or zeros; a
        narrower output dtype, after the kernel: see ``OpSpec.validate_result``). A NaN
        bound (NaN input) passes: NaN inputs propagate."""
        limit = torch.finfo(self.range_dtype).max
        expected = (
            f"{need} enough to keep {what} within {_dtype_name(self.range_dtype)} "
            f"range (<= {limit:.3g})"
        )
        if isinstance(bound, torch.Tensor):
            self.require(
                ~(bound > limit),
                arg,
                expected,
                lambda: f"inputs that bound it by {float(bound):.3g}",
            )
        elif bound > limit:
            self.fail(arg, expected, f"inputs that bound it by {bound:.3g}")

    def finite(self, arg: str, t: torch.Tensor) -> Magnitude:
        """Every element of ``t`` is finite; returns ``max |t|`` (0 if empty), so that
        an overflow bound reuses this scan."""
        if t.numel() == 0:
            return 0.0
        # One min/max pass: far cheaper than isfinite(t).all(), and NaN propagates.
        lo, hi = torch.aminmax(_scannable(t))
        ok = torch.isfinite(lo) & torch.isfinite(hi)
        self.require(ok, arg, "finite everywhere (no NaN or inf)", lambda: "a non-finite value")
        return self._magnitude(torch.maximum(-lo, hi))

    def magnitude(self, t: torch.Tensor) -> Magnitude:
        """``max |t|`` (0 for an empty tensor; NaN if ``t`` holds one), with no check."""
        if t.numel() == 0:
            return 0.0
        lo, hi = torch.aminmax(_scannable(t))  # no |t| copy of a large tensor
        return self._magnitude(torch.maximum(-lo, hi))


def first_overflow(
    op: str, outputs: Sequence[tuple[str, torch.Tensor, object]], *, reads: bool = False
) -> tuple[str, torch.Tensor] | None:
    """The first ``(name, output)`` of ``(name, output, neg_inf)`` that holds NaN,
    ``+inf``, or not exactly ``neg_inf`` entries of ``-inf`` (the count its contract
    puts there: an int or a 0-d tensor); None when every one is clean. One verdict for
    all of them, read on the host under ``reads``, else judged on the CPU only (None
    off it: see the module docstring). An overflow inside a kernel shows in its
    outputs that way."""
    present = [(name, out, neg_inf) for name, out, neg_inf in outputs if out.numel()]
    if not present or not (reads or present[0][1].device.type == "cpu"):
        # Off the CPU a verdict would need a host read, or be a device assert that a NaN
        # the caller's inputs carry (and the contract propagates) would turn into a dead
        # device: the diagnosis runs under strict there.
        return None
    flags = []
    for _, out, neg_inf in present:
        top = out.amax()  # NaN if any element is NaN
        minus_inf = (out == float("-inf")).sum()
        flags.append(torch.isnan(top) | (top == float("inf")) | (minus_inf != neg_inf))
    flags = torch.stack(flags)
    names = ", ".join(f"'{name}'" for name, _, _ in present)
    message = (
        f"glmport.ops.{op}: outputs {names} must hold no NaN, +inf or -inf beyond the "
        "contract's (a float32 overflow); GLMPORT_VALIDATE=strict names the input to blame"
    )
    if holds(~flags.any(), message, reads=reads):
        return None
    for (name, out, _), bad in zip(present, flags.tolist(), strict=True):
        if bad:
            return name, out
    return None


def _scannable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype ``aminmax`` takes (float8 is upcast)."""
    return t if t.dtype in (*FLOAT_DTYPES, torch.float64) else t.float()


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device``: the physical RAM for the CPU, the total memory an
    accelerator's torch module reports (``torch.cuda``, ``torch.xpu``, ``torch.npu``
    ...), None where it says nothing (the meta device, a platform without ``sysconf``)."""
    return _device_memory(device.type, device.index)


@functools.cache
def _device_memory(kind: str, index: int | None) -> int | None:
    if kind == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    module = getattr(torch, kind, None)
    properties = getattr(module, "get_device_properties", None)
    if properties is None:
        return None
    try:
        return int(properties(module.current_device() if index is None else index).total_memory)
    except (AttributeError, RuntimeError, AssertionError):
        return None


def _concrete(shape: Sequence[object]) -> bool:
    return all(type(s) is int for s in shape)


def _dense_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def _on_meta(a: object) -> object:
    """A tensor's shape and dtype on the meta device (no memory); anything else as is."""
    if isinstance(a, torch.Tensor):
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    return a


def _output_driver(args: dict[str, object], outs: Sequence[torch.Tensor]) -> str:
    """The argument an oversized output comes from: the largest int argument that is a
    dim of an output (``topk``, ``num_experts``), else the tensor argument with the most
    elements."""
    dims = {d for o in outs for d in o.shape}
    ints = [(v, n) for n, v in args.items() if type(v) is int and v in dims]
    if ints:
        return max(ints)[1]
    sizes = [(math.prod(t.shape), n) for n, t in args.items() if isinstance(t, torch.Tensor)]
    return max(sizes, key=lambda size_name: size_name[0])[1]  # the first of equals


_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _bytes(n: int) -> str:
    """``n`` bytes for a message, in the largest binary unit below it: ``'3.5 GiB'``."""
    exp = min(max(n.bit_length() - 1, 0) // 10, len(_UNITS) - 1)
    return f"{n} bytes" if exp == 0 else f"{n / 1024**exp:.3g} {_UNITS[exp]}"


def _shape_text(shape: Sequence[object] | None) -> str:
    if shape is None:
        return ""
    parts = []
    for want in shape:
        if isinstance(want, tuple):
            parts.append(f"{want[0]}={want[1]}")
        else:
            parts.append("*" if want is None else str(want))
    return f" [{', '.join(parts)}]"
