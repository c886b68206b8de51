"""The :class:`OpSpec` record every op of the interface is declared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import GlmportError
from ..validate import FP32_MAX, Checker, Level, first_overflow

# ``guard(outs, *args)``: the outputs that show an overflow, as ``(name, output,
# neg_inf)``, ``neg_inf`` the number of ``-inf`` the contract puts in that output.
ResultGuard = Callable[..., list[tuple[str, torch.Tensor, object]]]


def single_output(name: str) -> ResultGuard:
    """The guard of an op with one output, ``name``, where no ``-inf`` belongs."""
    return lambda out, *args: [(name, out, 0)]


@dataclass(frozen=True)
class OpSpec:
    """One op of the interface.

    ``check(c, *args, values=...)`` raises :class:`~glmport.core.errors.OpInputError`
    on a bad call; ``fake(*args)`` returns empty outputs of the right shapes and dtypes;
    ``features(*args)`` says what the call needs, as ``{name: value}`` over exactly
    ``feature_names`` (a value of None: the call does not have that feature);
    backends limit these names in their capabilities;
    ``differentiable`` names the inputs that receive gradients (empty: no autograd);
    ``backward`` optionally replaces the default vjp-of-the-reference backward with
    closed-form gradients: ``backward(inputs, grad_outputs) -> grads per input``;
    ``tie_outputs`` are integer outputs whose order may legally differ between
    backends when scores tie (compare them through the scores instead);
    ``result_guard`` names the outputs that show an overflow (see :data:`ResultGuard`).
    """

    name: str
    schema: str
    check: Callable[..., None]
    fake: Callable[..., object]
    features: Callable[..., dict[str, object]]
    feature_names: tuple[str, ...]
    differentiable: tuple[str, ...] = ()
    backward: Callable[..., tuple] | None = None
    tie_outputs: tuple[int, ...] = ()
    result_guard: ResultGuard | None = None
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

    def validate(self, args: tuple, *, values: bool, metadata: bool = True) -> None:
        """Raise ``OpInputError`` if ``args`` (in schema order) break the contract.
        ``metadata`` False: the caller knows this signature passed the metadata
        checks, and only the value checks run. The metadata checks end with the size
        bound (:meth:`Checker.fits_device`), before any check reads a value: a scan of
        a huge broadcast view would hang."""
        if metadata:
            checker = Checker(self.name)
            self.check(checker, *args, values=False)
            checker.fits_device(dict(zip(self.arg_names, args, strict=True)), self.fake)
        if values:
            reads = values >= Level.STRICT
            self.check(Checker(self.name, metadata=False, reads=reads), *args, values=values)

    def validate_result(self, args: tuple, outs: object, level: Level) -> None:
        """After the kernel (``GLMPORT_VALIDATE=full`` and up): when the outputs show an
        overflow, find out whose. The checks of ``strict`` (whole-cache scans, bounds
        from every input) raise their own ``OpInputError`` if the inputs are to blame.
        If they pass and the overflowed output is narrower than float32 (float16,
        bfloat16), the same bounds are held to that dtype's range: inputs that could
        overflow it are refused as well. Anything else is the kernel's own result and
        stands (the conformance judge sees it: a NaN from a softmax that forgot its
        max is the kernel's bug, not the caller's). The outputs are judged by one
        verdict (:func:`first_overflow`): on the CPU, and under ``strict`` (a host read)
        everywhere."""
        if self.result_guard is None:
            return
        with torch.no_grad():
            hit = first_overflow(
                self.name, self.result_guard(outs, *args), reads=level >= Level.STRICT
            )
        if hit is None:
            return
        if level < Level.STRICT:
            self.validate(args, values=Level.STRICT, metadata=False)
        out = hit[1]
        if torch.finfo(out.dtype).max < FP32_MAX:
            narrow = Checker(self.name, metadata=False, range_dtype=out.dtype, reads=True)
            self.check(narrow, *args, values=Level.STRICT)


# glmport.core.library installs dispatch.run here when it registers the ops: the path
# eager calls take around the torch.library dispatcher (see _plain_eager_call).
_eager_run: Callable[[str, tuple], object] | None = None


def set_eager_runner(run: Callable[[str, tuple], object]) -> None:
    """Install the function that runs an op call outside the dispatcher."""
    global _eager_run
    _eager_run = run


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.peek_interpreter_stack
_profiling = torch._C._autograd._profiler_enabled


def _plain_eager_call(args: tuple) -> bool:
    """Whether a call may skip the dispatcher with no change of meaning: nothing traces
    or transforms it (torch.compile / export, dispatch or function modes, vmap and
    grad transforms, the profiler), no input needs autograd, and every tensor is a
    plain, non-meta tensor (fake and other subclasses need the registered kernels)."""
    if (
        torch.compiler.is_compiling()
        or _dispatch_modes()
        or _function_mode()
        or _functorch_level() is not None
        or _profiling()
    ):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (
            type(a) not in _PLAIN_TENSORS or a.is_meta or (grad and a.requires_grad)
        ):
            return False
    return True


def invoke(spec: OpSpec, *args: object):
    """Call op ``spec`` with ``args`` in schema order.

    A plain eager call (see :func:`_plain_eager_call`) runs glmport's dispatch
    directly; any other goes through ``torch.ops.glmport.<spec.name>``, whose kernel
    is the same dispatch. The dispatcher rejects arguments of the wrong Python type
    before glmport's checks run; in that case the spec's checks are run here so the
    error names the op and the argument in glmport's terms. It also silently converts
    some scalars (a bool, a 0-d tensor or a numpy scalar into an int or float argument,
    ``1`` or ``None`` into a bool one) that glmport's checks reject, so those calls are
    checked here first.
    """
    if _eager_run is not None and len(args) == len(spec.arg_names) and _plain_eager_call(args):
        return _eager_run(spec.name, args)
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


def invoke_prepared(spec: OpSpec, args: tuple):
    """Call op ``spec`` with a prepared weight as its second argument ``w`` (a
    :class:`~glmport.core.specs.quant.PreparedWeight`): a plain eager call reaches the
    dispatch with it, which may run the backend's ``"<op>:prepared"`` kernel; any other
    call runs the op on the canonical weight it keeps."""
    if _eager_run is not None and _plain_eager_call(args):
        return _eager_run(spec.name, args)
    return invoke(spec, args[0], args[1].w, *args[2:])


# What an int or float argument may be: a Python number (a numpy float64 is one), or a
# symbolic one while tracing. The dispatcher would also take a bool, a 0-d tensor or a
# numpy int / float32 and convert it silently (a tensor's 2.7 into topk 2).
_NUMBERS = (int, float, torch.SymInt, torch.SymFloat)


def _coerced(spec: OpSpec, args: tuple) -> bool:
    """Whether the dispatcher would silently convert a scalar argument of ``args``."""
    for kind, a in zip(spec.arg_types, args, strict=False):
        if kind in ("int", "float") and (isinstance(a, bool) or not isinstance(a, _NUMBERS)):
            return True
        if kind == "bool" and not isinstance(a, (bool, torch.SymBool)):
            return True
    return False
