"""Quantisation ops: ``quantize`` to a canonical format, ``quant_gemm`` on packed or
fake-quantised (QAT) weights. Formats and schemes: :mod:`glmport.core.formats`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import OpInputError
from ..formats import (
    FORMATS,
    FP8_DTYPE,
    FP8_MAX,
    SCHEMES,
    QuantScheme,
    dequantize_weight,
    fake_quant_activation,
)
from ..validate import FLOAT_DTYPES, Checker, Level, Magnitude, at_least, describe
from .base import OpSpec, invoke, invoke_prepared, single_output

# -- prepared weights ----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """One quantised weight, prepared for ``backend``'s kernels.

    Attributes:
        op: ``"quant_gemm"`` (``w [N, K']``) or ``"grouped_gemm"`` (``w [E, N, K']``).
        w, w_scale, scheme, group_size: the canonical weight (``core/formats.py``),
            kept for calls that cannot take the native layout and for checkpoints.
        backend, emulate: whose native layout ``native`` is, under which emulation
            setting.
        native: the backend's own tensors by name, or None when it takes the
            canonical layout (then calls simply run the op on ``w``).
        version: ``w``'s in-place version when prepared (see :meth:`is_current`).
    """

    op: str
    w: torch.Tensor
    w_scale: torch.Tensor | None
    scheme: str
    group_size: int
    backend: str
    emulate: bool
    native: Mapping[str, torch.Tensor] | None = None
    version: int = 0

    def is_current(self, w: torch.Tensor) -> bool:
        """Whether this was prepared from ``w`` as it is now (same tensor, not written
        in place since, e.g. by ``load_state_dict``)."""
        return w is self.w and w._version == self.version

    def __repr__(self) -> str:
        layout = f"native {sorted(self.native)}" if self.native is not None else "canonical"
        return (
            f"PreparedWeight({self.op}, {self.scheme}, w {list(self.w.shape)} on "
            f"{self.w.device}, for {self.backend!r}: {layout})"
        )


# -- quantize ----------------------------------------------------------------------


def _check_quantize(c: Checker, x, fmt, group_size, *, values):
    c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    c.choice("fmt", fmt, FORMATS)
    c.int_in_range("group_size", group_size, 1)
    if FORMATS[fmt].storage == torch.uint8:
        _check_int4_groups(c, "x", x.shape[1], group_size)
    c.same_device(x=x)
    if values:
        c.finite("x", x)


def _check_int4_groups(c: Checker, arg: str, cols: int, group_size: int) -> None:
    if group_size % 2 or cols % group_size:
        c.fail(
            "group_size",
            f"even and a divisor of the {cols} columns of '{arg}' (int4 groups pack in pairs)",
            repr(group_size),
        )


def _fake_quantize(x, fmt, group_size):
    f = FORMATS[fmt]
    rows, cols = x.shape
    return (
        x.new_empty(f.packed_shape(rows, cols), dtype=f.storage),
        x.new_empty(f.scale_shape(rows, cols, group_size), dtype=torch.float32),
    )


QUANTIZE = OpSpec(
    name="quantize",
    schema="(Tensor x, str fmt, int group_size=128) -> (Tensor q, Tensor scale)",
    check=_check_quantize,
    fake=_fake_quantize,
    features=lambda x, fmt, group_size=128: {
        "dtype": x.dtype,
        "format": fmt,
        "group_size": group_size,
    },
    feature_names=("dtype", "format", "group_size"),
)


def quantize(x: torch.Tensor, fmt: str, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D float tensor into one of the canonical formats.

    Args:
        x: ``[R, C]`` fp32 | bf16 | fp16, finite.
        fmt: ``int8_row`` | ``int4_group`` | ``fp8_group`` | ``fp8_group_pow2`` |
            ``fp8_block`` | ``fp8_block_pow2`` (layouts in :mod:`glmport.core.formats`).
        group_size: columns per scale group (rows and columns per block for
            ``fp8_block*``); ignored by ``int8_row``.

    Returns:
        q: the packed values (int8 ``[R, C]``, uint8 ``[R, C/2]`` for int4, or
        float8_e4m3fn ``[R, C]``); scale: float32, shaped per the format.
    """
    return invoke(QUANTIZE, x, fmt, group_size)


# -- quant_gemm --------------------------------------------------------------------


