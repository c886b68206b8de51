"""The Relax graph builder the glmport op emitters (:mod:`.tvm_emitters`) share, and the
reason float8 stays out of TVM. ``tvm`` is imported inside functions only.
"""

from __future__ import annotations

import math
from typing import Any

from glmport.core.errors import UnsupportedError

FP8_REASON = "TVM's llvm target has no correct float8_e4m3fn conversion (1e-3 converts to 0.026)"
NEG_INF = float("-inf")


class Graph:
    """A ``relax.BlockBuilder`` with the shorthand the emitters use: calling it emits
    an expression and returns the bound variable (whose struct info carries the shape)."""

    def __init__(self, bb: Any) -> None:
        from tvm import relax

        self.bb, self.relax, self.op = bb, relax, relax.op

    def __call__(self, expr: Any) -> Any:
        return self.bb.emit(expr)

    def item(self, tup: Any, i: int) -> Any:
        return self(self.relax.TupleGetItem(tup, i))

    @staticmethod
    def shape(x: Any) -> list:
        return list(x.ty.shape)

    @staticmethod
    def dtype(x: Any) -> str:
        return str(x.ty.dtype)

    def const(self, value: float | int, dtype: str = "float32") -> Any:
        return self.relax.const(value, dtype)

    def dim(self, n: Any, dtype: str = "int64") -> Any:
        """A ``[1]`` tensor holding the (possibly symbolic) size ``n``. (Not ``arange(n,
        n + 1)``: legalised with symbolic sizes its length becomes an expression that
        broadcasting then spreads into other shapes, which matmul cannot legalise.)"""
        from tvm import relax

        return self(self.op.astype(self.op.shape_to_tensor(relax.ShapeExpr([n])), dtype))

    def neg_inf(self, shape: list) -> Any:
        """A float32 tensor of ``-inf`` (``0 - inf``: TVM 0.27's ``full`` cannot legalise an
        infinite fill value)."""
        return self(self.op.subtract(self.op.zeros(shape, "float32"), self.const(float("inf"))))

    def sum(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._over(x, axis, self.op.sum(x, axis=axis, keepdims=keepdims), 0)

    def max(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._over(x, axis, self.op.max(x, axis=axis, keepdims=keepdims), NEG_INF)

    def mean(self, x: Any, axis: int, keepdims: bool = False) -> Any:
        return self._over(x, axis, self.op.mean(x, axis=axis, keepdims=keepdims), math.nan)

    def matmul(self, a: Any, b: Any, out_dtype: str | None = None) -> Any:
        """``a @ b`` (``a`` a bound variable: its last axis is the one summed over)."""
        return self._over(a, -1, self.op.matmul(a, b, out_dtype=out_dtype), 0)

    def _over(self, x: Any, axis: int, reduction: Any, neutral: float) -> Any:
        """``reduction`` of ``x`` over ``axis``, emitted; ``neutral`` where that axis is
        empty. TVM 0.27's lowered reductions initialise their output inside the loop
        over the reduced axis, so over no element they return uninitialised memory. An
        axis of a fixed nonzero size needs no select."""
        from tvm import tirx

        result = self(reduction)
        extent = self.shape(x)[axis]
        if isinstance(extent, tirx.IntImm) and extent.value != 0:
            return result
        empty = self(self.op.equal(self.op.reshape(self.dim(extent), []), self.const(0, "int64")))
        dtype = self.dtype(result)
        if dtype.startswith("int") and math.isinf(neutral):  # an integer max: its lowest value
            neutral = -(2 ** (int(dtype.removeprefix("int")) - 1))
        return self(self.op.where(empty, self.const(neutral, dtype), result))

    def f32(self, x: Any) -> Any:
        return x if self.dtype(x) == "float32" else self(self.op.astype(x, "float32"))

    def i64(self, x: Any) -> Any:
        return x if self.dtype(x) == "int64" else self(self.op.astype(x, "int64"))

    def clamp(self, x: Any, lo: Any, hi: Any) -> Any:
        return self(self.op.minimum(self.op.maximum(x, lo), hi))

    def split2(self, x: Any, axis: int) -> tuple[Any, Any]:
        """The two halves of a size-2 ``axis``, that axis dropped."""
        parts = self(self.op.split(x, 2, axis=axis))
        return tuple(self(self.op.squeeze(self.item(parts, i), [axis])) for i in range(2))

    def stack2(self, a: Any, b: Any, axis: int) -> Any:
        op = self.op
        return self(op.concat([op.expand_dims(a, axis), op.expand_dims(b, axis)], axis=axis))


def reject_fp8(op: str, g: Graph, tensors: list) -> None:
    """Raise :class:`~glmport.core.errors.UnsupportedError` if a tensor of ``tensors`` is
    float8 (:data:`FP8_REASON`)."""
    for x in tensors:
        if x is not None and g.dtype(x).startswith("float8"):
            raise UnsupportedError(f"{op}: float8 input ({FP8_REASON})")
