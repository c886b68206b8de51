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


def _attention(
    t, h, hkv, dk, dv, n, k, *, absorbed=False, pattern="random", index_dtype="int32", sharpness=1.0
):
    """``sparse_attention`` arguments; ``sharpness`` multiplies the softmax scale
    ``Dk ** -0.5`` (40: scores of +-100 and more, past float32's ``exp`` range)."""

    def build(gen, dtype):
        q = _randn(gen, t, h, dk, dtype=dtype)
        kv = _randn(gen, n, hkv, dk, dtype=dtype)
        v = kv[..., :dv] if absorbed else _randn(gen, n, hkv, dv, dtype=dtype)
        if pattern == "repeated":
            idx = _repeated_slots(gen, t, n, k)
        elif pattern == "all_minus_one":
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
            elif pattern == "wide":  # the ids at 2**16 and the last slot in every row
                idx[:, :2] = torch.tensor([WIDE_ID, n - 1], dtype=torch.int32)
        return q, kv, v, idx.to(getattr(torch, index_dtype)), sharpness * dk**-0.5

    return build


# A slot id past 2**16: a kernel that stages ids as uint16 reads slot 0 for it.
WIDE_ID = 2**16


def _repeated_slots(gen, t: int, n: int, k: int) -> torch.Tensor:
    """``[T, K]`` int32 slot ids drawn with replacement from a pool of ``K / 3`` slots
    (each listed about three times), row 0 one slot ``K`` times, row 1 with ``-1``
    between repeats: a slot listed twice counts twice (docs/ops.md)."""
    pool = torch.randperm(n, generator=gen)[: max(2, k // 3)]
    idx = pool[torch.randint(0, pool.numel(), (t, k), generator=gen)].to(torch.int32)
    idx[0] = pool[0]
    idx[1, ::3] = -1
    return idx


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
    bf16 = (torch.bfloat16,)
    # (name, family, shape, the dtypes quick mode takes: the others run with --full)
    hard = [
        # Slot ids past 2**16 (near 2**17 and 2**20, small heads keep the key pool at
        # 8 / 16 MB), int32 and int64; ascend's absorbed MLA shape past 2**16 (150 MB).
        ("ids_2e17", "ids", dict(t=3, h=2, hkv=1, dk=16, dv=16, n=2**17 + 40, k=16), FLOATS),
        (
            "ids_2e17_int64",
            "ids",
            dict(t=3, h=2, hkv=1, dk=16, dv=16, n=2**17 + 40, k=16, index_dtype="int64"),
            bf16,
        ),
        ("ids_2e20", "ids", dict(t=2, h=2, hkv=1, dk=8, dv=8, n=2**20 + 24, k=8), bf16),
        (
            "ids_absorbed_2e16",
            "ids",
            dict(t=2, h=4, hkv=1, dk=576, dv=512, n=2**16 + 64, k=16, absorbed=True),
            bf16,
        ),
        # A slot listed two or more times counts as often (docs/ops.md).
        ("repeated", "duplicates", dict(t=4, h=4, hkv=2, dk=32, dv=16, n=20, k=12), FLOATS),
        (
            "repeated_absorbed",
            "duplicates",
            dict(t=3, h=4, hkv=1, dk=576, dv=512, n=24, k=9, absorbed=True),
            FLOATS,
        ),
        # Past every tile a kernel takes: K 520 (32 / 64 / 512 slots), Dk 144 and Dv 80
        # (64 / 128), 20 query heads per 2 kv heads (head blocks of 4 / 16).
        ("tail", "tail", dict(t=3, h=20, hkv=2, dk=144, dv=80, n=700, k=520), FLOATS),
        # Sharp attention (scores past 88, where float32's exp overflows): a softmax
        # must subtract the row's max before exponentiating.
        (
            "sharp",
            "sharp",
            dict(t=4, h=4, hkv=2, dk=32, dv=16, n=64, k=24, sharpness=40.0),
            FLOATS,
        ),
        # The same at absorbed MLA's shape, the only one vendor MLA kernels take
        # (ascend's): a scale that is not Dk ** -0.5, ragged rows with row 0 empty.
        (
            "sharp_absorbed",
            "sharp",
            dict(
                t=5,
                h=8,
                hkv=1,
                dk=576,
                dv=512,
                n=96,
                k=40,
                absorbed=True,
                sharpness=40.0,
                pattern="ragged",
            ),
            (torch.bfloat16,),
        ),
    ]
    for name, family, p, quick in hard:
        pattern = {"ids": "wide", "duplicates": "repeated"}.get(family, "random")
        make = _attention(**{"pattern": pattern, **p})
        for dtype in FLOATS:
            yield from _per_dtype(
                "sparse_attention", name, family, p, make, dtypes=(dtype,),
                full_only=dtype not in quick,
            )  # fmt: skip


# -- indexer -----------------------------------------------------------------------


def _indexer(
    t, hi, di, n, topk, *, ranges="causal", ties=False, keys="random", fp8=False, logits=False
):
    """``keys``: ``random``; ``periodic`` (key ``s`` equals key ``s + N / 2``: exact
    ties a tile apart); ``relu_zeros`` (every query entry positive, three keys in four
    negative in every entry: each of their dot products is negative in any precision,
    so they score exactly 0, a tie of many). ``ties``: every key slot repeated (pairs
    of exactly equal scores)."""

    def build(gen, dtype):
        q = _randn(gen, t, hi, di)
        k = _randn(gen, n, di)
        if ties:
            k = k[torch.arange(n) // 2]
        if keys == "periodic":
            k = k[torch.arange(n) % (n // 2)]
        elif keys == "relu_zeros":
            q = q.abs()
            live = torch.rand(n, generator=gen) < 0.25
            k = torch.where(live[:, None], k.abs(), -k.abs())
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
        elif ranges == "windows":  # short ranges past 2**16: one straddles it, one ends at N
            lengths = torch.tensor([100, 200, 300, 150])[torch.arange(t) % 4]
            starts = torch.tensor([WIDE_ID - 40, n - 200, (WIDE_ID + n) // 2, WIDE_ID])
            start = starts[torch.arange(t) % 4].to(torch.int32)
            end = torch.minimum(start + lengths, torch.tensor(n)).to(torch.int32)
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
    yield from _indexer_hard_cases()
    for name, family, p in [
        shapes[0],
        shapes[5],
        shapes[6],
        ("glm5", "glm5", dict(t=4, hi=32, di=128, n=2048, topk=1)),
        # Past every tile: keys 1300 (64 / 128 / 1024 per dot), Di 48 and Hi 6 padded
        # to powers of two, 34 queries.
        ("tail", "tail", dict(t=34, hi=6, di=48, n=1300)),
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


def _indexer_hard_cases() -> Iterator[Case]:
    """``lightning_indexer`` slot ids past 2**16 (ranges of 100-300 keys near 2**16,
    2**17 and 2**20; Di 128 is ascend's), short and empty ranges at Di 128, exact ties
    of many (ReLU zeros) and a tile apart, and tiles at the tail. Quick mode takes the
    dtypes listed, ``--full`` all."""
    bf16_fp8 = (torch.bfloat16, FP8_DTYPE)
    wide = dict(t=4, hi=2, di=16, topk=16, ranges="windows")
    hard = [
        ("ids_2e17", "ids", dict(wide, n=2**17 + 300), bf16_fp8),
        ("ids_2e17_d128", "ids", dict(wide, di=128, n=2**17 + 300), (torch.bfloat16,)),
        ("ids_2e20", "ids", dict(wide, n=2**20 + 100), (torch.bfloat16,)),
        # Ranges shorter than topk, one empty, at the 128-dim heads vendor indexers take.
        (
            "short_ranges_d128",
            "edge",
            dict(t=5, hi=4, di=128, n=12, topk=16, ranges="empty_row"),
            (torch.bfloat16,),
        ),
        (
            "relu_zeros",
            "ties",
            dict(t=5, hi=4, di=32, n=48, topk=20, ranges="staggered", keys="relu_zeros"),
            (*FLOATS, FP8_DTYPE),
        ),
        (
            "ties_far",
            "ties",
            dict(t=3, hi=4, di=32, n=1300, topk=100, ranges="full", keys="periodic"),
            (torch.float32, *bf16_fp8),
        ),
        (
            "tail",
            "tail",
            dict(t=3, hi=6, di=48, n=1300, topk=260, ranges="full"),
            (*FLOATS, FP8_DTYPE),
        ),
    ]
    for name, family, p, quick in hard:
        plain, fp8 = _indexer(**p), _indexer(**p, fp8=True)
        for dtype in (*FLOATS, FP8_DTYPE):
            make = plain if dtype in FLOATS else lambda g, _, fp8=fp8: fp8(g, torch.float32)
            yield from _per_dtype(
                "lightning_indexer", name, family, p, make, dtypes=(dtype,), judge="indexer",
                full_only=dtype not in quick,
            )  # fmt: skip


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
    exact_ties=False,
    scaling=2.5,
    norm=True,
):
    """``ties``: the logits of experts ``2i`` and ``2i + 1`` are equal; ``exact_ties``:
    their biases too, so their choice scores tie exactly in any arithmetic."""

    def build(gen):
        logits = _randn(gen, t, e, scale=2.0)
        if ties or exact_ties:  # experts come in identical pairs
            logits = logits[:, torch.arange(e) // 2]
        b = _randn(gen, e, scale=0.1) if bias else None
        if exact_ties and b is not None:
            b = b[torch.arange(e) // 2]
        if group_ties:  # every group's best two are the same two scores: all groups tie
            best = torch.arange(n_group)[:, None] * (e // n_group) + torch.arange(2)
            logits[:, best] = logits.amax(dim=1)[:, None, None] + torch.tensor([1.0, 0.5])
            if b is not None:
                b[best] = b.amax() + 0.05
        return logits, b, top_k, n_group, topk_group, scaling, norm, score_func

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
        # Exact ties (pairs of equal logits and biases): the lower expert id wins and
        # comes first, inside a group too.
        ("exact_ties", "ties", dict(t=16, e=16, top_k=3, exact_ties=True)),
        (
            "exact_ties_grouped",
            "ties",
            dict(t=16, e=32, top_k=5, n_group=4, topk_group=2, exact_ties=True),
        ),
        (
            "exact_ties_softmax",
            "ties",
            dict(t=16, e=16, top_k=5, score_func="softmax", bias=False, exact_ties=True),
        ),
        # DeepSeek-V3-style configurations: no renormalisation of the chosen weights,
        # scaling factors other than GLM-5's 2.5.
        (
            "no_norm",
            "gate_config",
            dict(t=16, e=64, top_k=6, n_group=8, topk_group=3, norm=False),
        ),
        (
            "no_norm_softmax",
            "gate_config",
            dict(t=16, e=32, top_k=4, score_func="softmax", bias=False, norm=False, scaling=1.0),
        ),
        ("scaling_1", "gate_config", dict(t=16, e=32, top_k=4, scaling=1.0)),
        ("scaling_16", "gate_config", dict(t=16, e=32, top_k=4, norm=False, scaling=16.0)),
        (
            "glm5_no_norm",
            "gate_config",
            dict(t=32, e=256, top_k=8, n_group=8, topk_group=4, norm=False),
        ),
        # Past the tiles: 160 experts in 8 groups of 20, 130 tokens, top-9.
        ("tail", "tail", dict(t=130, e=160, top_k=9, n_group=8, topk_group=3)),
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

    routes = [
        ("tiny", "tiny", dict(t=6, k=2, e=4, d=16)),
        ("glm5", "glm5", dict(t=128, k=8, e=256, d=64)),
        ("t1", "edge", dict(t=1, k=8, e=256, d=16)),
    ]
    for name, family, p in routes:
        yield from _per_dtype("moe_dispatch", name, family, p, _routing(**p), judge="exact")
        yield from _per_dtype("moe_combine", name, family, p, _combine(**p))
    yield from _routing_hard_cases()
    yield from _grouped_cases()


def _routing(t, k, e, d, pattern="random", index_dtype="int32"):
    """``moe_dispatch`` arguments: ``x [T, D]`` and ``ids [T, k]`` of ``pattern``:
    ``random`` (k distinct experts per token), ``one_expert`` (every token's first
    choice is expert ``E / 2``), ``two_empty`` (experts 0 and ``E - 1`` get nothing),
    ``every_expert`` (``k = E``: each token a permutation of all experts),
    ``repeated`` (a token lists an expert more than once: a copy per listing)."""

    def build(gen, dtype):
        x = _randn(gen, t, d, dtype=dtype)
        if pattern == "random":
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        elif pattern == "repeated":
            ids = torch.randint(0, e, (t, k), generator=gen)
            ids[:, 1] = ids[:, 0]
        else:
            lo, hi = (1, e - 1) if pattern == "two_empty" else (0, e)
            ids = torch.rand(t, hi - lo, generator=gen).argsort(dim=1)[:, :k] + lo
            if pattern == "one_expert":  # expert E / 2 first; the token's other picks stay
                hot = torch.full((t, 1), e // 2)
                rest = torch.where(ids == e // 2, ids[:, :1], ids)
                ids = torch.cat((hot, rest[:, 1:]), dim=1)
        return x, ids.to(getattr(torch, index_dtype)), e

    return build


def _routing_hard_cases() -> Iterator[Case]:
    """Dispatch and combine past 2**16 rows (T*k = 66,560: src_row ids past 2**16),
    int64 ids and src_row; imbalanced routing (family ``capacity``: far more copies
    per expert than a fixed buffer would hold); repeated ids; tiles at the tail."""
    wide = dict(t=8320, k=8, e=16, d=4)
    hard = [
        ("rows_2e16", "ids", dict(wide, pattern="two_empty"), (torch.bfloat16,)),
        ("tiny_int64", "ids", dict(t=6, k=2, e=4, d=16, index_dtype="int64"), FLOATS),
        ("one_expert", "capacity", dict(t=300, k=4, e=16, d=8, pattern="one_expert"), FLOATS),
        ("two_empty", "capacity", dict(t=200, k=6, e=8, d=8, pattern="two_empty"), FLOATS),
        ("every_expert", "capacity", dict(t=256, k=8, e=8, d=8, pattern="every_expert"), FLOATS),
        ("repeated", "duplicates", dict(t=12, k=3, e=4, d=16, pattern="repeated"), FLOATS),
        # Past the tiles: 1050 rows (256 / 512 / 1024 per block), D 1040 (1024).
        ("tail", "tail", dict(t=350, k=3, e=10, d=1040), FLOATS),
    ]
    for name, family, p, quick in hard:
        for dtype in FLOATS:
            full = dtype not in quick
            yield from _per_dtype(
                "moe_dispatch", name, family, p, _routing(**p), dtypes=(dtype,), judge="exact",
                full_only=full,
            )  # fmt: skip
            if family in ("ids", "tail"):  # combine sees rows, not experts
                combine = _combine(**{k: v for k, v in p.items() if k != "pattern"})
                yield from _per_dtype(
                    "moe_combine", name, family, p, combine, dtypes=(dtype,), full_only=full
                )


def _combine(t, k, e, d, index_dtype="int32"):
    def build(gen, dtype):
        y = _randn(gen, t * k, d, dtype=dtype)
        src = torch.randperm(t * k, generator=gen).to(getattr(torch, index_dtype))
        return y, src, torch.rand(t, k, generator=gen)

    return build


def _offsets(gen, m, e, empty=()):
    counts = torch.zeros(e, dtype=torch.long)
    live = [i for i in range(e) if i not in empty]
    picks = torch.randint(0, len(live), (m,), generator=gen)
    for p in picks.tolist():
        counts[live[p]] += 1
    return torch.cat((torch.zeros(1, dtype=torch.long), counts.cumsum(0))).to(torch.int32)


def _zero_every(x: torch.Tensor, step: int) -> torch.Tensor:
    """``x`` with every ``step``-th row zero (``step`` 0: unchanged)."""
    if step:
        x = x.clone()
        x[::step] = 0
    return x


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


def _grouped(
    m, e, n, k, scheme=FLOAT_WEIGHT, group_size=128, empty=(), offsets_dtype="int32", zero_rows=0
):
    """``grouped_gemm`` arguments; ``empty``: experts given no row; ``zero_rows``: every
    ``zero_rows``-th row of ``x`` all zero (padding tokens)."""

    def build(gen, dtype):
        x = _zero_every(_randn(gen, m, k, dtype=dtype), zero_rows)
        w = _randn(gen, e, n, k, scale=k**-0.5)
        offsets = _offsets(gen, m, e, empty).to(getattr(torch, offsets_dtype))
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
        # Quantised experts in float32 as well as bfloat16 where cheap (fp16: --full).
        small = name in ("tiny", "empty_experts")
        for scheme in SCHEMES:
            for dtype in FLOATS if small else (torch.bfloat16,):
                yield from _per_dtype(
                    "grouped_gemm", name, family, p, _grouped(**p, scheme=scheme, group_size=32),
                    dtypes=(dtype,), scheme=scheme, judge="gemm",
                    full_only=dtype == torch.float16,
                )  # fmt: skip
    everyone = tuple(range(8))
    hard = [
        # Past the tiles: M 300 over 2 experts (row tiles of 16..128), N 200, K 320.
        ("tail", "tail", dict(m=300, e=2, n=200, k=320)),
        # Every row to one expert (300 rows), the other seven empty.
        ("one_expert", "capacity", dict(m=300, e=8, n=16, k=64, empty=everyone[:5] + everyone[6:])),
        # Rows past 2**16 (offsets past uint16), int64 offsets.
        ("rows_2e16", "ids", dict(m=2**16 + 500, e=4, n=8, k=32)),
        ("tiny_int64", "ids", dict(m=20, e=4, n=16, k=64, offsets_dtype="int64")),
        # Padding rows of x: all zero, an activation amax at the format's floor.
        ("zero_rows", "zeros", dict(m=20, e=4, n=16, k=64, zero_rows=3)),
    ]
    for name, family, p in hard:
        schemes = () if name == "rows_2e16" else SCHEMES
        for scheme in (FLOAT_WEIGHT, *schemes):
            if scheme == FLOAT_WEIGHT and family == "zeros":
                continue
            for dtype in FLOATS:
                yield from _per_dtype(
                    "grouped_gemm", name, family, p, _grouped(**p, scheme=scheme, group_size=32),
                    dtypes=(dtype,), judge="gemm", full_only=dtype != torch.bfloat16,
                    scheme=None if scheme == FLOAT_WEIGHT else scheme,
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
            # An all-zero row (padding), group and tile (pruned channels), and a tensor
            # of zeros: amax 0, the scale the format's floor.
            ("zero_groups", "zeros", (8, 256), 64),
            ("all_zero", "zeros", (4, 64), 32),
            # Past the tiles: 131 rows, 300 columns (int4: 384), a partial last group.
            ("tail", "tail", (131, 300), 128),
        ]:
            if fmt == "int4_group" and c % gs:  # int4 groups divide the row
                if family != "tail":
                    continue
                c = -(-c // gs) * gs
            for dtype in FLOATS:
                yield Case(
                    "quantize",
                    name,
                    family,
                    dtype,
                    build=lambda g, r=r, c=c, dtype=dtype, fmt=fmt, gs=gs, name=name: (
                        _quantize_input(g, r, c, gs, dtype, name),
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
        # Zero rows of x (padding tokens), and zero weight groups under QAT: the formats'
        # amax floors; past the tiles: M 200 (prefill row tiles of 128), N 200, K 320.
        for name, family, (m, n, k), gs, qat, dtypes, quick in [
            ("zero_rows", "zeros", (8, 16, 128), 32, False, FLOATS, FLOATS),
            ("qat_zero_groups", "zeros", (6, 16, 128), 32, True, (torch.float32,), FLOATS),
            ("tail", "tail", (200, 200, 320), 64, False, FLOATS, (torch.bfloat16,)),
        ]:
            for dtype in dtypes:
                yield Case(
                    "quant_gemm",
                    name,
                    family,
                    dtype,
                    build=_quant_gemm(m, n, k, scheme, gs, dtype, qat=qat, zeros=family == "zeros"),
                    params=(("group_size", gs), ("k", k), ("m", m), ("n", n)),
                    judge="gemm",
                    scheme=scheme,
                    full_only=dtype not in quick,
                )


def _quantize_input(gen, r: int, c: int, gs: int, dtype, name: str) -> torch.Tensor:
    """``quantize``'s ``x`` ``[R, C]``: N(0, 1), with zeros for the ``zeros`` cases
    (``zero_groups``: row 2, and columns ``[gs, 2 gs)`` of every row; ``all_zero``)."""
    x = _randn(gen, r, c, dtype=dtype)
    if name == "all_zero":
        return torch.zeros_like(x)
    if name == "zero_groups":
        x[2] = 0
        x[:, gs : 2 * gs] = 0
    return x


def _quant_gemm(m, n, k, scheme, gs, dtype, qat=False, zeros=False):
    """``quant_gemm`` arguments; ``zeros``: every third row of ``x`` zero (padding
    tokens) and, for QAT, weight row 1 and the first group of every row zero."""

    def build(gen):
        x = _zero_every(_randn(gen, m, k, dtype=dtype), 3 if zeros else 0)
        w = _randn(gen, n, k, scale=k**-0.5)
        if zeros and qat:
            w[1] = 0
            w[:, :gs] = 0
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
        # Past the tiles: 130 rows of 200, and rows of 8200 (past a GPU's 8192 per block).
        ("tail_rows", "tail", (130, 200)),
        ("tail_width", "tail", (3, 8200)),
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
            # Rotary widths past 64 (pairs beyond 32), 96 pairs (no power of two), and
            # 17 heads past the head blocks.
            ("rotary_128", "rotary", (4, 2, 128)),
            ("rotary_192", "rotary", (5, 17, 192)),
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
    yield from _logprob_hard_cases()


def _logprob_hard_cases() -> Iterator[Case]:
    """``token_logprobs`` with vocabulary ids past 2**16 (int64 and int32 targets), a
    partial last vocabulary tile (17,384 = 16,384 + 1,000 = 4 x 4,096 + 1,000), and
    LM-sized logits (``lm_logits``: a spread of 8-10, so the largest are 30-40, as a
    language model's are) on ragged vocabularies, where logits rounded to bf16 / fp16
    before the log-softmax are off by 0.01-0.1 nats. Half of the targets are the most
    likely token."""
    hard = [
        ("vocab_2e17", "ids", (4, 8, 2**17 + 100), 1.0, 1.0, "int64", (torch.bfloat16,)),
        ("vocab_2e17_int32", "ids", (4, 8, 2**17 + 100), 1.0, 1.0, "int32", (torch.bfloat16,)),
        ("tail_vocab", "tail", (40, 288, 16384 + 1000), 1.0, 1.0, "int64", FLOATS),
        ("lm_logits", "lm_logits", (24, 128, 5003), 10.0, 1.0, "int64", FLOATS),
        ("lm_logits_t07", "lm_logits", (24, 256, 12289), 8.0, 0.7, "int32", FLOATS),
        ("lm_logits_glm5", "lm_logits", (8, 512, 154880), 10.0, 1.0, "int64", ()),
    ]
    for name, family, (t, d, v), spread, temp, index_dtype, quick in hard:

        def build(g, dtype, t=t, d=d, v=v, spread=spread, temp=temp, index_dtype=index_dtype):
            hidden = _randn(g, t, d, dtype=dtype, scale=spread)
            lm_head = _randn(g, v, d, scale=d**-0.5, dtype=dtype)
            best = (hidden.double() @ lm_head.double().T).argmax(dim=1)
            if v > WIDE_ID:  # the other half past 2**16
                other = torch.randint(WIDE_ID, v, (t,), generator=g)
            else:
                other = torch.randint(0, v, (t,), generator=g)
            targets = torch.where(torch.arange(t) % 2 == 0, best, other)
            return hidden, lm_head, targets.to(getattr(torch, index_dtype)), temp

        params = {"d": d, "t": t, "temperature": temp, "v": v, "logit_spread": spread}
        for dtype in FLOATS:
            yield from _per_dtype(
                "token_logprobs", name, family, params, build, dtypes=(dtype,),
                judge="logprobs", full_only=dtype not in quick,
            )  # fmt: skip


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


# -- magnitudes --------------------------------------------------------------------

# Family ``magnitude``: small calls of every op with arguments at 1e30 or 1e-30, each
# set of arguments chosen so that the float64 reference and the op's float32
# intermediates stay finite and normal (products meet at about 1, outputs are 1e30 or
# 1e-30), which float16 cannot hold: bf16 and float32 only. A kernel staging values
# through float16, or without an epsilon, an amax floor or a masked max, fails here.
# ``moe_gate`` has none: a sigmoid of 1e30 is 1 for every expert, which leaves only ties.
MAGNITUDES: dict[str, tuple[dict[str, float], ...]] = {
    "sparse_attention": ({"q": 1e-30, "k": 1e30, "v": 1e30}, {"q": 1e-30, "v": 1e-30}),
    "lightning_indexer": (
        {"q": 1e-30, "k": 1e30},
        {"weights": 1e-30},
        {"q_scale": 1e-30, "k_scale": 1e30},
    ),
    "indexer_logits": ({"q": 1e30, "k": 1e-30}, {"weights": 1e-30}, {"k_scale": 1e-30}),
    "moe_dispatch": ({"x": 1e30}, {"x": 1e-30}),
    "moe_combine": ({"y_sorted": 1e30}, {"y_sorted": 1e-30}),
    "grouped_gemm": ({"x": 1e30}, {"x": 1e-30}, {"x": 1e-30, "w": 1e30}, {"w_scale": 1e30}),
    "quant_gemm": ({"x": 1e30}, {"x": 1e-30}, {"x": 1e-30, "w": 1e30}, {"w_scale": 1e30}),
    "quantize": ({"x": 1e30}, {"x": 1e-30}),
    "rms_norm": ({"x": 1e-30}, {"weight": 1e30}),
    "rope": ({"x": 1e30}, {"x": 1e-30}),
    "token_logprobs": ({"hidden": 1e-30, "lm_head": 1e30}, {"hidden": 1e-30}),
}
# And at the edge of float32's range: the argument scaled so that its largest entry is
# FLOAT32_EDGE, where each output is a copy, a weighted sum, a rotation or a code of it
# and so still fits float32 (a kernel whose intermediate product overflows, such as
# x * qmax / amax in quantize, turns it into inf or NaN). Arguments whose bounds glmport
# refuses by design (attention's K * max|v|, scores, GEMM partial sums: the overflow
# refusal of docs/reliability.md) have none.
FLOAT32_EDGE = 3e38
EDGES: dict[str, tuple[str, ...]] = {
    "moe_dispatch": ("x",),
    "moe_combine": ("y_sorted",),
    "quantize": ("x",),
    "rope": ("x",),
}
MAGNITUDE_BASES = (
    ("sparse_attention", "tiny"),
    ("lightning_indexer", "tiny"),
    ("indexer_logits", "tiny"),
    ("moe_dispatch", "tiny"),
    ("moe_combine", "tiny"),
    ("grouped_gemm", "tiny"),
    ("quantize", "tiny"),
    ("quant_gemm", "tiny"),
    ("quant_gemm", "qat"),
    ("rms_norm", "tiny"),
    ("rope", "tiny_half"),
    ("token_logprobs", "tiny"),
)


def _times(build: Builder, positions: dict[int, float]) -> Builder:
    """``build`` with the tensor arguments at ``positions`` multiplied (in float64,
    then back to their dtype) by their factors."""

    def scaled(gen):
        args = list(build(gen))
        for pos, factor in positions.items():
            args[pos] = (args[pos].double() * factor).to(args[pos].dtype)
        return tuple(args)

    return scaled


def _at_edge(build: Builder, pos: int) -> Builder:
    """``build`` with tensor argument ``pos`` scaled (in float64) so that its largest
    magnitude is :data:`FLOAT32_EDGE`."""

    def scaled(gen):
        args = list(build(gen))
        a = args[pos].double()
        args[pos] = (a * (FLOAT32_EDGE / a.abs().max())).to(args[pos].dtype)
        return tuple(args)

    return scaled


def _magnitude_label(factors: dict[str, float]) -> str:
    return "_".join(f"{arg}{factor:.0e}".replace("+", "") for arg, factor in factors.items())


def magnitude_cases(cases: list[Case], *, full: bool = False) -> list[Case]:
    """Family ``magnitude``: each base (:data:`MAGNITUDE_BASES` among ``cases``, bf16
    and float32; fp8 indexer inputs through their scales) once per factor set of
    :data:`MAGNITUDES` whose arguments are all bf16 / float32 tensors of the call, named
    ``<base>_<arg><factor>...`` (``rope-tiny_half_x1e30-bfloat16``). Quick mode takes
    bf16 and fp8 (float32 where a case has no other), ``--full`` float32 too."""
    out = []
    fp32_only = {(c.op, c.name, c.scheme) for c in cases if c.dtype == torch.float32} - {
        (c.op, c.name, c.scheme) for c in cases if c.dtype in LAYOUT_QUICK_DTYPES
    }
    for base in cases:
        if (base.op, base.name) not in MAGNITUDE_BASES or base.layout is not None:
            continue
        if base.dtype not in (torch.float32, torch.bfloat16, FP8_DTYPE):
            continue
        quick = base.dtype != torch.float32 or (base.op, base.name, base.scheme) in fp32_only
        if not (quick or full):
            continue
        args = base.args()
        names = SPECS[base.op].arg_names

        def scalable(pos, args=args):
            a = args[pos]
            return isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.bfloat16)

        variants = []
        for factors in MAGNITUDES[base.op]:
            pos = {names.index(arg): f for arg, f in factors.items()}
            if all(scalable(i) for i in pos):
                variants.append((_magnitude_label(factors), _times(base.build, pos)))
        for arg in EDGES.get(base.op, ()):
            if scalable(names.index(arg)) and args[names.index(arg)].abs().max() > 0:
                variants.append((f"{arg}_edge3e38", _at_edge(base.build, names.index(arg))))
        out += [
            replace(
                base, name=f"{base.name}_{label}", family="magnitude", build=b, full_only=not quick
            )
            for label, b in variants
        ]
    return out


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
    wanted += magnitude_cases(wanted, full=full)
    wanted += layout_cases(wanted, ops=ops, full=full)
    return [c for c in wanted if full or not c.full_only]
