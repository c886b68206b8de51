"""grouped_gemm and quant_gemm mutants.

grouped: (x [M, K], w [E, N, K'], expert_offsets [E + 1] int32, w_scale, scheme,
group_size) -> [M, N]; quant_gemm: (x [M, K], w [N, K'], w_scale, scheme,
group_size) -> [M, N]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmport.core.formats import FLOAT_WEIGHT, FP8_DTYPE, SCHEMES, fake_quant
from glmport.core.specs import SPECS

from .base import TAIL_TILES, add, chunks, column_major, mutant, on_args, swap_nibbles
from .every_op import first_output_edited

GEMMS = ("grouped_gemm", "quant_gemm")
FP8_SCHEMES = tuple(s for s in SCHEMES if SCHEMES[s].weight.storage == FP8_DTYPE)
INT4_SCHEMES = tuple(s for s in SCHEMES if SCHEMES[s].weight.storage == torch.uint8)
INT8_ACTIVATION = tuple(
    s for s in SCHEMES if SCHEMES[s].activation and SCHEMES[s].activation.storage == torch.int8
)
FP8_ACTIVATION = tuple(
    s for s in SCHEMES if SCHEMES[s].activation and SCHEMES[s].activation.storage == FP8_DTYPE
)
ROW_TILE = 128  # the prefill row tile of the tail-tile mutant


def _when_scheme(op: str, schemes: tuple, edit: Callable[[list], None]):
    """A GEMM mutation ``edit(args)`` of the calls whose scheme is one of ``schemes``."""
    pos = SPECS[op].arg_names.index("scheme")

    def guarded(args: list) -> None:
        if args[pos] in schemes:
            edit(args)

    return on_args(guarded)


def _weight_scales(op: str, change: Callable[[torch.Tensor, int], torch.Tensor], schemes):
    """A GEMM mutation of the weight scales of ``schemes`` weights:
    ``change(scales, K) -> scales`` (per expert for grouped_gemm)."""
    pos = SPECS[op].arg_names.index("w_scale")

    def edit(args: list) -> None:
        scales, k = args[pos], args[0].shape[1]
        if scales is None:
            return
        if op == "grouped_gemm":
            args[pos] = torch.stack([change(s, k) for s in scales])
        else:
            args[pos] = change(scales, k)

    return _when_scheme(op, schemes, edit)


def _last_group_uses_previous(s: torch.Tensor, k: int) -> torch.Tensor:
    if s.dim() < 2 or s.shape[-1] < 2:
        return s
    s = s.clone()
    s[..., -1] = s[..., -2]
    return s


def _group_size_128(s: torch.Tensor, k: int) -> torch.Tensor:
    """The int4 scales ``[N, G]`` (of ``K`` columns) as a kernel reads them that
    assumes 128-wide groups: each 128 columns take their first group's scale."""
    group_size = k // s.shape[-1]
    if group_size >= 128:
        return s
    ratio = 128 // group_size
    return s[..., ::ratio].repeat_interleave(ratio, dim=-1)[..., : s.shape[-1]].contiguous()


def _nibbles_swapped(args: list) -> None:
    if args[1].dtype == torch.uint8:
        args[1] = swap_nibbles(args[1])


def _activations(fake: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list], None]:
    """``x`` as ``fake`` (a coarser quantisation) leaves it: the kernel's own per-token /
    per-tile quantisation then sees values already on that grid."""

    def edit(args: list) -> None:
        if args[0].numel():
            args[0] = fake(args[0]).to(args[0].dtype)

    return edit


def _per_tensor_int8(x: torch.Tensor) -> torch.Tensor:
    return fake_quant(x.reshape(1, -1), "int8_row", x.numel()).view(x.shape)


def _per_block_fp8(x: torch.Tensor) -> torch.Tensor:
    return fake_quant(x, "fp8_block", 128)


def _tail_tile(rows: torch.Tensor) -> None:
    """Rows past the last full row tile of an M > ROW_TILE output left zero."""
    m = rows.shape[0]
    if m > ROW_TILE and m % ROW_TILE:
        rows[m - m % ROW_TILE :] = 0


