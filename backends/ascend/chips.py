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
