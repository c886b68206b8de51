"""What a mutant is, the library it goes into, and the pieces mutations are built of.

A mutation is a function ``kernel -> mutated kernel`` (same signature, same outputs);
most are built from :func:`on_args` (edit the call before the kernel runs),
:func:`replace_args` (the same, argument by name) or :func:`on_outputs` (rewrite what
the kernel returned).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from glmport.core.registry import Kernel
from glmport.core.specs import SPECS

from ..paging import in_packed_form

LN2 = math.log(2.0)

# Case families a mutant may need beyond those the suite had (``needs``); a mutant
# that needs one survives until the suite has it.
IDS_2P16 = "ids >= 2^16 (slot, row, token ids past uint16)"
IMBALANCED_ROUTING = "imbalanced MoE routing (one expert takes most copies)"
NORM_TOPK_FALSE = "moe_gate with norm_topk_prob = False"
DUPLICATE_SLOTS = "sparse_attention with a slot listed twice"
EXACT_TIES = "exact ties judged in the documented order (lower slot / expert wins)"
TAIL_TILES = "sizes past a tile with a partial last tile (M > 128, vocabulary tiles)"
LM_LOGITS = "token_logprobs at LM-sized logits, judged in nats"
ZERO_GROUPS = "quantize with all-zero rows and groups"
ROPE_WIDE = "rope with rotary dims > 64"
EXACT_SCALES = "quantize scales compared bit-exactly"


@dataclass(frozen=True)
class Mutant:
    """One op's kernel with one porting bug.

    ``kind`` is the standard mutation it instantiates (``"stride"``, ``"tail
    element"``, ...), ``breaks`` what goes wrong, ``needs`` the case family meant to
    kill it (shown for a survivor). ``wrap`` takes the base backend's kernel for
    ``op`` and returns the mutated kernel. ``only``: ``(feature, values)`` pairs
    (feature names of ``SPECS[op]``) the mutated calls have; a backend whose
    capabilities take none of a feature's values never runs the mutated path, so the
    mutant does not apply to it."""

    op: str
    name: str
    kind: str
    breaks: str
    needs: str
    wrap: Callable[[Kernel], Kernel] = field(compare=False, repr=False)
    only: tuple[tuple[str, tuple], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.op}.{self.name}"


LIBRARY: dict[str, Mutant] = {}


def add(
    op: str,
    name: str,
    kind: str,
    breaks: str,
    needs: str,
    wrap: Callable[[Kernel], Kernel],
    **only: tuple,
) -> Callable[[Kernel], Kernel]:
    """Put the mutation ``wrap`` of ``op`` into :data:`LIBRARY` (ids are unique). An
    indexer mutation sees every call in the packed form (a paged one as its packed
    equivalent, :mod:`glmport.conformance.paging`), but a stride mutation sees the
    call as made: packing gathers the paged arguments into new tensors (and drops
    ``block_table``), which no stride mutation could reach."""
    full = wrap
    if op == "lightning_indexer":
        if kind == "stride":
            full = lambda kernel: wrap(in_packed_form(kernel))  # noqa: E731
        else:
            full = lambda kernel: in_packed_form(wrap(kernel))  # noqa: E731
    new = Mutant(op, name, kind, breaks, needs, full, tuple(only.items()))
    if new.id in LIBRARY:
        raise ValueError(f"mutant {new.id!r} is defined twice")
    LIBRARY[new.id] = new
    return wrap


def mutant(op: str, name: str, kind: str, breaks: str, needs: str, **only: tuple):
    """:func:`add` as a decorator of a ``kernel -> mutated kernel`` function."""
    return lambda wrap: add(op, name, kind, breaks, needs, wrap, **only)


def identity(op: str) -> Mutant:
    """The honest wrapper of ``op``: the base kernel unchanged. No check may kill it."""
    return Mutant(op, "identity", "none", "nothing (the kernel as it is)", "-", lambda k: k)


def on_args(edit: Callable[[list], None]) -> Callable[[Kernel], Kernel]:
    """A mutation that edits the argument list (in place) before the kernel runs."""

    def wrap(kernel: Kernel) -> Kernel:
        def mutated(*args):
            args = list(args)
            edit(args)
            return kernel(*args)

        return mutated

    return wrap


def replace_args(op: str, **changes: Callable[[object], object]) -> Callable[[Kernel], Kernel]:
    """A mutation of ``op`` that replaces arguments by name: ``name=lambda old: new``."""
    names = SPECS[op].arg_names
    unknown = set(changes) - set(names)
    if unknown:
        raise ValueError(f"{op} has no argument {', '.join(sorted(unknown))}")

    def edit(args: list) -> None:
        for name, change in changes.items():
            pos = names.index(name)
            args[pos] = change(args[pos])

    return on_args(edit)


def on_outputs(edit: Callable[[tuple, tuple], object]) -> Callable[[Kernel], Kernel]:
    """A mutation that rewrites the kernel's outputs: ``edit(outputs, args)``."""

    def wrap(kernel: Kernel) -> Kernel:
        return lambda *args: edit(kernel(*args), args)

    return wrap


def ones_if_given(t: torch.Tensor | None) -> torch.Tensor | None:
    """An optional scale tensor replaced by ones (a scale ignored)."""
    return None if t is None else torch.ones_like(t)


def same_width_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (fp8 and bf16 tensors
    can then be edited, gathered and copied bit for bit)."""
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(kinds[t.element_size()])


def flipped(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` reversed along ``dim``, bit for bit (torch has no flip of fp8)."""
    return same_width_int(t).flip(dim).view(t.dtype)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """A row-major ``[rows, cols]`` tensor read as if stored column-major."""
    return t.reshape(-1).view(t.shape[1], t.shape[0]).t()


def ids_16bit(ids: torch.Tensor) -> torch.Tensor:
    """Ids staged as uint16 (``-1`` kept): id ``i`` becomes ``i % 65536``."""
    return torch.where(ids >= 0, ids % 65536, ids).to(ids.dtype)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Packed int4 bytes with their two nibbles exchanged."""
    return ((packed >> 4) | (packed << 4)).to(torch.uint8)


def chunks(size: int, width: int) -> Iterator[slice]:
    """``range(size)`` in consecutive slices of ``width`` (the last may be shorter)."""
    return (slice(start, min(start + width, size)) for start in range(0, size, width))
