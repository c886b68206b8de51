"""The torch_npu build the emulator answers as: its version (which contract the
documentation gives it, :mod:`..chips`) and the conventions the documentation leaves
open, so the adapters' handling of each can be tested on a laptop.

The default is the newest documented contract with batch-relative indexer positions;
:func:`emulated_build` switches it for the duration of a ``with`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# A TorchNPU 26.1.0 package (CANN 9.1): the newest pages.
NEWEST = "2.12.0"
# A TorchNPU 7.3.0 package (CANN 8.5): the lightning indexer takes exactly 64 heads.
BEFORE_2026_03 = "2.9.0"


@dataclass(frozen=True)
class EmulatedBuild:
    """``version``: the torch_npu package version reported as ``__version__``;
    ``indexer_positions``: ``"batch"`` or ``"global"``, what multi-batch TND
    ``sparse_indices`` count from (undocumented); ``soc_name``: the chip the device
    reports (``torch.npu.get_device_name()``), an Atlas A3 by default;
    ``prolog_columns``: how ``npu_mla_prolog_v3``'s ``weight_uq_qr`` orders its
    columns (undocumented): ``"per_head"`` (each head's ``D`` query then ``Dr`` rope
    columns, DeepSeek's ``wq_b``) or ``"split"`` (every head's query columns, then
    every head's rope columns); ``prolog_rope``: the pairs its rope rotates
    (undocumented): ``"interleaved"`` ``(2i, 2i + 1)`` or ``"half"`` ``(i, i + Dr/2)``."""

    version: str = NEWEST
    indexer_positions: str = "batch"
    soc_name: str = "Ascend910_9382"
    prolog_columns: str = "per_head"
    prolog_rope: str = "interleaved"


_current = [EmulatedBuild()]


def current_build() -> EmulatedBuild:
    """The build the emulated ops answer as now."""
    return _current[0]


@contextmanager
def emulated_build(build: EmulatedBuild) -> Iterator[EmulatedBuild]:
    """Emulate ``build`` inside the block (not thread-safe: tests and scripts)."""
    saved, _current[0] = _current[0], build
    try:
        yield build
    finally:
        _current[0] = saved
