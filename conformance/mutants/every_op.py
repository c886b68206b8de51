"""Mutations applied to every op they fit: a tail element of the first output lost or
repeated (an off-by-one tile bound or loop end), and each tensor argument read as if
contiguous (its strides ignored)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmport.core.formats import FP8_DTYPE, SCHEMES
from glmport.core.registry import Kernel
from glmport.core.specs import OP_NAMES, SPECS

from .base import add, on_args, on_outputs, same_width_int

TENSOR_TYPES = ("Tensor", "Optional[Tensor]")
# Optional tensors given only with some feature value: their stride mutants apply only
# to backends that take such calls (``Mutant.only``).
GIVEN_WITH = {
    "q_scale": {"dtype": (FP8_DTYPE,)},
    "k_scale": {"dtype": (FP8_DTYPE,)},
    "w_scale": {"scheme": tuple(SCHEMES)},
}


def first_output_edited(edit: Callable[[torch.Tensor], None]) -> Callable[[Kernel], Kernel]:
    """Edit (a copy of) the op's first output in place, through its bits (so that a
    float8 output takes the edit too: 0 bits are +0)."""

    def rewrite(outs, args):
        first, rest = (outs[0], outs[1:]) if isinstance(outs, tuple) else (outs, None)
        first = first.clone()
        edit(same_width_int(first))
        return first if rest is None else (first, *rest)

    return on_outputs(rewrite)


def _drop_last_row(t: torch.Tensor) -> None:
    if t.shape[0]:
        t[-1] = 0


def _duplicate_last_row(t: torch.Tensor) -> None:
    if t.shape[0] >= 2:
        t[-1] = t[-2]


def _drop_last_column(t: torch.Tensor) -> None:
    if t.shape[-1]:
        t[..., -1] = 0


# (name, what breaks, the edit, whether it needs a column dim: token_logprobs' are [T])
_TAIL = (
    ("last_row_dropped", "the last row of the first output is never written (left zero)",
     _drop_last_row, False),
    ("last_row_duplicated", "the last row of the first output repeats the one before "
     "(an off-by-one tile index)", _duplicate_last_row, False),
    ("last_column_dropped", "the last column of the first output is never written "
     "(left zero)", _drop_last_column, True),
)  # fmt: skip


def as_if_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s elements as a kernel reads them that takes its storage for a dense
    tensor of ``t``'s shape from its storage offset (wrapping around the storage's
    end rather than reading past it)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous() or t.numel() == 0:
        return t
    bits = same_width_int(t)
    size = t.untyped_storage().nbytes() // t.element_size()
    storage = torch.as_strided(bits, (size,), (1,), 0)
    where = (t.storage_offset() + torch.arange(t.numel(), device=t.device)) % size
    return storage[where].view(t.shape).view(t.dtype)


def _ignores_stride(position: int) -> Callable[[Kernel], Kernel]:
    def edit(args: list) -> None:
        args[position] = as_if_contiguous(args[position])

    return on_args(edit)


for _op in OP_NAMES:
    for _name, _breaks, _edit, _needs_column in _TAIL:
        if not (_needs_column and _op == "token_logprobs"):
            add(_op, _name, "tail element", _breaks, "tiny", first_output_edited(_edit))
    _spec = SPECS[_op]
    for _pos, (_arg, _type) in enumerate(zip(_spec.arg_names, _spec.arg_types, strict=True)):
        if _type in TENSOR_TYPES:
            add(
                _op,
                f"ignores_stride_{_arg}",
                "stride",
                f"reads '{_arg}' as if it were contiguous (its strides ignored)",
                f"layout: a non-contiguous or stride-0 '{_arg}'",
                _ignores_stride(_pos),
                **GIVEN_WITH.get(_arg, {}),
            )
