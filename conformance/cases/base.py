"""The shared case machinery: :class:`Case` (one op call to judge, built from a seed)
and the helpers its builders share (seeded random tensors, causal key ranges, one case
per dtype, quantised GEMM weights with distinct scale tiles, degenerate GEMM sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from glmport.core.formats import FLOAT_WEIGHT, SCHEMES, quantize_tensor
from glmport.core.specs import SPECS

from ..layouts import relayout

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
Builder = Callable[[torch.Generator], tuple]


@dataclass(frozen=True)
class Case:
    """One op call to judge against the reference.

    ``dtype`` is the input precision under test (``float8_e4m3fn`` for fp8 inputs);
    ``scheme`` names a quant scheme or format where the op takes one; ``judge`` picks
    the comparison (see :mod:`glmport.conformance.judges`); ``layout`` is ``(argument,
    layout)`` when the case passes that argument in a view of
    :mod:`glmport.conformance.layouts` (family ``layout``).
    """

    op: str
    name: str
    family: str
    dtype: torch.dtype
    build: Builder = field(compare=False, repr=False)
    params: tuple[tuple[str, object], ...] = ()
    judge: str = "close"
    scheme: str | None = None
    full_only: bool = False
    seed: int = 0
    layout: tuple[str, str] | None = None

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        extra = f"-{self.scheme}" if self.scheme else ""
        laid = f"-{self.layout[0]}-{self.layout[1]}" if self.layout else ""
        return f"{self.op}-{self.name}-{dtype}{extra}{laid}"

    def args(self) -> tuple:
        """The op's arguments in schema order, all of them (defaults filled in after
        the builder's), CPU tensors (in the case's layout)."""
        gen = torch.Generator().manual_seed(self.seed)
        args = self.build(gen)
        if self.op in SPECS:  # an op, not a component such as expert_parallel
            args = SPECS[self.op].complete(args, {})
        return self.laid_out(args)

    def laid_out(self, args: tuple) -> tuple:
        """``args`` (on any device) with the case's layout made there: a non-dense view
        does not survive ``Tensor.to(device)``, so runners re-apply it after the move
        (the layouts are idempotent in value). A view of the re-laid-out argument
        (absorbed MLA's ``v = k[..., :512]``) is re-derived as the same view of it."""
        if self.layout is None:
            return args
        arg, layout = self.layout
        pos = SPECS[self.op].arg_names.index(arg)
        old, new = args[pos], relayout(args[pos], layout)
        out = list(args)
        out[pos] = new
        for i, other in enumerate(args):
            width = prefix_width(old, other) if i != pos else None
            if width is not None:
                out[i] = new[..., :width]
        return tuple(out)


def randn(
    gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    """``[*shape]`` standard normal draws of ``gen`` times ``scale``, in ``dtype``."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def causal_ranges(
    t: int, n: int, starts: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query ``i`` of a sequence whose last ``t`` tokens are queries over ``n`` slots:
    ``(start, end)``, each ``[t]`` int32 (start 0, or ``starts``)."""
    end = torch.arange(n - t + 1, n + 1, dtype=torch.int32)
    start = (
        torch.zeros(t, dtype=torch.int32)
        if starts is None
        else torch.tensor(starts, dtype=torch.int32)
    )
    return start, end


def per_dtype(
    op: str,
    name: str,
    family: str,
    params: dict,
    make: Callable[[torch.Generator, torch.dtype], tuple],
    dtypes: tuple[torch.dtype, ...] = FLOATS,
    **fields: object,
) -> Iterator[Case]:
    """One case per input dtype of a ``make(gen, dtype) -> args`` builder."""
    for dtype in dtypes:
        yield Case(
            op,
            name,
            family,
            dtype,
            build=lambda g, dtype=dtype: make(g, dtype),
            params=tuple(sorted(params.items())),
            **fields,
        )


# A slot id past 2**16: a kernel that stages ids as uint16 reads slot 0 for it.
WIDE_ID = 2**16


def prefix_width(base: torch.Tensor, view: object) -> int | None:
    """``w`` when ``view`` is ``base[..., :w]`` (same storage, offset and strides), else
    None."""
    tensors = isinstance(view, torch.Tensor) and isinstance(base, torch.Tensor)
    if not tensors or view is base or base.dim() == 0:
        return None
    same = (
        torch._C._is_alias_of(view, base)
        and view.storage_offset() == base.storage_offset()
        and view.stride() == base.stride()
        and view.shape[:-1] == base.shape[:-1]
        and view.shape[-1] <= base.shape[-1]
    )
    return view.shape[-1] if same else None


def zero_every(x: torch.Tensor, step: int) -> torch.Tensor:
    """``x`` with every ``step``-th row zero (``step`` 0: unchanged)."""
    if step:
        x = x.clone()
        x[::step] = 0
    return x


def scaled_tiles(gen: torch.Generator, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` ``[R, C]`` with each ``rows x cols`` tile times a power of two from 1/4 to
    8, a random permutation (all distinct up to 6 tiles): the scales of the tiles differ,
    so reading one tile's scale for another's (a transposed or mis-indexed scale) cannot
    pass, with ue8m0 scales too."""
    r, c = x.shape
    tiles = (-(-r // rows), -(-c // cols))
    exps = torch.randperm(tiles[0] * tiles[1], generator=gen).view(tiles) % 6 - 2
    factor = exps.exp2().repeat_interleave(rows, 0)[:r].repeat_interleave(cols, 1)[:, :c]
    return x * factor.to(x.dtype)


def quantized_weight(
    gen: torch.Generator, w: torch.Tensor, scheme: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight with scales that differ per scale tile, packed in
    ``scheme``'s weight format: ``(codes, scales)``, as :func:`quantize_tensor` returns."""
    s = SCHEMES[scheme]
    size = s.fixed_group_size or group_size
    rows, cols = {"row": (1, w.shape[1]), "group": (1, size), "block": (size, size)}[
        s.weight.granularity
    ]
    return quantize_tensor(scaled_tiles(gen, w, rows, cols), s.weight.name, size)


# M x N x K of the degenerate GEMM cases (quant_gemm and grouped_gemm).
DEGENERATE = {"k1": (5, 24, 1), "n1": (5, 1, 64), "m1_n24": (1, 24, 64), "mnk1": (1, 1, 1)}


def smallest_k(scheme: str, k: int) -> tuple[int, int]:
    """``(K, group_size)`` for a degenerate case of ``K = k``: int4 weights pack values
    in pairs within even groups, so their smallest K (and group) is 2."""
    if scheme != FLOAT_WEIGHT and SCHEMES[scheme].weight.storage == torch.uint8:
        k = max(k, 2)
        return k, min(k, 32)
    return k, 32
