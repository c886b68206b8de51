"""Cases of ``lightning_indexer`` and ``indexer_logits``: plain and fp8 inputs,
GLM-5's 32 x 128 with topk 2048, ragged and empty ranges, tied scores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from glmport.core.formats import FP8_DTYPE, quantize_tensor

from .base import FLOATS, WIDE_ID, Case, causal_ranges, per_dtype, randn


def indexer_builder(
    t: int,
    hi: int,
    di: int,
    n: int,
    topk: int,
    *,
    ranges: str = "causal",
    ties: bool = False,
    keys: str = "random",
    fp8: bool = False,
    logits: bool = False,
) -> Callable[[torch.Generator, torch.dtype], tuple]:
    """``keys``: ``random``; ``periodic`` (key ``s`` equals key ``s + N / 2``: exact
    ties a tile apart); ``relu_zeros`` (every query entry positive, three keys in four
    negative in every entry: each of their dot products is negative in any precision,
    so they score exactly 0, a tie of many). ``ties``: every key slot repeated (pairs
    of exactly equal scores)."""

    def build(gen, dtype):
        q = randn(gen, t, hi, di)
        k = randn(gen, n, di)
        if ties:
            k = k[torch.arange(n) // 2]
        if keys == "periodic":
            k = k[torch.arange(n) % (n // 2)]
        elif keys == "relu_zeros":
            q = q.abs()
            live = torch.rand(n, generator=gen) < 0.25
            k = torch.where(live[:, None], k.abs(), -k.abs())
        w = randn(gen, t, hi) * hi**-0.5 * di**-0.5
        if ranges == "causal":
            start, end = causal_ranges(t, n)
        elif ranges == "packed":  # two sequences packed back to back, each causal
            half = t // 2
            s1, e1 = causal_ranges(half, n // 2)
            s2, e2 = causal_ranges(t - half, n)
            start = torch.cat((s1, torch.full_like(s2, n // 2)))
            end = torch.cat((e1, e2))
        elif ranges == "staggered":  # causal ends, every query its own start
            start, end = causal_ranges(t, n, starts=list(range(t)))
        elif ranges == "empty_row":
            start, end = causal_ranges(t, n)
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


def paged_indexer_builder(
    hi: int,
    di: int,
    topk: int,
    block_size: int,
    blocks: int,
    queries: tuple[tuple[int, int], ...],
    *,
    need_scores: bool = True,
    fp8: bool = False,
) -> Callable[[torch.Generator, torch.dtype], tuple]:
    """A paged ``lightning_indexer`` call over a pool of ``blocks`` blocks of
    ``block_size`` keys: ``queries`` lists ``(sequence length, new tokens)`` per
    sequence, each sequence's blocks a random choice of the pool's (shared by none
    other), its new tokens its last positions (one: decode; more: a causal prefill
    chunk). Table entries past what a query reads name blocks far outside the pool:
    the op reads no such entry."""

    def build(gen, dtype):
        per_block = [-(-length // block_size) for length, _ in queries]
        order = torch.randperm(blocks, generator=gen)
        width = max(per_block)
        rows, ends, first = [], [], 0
        for (length, new), used in zip(queries, per_block, strict=True):
            table = torch.full((width,), 10**6 + first, dtype=torch.int32)
            table[:used] = order[first : first + used]
            first += used
            rows += [table] * new
            ends += list(range(length - new + 1, length + 1))
        t = len(ends)
        q = randn(gen, t, hi, di)
        k = randn(gen, blocks, block_size, di)
        w = randn(gen, t, hi) * hi**-0.5 * di**-0.5
        start, end = torch.zeros(t, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32)
        if fp8:
            qq, qs = quantize_tensor(q.reshape(t * hi, di), "fp8_group", di)
            kq, ks = quantize_tensor(k.reshape(-1, di), "fp8_group", di)
            q, k = qq.reshape(t, hi, di), kq.reshape(blocks, block_size, di)
            scales = (qs.reshape(t, hi), ks.reshape(blocks, block_size))
        else:
            q, k, scales = q.to(dtype), k.to(dtype), (None, None)
        return (q, k, w, start, end, topk, *scales, torch.stack(rows), need_scores)

    return build


def _paged_indexer_cases() -> Iterator[Case]:
    """Paged calls (``block_table``): decode (a query per sequence) and prefill chunks,
    ranges shorter than ``topk`` and empty, scores asked for or not; at the vendor
    indexers' Di 128 with pages of 16 and 64 keys, and GLM-5's 32 x 128 at topk 2048."""
    paged = [
        ("paged_tiny", "tiny", dict(hi=4, di=32, topk=8, block_size=4, blocks=12,
                                    queries=((9, 1), (20, 1), (3, 1)))),
        ("paged_decode", "edge", dict(hi=8, di=128, topk=40, block_size=16, blocks=24,
                                      queries=((70, 1), (130, 1), (33, 1), (16, 1)))),
        ("paged_prefill", "edge", dict(hi=8, di=128, topk=24, block_size=16, blocks=16,
                                       queries=((50, 6), (31, 4)))),
        ("paged_short", "edge", dict(hi=4, di=128, topk=64, block_size=16, blocks=8,
                                     queries=((5, 1), (40, 3), (0, 1)))),
        ("paged_no_scores", "edge", dict(hi=8, di=128, topk=40, block_size=16, blocks=24,
                                         queries=((70, 1), (130, 1), (12, 1)),
                                         need_scores=False)),
        ("paged_glm5", "glm5", dict(hi=32, di=128, topk=2048, block_size=64, blocks=100,
                                    queries=((3000, 1), (2500, 1)))),
    ]  # fmt: skip
    for name, family, p in paged:
        yield from per_dtype(
            "lightning_indexer", name, family, p, paged_indexer_builder(**p), judge="indexer"
        )
        fp8 = paged_indexer_builder(**p, fp8=True)  # quantises fp32 data itself
        yield from per_dtype(
            "lightning_indexer", name, family, p, lambda g, _, fp8=fp8: fp8(g, torch.float32),
            dtypes=(FP8_DTYPE,), judge="indexer",
        )  # fmt: skip


def indexer_cases() -> Iterator[Case]:
    shapes = [
        ("tiny", "tiny", dict(t=6, hi=4, di=32, n=50, topk=8)),
        ("glm5", "glm5", dict(t=4, hi=32, di=128, n=4096, topk=2048)),
        ("glm5_long", "glm5", dict(t=8, hi=32, di=128, n=8192, topk=2048)),
        # DeepSeek-V3.2's indexer width (64 heads x 128), GLM-5-class.
        ("heads64", "glm5", dict(t=2, hi=64, di=128, n=4096, topk=2048)),
        # GLM-5's widest top-k (DSA at long context): wider than any one sort of cuda.
        ("glm5_topk8192", "glm5", dict(t=2, hi=32, di=128, n=9000, topk=8192)),
        # As many queries as an H200 has SMs: cuda's prefill path (a program per query).
        ("glm5_prefill", "glm5", dict(t=132, hi=32, di=128, n=2100, topk=2048)),
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
        yield from per_dtype(
            "lightning_indexer",
            name,
            family,
            p,
            indexer_builder(**p),
            judge="indexer",
            full_only=full,
        )
        if family != "glm5" or not full:
            fp8 = indexer_builder(**p, fp8=True)  # quantises fp32 data itself
            yield from per_dtype(
                "lightning_indexer", name, family, p, lambda g, _, fp8=fp8: fp8(g, torch.float32),
                dtypes=(FP8_DTYPE,), judge="indexer",
            )  # fmt: skip
    yield from _indexer_hard_cases()
    yield from _paged_indexer_cases()
    # An inference call over packed keys: no scores asked for.
    p = dict(t=4, hi=8, di=128, n=300, topk=40)
    plain = indexer_builder(**p)
    yield from per_dtype(
        "lightning_indexer", "no_scores", "edge", p,
        lambda g, dtype: (*plain(g, dtype), None, False), judge="indexer",
    )  # fmt: skip
    named = {name: (name, family, p) for name, family, p in shapes}
    for name, family, p in [
        named["tiny"],
        named["empty_range"],
        named["packed_ragged"],
        ("glm5", "glm5", dict(t=4, hi=32, di=128, n=2048, topk=1)),
        # Past every tile: keys 1300 (64 / 128 / 1024 per dot), Di 48 and Hi 6 padded
        # to powers of two, 34 queries.
        ("tail", "tail", dict(t=34, hi=6, di=48, n=1300)),
    ]:
        p = {k: v for k, v in p.items() if k != "topk"}
        for dtype in (*FLOATS, FP8_DTYPE):
            make = indexer_builder(**p, topk=0, fp8=dtype == FP8_DTYPE, logits=True)
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
        plain, fp8 = indexer_builder(**p), indexer_builder(**p, fp8=True)
        for dtype in (*FLOATS, FP8_DTYPE):
            make = plain if dtype in FLOATS else lambda g, _, fp8=fp8: fp8(g, torch.float32)
            yield from per_dtype(
                "lightning_indexer", name, family, p, make, dtypes=(dtype,), judge="indexer",
                full_only=dtype not in quick,
            )  # fmt: skip
