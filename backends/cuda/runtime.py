"""What every Triton kernel of the cuda backend shares: interpreter mode, launch
configurations (autotuned on a GPU, fixed and large under the interpreter), the dtype
a kernel computes its dot products in, and exact float32 -> float8 rounding.

Import this module, and the kernel modules, only after ``TRITON_INTERPRET`` has its
final value for the process (``CudaBackend.load_kernels`` sets it for emulation):
Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted.

The interpreter's defects the kernels work around (measured, triton 3.9):

- bfloat16 arithmetic is wrong (values are kept as raw 16-bit patterns): every kernel
  loads, converts to float32 at once (``DOT_DTYPE`` is float32 under the interpreter)
  and converts back only at the store.
- float32 -> bfloat16 conversion truncates instead of rounding to nearest even (half
  of all values one ulp off, a bias that grows through a model's layers): every
  floating output is stored through :func:`rounded_to`, which rounds in integer
  arithmetic first (the GPU's own conversion gives the same values).
- float32 -> float8e4nv conversion drops the carry when rounding crosses a power of
  two (31.5 -> 16 instead of 32): :func:`round_to_e4m3` rounds in float32 first, so
  the conversion only ever sees exactly representable values.

Float32 division on a GPU is approximate (``div.full.f32``) unless spelled
``tl.div_rn``; quantisation, which must match the formats bit for bit, uses it. The
workarounds are compiled in only under the interpreter (the ``INTERPRETER`` constexpr):
a GPU's epilogue is a plain conversion.

The GPU's plan under the interpreter: the host heuristics (tile sizes, head blocks,
decode splits, the dot dtype) and the launch configurations normally take the
interpreter's branch, large blocks for speed. Inside :func:`gpu_plan` they take the
GPU's instead (an H200's 132 SMs, the autotune config chosen per kernel, 16-bit dots
emulated by :func:`to_dot`), so what a GPU would execute runs, interpreted, against
the float64 reference (tests/test_cuda_gpu_plan.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .mode import interpreting  # re-exported: the kernel modules ask here

# Read inside kernels: the interpreter's workarounds exist only where it runs them.
INTERPRETER: tl.constexpr = tl.constexpr(interpreting())
H200_SMS = 132


@dataclass(frozen=True)
class GpuPlan:
    """What :func:`gpu_plan` makes the host code assume: ``sms`` streaming
    multiprocessors, and per tuned kernel (by :func:`kernel_name`) the index of the autotune
    config its launches take (0, the default, when absent)."""

    sms: int = H200_SMS
    configs: Mapping[str, int] = field(default_factory=dict)


_PLAN: ContextVar[GpuPlan | None] = ContextVar("glmport_gpu_plan", default=None)
# Every tuned kernel by function name: its GPU autotune configs, default first.
TUNED_CONFIGS: dict[str, tuple[triton.Config, ...]] = {}


@contextmanager
def gpu_plan(sms: int = H200_SMS, configs: Mapping[str, int] | None = None) -> Iterator[GpuPlan]:
    """Within the block, interpreted launches take the GPU's host branches and configs
    (``configs``: kernel name -> autotune config index). Only under the interpreter:
    on a GPU the GPU's plan is what runs anyway."""
    if not interpreting():
        raise RuntimeError("gpu_plan runs a GPU's code paths under Triton's interpreter only")
    chosen = dict(configs or {})
    for name, index in chosen.items():
        if name not in TUNED_CONFIGS:
            raise KeyError(f"gpu_plan: no tuned kernel {name!r} (known: {sorted(TUNED_CONFIGS)})")
        if not 0 <= index < len(TUNED_CONFIGS[name]):
            raise IndexError(
                f"gpu_plan: {name} has {len(TUNED_CONFIGS[name])} configs, not index {index}"
            )
    token = _PLAN.set(GpuPlan(sms, chosen))
    try:
        yield _PLAN.get()
    finally:
        _PLAN.reset(token)


def interpreter_plan() -> bool:
    """Whether host heuristics take the interpreter's branch (fewest, largest
    programs): under the interpreter, outside :func:`gpu_plan`."""
    return interpreting() and _PLAN.get() is None


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors the host plans for: the plan's under
    :func:`gpu_plan`, else CUDA ``device``'s."""
    plan = _PLAN.get()
    if plan is not None:
        return plan.sms
    return torch.cuda.get_device_properties(device).multi_processor_count


def _patch_languages_once_per_launch() -> None:
    """Speed up the interpreter (same results): it re-patches ``triton.language`` on
    every call of a nested ``@triton.jit`` function (``tl.sum``, ``tl.max``, our
    helpers), ~2.5 ms each and over half the time of a small kernel, although within
    one launch the first patch of a function's modules already holds (nested patches
    are never undone). Each launch now patches each function once. Relies on two
    interpreter internals; where they differ (another triton version) nothing changes."""
    from triton.runtime import interpreter

    patch, executor = (
        getattr(interpreter, "_patch_lang", None),
        getattr(interpreter, "GridExecutor", None),
    )
    if patch is None or executor is None or getattr(patch, "glmport_once", False):
        return
    state = threading.local()
    run = executor.__call__

    def patch_once(fn):
        done = getattr(state, "done", None)
        if done is not None:
            if fn in done:
                return None  # only a launch uses the scope, and its first call returns it
            done.add(fn)
        return patch(fn)

    def launch(self, *args, **kwargs):
        outer, state.done = getattr(state, "done", None), set()
        try:
            return run(self, *args, **kwargs)
        finally:
            state.done = outer

    patch_once.glmport_once = True
    interpreter._patch_lang = patch_once
    executor.__call__ = launch


