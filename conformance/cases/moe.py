"""Cases of the MoE ops: ``moe_gate``, ``moe_dispatch`` / ``moe_combine`` and
``grouped_gemm`` (float and quantised weights, empty experts, degenerate sizes).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from glmport.core.formats import FLOAT_WEIGHT, SCHEMES

from .base import (
    DEGENERATE,
    FLOATS,
    Case,
    per_dtype,
    quantized_weight,
    randn,
    smallest_k,
    zero_every,
)


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
        logits = randn(gen, t, e, scale=2.0)
        if ties or exact_ties:  # experts come in identical pairs
            logits = logits[:, torch.arange(e) // 2]
        b = randn(gen, e, scale=0.1) if bias else None
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
        yield from per_dtype("moe_dispatch", name, family, p, _routing(**p), judge="exact")
        yield from per_dtype("moe_combine", name, family, p, _combine(**p))
    yield from _routing_hard_cases()
    yield from _grouped_cases()


def _routing(t, k, e, d, pattern="random", index_dtype="int32"):
    """``moe_dispatch`` arguments: ``x [T, D]`` and ``ids [T, k]`` of ``pattern``:
    ``random`` (k distinct experts per token), ``one_expert`` (every token's first
    choice is expert ``E / 2``), ``two_empty`` (experts 0 and ``E - 1`` get nothing),
    ``every_expert`` (``k = E``: each token a permutation of all experts),
    ``repeated`` (a token lists an expert more than once: a copy per listing)."""

    def build(gen, dtype):
        x = randn(gen, t, d, dtype=dtype)
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
            yield from per_dtype(
                "moe_dispatch", name, family, p, _routing(**p), dtypes=(dtype,), judge="exact",
                full_only=full,
            )  # fmt: skip
            if family in ("ids", "tail"):  # combine sees rows, not experts
                combine = _combine(**{k: v for k, v in p.items() if k != "pattern"})
                yield from per_dtype(
                    "moe_combine", name, family, p, combine, dtypes=(dtype,), full_only=full
                )


def _combine(t, k, e, d, index_dtype="int32"):
    def build(gen, dtype):
        y = randn(gen, t * k, d, dtype=dtype)
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


def _grouped(
    m, e, n, k, scheme=FLOAT_WEIGHT, group_size=128, empty=(), offsets_dtype="int32", zero_rows=0
):
    """``grouped_gemm`` arguments; ``empty``: experts given no row; ``zero_rows``: every
    ``zero_rows``-th row of ``x`` all zero (padding tokens)."""

    def build(gen, dtype):
        x = zero_every(randn(gen, m, k, dtype=dtype), zero_rows)
        w = randn(gen, e, n, k, scale=k**-0.5)
        offsets = _offsets(gen, m, e, empty).to(getattr(torch, offsets_dtype))
        if scheme == FLOAT_WEIGHT:
            return x, w.to(dtype), offsets, None, scheme, group_size
        packed = [quantized_weight(gen, w[i], scheme, group_size) for i in range(e)]
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
            yield from per_dtype("grouped_gemm", name, family, p, _grouped(**p), judge="gemm")
        # Quantised experts in float32 as well as bfloat16 where cheap (fp16: --full).
        small = name in ("tiny", "empty_experts")
        for scheme in SCHEMES:
            for dtype in FLOATS if small else (torch.bfloat16,):
                yield from per_dtype(
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
                yield from per_dtype(
                    "grouped_gemm", name, family, p, _grouped(**p, scheme=scheme, group_size=32),
                    dtypes=(dtype,), judge="gemm", full_only=dtype != torch.bfloat16,
                    scheme=None if scheme == FLOAT_WEIGHT else scheme,
                )  # fmt: skip
    # Degenerate GEMM sizes, where a size-1 dimension's stride is arbitrary and fast
    # kernels' size minimums bite: K = 1 (the smallest int4 K is one packed pair: 2),
    # N = 1, M = 1.
    for name, (m, n, k) in DEGENERATE.items():
        for scheme in (FLOAT_WEIGHT, *SCHEMES):
            kk, gs = smallest_k(scheme, k)
            p = dict(m=m, e=3, n=n, k=kk, group_size=gs)
            yield from per_dtype(
                "grouped_gemm", name, "edge", p, _grouped(**p, scheme=scheme),
                dtypes=(torch.bfloat16,), judge="gemm",
                scheme=None if scheme == FLOAT_WEIGHT else scheme,
            )  # fmt: skip
