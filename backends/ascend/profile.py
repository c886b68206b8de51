"""What the adapters may assume of the torch_npu build they call: read from its version
(:mod:`.chips`'s table of documented contracts) and, where the documentation is
silent, measured at start-up by a tiny call whose answer tells the conventions apart.

The adapters never assume an undocumented convention: :func:`detect_profile` runs on
the real torch_npu when the probe finds an NPU, and on the emulator (which can answer
as either convention, :mod:`.emulator.build`) under ``GLMPORT_EMULATE=1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from .chips import chip_generation, indexer_takes_any_heads

BATCH, GLOBAL = "batch", "global"
# npu_mla_prolog_v3's undocumented conventions: weight_uq_qr's column order, rope pairs.
PER_HEAD, SPLIT = "per_head", "split"
INTERLEAVED, HALF = "interleaved", "half"
# The lightning indexer's query heads on builds documenting exactly 64.
INDEXER_HEADS = 64


@dataclass(frozen=True)
class NpuProfile:
    """The conventions of one torch_npu build.

    Attributes:
        version: ``torch_npu.__version__`` (the emulator's stand-in version under
            emulation).
        indexer_any_heads: the lightning indexer takes ``N1 <= 64`` query heads with
            float32 weights (pages from 2026-03); else exactly 64 heads with weights in
            the query's dtype, and the adapters pad with zero-weight heads.
        indexer_positions: what ``sparse_indices`` count from in a multi-batch TND
            call (undocumented): ``"batch"`` (each batch's own keys) or ``"global"``
            (the whole key tensor).
        generation: the chip's (``"A2"``, ``"A3"``: :func:`.chips.chip_generation` of
            the SoC name ``torch_npu.npu.get_device_name()`` reports); ops documented
            for one generation only (``npu_mla_prolog_v3``: A3) read it.
        prolog_columns: ``npu_mla_prolog_v3``'s ``weight_uq_qr`` column order
            (undocumented): ``"per_head"`` (each head's query then rope columns) or
            ``"split"`` (every head's query columns, then every head's rope columns).
        prolog_rope: the pairs its rope rotates (undocumented): ``"interleaved"``
            ``(2i, 2i + 1)`` or ``"half"`` ``(i, i + Dr/2)``.
    """

    version: str = "unknown"
    indexer_any_heads: bool = True
    indexer_positions: str = BATCH
    generation: str | None = "A3"
    prolog_columns: str = PER_HEAD
    prolog_rope: str = INTERLEAVED

    def describe(self) -> str:
        heads = "N1 <= 64, fp32 weights" if self.indexer_any_heads else "N1 = 64 only"
        prolog = f"MLA prolog {self.prolog_columns} columns, {self.prolog_rope} rope pairs"
        return f"indexer {heads}, {self.indexer_positions}-relative indices; {prolog}"


# The newest pages' contract with batch-relative indices: the adapters' default.
NEWEST_PAGES = NpuProfile()


class SelfTestError(RuntimeError):
    """The start-up call answered in no documented or known convention."""


def indexer_positions(npu: ModuleType | SimpleNamespace, device: torch.device) -> str:
    """``"batch"`` or ``"global"``: one ``npu_lightning_indexer`` call of two TND
    batches (one query, two keys each) whose second query's best key is the second
    key of its batch: position 1 within the batch, 3 in the key tensor. The call is
    valid under every documented contract (64 heads, weights in the query's dtype,
    no ``return_value``)."""
    dtype = torch.bfloat16
    query = torch.zeros(2, INDEXER_HEADS, 128, dtype=dtype, device=device)
    query[:, :, 0] = 1.0
    key = torch.zeros(4, 1, 128, dtype=dtype, device=device)
    key[1, 0, 0] = 1.0  # batch 0: keys 0, 1 -> the best is position 1
    key[2, 0, 0] = 1.0  # batch 1: keys 2, 3 -> key 3 scores 2 against key 2's 1
    key[3, 0, 0] = 2.0
    weights = torch.ones(2, INDEXER_HEADS, dtype=dtype, device=device)
    lengths = torch.tensor([1, 2], dtype=torch.int32, device=device)
    indices, _ = npu.npu_lightning_indexer(
        query,
        key,
        weights,
        actual_seq_lengths_query=lengths,
        actual_seq_lengths_key=lengths * 2,
        layout_query="TND",
        layout_key="TND",
        sparse_count=1,
        sparse_mode=0,
    )
    answer = indices.reshape(2).tolist()
    if answer == [1, 1]:
        return BATCH
    if answer == [1, 3]:
        return GLOBAL
    raise SelfTestError(
        f"npu_lightning_indexer's start-up check returned positions {answer} for two "
        "batches whose best keys are [1, 1] batch-relative or [1, 3] global"
    )


def prolog_conventions(npu: ModuleType | SimpleNamespace, device: torch.device) -> tuple[str, str]:
    """``(prolog_columns, prolog_rope)``: one ``npu_mla_prolog_v3`` call of one token
    and two heads at the page's widths, ``x`` and ``c^Q`` one-hot. ``weight_uq_qr``'s
    column ``D`` is head 0's first rope column (``"per_head"``: ``query_rope`` of head 0
    moves) or head 1's first query column (``"split"``: ``query`` of head 1 moves). The
    key's first rope input is 1 at a quarter turn: it lands in column 1 of ``kr_cache``
    for interleaved pairs, in column ``Dr / 2`` for half-split ones."""
    he, hcq, hckv, d, dr, heads = 7168, 1536, 512, 128, 64, 2
    bf = torch.bfloat16

    def one_hot(rows: int, cols: int, row: int, col: int) -> torch.Tensor:
        w = torch.zeros(rows, cols, dtype=bf, device=device)
        w[row, col] = 1.0
        return w

    def nz(w: torch.Tensor) -> torch.Tensor:  # [in, out], FRACTAL_NZ as the page requires
        return npu.npu_format_cast(w, 29)

    kv_cache = torch.zeros(1, 16, 1, hckv, dtype=bf, device=device)
    kr_cache = torch.zeros(1, 16, 1, dr, dtype=bf, device=device)
    w_uk = torch.zeros(heads, d, hckv, dtype=bf, device=device)
    w_uk[:, 0, 0] = 1.0
    query, query_rope, *_ = npu.npu_mla_prolog_v3(
        one_hot(1, he, 0, 0),
        nz(one_hot(he, hcq, 0, 0)),
        nz(one_hot(hcq, heads * (d + dr), 0, d)),
        w_uk,
        nz(one_hot(he, hckv + dr, 0, hckv)),
        torch.ones(hcq, dtype=bf, device=device),
        torch.ones(hckv, dtype=bf, device=device),
        torch.ones(1, dr, dtype=bf, device=device),  # sin: a quarter turn everywhere
        torch.zeros(1, dr, dtype=bf, device=device),  # cos
        kv_cache,
        kr_cache,
        cache_index=torch.zeros(1, dtype=torch.int64, device=device),
        cache_mode="PA_BSND",
    )
    moved = (bool(query_rope[0, 0].any()), bool(query[0, 1].any()))
    columns = {(True, False): PER_HEAD, (False, True): SPLIT}.get(moved)
    key = kr_cache[0, 0, 0].float().cpu()
    rope = {(1,): INTERLEAVED, (dr // 2,): HALF}.get(tuple(key.nonzero().flatten().tolist()))
    if columns is None or rope is None:
        raise SelfTestError(
            "npu_mla_prolog_v3's start-up check answered in no known convention: "
            f"query_rope of head 0 / query of head 1 nonzero {moved} (one of the two "
            f"expected), the key's rope in columns {key.nonzero().flatten().tolist()} "
            f"(1: interleaved pairs, {dr // 2}: half-split)"
        )
    return columns, rope


def detect_profile(npu: ModuleType | SimpleNamespace, device: torch.device) -> NpuProfile:
    """The profile of the torch_npu (or emulator) ``npu``: its version's documented
    contract, and the conventions start-up calls measure on ``device`` (the MLA
    prolog's on an Atlas A3 only, where the op is documented)."""
    version = str(getattr(npu, "__version__", "unknown"))
    generation = chip_generation(npu.npu.get_device_name())
    columns, rope = (
        prolog_conventions(npu, device) if generation == "A3" else (PER_HEAD, INTERLEAVED)
    )
    return NpuProfile(
        version=version,
        indexer_any_heads=indexer_takes_any_heads(version),
        indexer_positions=indexer_positions(npu, device),
        generation=generation,
        prolog_columns=columns,
        prolog_rope=rope,
    )