class _FixedLaunch:
    """A jitted kernel launched with one fixed meta-parameter set: the interpreter's
    stand-in for ``triton.autotune`` (which would time every config with CUDA
    events); inside :func:`gpu_plan` the GPU config the plan names. ``kernel[grid](*args)``
    works as for an autotuned kernel; a callable grid receives the meta-parameters."""

    def __init__(self, fn, config: dict, gpu_configs: Sequence[triton.Config]) -> None:
        self.fn = fn
        self.config = dict(config)
        self.gpu_configs = tuple(gpu_configs)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            plan = _PLAN.get()
            if plan is None:
                config = self.config
            else:
                config = self.gpu_configs[plan.configs.get(kernel_name(self.fn), 0)].kwargs
            meta = {**config, **kwargs}
            g = grid(meta) if callable(grid) else grid
            return self.fn[g](*args, **meta)

        return launch


def kernel_name(fn) -> str:
    """A kernel's name across the backend's modules: ``"attention._combine_kernel"``."""
    python = getattr(fn, "fn", fn)  # a jitted or interpreted kernel wraps the function
    return f"{python.__module__.rpartition('.')[2]}.{python.__name__}"


def tuned(configs: Sequence[triton.Config], key: Sequence[str], interpreter: dict) -> Callable:
    """Decorate a ``@triton.jit`` kernel: ``triton.autotune`` over ``configs`` (keyed on
    ``key``) on a GPU; under the interpreter, the single large-block ``interpreter``
    meta-parameters (interpreted speed grows with the number of program instances)."""

    def wrap(fn):
        TUNED_CONFIGS[kernel_name(fn)] = tuple(configs)
        if interpreting():
            _patch_languages_once_per_launch()
            return _FixedLaunch(fn, interpreter, configs)
        return triton.autotune(configs=list(configs), key=list(key))(fn)

    return wrap


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype a kernel feeds ``tl.dot`` for inputs of ``dtype``: the input's
    own 16-bit type on a GPU (tensor cores), float32 under the interpreter (its bf16
    arithmetic is wrong) and for float32 inputs (with ``input_precision="ieee"``: no
    TF32, the float32 tolerance would not hold). Inside :func:`gpu_plan` the GPU's
    choice, which :func:`to_dot` emulates."""
    if interpreter_plan() or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def next_pow2(n: int, floor: int = 16) -> int:
    """The block size covering ``n`` (at least ``floor``: ``tl.dot`` needs 16)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def round_to_e4m3(v):
    """Round float32 ``v`` (already clamped to +-448) to the nearest float8 e4m3 value,
    ties to even, in float32: the spacing is ``2**(e - 3)`` for exponent ``e``, at least
    ``2**-9`` (subnormals). Scaling by powers of two is exact; adding and subtracting
    ``1.5 * 2**23`` rounds to an integer, half to even. The sign is copied back so that
    tiny negatives round to -0.0 as torch's conversion does."""
    mag = tl.abs(v)
    bits = mag.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    r = ((mag * inverse + 12582912.0) - 12582912.0) * spacing
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_half_even(v):
    """Round float32 ``v`` with ``|v| < 2**22`` to an integer value, half to even."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def rounded_to(v, dtype: tl.constexpr):
    """Float32 ``v`` converted to ``dtype`` rounding to nearest, ties to even. For
    bfloat16 the rounding is done on the bits first (add ``0x7FFF`` plus the lowest kept
    bit, clear the low half; in int64, so nothing overflows), leaving a value the
    interpreter's truncating conversion keeps exactly; NaN stays NaN. On a GPU the
    conversion itself rounds so."""
    if INTERPRETER and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True).to(tl.int64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = tl.where(v != v, v, bits.to(tl.uint32).to(tl.float32, bitcast=True))
    return v.to(dtype)


@triton.jit
def row_invariant_dot(a, b, IEEE: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in float32 (operands from :func:`to_dot`) such that
    identical rows of ``a`` give bit-identical rows, as a GPU's MMA and FMA dots do
    (each output summed over ``K`` in one order whatever its row). The interpreter's
    float32 ``tl.dot`` (numpy's BLAS) does not: its edge rows take other kernels and
    differ in the last bit. So there the dot runs in float64 and rounds once to float32
    (a last-bit difference of float64 changes the float32 result only across a rounding
    boundary, about 2**-29 of outputs), except where the float32 dot overflows: a GPU's
    float32 accumulator overflows there too (to inf, or NaN from +inf and -inf), which
    float64 would hide. ``IEEE``: full-precision float32 on the GPU."""
    if INTERPRETER:
        exact = tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
        plain = tl.dot(a, b)
        return tl.where((plain == plain) & (tl.abs(plain) < float("inf")), exact, plain)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def to_dot(x, dtype: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of dtype ``dtype`` (from :func:`dot_dtype`). The
    interpreter's 16-bit dots are wrong, so there a 16-bit operand is rounded to
    ``dtype`` and held in float32: the same values and exact products a GPU's tensor
    cores multiply, summed in float32 as they do (order aside)."""
    if INTERPRETER:
        if dtype == tl.bfloat16 or dtype == tl.float16:
            return rounded_to(x.to(tl.float32), dtype).to(tl.float32)
        return x.to(tl.float32)
    return x.to(dtype)
