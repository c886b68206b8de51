"""What the ``tvm`` backend and the TVM model export share: compiling a glmport Relax
module for the CPU, saving it, and torch tensors across the Relax VM's boundary
(DLPack). ``tvm`` is imported inside functions only: importing this module does not
import it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from .native_log import dropped_native_lines

log = logging.getLogger("glmport")

# TVM's native log lines that a glmport compile always prints and nobody can act on.
# Legalising relax.take in its default "fast" mode warns that an out-of-bounds index
# would read outside the tensor. glmport's own emitters take in "clip" mode; the fast
# takes left are the importers': torch's embedding and the ONNX Gathers, whose ids the
# graph asserts in [0, vocab) before it runs (tvm_model's guard), the ai.glmport ONNX
# bodies' Gathers, which clamp their indices (the ONNX spec forbids them outside), and
# torch's select, a constant index into an axis of fixed size that torch.export checked.
FAST_TAKE = "Fast mode segfaults when there are out-of-bounds indices"
# The llvm code generator does not read the pragma TVM's own lowering attaches.
UNKNOWN_PRAGMA = "Warning: Unknown pragma pragma_scope"
# The VM executable logs each constant's (default) storage scope when it is saved.
SCOPE_SAVING = "Warning: Scope Saving:"


def compile_relax(mod: Any) -> Any:
    """A glmport Relax ``IRModule`` compiled for the CPU (llvm): the "zero" pipeline
    (legalise, fold constants, fuse; no tuning), then ``tvm.compile``. Returns the VM
    executable. TVM's expected log lines (:data:`FAST_TAKE`, :data:`UNKNOWN_PRAGMA`)
    are dropped; any other reaches stderr.

    TVM 0.27's operator fusion (FuseTIR) fails on some graphs whose shapes are sums of
    symbolic sizes (the decode step's ``past + 1`` keys): those compile unfused, the
    same computation in more kernels, with one log line saying so."""
    import tvm
    from tvm import relax
    from tvm.relax import transform

    with dropped_native_lines(FAST_TAKE, UNKNOWN_PRAGMA):
        try:
            lowered = relax.get_pipeline("zero")(mod)
        except tvm.error.InternalError as err:
            log.info("glmport: TVM could not fuse this graph (%s); compiling it unfused", err)
            unfused = tvm.transform.Sequential(
                [
                    transform.LegalizeOps(),
                    transform.AnnotateTIROpPattern(),
                    transform.FoldConstant(),
                ]
            )
            lowered = unfused(mod)
        return tvm.compile(lowered, target="llvm")


def save_library(executable: Any, path: str | Path) -> None:
    """Write a VM executable as a shared library at ``path``, without TVM's
    :data:`SCOPE_SAVING` log lines."""
    with dropped_native_lines(SCOPE_SAVING):
        executable.export_library(str(path))


def from_tvm(value: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A VM result (a tensor or a tuple of them) as torch tensors, through DLPack."""
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        return torch.from_dlpack(value)
    return tuple(torch.from_dlpack(v) for v in value)


def to_tvm(t: torch.Tensor) -> Any:
    """A CPU tensor as a TVM tensor through DLPack. TVM's import wants a 64-byte aligned
    address (a view that starts elsewhere in a larger tensor is copied first), and its
    calls want compact row-major strides (:func:`_compact`), which torch does not give
    every tensor it calls contiguous: those are copied into compact storage too."""
    import tvm

    t = t.detach()
    if t.data_ptr() % 64 or not _compact(t):
        t = torch.empty_strided(t.shape, _row_major(t.shape), dtype=t.dtype).copy_(t)
    return tvm.runtime.from_dlpack(t)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    """Each dimension's stride as the product of the later sizes (0 after a 0-size
    dimension, where torch says 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _compact(t: torch.Tensor) -> bool:
    """Whether TVM takes ``t``'s strides as compact: row-major in every dimension of a
    size other than 1 (TVM ignores the stride of a size-1 dimension)."""
    return all(
        size == 1 or stride == want
        for size, stride, want in zip(t.shape, t.stride(), _row_major(t.shape), strict=True)
    )