def check_quant_weight(
    c: Checker, x, w, w_scale, scheme, group_size, *, values: bool, experts: int | None = None
) -> None:
    """Check ``w`` / ``w_scale`` against ``scheme`` for activations ``x`` ``[M, K]``.

    ``experts`` is ``E`` for a grouped weight ``[E, N, K']`` (scales ``[E, ...]``).
    Float weights with ``w_scale=None`` are the fake-quant (QAT) mode.
    """
    c.choice("scheme", scheme, SCHEMES)
    c.int_in_range("group_size", group_size, 1)
    s: QuantScheme = SCHEMES[scheme]
    lead = () if experts is None else (("E", experts),)
    k = x.shape[1]
    if w.dtype in FLOAT_DTYPES:
        c.tensor("w", w, shape=(*lead, None, ("K", k)))
        if w_scale is not None:
            c.fail("w_scale", "None for a float (fake-quant, QAT) weight", "a scale tensor")
        n = w.shape[-2]
    else:
        c.tensor("w", w, ndim=len(lead) + 2, dtypes=(s.weight.storage,))
        n = w.shape[-2]
        c.tensor("w", w, shape=(*lead, ("N", n), s.weight.packed_shape(n, k)[1]))
        if w_scale is None:
            c.fail("w_scale", f"a float32 scale tensor for a packed {scheme} weight", "None")
        c.tensor("w_scale", w_scale, ndim=len(lead) + len(s.weight.scale_shape(n, k, 1)))
        group = None
        if s.weight.granularity == "group":
            group = s.weight_group_size(k, w_scale) if w_scale.shape[-1] else 0
        if group is not None and (group < 1 or group * w_scale.shape[-1] != k):
            c.fail(
                "w_scale",
                f"[..., K/group] with a group size dividing K={k}",
                str(list(w_scale.shape)),
            )
        want = s.weight.scale_shape(n, k, group or s.fixed_group_size or k)
        c.tensor("w_scale", w_scale, shape=(*lead, *want), dtypes=(torch.float32,))
        c.same_device(x=x, w_scale=w_scale)
    if s.weight.storage == torch.uint8:
        group = group_size if w.dtype in FLOAT_DTYPES else s.weight_group_size(k, w_scale)
        _check_int4_groups(c, "x", k, group)
    c.same_device(x=x, w=w)
    if not values:
        return
    packed = w.dtype not in FLOAT_DTYPES
    # Packed: |w| <= its largest code times max w_scale (a scan of the scales only).
    w_max = c.finite_positive("w_scale", w_scale) if packed else None
    x_max = c.finite("x", x) if s.activation is not None else None
    codes = 1.0
    if packed:  # an integer or fp8 accumulator of codes, then the scales
        codes = CODE_MAX[s.weight.storage]
        codes *= CODE_MAX[s.activation.storage] if s.activation is not None else 1.0
    check_product_bound(c, x, w, values, x_max=x_max, w_max=w_max, codes=codes)


# The largest magnitude of a packed code, by storage dtype (int8 includes -128).
CODE_MAX = {torch.int8: 128.0, torch.uint8: 8.0, FP8_DTYPE: FP8_MAX}


def check_product_bound(
    c: Checker,
    x: torch.Tensor,
    w: torch.Tensor,
    values: int,
    *,
    x_max: Magnitude | None = None,
    w_max: Magnitude | None = None,
    codes: float = 1.0,
) -> None:
    """Before the kernel: the partial sums of ``y = x @ w.T`` (``K`` terms, ``w``
    dequantised) stay within float32. ``x_max`` / ``w_max``: magnitudes the checks
    already read (``w_max`` of a packed weight: its largest scale); ``None``: read here
    under ``GLMPORT_VALIDATE=strict`` (a weight or unquantised activation ``full`` does
    not scan; there the result check catches an overflow). ``codes``: the product of
    the largest weight and activation codes of a quantised accumulator, 1 for float.
    The ``max(., 1)`` terms cover a kernel applying the scales after accumulating."""
    if values >= Level.STRICT:
        x_max = c.magnitude(x) if x_max is None else x_max
        w_max = c.magnitude(w) if w_max is None else w_max
    if x_max is None or w_max is None:
        return
    bound = x.shape[1] * codes * at_least(x_max, 1.0) * at_least(w_max, 1.0)
    c.within_range("x", bound, "the partial sums of x @ w.T (K * max|x| * max|w|, codes, scales)")


# A GEMM's product: float32 partial sums (bounded before the kernel where the level
# scans both operands) rounded to x's dtype, which may be float16.
PRODUCT_GUARD = single_output("y")


def _check_quant_gemm(c: Checker, x, w, w_scale, scheme, group_size, *, values):
    c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    c.tensor("w", w, ndim=2)
    check_quant_weight(c, x, w, w_scale, scheme, group_size, values=values)


