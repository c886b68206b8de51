"""The glmport ops as Relax graphs (Apache TVM 0.27): the entry points.

One emitter per op (:mod:`.tvm_emitters`) builds the op from standard Relax ops through
a ``relax.BlockBuilder``. Two entry points share them:

* :func:`convert_map` -- the ``custom_convert_map`` of
  ``tvm.relax.frontend.torch.from_exported_program``, so an exported program that calls
  ``torch.ops.glmport.*`` imports into one Relax module;
* :func:`op_module` -- a Relax ``main`` for one op call with symbolic sizes, which the
  ``tvm`` conformance backend (:mod:`glmport.export.tvm_backend`) compiles once per
  signature family.

float8 inputs and outputs raise :class:`~glmport.core.errors.UnsupportedError`: TVM's
llvm target converts float8_e4m3fn wrongly (1e-3 comes back as 0.026). ``tvm`` is
imported inside functions only: importing this module does not import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from glmport.core.errors import UnsupportedError
from glmport.core.formats import FP8_DTYPE
from glmport.core.specs import OP_NAMES

from .tvm_emitters import emit
from .tvm_graph import FP8_REASON

# ---------------------------------------------------------------- entry points


def convert_map() -> dict[str, Callable[[Any, Any], Any]]:
    """``{"<op>.default": converter}`` for ``from_exported_program(ep,
    custom_convert_map=convert_map())``: each converter reads the fx node's arguments
    (schema defaults filled in) and emits the op into the importer's block builder."""

    def converter(op: str) -> Callable[[Any, Any], Any]:
        def convert(node: Any, importer: Any) -> Any:
            from torch import fx

            args = []
            for i, spec in enumerate(node.target._schema.arguments):
                if i < len(node.args):
                    value = node.args[i]
                elif spec.name in node.kwargs:
                    value = node.kwargs[spec.name]
                else:
                    value = spec.default_value
                args.append(importer.env[value] if isinstance(value, fx.Node) else value)
            return emit(op, importer.block_builder, args)

        return convert

    return {f"{op}.default": converter(op) for op in OP_NAMES}


class _Dims:
    """Named symbolic sizes (int64 TIR variables), one per name."""

    def __init__(self) -> None:
        self._vars: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        from tvm import tirx

        if name not in self._vars:
            self._vars[name] = tirx.Var(name, "int64")
        return self._vars[name]


def _int4(t: torch.Tensor) -> bool:
    return t.dtype == torch.uint8


def _shapes(op: str, args: tuple, d: _Dims) -> list:
    """Symbolic shapes of ``op``'s tensor arguments in schema order (None for an absent
    optional): sizes the op ties together share a variable."""
    if op in ("lightning_indexer", "indexer_logits"):
        q_scale, k_scale = args[6:8] if op == "lightning_indexer" else args[5:7]
        table = args[8] if op == "lightning_indexer" else None
        keys, key_scale = ([d.N, d.Di], [d.N]) if table is None else (
            [d.blocks, d.block_size, d.Di], [d.blocks, d.block_size]
        )  # fmt: skip
        return [
            [d.T, d.Hi, d.Di], keys, [d.T, d.Hi], [d.T], [d.T],
            None if q_scale is None else [d.T, d.Hi], None if k_scale is None else key_scale,
            *([] if op == "indexer_logits" else [None if table is None else [d.T, d.M]]),
        ]  # fmt: skip
    if op == "sparse_attention":
        if args[6] is None:
            return [[d.T, d.H, d.Dk], [d.N, d.Hkv, d.Dk], [d.N, d.Hkv, d.Dv], [d.T, d.K], None]
        # A rope key apart: k holds the first Dk - Dr columns (Dn), k_rope the last Dr.
        return [
            [d.T, d.H, d.Dn + d.Dr], [d.N, d.Hkv, d.Dn], [d.N, d.Hkv, d.Dv], [d.T, d.K],
            [d.N, d.Hkv, d.Dr],
        ]  # fmt: skip
    if op == "moe_gate":
        return [[d.T, d.E], None if args[1] is None else [d.E]]
    if op == "moe_dispatch":
        return [[d.T, d.D], [d.T, d.K]]
    if op == "moe_combine":
        return [[d.R, d.D], [d.R], [d.T, d.K]]
    if op in ("grouped_gemm", "quant_gemm"):
        grouped = op == "grouped_gemm"
        x, w, w_scale = args[0], args[1], args[3 if grouped else 2]
        lead = [d.E] if grouped else []
        kw = d.K // 2 if _int4(w) else d.K
        scale = None if w_scale is None else [*lead, d.N, d.G][: w_scale.dim()]
        shapes = [[d.M, d.K], [*lead, d.N, kw]]
        return shapes + ([[d.E1], scale] if grouped else [scale])
    if op == "quantize":
        return [[d.R, d.C]]
    if op == "rms_norm":
        x = args[0]
        return [[*(getattr(d, f"B{i}") for i in range(x.dim() - 1)), d.D], [d.D]]
    if op == "rope":
        x = args[0]
        mid = [getattr(d, f"H{i}") for i in range(x.dim() - 2)]
        return [[d.T, *mid, d.D], [d.T, d.D // 2], [d.T, d.D // 2]]
    if op == "token_logprobs":
        return [[d.T, d.D], [d.V, d.D], [d.T]]
    if op == "mla_prolog":  # hidden Hd, q_lora Q, nope Dn, kv_lora C, rope 2P
        rope = 2 * d.P
        scales = (
            [[d.Q], [d.H * (d.Dn + rope)], [d.C + rope]] if args[10] is not None else [None] * 3
        )
        return [
            [d.T, d.Hd], [d.Q, d.Hd], [d.Q], [d.H * (d.Dn + rope), d.Q], [d.H, d.Dn, d.C],
            [d.C + rope, d.Hd], [d.C], [d.T, d.P], [d.T, d.P], *scales,
        ]  # fmt: skip
    raise KeyError(op)


def tvm_dtype(dtype: torch.dtype) -> str:
    """TVM's name of a torch dtype."""
    return str(dtype).removeprefix("torch.")


def op_module(op: str, args: tuple) -> Any:
    """A ``tvm.IRModule`` whose Relax ``main`` runs one ``op`` call.

    ``args`` are the op's arguments in schema order: each tensor becomes a parameter of
    its dtype and rank with symbolic sizes (one compiled module serves every size),
    Python scalars are baked in, an optional input that is None is no parameter. The
    outputs are a tuple for ops with several. Raises UnsupportedError for inputs TVM
    cannot take (float8).
    """
    from tvm import relax

    for a in args:
        if isinstance(a, torch.Tensor) and a.dtype == FP8_DTYPE:
            raise UnsupportedError(f"{op}: float8 input ({FP8_REASON})")
    shapes = _shapes(op, args, _Dims())
    tensors = [a for a in args if isinstance(a, torch.Tensor) or a is None]
    assert len(tensors) == len(shapes), (op, len(tensors), len(shapes))
    names = [s.name for s in getattr(torch.ops.glmport, op).default._schema.arguments]
    params, values, shape_iter = [], [], iter(shapes)
    for name, a in zip(names, args, strict=True):
        if isinstance(a, torch.Tensor) or a is None:
            shape = next(shape_iter)
            if a is None:
                values.append(None)
                continue
            var = relax.Var(name, relax.TensorType(shape, tvm_dtype(a.dtype)))
            params.append(var)
            values.append(var)
        else:
            values.append(a)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(emit(op, bb, values))
        bb.emit_func_output(out)
    return bb.get()
