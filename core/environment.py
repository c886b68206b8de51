"""What a report needs to say about where it ran: versions, platform, device.

Reads package metadata instead of importing optional packages, so asking never
imports triton, torch_npu, onnx or tvm.
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
    """glmport, python, torch, triton, torch_npu and the CANN toolkit path (None: absent)."""
    return {
        "glmport": _version("glmport"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "torch_npu": _version("torch-npu"),
        "cann": os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH"),
    }


def device_name(device: torch.device) -> str:
    """A human name for ``device``: the GPU / NPU model, or the CPU and platform."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{platform.machine()} CPU ({platform.system()}, {os.cpu_count()} cores)"
    return str(device)
