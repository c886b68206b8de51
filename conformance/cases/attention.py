"""Cases of ``sparse_attention``: GQA and absorbed MLA, GLM-5's head counts, edges
(T=1, N < topk, empty ranges, every index -1, repeated and wide slot ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .base import FLOATS, WIDE_ID, Case, per_dtype, randn


def attention_builder(
    t: int,
    h: int,
    hkv: int,
    dk: int,
    dv: int,
    n: int,
    k: int,
    *,
    absorbed: bool = False,
    pattern: str = "random",
    index_dtype: str = "int32",
    sharpness: float = 1.0,
    need_lse: bool = True,
    split_rope: bool = False,
) -> Callable[[torch.Generator, torch.dtype], tuple]:
    """``sparse_attention`` arguments; ``sharpness`` multiplies the softmax scale
    ``Dk ** -0.5`` (40: scores of +-100 and more, past float32's ``exp`` range);
    ``need_lse=False`` is an inference call (``lse`` is ``[0]``); ``split_rope``
    (absorbed): the key's columns past ``dv`` stored apart as ``k_rope``, ``k`` the
    latent ``[N, Hkv, dv]`` and ``v`` a full-width view of it (a paged cache's pools)."""

    def build(gen, dtype):
        q = randn(gen, t, h, dk, dtype=dtype)
        kv = randn(gen, n, hkv, dk, dtype=dtype)
        v = kv[..., :dv] if absorbed else randn(gen, n, hkv, dv, dtype=dtype)
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
        idx, scale = idx.to(getattr(torch, index_dtype)), sharpness * dk**-0.5
        if split_rope:
            latent = kv[..., :dv].contiguous()
            return q, latent, latent[..., :dv], idx, scale, need_lse, kv[..., dv:].contiguous()
        return q, kv, v, idx, scale, need_lse

    return build


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
            "no_lse",
            "edge",
            dict(t=4, h=8, hkv=2, dk=32, dv=16, n=30, k=12, pattern="ragged", need_lse=False),
            False,
        ),
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
        yield from per_dtype(
            "sparse_attention", name, family, p, attention_builder(**p), full_only=full
        )
    # The edges again at absorbed MLA's shape (one latent kv head, Dk 576, v = k[..., :512]),
    # the only one vendor MLA kernels take (ascend's), in bf16 and fp16 (fp32: --full):
    # every head count the kernels list from 1 to 128, paged and int64 slot ids.
    mla = dict(hkv=1, dk=576, dv=512, absorbed=True)
    for name, p in (
        ("mla_t1", dict(t=1, h=16, n=40, k=16)),
        ("mla_h1", dict(t=3, h=1, n=24, k=8)),
        ("mla_h2", dict(t=2, h=2, n=33, k=12)),
        ("mla_h128", dict(t=2, h=128, n=48, k=16)),
        ("mla_n_lt_topk", dict(t=3, h=8, n=6, k=6, pattern="padded")),
        ("mla_all_minus_one", dict(t=2, h=4, n=9, k=4, pattern="all_minus_one")),
        ("mla_ragged", dict(t=6, h=16, n=64, k=20, pattern="ragged")),
        ("mla_causal", dict(t=5, h=8, n=12, k=12, pattern="causal")),
        ("mla_paged_slots", dict(t=3, h=32, n=3000, k=32)),
        ("mla_int64", dict(t=2, h=4, n=50, k=10, index_dtype="int64")),
        ("mla_topk_100", dict(t=2, h=8, n=300, k=100)),
        # An inference call: no lse asked for (ascend: return_softmax_lse=False).
        ("mla_no_lse", dict(t=3, h=16, n=40, k=16, pattern="ragged", need_lse=False)),
        # The rope key stored apart (the paged cache's pools): in inference (ascend:
        # PA_BSND over the pools), with lse (TND), a pool of no whole 16-slot page, ids
        # past the pool (K > N), and GLM-5's decode.
        (
            "mla_split",
            dict(t=3, h=16, n=64, k=16, pattern="ragged", split_rope=True, need_lse=False),
        ),
        ("mla_split_lse", dict(t=3, h=16, n=64, k=16, pattern="ragged", split_rope=True)),
        ("mla_split_odd_pool", dict(t=2, h=8, n=40, k=12, split_rope=True, need_lse=False)),
        (
            "mla_split_n_lt_topk",
            dict(t=2, h=8, n=16, k=16, pattern="padded", split_rope=True, need_lse=False),
        ),
        ("mla_split_decode", dict(t=2, h=64, n=4096, k=2048, split_rope=True, need_lse=False)),
    ):
        p = {**mla, **p}
        for dtype in FLOATS:
            yield from per_dtype(
                "sparse_attention", name, "edge", p, attention_builder(**p), dtypes=(dtype,),
                full_only=dtype == torch.float32,
            )  # fmt: skip
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
        make = attention_builder(**{"pattern": pattern, **p})
        for dtype in FLOATS:
            yield from per_dtype(
                "sparse_attention", name, family, p, make, dtypes=(dtype,),
                full_only=dtype not in quick,
            )  # fmt: skip
