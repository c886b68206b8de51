"""Counting host reads of tensor values (a host synchronisation on an accelerator),
shared by the tests of sync-free decode (the model's, and the vendor adapters').

On an accelerator a host read of a device tensor (``.item()``, ``bool(t)``, ``int(t)``,
``.tolist()``, ``.cpu()``, ``nonzero``, a boolean-mask index) makes the host wait for
the device. The CPU has no such wait, so the tests count the calls themselves.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from glmport.core.specs import base

_READS = frozenset(
    {"item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
    | {"equal", "is_nonzero"}  # torch functions
)
KERNELS = "glmport.backends."


def _is_mask(index: object) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype in (torch.bool, torch.uint8) for p in parts)


class _HostReadCounter(TorchFunctionMode):
    """Counts, by ``(what, calling module)``, the calls that read a tensor's value on
    the host, made by any code but modules under ``exempt``. The calling module is the
    first frame outside torch (a read made by torch's own Python code, such as an
    ``nn.Module``'s, counts for the code that called into it). Not seen: reads inside
    the body of a torch function (torch pops the mode while one runs) and reads made
    in C++, neither of which the model's or glmport's ops' own code is."""

    def __init__(self, exempt: str) -> None:
        super().__init__()
        self.exempt, self.reads = exempt, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = getattr(func, "__name__", "")
        if what in ("__getitem__", "__setitem__") and _is_mask(args[1]):
            what = f"{what} with a mask"
        if what in _READS or what.endswith("with a mask"):
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__", "").split(".")[0] == "torch":
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "")
            if not caller.startswith(self.exempt):
                self.reads[(what, caller)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_host_reads(exempt: str = KERNELS) -> Iterator[Counter]:
    """Count host reads of tensor values with a torch function mode (patching Tensor's
    methods would leave it a sequence type for good). glmport's ops are told to ignore
    the mode and take the plain eager path they take in production, whose Python code
    the mode sees whole; through the dispatcher torch would hide the op's body from it."""
    original = base._function_mode
    base._function_mode = lambda: False
    try:
        with _HostReadCounter(exempt) as counter:
            yield counter.reads
    finally:
        base._function_mode = original
