"""What a report needs to say about where it ran: versions, platform, device.

Reads package metadata instead of importing optional packages, so asking never
imports a vendor SDK; which packages to ask about, the backends' manifests say.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

import torch


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """glmport, python and torch, then the vendor software the backends declare in
    their manifests' ``stack``: a distribution's version, or for ``"$VAR"`` the
    toolkit path the variable holds (None: absent)."""
    from .registry import REGISTRY

    found: dict[str, str | None] = {
        "glmport": _version("glmport"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for item in REGISTRY.stack():
        found[item] = os.environ.get(item[1:]) if item.startswith("$") else _version(item)
    return found


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the accelerator model its torch device module
    reports (``torch.<type>.get_device_name``), or the CPU and platform."""
    if device.type == "cpu":
        return f"{platform.machine()} CPU ({platform.system()}, {os.cpu_count()} cores)"
    get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    try:
        return get_name(device) if get_name is not None else str(device)
    except (RuntimeError, AssertionError):  # the device module exists but no device does
        return str(device)
