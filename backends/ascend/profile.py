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
    """

    version: str = "unknown"
    indexer_any_heads: bool = True
    indexer_positions: str = BATCH
    generation: str | None = "A3"

    def describe(self) -> str:
        heads = "N1 <= 64, fp32 weights" if self.indexer_any_heads else "N1 = 64 only"
        return f"indexer {heads}, {self.indexer_positions}-relative indices"


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


def detect_profile(npu: ModuleType | SimpleNamespace, device: torch.device) -> NpuProfile:
    """The profile of the torch_npu (or emulator) ``npu``: its version's documented
    contract, and the conventions one start-up call measures on ``device``."""
    version = str(getattr(npu, "__version__", "unknown"))
    return NpuProfile(
        version=version,
        indexer_any_heads=indexer_takes_any_heads(version),
        indexer_positions=indexer_positions(npu, device),
        generation=chip_generation(npu.npu.get_device_name()),
    )