def _fake_quant_gemm(x, w, w_scale, scheme, group_size=128):
    return x.new_empty((x.shape[0], w.shape[0]))


def _quant_gemm_backward(inputs, grads):
    """Straight-through estimator: ``y = Q(x) @ Q(w).T`` with ``Q`` taken as identity
    in the backward, so ``dx = dy @ Q(w)`` and (QAT) ``dw = dy.T @ Q(x)``."""
    x, w, w_scale, scheme, group_size = inputs
    (gy,) = grads
    gy32 = gy.float()
    gx = gy32 @ dequantize_weight(w, w_scale, scheme, group_size)
    gw = None
    if w_scale is None:  # QAT: a float weight, fake-quantised
        gw = (gy32.transpose(0, 1) @ fake_quant_activation(x, scheme)).to(w.dtype)
    return gx.to(x.dtype), gw, None, None, None


QUANT_GEMM = OpSpec(
    name="quant_gemm",
    schema="(Tensor x, Tensor w, Tensor? w_scale, str scheme, int group_size=128) -> Tensor",
    check=_check_quant_gemm,
    fake=_fake_quant_gemm,
    features=lambda x, w, w_scale, scheme, *_: {
        "dtype": x.dtype,
        "scheme": scheme,
        "out_features": w.shape[0],
        "in_features": x.shape[1],
    },
    feature_names=("dtype", "scheme", "out_features", "in_features"),
    differentiable=("x", "w"),
    backward=_quant_gemm_backward,
    result_guard=PRODUCT_GUARD,
)


def quant_gemm(
    x: torch.Tensor,
    w: torch.Tensor | PreparedWeight,
    w_scale: torch.Tensor | None = None,
    scheme: str | None = None,
    group_size: int = 128,
) -> torch.Tensor:
    """``y = x @ w.T`` with ``w`` quantised per ``scheme`` (activations quantised inside).

    Two modes, told apart by ``w``'s dtype:

    * packed (inference): ``w`` and ``w_scale`` as produced by
      :func:`glmport.ops.quantize_weight` for ``scheme``;
    * fake-quant (QAT): ``w`` is float ``[N, K]``, ``w_scale`` is ``None``; both
      ``x`` and ``w`` are quantised and dequantised on the fly, and gradients pass
      straight through (as if no rounding happened).

    Args:
        x: ``[M, K]`` fp32 | bf16 | fp16.
        w: packed ``[N, K]`` int8 (w8a8), ``[N, K/2]`` uint8 (w4a8, w4a16),
            ``[N, K]`` float8_e4m3fn (fp8_block*), or float ``[N, K]`` (QAT); or a
            :class:`PreparedWeight` from :func:`glmport.prepare_weight` (then
            ``w_scale``, ``scheme`` and ``group_size`` come from it).
        w_scale: float32 scales of the weight format, or ``None`` in QAT mode.
        scheme: ``w8a8`` | ``w4a8`` | ``w4a16`` | ``fp8_block`` | ``fp8_block_ue8m0``.
        group_size: int4 weight group size in QAT mode (packed weights carry theirs
            in ``w_scale``'s shape).

    Returns:
        ``[M, N]`` in ``x``'s dtype. Differentiable in ``x`` (both modes) and ``w``
        (QAT mode).
    """
    if isinstance(w, PreparedWeight):
        return invoke_prepared(QUANT_GEMM, (x, w, w.w_scale, w.scheme, w.group_size))
    return invoke(QUANT_GEMM, x, w, w_scale, scheme, group_size)


def quantize_weight(
    w: torch.Tensor, scheme: str, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a float weight ``[N, K]`` (or ``[E, N, K]`` for experts) for ``scheme``.

    Returns ``(w_packed, w_scale)`` ready for ``quant_gemm`` / ``grouped_gemm``;
    ``group_size`` sets the int4 group (the FP8-block size is fixed at 128). Runs the
    selected backend's ``quantize`` op.
    """
    if scheme not in SCHEMES:
        raise OpInputError(
            "quantize_weight", "scheme", f"one of {', '.join(SCHEMES)}", repr(scheme)
        )
    if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
        raise OpInputError(
            "quantize_weight", "w", "a 2-D [N, K] or 3-D [E, N, K] tensor", describe(w)
        )
    s = SCHEMES[scheme]
    size = s.fixed_group_size or group_size
    if w.dim() == 3:
        packed = [quantize(e, s.weight.name, size) for e in w.unbind(0)]
        return torch.stack([p[0] for p in packed]), torch.stack([p[1] for p in packed])
    return quantize(w, s.weight.name, size)
