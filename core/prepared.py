"""Prepared weights: a quantised weight converted once, at load time, into the native
layout of the backend that will run it (int4 repacked to int32 x 8 for Ascend,
pre-transposed or swizzled tiles for Triton, unpacked int8 for the generic backend's
integer GEMMs), so the conversion never runs per call.

``prepare_weight(op, w, w_scale, scheme)`` resolves ``op`` for the weight's device,
asks that backend's ``prepare_weight`` hook for its native tensors and returns a
:class:`~glmport.core.specs.quant.PreparedWeight`. Pass it where the op takes ``w``
(``glmport.ops.quant_gemm(x, prepared)``, ``glmport.ops.grouped_gemm(x, prepared,
offsets)``): a plain eager call on the backend it was prepared for runs that
backend's ``"<op>:prepared"`` kernel; any other call (another backend selected now,
autograd, tracing) runs the op on the canonical weight, which the record keeps.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .errors import BackendUnavailableError, OpInputError
from .registry import PREPARABLE_OPS, PREPARED_SUFFIX, REGISTRY
from .selection import current_settings, resolve
from .specs import SPECS
from .specs.quant import PreparedWeight
from .validate import describe

__all__ = ["PreparedWeight", "prepare_weight"]


def _probe_args(op: str, w, w_scale, scheme: str, group_size: int) -> tuple:
    """The op's arguments for zero rows of activations: enough to run its checks."""
    k = w.shape[-1] * (2 if w.dtype == torch.uint8 else 1)
    x = torch.empty((0, k), dtype=torch.float32, device=w.device)
    if op == "grouped_gemm":
        offsets = torch.zeros(w.shape[0] + 1, dtype=torch.int32, device=w.device)
        return (x, w, offsets, w_scale, scheme, group_size)
    return (x, w, w_scale, scheme, group_size)


def prepare_weight(
    op: str,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    scheme: str,
    group_size: int = 128,
) -> PreparedWeight:
    """Convert one canonical quantised weight for the backend that runs ``op`` on its
    device under the current selection; run it once per weight, at load time.

    Args:
        op: ``"quant_gemm"`` or ``"grouped_gemm"``.
        w: the packed weight, ``[N, K']`` (or ``[E, N, K']`` for ``grouped_gemm``), in
            ``scheme``'s canonical format; w_scale: its float32 scales.

    Raises:
        OpInputError: an op that takes no prepared weight, or a weight that breaks the
            op's contract (the same checks as a call, scales included).
    """
    if op not in PREPARABLE_OPS:
        raise OpInputError("prepare_weight", "op", f"one of {', '.join(PREPARABLE_OPS)}", op)
    if not isinstance(w, torch.Tensor) or w.dim() != (3 if op == "grouped_gemm" else 2):
        want = "[E, N, K']" if op == "grouped_gemm" else "[N, K']"
        raise OpInputError("prepare_weight", "w", f"a packed {want} tensor", describe(w))
    if w_scale is None:
        raise OpInputError(
            "prepare_weight", "w_scale", "the packed weight's float32 scales", "None"
        )
    SPECS[op].validate(_probe_args(op, w, w_scale, scheme, group_size), values=True)
    settings = current_settings()
    res = resolve(op, settings, device_type=w.device.type)
    kernels = REGISTRY.kernels(res.backend, settings.emulate)
    native = REGISTRY.get(res.backend).prepare_weight(op, w, w_scale, scheme, settings.emulate)
    if native is not None and op + PREPARED_SUFFIX not in kernels:
        raise BackendUnavailableError(
            f"backend {res.backend!r} prepared a {op} weight but its load_kernels() has no "
            f"'{op}{PREPARED_SUFFIX}' kernel to run it"
        )
    return PreparedWeight(
        op=op,
        w=w,
        w_scale=w_scale,
        scheme=scheme,
        group_size=group_size,
        backend=res.backend,
        emulate=settings.emulate,
        native=None if native is None else MappingProxyType(dict(native)),
        version=w._version,
    )