# (name, kind, what breaks, the family that kills it, the schemes it changes (empty:
# all), the mutation of op); the schemes say which backends it applies to (``only``).
_BOTH = (
    ("fp8_block_scales_transposed", "scale layout",
     "reads the 128 x 128 block scales [NB, KB] as if stored column-major",
     "edge: multi_block (NB != KB)", FP8_SCHEMES,
     lambda op: _weight_scales(op, lambda s, k: column_major(s), FP8_SCHEMES)),
    ("int4_group_scales_transposed", "scale layout",
     "reads the int4 group scales [N, G] as if stored column-major", "edge: multi_block",
     INT4_SCHEMES, lambda op: _weight_scales(op, lambda s, k: column_major(s), INT4_SCHEMES)),
    ("last_k_group_uses_previous_scale", "range end",
     "the last K group (or block) reuses the scale of the one before",
     "edge: k_not_128, multi_block", (*FP8_SCHEMES, *INT4_SCHEMES),
     lambda op: _weight_scales(op, _last_group_uses_previous, (*FP8_SCHEMES, *INT4_SCHEMES))),
    ("group_size_hardcoded_128", "scale layout",
     "assumes 128-wide int4 groups whatever the scales say", "tiny (32-wide groups)",
     INT4_SCHEMES, lambda op: _weight_scales(op, _group_size_128, INT4_SCHEMES)),
    ("int4_nibbles_swapped", "layout", "unpacks int4 with the nibbles swapped (high first)",
     "tiny", INT4_SCHEMES, lambda op: _when_scheme(op, INT4_SCHEMES, _nibbles_swapped)),
    ("activation_scale_per_tensor", "scale",
     "quantises the activations with one int8 scale for the whole tensor, not per token",
     "tiny (rows of different magnitudes)", INT8_ACTIVATION,
     lambda op: _when_scheme(op, INT8_ACTIVATION, _activations(_per_tensor_int8))),
    ("activation_scale_per_block", "scale",
     "quantises the activations per 128 x 128 block, not per token and 128 columns",
     "tiny (rows of different magnitudes)", FP8_ACTIVATION,
     lambda op: _when_scheme(op, FP8_ACTIVATION, _activations(_per_block_fp8))),
    ("tail_tile_m", "tail element",
     f"launches M // {ROW_TILE} row tiles for M > {ROW_TILE} (prefill): the last partial "
     "tile stays zero", TAIL_TILES, (), lambda op: first_output_edited(_tail_tile)),
)  # fmt: skip
for _op in GEMMS:
    for _name, _kind, _breaks, _needs, _schemes, _of_op in _BOTH:
        _only = {"scheme": _schemes} if _schemes else {}
        add(_op, _name, _kind, _breaks, _needs, _of_op(_op), **_only)


@mutant(
    "grouped_gemm",
    "offsets_off_by_one",
    "range end",
    "starts every expert but the first one row late",
    "tiny",
)
def _late_offsets(kernel):
    def mutated(x, w, offsets, *rest):
        late = offsets.clone()
        late[1:-1] = (offsets[1:-1] + 1).clamp_max(x.shape[0])
        return kernel(x, w, late, *rest)

    return mutated


@mutant(
    "grouped_gemm",
    "empty_expert_takes_a_row",
    "range end",
    "an expert with no rows still computes one (the next expert's first row, with its own weight)",
    "edge: empty_experts",
)
def _empty_expert(kernel):
    def mutated(x, w, offsets, w_scale, scheme, group_size):
        out = kernel(x, w, offsets, w_scale, scheme, group_size).clone()
        bounds = offsets.tolist()
        one = torch.tensor([0, 1], dtype=offsets.dtype, device=offsets.device)
        for e in range(w.shape[0]):
            row = bounds[e]
            if bounds[e + 1] == row < x.shape[0]:
                scale = None if w_scale is None else w_scale[e : e + 1]
                out[row] = kernel(x[row : row + 1], w[e : e + 1], one, scale, scheme, group_size)[0]
        return out

    return mutated


@mutant(
    "grouped_gemm",
    "expert0_scales_for_all",
    "scale layout",
    "every expert reads expert 0's weight scales (the expert stride of w_scale ignored)",
    "tiny",
    scheme=tuple(SCHEMES),
)
def _one_scale(kernel):
    def mutated(x, w, offsets, w_scale, *rest):
        if w_scale is not None:
            w_scale = w_scale[:1].expand_as(w_scale).contiguous()
        return kernel(x, w, offsets, w_scale, *rest)

    return mutated


@mutant(
    "grouped_gemm",
    "last_expert_ignored",
    "range end",
    "never runs the last expert (its rows stay zero)",
    "tiny",
)
def _last_expert(kernel):
    def mutated(x, w, offsets, *rest):
        out = kernel(x, w, offsets, *rest).clone()
        out[int(offsets[-2]) : int(offsets[-1])] = 0
        return out

    return mutated


def _summed_in_output_dtype(parts) -> torch.Tensor | None:
    """The partial products added one by one, each sum rounded to their dtype."""
    total = None
    for part in parts:
        total = part if total is None else (total + part).to(part.dtype)
    return total


@mutant(
    "grouped_gemm",
    "accumulates_in_low_dtype",
    "low precision",
    "adds the K partial sums (16 at a time) in the input dtype",
    "glm5 (K = 256, bfloat16)",
    scheme=(FLOAT_WEIGHT,),
)
def _grouped_low_accumulation(kernel):
    def mutated(x, w, offsets, w_scale, scheme, group_size):
        if scheme != FLOAT_WEIGHT or x.shape[1] == 0:
            return kernel(x, w, offsets, w_scale, scheme, group_size)
        return _summed_in_output_dtype(
            kernel(x[:, cols].contiguous(), w[:, :, cols].contiguous(), offsets, None, scheme,
                   group_size)
            for cols in chunks(x.shape[1], 16)
        )  # fmt: skip

    return mutated


@mutant(
    "quant_gemm",
    "accumulates_in_low_dtype",
    "low precision",
    "adds the per-group partial sums of w4a16 in the input dtype",
    "glm5 (16 groups, bfloat16)",
    scheme=("w4a16",),
)
def _quant_low_accumulation(kernel):
    def mutated(x, w, w_scale, scheme, group_size):
        if scheme != "w4a16" or w_scale is None or w_scale.shape[-1] < 2:
            return kernel(x, w, w_scale, scheme, group_size)
        size = x.shape[1] // w_scale.shape[-1]
        return _summed_in_output_dtype(
            kernel(x[:, cols].contiguous(), w[:, cols.start // 2 : cols.stop // 2].contiguous(),
                   w_scale[:, g : g + 1].contiguous(), scheme, size)
            for g, cols in enumerate(chunks(x.shape[1], size))
        )  # fmt: skip

    return mutated
