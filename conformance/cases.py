"""The conformance cases, as data: per op, shape families x dtypes, each a seeded
builder of the op's arguments (schema order, CPU tensors).

Families: ``tiny``; ``glm5`` (GLM-5's real head counts and widths where affordable:
absorbed attention with 64 heads, Dk 576 / Dv 512; indexer 32 x 128 with topk 2048;
MoE 256 experts top-8, reduced width); ``edge`` (T=1, N < topk, empty key ranges,
every index -1, ragged ranges of packed sequences, topk not a multiple of 64, paged
slot ids, tied scores); ``layout`` (one tensor argument of a small call in a
non-contiguous or stride-0 view, :func:`layout_cases`). ``full_only`` cases run only
with ``--full``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from glmport.core.errors import OpInputError
from glmport.core.formats import FLOAT_WEIGHT, FP8_DTYPE, SCHEMES, quantize_tensor
from glmport.core.specs import SPECS, OpSpec
from glmport.core.validate import Level

from .layouts import LAYOUTS, relayout

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
        """The op's arguments in schema order, CPU tensors (in the case's layout)."""
        gen = torch.Generator().manual_seed(self.seed)
        return self.laid_out(self.build(gen))

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
            width = _prefix_width(old, other) if i != pos else None
            if width is not None:
                out[i] = new[..., :width]
        return tuple(out)


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _causal_ranges(t: int, n: int, starts: list[int] | None = None):
    """Query ``i`` of a sequence whose last ``t`` tokens are queries over ``n`` slots."""
    end = torch.arange(n - t + 1, n + 1, dtype=torch.int32)
    start = (
        torch.zeros(t, dtype=torch.int32)
        if starts is None
        else torch.tensor(starts, dtype=torch.int32)
    )
    return start, end


def _per_dtype(op, name, family, params: dict, make, dtypes=FLOATS, **fields) -> Iterator[Case]:
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


# -- attention ---------------------------------------------------------------------


def _attention(t, h, hkv, dk, dv, n, k, *, absorbed=False, pattern="random"):
    def build(gen, dtype):
        q = _randn(gen, t, h, dk, dtype=dtype)
        kv = _randn(gen, n, hkv, dk, dtype=dtype)
        v = kv[..., :dv] if absorbed else _randn(gen, n, hkv, dv, dtype=dtype)
        if pattern == "all_minus_one":
            idx = torch.full((t, k), -1, dtype=torch.int32)
        elif pattern == "causal":  # dense causal attention as indices
            slots = torch.arange(k)[None, :].expand(t, k)
            limit = torch.arange(n - t + 1, n + 1)[:, None]
            idx = torch.where(slots < limit, slots, -1).to(torch.int32)
        else:
            idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(t)]).to(
                torch.int32
            )
            if pattern == "ragged":  # row i keeps a different number of valid slots
                keep = torch.arange(k)[None, :] < torch.linspace(0, k, t).long()[:, None]
                idx = torch.where(keep, idx, -1)
            elif pattern == "padded":  # N < topk: the tail is -1
                idx = torch.cat((idx, torch.full((t, k), -1, dtype=torch.int32)), dim=1)
        return q, kv, v, idx, dk**-0.5

    return build


def attention_cases() -> Iterator[Case]:
    shapes = [
        ("tiny", "tiny", dict(t=5, h=4, hkv=1, dk=32, dv=16, n=40, k=8), False),
        ("tiny_gqa", "tiny", dict(t=4, h=8, hkv=2, dk=32, dv=32, n=30, k=12), False),
        # Every kv-head count of 8 query heads but MHA: a wrong head mapping (h % Hkv
        # instead of h // (H / Hkv)) agrees with the right one only at Hkv = 1 or H.
        ("gqa_hkv1", "edge", dict(t=3, h=8, hkv=1, dk=32, dv=16, n=24, k=10), False),
        ("gqa_hkv4", "edge", dict(t=3, h=8, hkv=4, dk=32, dv=16, n=24, k=10), False),
        (
            "glm5_absorbed",
            "glm5",
            dict(t=2, h=64, hkv=1, dk=576, dv=512, n=4096, k=2048, absorbed=True),
            False,
        ),
        (
            "glm5_absorbed_long",
            "glm5",
            dict(t=4, h=64, hkv=1, dk=576, dv=512, n=8192, k=2048, absorbed=True),
            True,
        ),
        ("t1", "edge", dict(t=1, h=4, hkv=1, dk=64, dv=32, n=17, k=5), False),
        (
            "n_lt_topk",
            "edge",
            dict(t=3, h=4, hkv=1, dk=32, dv=16, n=6, k=6, pattern="padded"),
            False,
        ),
        (
            "all_minus_one",
            "edge",
            dict(t=3, h=4, hkv=1, dk=32, dv=16, n=9, k=4, pattern="all_minus_one"),
            False,
        ),
        (
            "ragged",
            "edge",
            dict(t=6, h=4, hkv=1, dk=32, dv=16, n=64, k=10, pattern="ragged"),
            False,
        ),
        ("topk_100", "edge", dict(t=3, h=4, hkv=1, dk=32, dv=16, n=300, k=100), False),
        ("paged_slots", "edge", dict(t=3, h=4, hkv=1, dk=32, dv=16, n=5000, k=32), False),
        (
            "dense_causal",
            "edge",
            dict(t=6, h=4, hkv=1, dk=32, dv=16, n=20, k=20, pattern="causal"),
            False,
        ),
    ]
    for name, family, p, full in shapes:
        yield from _per_dtype("sparse_attention", name, family, p, _attention(**p), full_only=full)


# -- indexer -----------------------------------------------------------------------


def _indexer(t, hi, di, n, topk, *, ranges="causal", ties=False, fp8=False, logits=False):
    def build(gen, dtype):
        q = _randn(gen, t, hi, di)
        k = _randn(gen, n, di)
        if ties:  # every key slot repeated: pairs of exactly equal scores
            k = k[torch.arange(n) // 2]
        w = _randn(gen, t, hi) * hi**-0.5 * di**-0.5
        if ranges == "causal":
            start, end = _causal_ranges(t, n)
        elif ranges == "packed":  # two sequences packed back to back, each causal
            half = t // 2
            s1, e1 = _causal_ranges(half, n // 2)
            s2, e2 = _causal_ranges(t - half, n)
            start = torch.cat((s1, torch.full_like(s2, n // 2)))
            end = torch.cat((e1, e2))
        elif ranges == "staggered":  # causal ends, every query its own start
            start, end = _causal_ranges(t, n, starts=list(range(t)))
        elif ranges == "empty_row":
            start, end = _causal_ranges(t, n)
            start[0] = end[0] = 3
        elif ranges == "peak":  # each range ends right at its query's best key, doubled
            dots = torch.einsum("thd,nd->thn", q.double(), k.double()).relu()
            scores = torch.einsum("th,thn->tn", w.double(), dots)
            last = scores[:, topk : n - 1].argmax(dim=1) + topk
            k[last] = k[last] * 2  # scores are positively homogeneous in the key
            start, end = torch.zeros(t, dtype=torch.int32), (last + 1).to(torch.int32)
        else:
            start, end = torch.zeros(t, dtype=torch.int32), torch.full((t,), n, dtype=torch.int32)
        if fp8:
            qq, qs = quantize_tensor(q.reshape(t * hi, di), "fp8_group", di)
            kq, ks = quantize_tensor(k, "fp8_group", di)
            scales = (qs.reshape(t, hi), ks.reshape(n))
            q, k = qq.reshape(t, hi, di), kq
        else:
            q, k, scales = q.to(dtype), k.to(dtype), (None, None)
        head = (q, k, w, start, end)
        return (*head, *scales) if logits else (*head, topk, *scales)

    return build


def indexer_cases() -> Iterator[Case]:
    shapes = [
        ("tiny", "tiny", dict(t=6, hi=4, di=32, n=50, topk=8)),
        ("glm5", "glm5", dict(t=4, hi=32, di=128, n=4096, topk=2048)),
        ("glm5_long", "glm5", dict(t=8, hi=32, di=128, n=8192, topk=2048)),
        ("t1", "edge", dict(t=1, hi=4, di=32, n=20, topk=8)),
        ("n_lt_topk", "edge", dict(t=5, hi=4, di=32, n=12, topk=16)),
        ("empty_range", "edge", dict(t=4, hi=4, di=32, n=30, topk=8, ranges="empty_row")),
        ("packed_ragged", "edge", dict(t=8, hi=4, di=32, n=64, topk=12, ranges="packed")),
        ("topk_100", "edge", dict(t=3, hi=4, di=32, n=300, topk=100, ranges="full")),
        ("ties", "edge", dict(t=4, hi=4, di=32, n=40, topk=7, ranges="full", ties=True)),
        # Each range ends right at a clearly best key: a range one key short loses it,
        # beyond the near-tie slack of low precision (fp8).
        ("ends_at_peak", "edge", dict(t=4, hi=4, di=32, n=64, topk=8, ranges="peak")),
    ]
    for name, family, p in shapes:
        full = name.endswith("_long")
        yield from _per_dtype(
            "lightning_indexer", name, family, p, _indexer(**p), judge="indexer", full_only=full
        )
        if family != "glm5" or not full:
            fp8 = _indexer(**p, fp8=True)  # quantises fp32 data itself
            yield from _per_dtype(
                "lightning_indexer", name, family, p, lambda g, _, fp8=fp8: fp8(g, torch.float32),
                dtypes=(FP8_DTYPE,), judge="indexer",
            )  # fmt: skip
    for name, family, p in [
        shapes[0],
        shapes[5],
        shapes[6],
        ("glm5", "glm5", dict(t=4, hi=32, di=128, n=2048, topk=1)),
    ]:
        p = {k: v for k, v in p.items() if k != "topk"}
        for dtype in (*FLOATS, FP8_DTYPE):
            make = _indexer(**p, topk=0, fp8=dtype == FP8_DTYPE, logits=True)
            yield Case(
                "indexer_logits",
                name,
                family,
                dtype,
                build=lambda g, make=make, dtype=dtype: make(
                    g, dtype if dtype in FLOATS else torch.float32
                ),
                params=tuple(sorted(p.items())),
                judge="logits",
            )


# -- MoE ---------------------------------------------------------------------------


def _gate(
    t,
    e,
    top_k,
    n_group=1,
    topk_group=1,
    score_func="sigmoid",
    bias=True,
    ties=False,
    group_ties=False,
):
    def build(gen):
        logits = _randn(gen, t, e, scale=2.0)
        if ties:  # experts come in identical pairs
            logits = logits[:, torch.arange(e) // 2]
        b = _randn(gen, e, scale=0.1) if bias else None
        if group_ties:  # every group's best two are the same two scores: all groups tie
            best = torch.arange(n_group)[:, None] * (e // n_group) + torch.arange(2)
            logits[:, best] = logits.amax(dim=1)[:, None, None] + torch.tensor([1.0, 0.5])
            if b is not None:
                b[best] = b.amax() + 0.05
        return logits, b, top_k, n_group, topk_group, 2.5, True, score_func

    return build


def moe_cases() -> Iterator[Case]:
    gates = [
        ("tiny", "tiny", dict(t=8, e=16, top_k=4)),
        ("grouped", "tiny", dict(t=8, e=32, top_k=8, n_group=4, topk_group=2)),
        # Group scores: the best expert without a bias, the best two with one.
        ("grouped_nobias", "edge", dict(t=16, e=32, top_k=6, n_group=4, topk_group=2, bias=False)),
        (
            "grouped_softmax",
            "edge",
            dict(t=8, e=64, top_k=4, n_group=8, topk_group=3, score_func="softmax", bias=False),
        ),
        ("glm5_grouped", "glm5", dict(t=32, e=256, top_k=8, n_group=8, topk_group=4)),
        # Every group ties: the lower groups win; top_k > 2 * topk_group picks experts
        # beyond the tied ones, so keeping other groups changes the choice.
        (
            "group_ties",
            "edge",
            dict(t=8, e=32, top_k=6, n_group=4, topk_group=2, group_ties=True),
        ),
        (
            "group_ties_nobias",
            "edge",
            dict(t=8, e=32, top_k=6, n_group=4, topk_group=2, bias=False, group_ties=True),
        ),
        ("softmax_nobias", "tiny", dict(t=8, e=16, top_k=2, score_func="softmax", bias=False)),
        ("glm5", "glm5", dict(t=64, e=256, top_k=8)),
        ("t1", "edge", dict(t=1, e=16, top_k=4)),
        ("ties", "edge", dict(t=8, e=16, top_k=3, ties=True)),
    ]
    for name, family, p in gates:
        yield Case(
            "moe_gate",
            name,
            family,
            torch.float32,
            build=_gate(**p),
            params=tuple(sorted(p.items())),
            judge="gate",
        )

    def routing(t, k, e, d):
        def build(gen, dtype):
            x = _randn(gen, t, d, dtype=dtype)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(
                torch.int32
            )
            return x, ids, e

        return build

    routes = [
        ("tiny", "tiny", dict(t=6, k=2, e=4, d=16)),
        ("glm5", "glm5", dict(t=128, k=8, e=256, d=64)),
        ("t1", "edge", dict(t=1, k=8, e=256, d=16)),
    ]
    for name, family, p in routes:
        yield from _per_dtype("moe_dispatch", name, family, p, routing(**p), judge="exact")
        yield from _per_dtype("moe_combine", name, family, p, _combine(**p))
    yield from _grouped_cases()


def _combine(t, k, e, d):
    def build(gen, dtype):
        y = _randn(gen, t * k, d, dtype=dtype)
        src = torch.randperm(t * k, generator=gen).to(torch.int32)
        return y, src, torch.rand(t, k, generator=gen)

    return build


def _offsets(gen, m, e, empty=()):
    counts = torch.zeros(e, dtype=torch.long)
    live = [i for i in range(e) if i not in empty]
    picks = torch.randint(0, len(live), (m,), generator=gen)
    for p in picks.tolist():
        counts[live[p]] += 1
    return torch.cat((torch.zeros(1, dtype=torch.long), counts.cumsum(0))).to(torch.int32)


def _scaled_tiles(gen, x, rows, cols):
    """``x`` ``[R, C]`` with each ``rows x cols`` tile times a power of two from 1/4 to
    8, a random permutation (all distinct up to 6 tiles): the scales of the tiles differ,
    so reading one tile's scale for another's (a transposed or mis-indexed scale) cannot
    pass, with ue8m0 scales too."""
    r, c = x.shape
    tiles = (-(-r // rows), -(-c // cols))
    exps = torch.randperm(tiles[0] * tiles[1], generator=gen).view(tiles) % 6 - 2
    factor = exps.exp2().repeat_interleave(rows, 0)[:r].repeat_interleave(cols, 1)[:, :c]
    return x * factor.to(x.dtype)


def _quantized_weight(gen, w, scheme, group_size):
    """A float ``[N, K]`` weight with scales that differ per scale tile, packed."""
    s = SCHEMES[scheme]
    size = s.fixed_group_size or group_size
    rows, cols = {"row": (1, w.shape[1]), "group": (1, size), "block": (size, size)}[
        s.weight.granularity
    ]
    return quantize_tensor(_scaled_tiles(gen, w, rows, cols), s.weight.name, size)


def _grouped(m, e, n, k, scheme=FLOAT_WEIGHT, group_size=128, empty=()):
    def build(gen, dtype):
        x = _randn(gen, m, k, dtype=dtype)
        w = _randn(gen, e, n, k, scale=k**-0.5)
        offsets = _offsets(gen, m, e, empty)
        if scheme == FLOAT_WEIGHT:
            return x, w.to(dtype), offsets, None, scheme, group_size
        packed = [_quantized_weight(gen, w[i], scheme, group_size) for i in range(e)]
        wq = torch.stack([p[0] for p in packed])
        ws = torch.stack([p[1] for p in packed])
        return x, wq, offsets, ws, scheme, group_size

    return build


def _grouped_cases() -> Iterator[Case]:
    shapes = [
        ("tiny", "tiny", dict(m=20, e=4, n=16, k=64)),
        ("empty_experts", "edge", dict(m=12, e=6, n=16, k=64, empty=(0, 3, 5))),
        ("glm5_reduced", "glm5", dict(m=512, e=256, n=64, k=256)),
        # Several scale blocks along both N and K, NB != KB (2 x 3 FP8 blocks, 12 int4
        # groups of 32 per row).
        ("multi_block", "edge", dict(m=16, e=2, n=256, k=384)),
    ]
    for name, family, p in shapes:
        if name != "multi_block":
            yield from _per_dtype("grouped_gemm", name, family, p, _grouped(**p), judge="gemm")
        for scheme in SCHEMES:
            yield from _per_dtype(
                "grouped_gemm", name, family, p, _grouped(**p, scheme=scheme, group_size=32),
                dtypes=(torch.bfloat16,), scheme=scheme, judge="gemm",
            )  # fmt: skip
    # Degenerate GEMM sizes, where a size-1 dimension's stride is arbitrary and fast
    # kernels' size minimums bite: K = 1 (the smallest int4 K is one packed pair: 2),
    # N = 1, M = 1.
    for name, (m, n, k) in _DEGENERATE.items():
        for scheme in (FLOAT_WEIGHT, *SCHEMES):
            kk, gs = _smallest_k(scheme, k)
            p = dict(m=m, e=3, n=n, k=kk, group_size=gs)
            yield from _per_dtype(
                "grouped_gemm", name, "edge", p, _grouped(**p, scheme=scheme),
                dtypes=(torch.bfloat16,), judge="gemm",
                scheme=None if scheme == FLOAT_WEIGHT else scheme,
            )  # fmt: skip


# M x N x K of the degenerate GEMM cases (quant_gemm and grouped_gemm).
_DEGENERATE = {"k1": (5, 24, 1), "n1": (5, 1, 64), "m1_n24": (1, 24, 64), "mnk1": (1, 1, 1)}


def _smallest_k(scheme: str, k: int) -> tuple[int, int]:
    """``(K, group_size)`` for a degenerate case of ``K = k``: int4 weights pack values
    in pairs within even groups, so their smallest K (and group) is 2."""
    if scheme != FLOAT_WEIGHT and SCHEMES[scheme].weight.storage == torch.uint8:
        k = max(k, 2)
        return k, min(k, 32)
    return k, 32


# -- quantisation ------------------------------------------------------------------


def quant_cases() -> Iterator[Case]:
    from glmport.core.formats import FORMATS

    for fmt in FORMATS:
        for name, family, (r, c), gs in [
            ("tiny", "tiny", (8, 64), 32),
            ("ragged_groups", "edge", (5, 200), 128),
            ("glm5", "glm5", (256, 2048), 128),
        ]:
            if fmt == "int4_group" and c % gs:
                continue
            for dtype in FLOATS:
                yield Case(
                    "quantize",
                    name,
                    family,
                    dtype,
                    build=lambda g, r=r, c=c, dtype=dtype, fmt=fmt, gs=gs: (
                        _randn(g, r, c, dtype=dtype),
                        fmt,
                        gs,
                    ),
                    params=(("cols", c), ("group_size", gs), ("rows", r)),
                    judge="quantize",
                    scheme=fmt,
                )
    for scheme in SCHEMES:
        for name, family, (m, n, k), gs in [
            ("tiny", "tiny", (4, 16, 64), 32),
            ("m1", "edge", (1, 32, 256), 64),
            ("k_not_128", "edge", (3, 24, 192), 64),
            ("multi_block", "edge", (4, 256, 384), 64),  # NB 2 x KB 3 FP8 blocks
            ("glm5", "glm5", (16, 512, 2048), 128),
        ]:
            # Scale indexing does not depend on x's dtype: one is enough for multi_block.
            for dtype in (torch.bfloat16,) if name == "multi_block" else FLOATS:
                yield Case(
                    "quant_gemm",
                    name,
                    family,
                    dtype,
                    build=_quant_gemm(m, n, k, scheme, gs, dtype),
                    params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                    judge="gemm",
                    scheme=scheme,
                )
        for name, (m, n, k) in _DEGENERATE.items():
            k, gs = _smallest_k(scheme, k)
            yield Case(
                "quant_gemm",
                name,
                "edge",
                torch.bfloat16,
                build=_quant_gemm(m, n, k, scheme, gs, torch.bfloat16),
                params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                judge="gemm",
                scheme=scheme,
            )
        yield Case(
            "quant_gemm",
            "qat",
            "tiny",
            torch.float32,
            build=_quant_gemm(4, 16, 128, scheme, 32, torch.float32, qat=True),
            params=(("group_size", 32), ("k", 128), ("m", 4), ("n", 16)),
            judge="gemm",
            scheme=scheme,
        )


def _quant_gemm(m, n, k, scheme, gs, dtype, qat=False):
    def build(gen):
        x = _randn(gen, m, k, dtype=dtype)
        w = _randn(gen, n, k, scale=k**-0.5)
        if qat:
            return x, w.to(dtype), None, scheme, gs
        # Activation groups (1 x 128 for FP8) of different magnitudes too.
        x = _scaled_tiles(gen, x, 1, 128)
        wq, ws = _quantized_weight(gen, w, scheme, gs)
        return x, wq, ws, scheme, gs

    return build


# -- norm, rope, log-probs ---------------------------------------------------------


def misc_cases() -> Iterator[Case]:
    for name, family, shape in [
        ("tiny", "tiny", (5, 32)),
        ("glm5", "glm5", (8, 6144)),
        ("t1_3d", "edge", (1, 4, 512)),
    ]:
        for dtype in FLOATS:
            yield Case(
                "rms_norm",
                name,
                family,
                dtype,
                build=lambda g, shape=shape, dtype=dtype: (
                    _randn(g, *shape, dtype=dtype),
                    (1 + _randn(g, shape[-1], scale=0.1)).to(dtype),
                    1e-5,
                ),
                params=(("shape", shape),),
            )
    for interleaved in (True, False):
        for name, family, shape in [
            ("tiny", "tiny", (6, 2, 16)),
            ("glm5", "glm5", (16, 64, 64)),
            ("t1_2d", "edge", (1, 64)),
        ]:
            for dtype in FLOATS:

                def build(g, shape=shape, dtype=dtype, interleaved=interleaved):
                    t, d = shape[0], shape[-1]
                    pos = torch.arange(t, dtype=torch.float64)[:, None] + 1000
                    freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
                    ang = pos * freq
                    return (
                        _randn(g, *shape, dtype=dtype),
                        ang.cos().float(),
                        ang.sin().float(),
                        interleaved,
                    )

                yield Case(
                    "rope",
                    f"{name}_{'interleaved' if interleaved else 'half'}",
                    family,
                    dtype,
                    build=build,
                    params=(("interleaved", interleaved), ("shape", shape)),
                )
    for name, family, (t, d, v), temp, full in [
        ("tiny", "tiny", (6, 32, 100), 1.0, False),
        ("glm5_reduced", "glm5", (16, 256, 32768), 0.7, False),
        ("glm5_vocab", "glm5", (8, 512, 154880), 1.0, True),
        ("t1", "edge", (1, 32, 50), 0.6, False),
    ]:
        for dtype in FLOATS:
            yield Case(
                "token_logprobs",
                name,
                family,
                dtype,
                build=lambda g, t=t, d=d, v=v, temp=temp, dtype=dtype: (
                    _randn(g, t, d, dtype=dtype),
                    _randn(g, v, d, scale=d**-0.5, dtype=dtype),
                    torch.randint(0, v, (t,), generator=g),
                    temp,
                ),
                params=(("d", d), ("t", t), ("temperature", temp), ("v", v)),
                judge="logprobs",
                full_only=full,
            )
    yield from _logprob_temperature_cases()


# Temperatures 1e-6 .. 1e6: near 0 the logits' float32 rounding is magnified by
# 1 / temperature (a target's logit one ulp above the max was once a log-probability of
# +1.43), near infinity every distribution is uniform.
LOGPROB_TEMPERATURES = (1e-6, 1e-3, 1e3, 1e6)


def _logprob_temperature_cases() -> Iterator[Case]:
    """``token_logprobs`` at extreme temperatures on a 500-token vocabulary; half of
    the targets are each token's most likely one (its log-probability is about 0 at a
    small temperature, where a rounding error shows as a positive value)."""
    t, d, v = 8, 32, 500
    for temp in LOGPROB_TEMPERATURES:

        def build(g, dtype, temp=temp):
            hidden = _randn(g, t, d, dtype=dtype)
            lm_head = _randn(g, v, d, scale=d**-0.5, dtype=dtype)
            best = (hidden.double() @ lm_head.double().T).argmax(dim=1)
            targets = torch.where(
                torch.arange(t) % 2 == 0, best, torch.randint(0, v, (t,), generator=g)
            )
            return hidden, lm_head, targets, temp

        yield from _per_dtype(
            "token_logprobs",
            f"temperature_{temp:g}",
            "edge",
            {"d": d, "t": t, "temperature": temp, "v": v},
            build,
            judge="logprobs",
        )


# -- layouts -----------------------------------------------------------------------

# The calls whose tensor arguments the layout family re-lays out, one at a time: small
# cases of every op (every scheme and format), inside every built-in backend's declared
# limits where a limit allows a small case (ascend: attention Dk 576, indexer Di 128).
# Named cases of the families above, by (op, name) ...
LAYOUT_BASES = (
    ("sparse_attention", "tiny_gqa"),
    ("moe_gate", "grouped"),
    ("moe_dispatch", "tiny"),
    ("moe_combine", "tiny"),
    ("grouped_gemm", "tiny"),
    ("quantize", "tiny"),
    ("quant_gemm", "tiny"),
    ("quant_gemm", "qat"),
    ("rms_norm", "t1_3d"),
    ("rope", "tiny_interleaved"),
    ("rope", "tiny_half"),
    ("token_logprobs", "tiny"),
)
# ... and the dtypes quick mode takes of them (the others run with --full); a case
# with none of these (fp32-only router logits, QAT) keeps the dtypes it has.
LAYOUT_QUICK_DTYPES = (torch.bfloat16, FP8_DTYPE)


def _layout_only_bases() -> Iterator[Case]:
    """Bases of the layout family alone: absorbed MLA attention and a 128-dim indexer
    (the shapes the ascend adapters take), small enough for an interpreter."""
    absorbed = dict(t=3, h=4, hkv=1, dk=576, dv=512, n=24, k=8, absorbed=True)
    yield from _per_dtype(
        "sparse_attention", "absorbed_small", "edge", absorbed, _attention(**absorbed)
    )
    index = dict(t=5, hi=4, di=128, n=40, topk=8, ranges="staggered")
    for op, logits in (("lightning_indexer", False), ("indexer_logits", True)):
        judge = "logits" if logits else "indexer"
        plain = _indexer(**index, logits=logits)
        yield from _per_dtype(op, "d128", "edge", index, plain, judge=judge)
        fp8 = _indexer(**index, logits=logits, fp8=True)  # quantises fp32 data itself
        yield from _per_dtype(
            op, "d128", "edge", index, lambda g, _, fp8=fp8: fp8(g, torch.float32),
            dtypes=(FP8_DTYPE,), judge=judge,
        )  # fmt: skip


def layout_cases(
    cases: list[Case], *, ops: tuple[str, ...] | None = None, full: bool = False
) -> list[Case]:
    """Family ``layout``: each base call (:data:`LAYOUT_BASES` among ``cases``, and
    :func:`_layout_only_bases`) once per tensor argument and layout of
    :data:`~glmport.conformance.layouts.LAYOUTS`, that argument in that view, the
    others as built. A variant is kept where it is a valid call (glmport's full
    checks pass on it): a broadcast ``src_row`` is no permutation, broadcast
    ``expert_offsets`` do not rise from 0 to M. A view of another argument (absorbed
    ``v``) is re-laid out with it, not alone. Quick mode takes the bases in
    :data:`LAYOUT_QUICK_DTYPES`; the other dtypes are ``full_only``."""
    named = [c for c in cases if (c.op, c.name) in LAYOUT_BASES]
    bases = [*named, *(c for c in _layout_only_bases() if ops is None or c.op in ops)]
    dtypes_of: dict[tuple, set[torch.dtype]] = {}
    for c in bases:
        dtypes_of.setdefault((c.op, c.name, c.scheme), set()).add(c.dtype)
    out = []
    for base in bases:
        has_quick = dtypes_of[(base.op, base.name, base.scheme)] & set(LAYOUT_QUICK_DTYPES)
        quick = base.dtype in LAYOUT_QUICK_DTYPES or not has_quick
        if not (quick or full):
            continue
        args = base.args()
        spec = SPECS[base.op]
        for pos, arg in enumerate(spec.arg_names):
            if not isinstance(args[pos], torch.Tensor) or _is_view_of_another(args, pos):
                continue
            for layout in LAYOUTS:
                case = replace(base, family="layout", layout=(arg, layout), full_only=not quick)
                if relayout(args[pos], layout) is not None and _valid(spec, case.args()):
                    out.append(case)
    return out


def _valid(spec: OpSpec, args: tuple) -> bool:
    try:
        spec.validate(args, values=Level.FULL)
    except OpInputError:
        return False
    return True


def _prefix_width(base: torch.Tensor, view: object) -> int | None:
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


def _is_view_of_another(args: tuple, pos: int) -> bool:
    return any(_prefix_width(a, args[pos]) is not None for i, a in enumerate(args) if i != pos)


def all_cases(*, full: bool = False, ops: tuple[str, ...] | None = None) -> list[Case]:
    """Every value case of the suite for the chosen mode and ops."""
    cases = [
        *attention_cases(),
        *indexer_cases(),
        *moe_cases(),
        *quant_cases(),
        *misc_cases(),
    ]
    wanted = [c for c in cases if ops is None or c.op in ops]
    wanted += layout_cases(wanted, ops=ops, full=full)
    return [c for c in wanted if full or not c.full_only]
