"""The mutant library: standard porting bugs, each applied to each op it fits.

A mutant is a correct backend's kernel for one op wrapped with one porting bug: a
scale off, a scale or layout transposed, an off-by-one at a range end, a stride
ignored, ids staged in 16 bits, the last element dropped or duplicated, tie order
flipped, accumulation in the input's low dtype, a renormalisation missing, the
temperature ignored, an lse in log2, a capacity drop, ... Each
:class:`~.base.Mutant` names its op, the kind of mutation, what it breaks, the case
family meant to kill it (``needs``) and the wrapper (the op's kernel -> the mutated
kernel). :mod:`.every_op` applies the tail and stride mutations to every op they fit;
the other modules hold one op family's mutants each, mostly as tables.

:mod:`glmport.conformance.mutation` runs a mutant against the suite;
``glmport conformance --mutants`` runs the whole library (:mod:`..mutation_suite`) and
reports the kill rate (:mod:`..mutation_report`).
"""

from __future__ import annotations

# Each module fills LIBRARY as it is imported.
from . import attention, every_op, gemm, indexer, logprobs, mla, moe, norm_rope, quantize  # noqa: F401
from .base import LIBRARY, Mutant, identity

__all__ = ["LIBRARY", "Mutant", "identity"]
