"""Ascend chip generations, told apart by the SoC name the driver reports
(``torch.npu.get_device_name()``, e.g. ``"Ascend910B3"``).

The adapters target the generations the torch_npu DSA ops document, Atlas A2
(Ascend 910B) and Atlas A3 (Ascend 910_93): the manifest's capabilities are their
limits. Other generations are named so the probe can say why it refuses them.
SoC names as CANN lists them (SOC_VERSION values, e.g. ``ascend910b1`` ...
``ascend910_9392``; HCCL's device-type table).
"""

from __future__ import annotations

import re

# (generation, pattern over the SoC name, whether the adapters target it)
_GENERATIONS = (
    ("A2", re.compile(r"Ascend910B\d"), True),  # Atlas 800T / 800I A2: 910B1..B4, B2C, B4-1
    ("A3", re.compile(r"Ascend910_93\d\d"), True),  # Atlas A3: 910_9362 .. 910_9392
    ("A5", re.compile(r"Ascend(950|910_95)"), False),  # Ascend 950PR / 950DT
    ("310P", re.compile(r"Ascend310P"), False),  # Atlas 300I inference cards
    ("910", re.compile(r"Ascend910(A|B|ProA|ProB|PremiumA)?$"), False),  # first-generation 910
)
SUPPORTED = tuple(name for name, _, ok in _GENERATIONS if ok)


def chip_generation(soc_name: str) -> str | None:
    """The generation (``"A2"``, ``"A3"``, ``"A5"``, ``"310P"``, ``"910"``) of an SoC
    name, or None for a name this version does not know."""
    for name, pattern, _ in _GENERATIONS:
        if pattern.match(soc_name):
            return name
    return None


# What torch_npu builds document, by TorchNPU product release (install package version ->
# release: Ascend/pytorch COMPATIBILITY.md and docs/zh/release_notes.md, read 2026-12).
# The lightning indexer's page allowed exactly N1 = 64 query heads with weights in the
# query's dtype until 2026-03; "N1 <= 64" with float32 weights arrived 2026-03-13 /
# 03-24 (Ascend/op-plugin history), first shipped in TorchNPU 26.1.0 (2026-07, CANN 9.1).
# 26.0.0 (CANN 9.0) is treated as older: its page was not read, and the older call
# (64 heads, weights in the query's dtype) is valid under both.
INDEXER_ANY_HEADS_FROM = (26, 1, 0)
# (PyTorch base, first .postN of that base in the release) -> TorchNPU release, newest first.
_RELEASES = (
    ((2, 12, 0), 0, (26, 1, 0)),
    ((2, 11, 0), 0, (26, 1, 0)),
    ((2, 10, 0), 4, (26, 1, 0)),
    ((2, 10, 0), 0, (26, 0, 0)),
    ((2, 9, 0), 6, (26, 1, 0)),
    ((2, 9, 0), 2, (26, 0, 0)),
    ((2, 9, 0), 0, (7, 3, 0)),
    ((2, 8, 0), 4, (26, 0, 0)),
    ((2, 8, 0), 2, (7, 3, 0)),
    ((2, 8, 0), 0, (7, 2, 0)),
    ((2, 7, 1), 8, (26, 1, 0)),
    ((2, 7, 1), 4, (26, 0, 0)),
    ((2, 7, 1), 2, (7, 3, 0)),
    ((2, 7, 1), 0, (7, 2, 0)),
    ((2, 6, 0), 5, (7, 3, 0)),
    ((2, 6, 0), 3, (7, 2, 0)),
    ((2, 6, 0), 0, (7, 1, 0)),
    ((2, 5, 1), 1, (7, 1, 0)),
    ((2, 5, 1), 0, (7, 0, 0)),
)
# The MC2 pair (npu_moe_distribute_dispatch_v2 / combine_v2) on Atlas A3: the 26.1.0
# pages take H in [1024, 7168] (combine's range; dispatch's reaches 8192) and K <= 16;
# the 7.0.0 pages took H = 7168 only and K <= 8. The releases between were not read and
# count as older.
MC2_WIDTHS_FROM = (26, 1, 0)
_PACKAGE = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?")


def torch_npu_release(package_version: str) -> tuple[int, int, int] | None:
    """The TorchNPU product release (``(26, 1, 0)``) an installed torch_npu package
    version (``"2.7.1.post8"``, ``torch_npu.__version__``; a ``+`` local part or rc tag
    is ignored) belongs to: the newest release whose first package of that PyTorch base
    it reaches. A PyTorch base newer than the table's counts as the newest release;
    an older or unreadable one is None (treated as the oldest contract)."""
    found = _PACKAGE.match(package_version)
    if found is None:
        return None
    major, minor, patch, post = (int(g) if g else 0 for g in found.groups())
    base = (major, minor, patch)
    if base > _RELEASES[0][0]:
        return _RELEASES[0][2]
    for table_base, first_post, release in _RELEASES:
        if base == table_base and post >= first_post:
            return release
    return None


def _documented_from(package_version: str, first: tuple[int, int, int]) -> bool:
    """Whether the build belongs to TorchNPU release ``first`` or a newer one."""
    release = torch_npu_release(package_version)
    return release is not None and release >= first


def indexer_takes_any_heads(package_version: str) -> bool:
    """Whether the build's lightning indexer documents ``N1 <= 64`` query heads with
    float32 weights (else exactly 64, weights in the query's dtype)."""
    return _documented_from(package_version, INDEXER_ANY_HEADS_FROM)


def mc2_takes_any_width(package_version: str) -> bool:
    """Whether the build's MC2 pair documents hidden sizes in [1024, 7168] on Atlas A3
    (else 7168 only)."""
    return _documented_from(package_version, MC2_WIDTHS_FROM)
