"""Which mode Triton kernels run in, asked without importing triton.

The backend's probe (``__init__``) and the kernels' ``runtime`` both ask here: the
probe must decide before triton is first imported, since a process chooses compiled or
interpreted once, at that import.
"""

from __future__ import annotations

import os
import sys

INTERPRET_VAR = "TRITON_INTERPRET"


def interpreting() -> bool:
    """Whether Triton kernels defined now run in the interpreter (on CPU tensors)."""
    return os.environ.get(INTERPRET_VAR, "0") not in ("", "0")


def triton_mode() -> bool | None:
    """True / False when triton is already imported interpreted / compiled in this
    process (its own ``@triton.jit`` helpers such as ``tl.sum`` are defined at import,
    in one mode), None before its first import."""
    if "triton" not in sys.modules:
        return None
    import triton.language as tl

    return type(tl.standard.sum).__name__ == "InterpretedFunction"
