"""Strides of op arguments: every tensor argument of every op may come in any layout
(non-contiguous, stride 0), and every backend reads it through its strides.

The class of bug: a kernel that reads a tensor from its data pointer as if contiguous
(the cuda ``token_logprobs`` kernel read ``targets`` so) is right on the contiguous
calls the value cases make and silently wrong on a slice or an expand. The
conformance suite's ``layout`` family feeds each tensor argument of a small call of
every op in a ``strided`` and a ``broadcast`` view (:mod:`glmport.conformance.layouts`);
this module checks that family catches the bug, covers every argument, and passes on
the backends that run here quickly (the cuda and ascend conformance modules run it
under emulation).
"""

from __future__ import annotations

import pytest
import torch

import glmport
from glmport.conformance.calls import to_device
from glmport.conformance.cases import all_cases
from glmport.conformance.cases.base import prefix_width
from glmport.conformance.layouts import LAYOUTS, broadcast, relayout, strided
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.registry import REGISTRY, Availability, Backend, BackendManifest
from glmport.core.specs import OP_NAMES, SPECS

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUT_CHECKS = [c for c in suite_checks() if c.case.family == "layout"]
# Arguments without a variant in one layout, and why (the family keeps valid calls only).
NO_VARIANT = {
    ("moe_combine", "src_row", "broadcast"),  # a permutation of 0..T*k-1
    ("grouped_gemm", "expert_offsets", "broadcast"),  # non-decreasing from 0 to M
    ("lightning_indexer", "block_table", "broadcast"),  # the first row: others read past it
}


def _contiguous_reading(t: torch.Tensor) -> torch.Tensor:
    """What a kernel that ignores ``t``'s strides reads: ``numel`` elements from its data
    pointer in contiguous order (zeros past the end of its storage)."""
    room = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    flat = torch.empty(0, dtype=t.dtype).set_(
        t.untyped_storage(), t.storage_offset(), (min(t.numel(), max(room, 0)),)
    )
    out = torch.zeros(t.numel(), dtype=t.dtype)
    out[: flat.numel()] = flat
    return out.view(t.shape)


def _ignores_strides(op: str):
    reference = REGISTRY.kernels("cpu", False)[op]

    def kernel(*args):
        return reference(*(_contiguous_reading(a) if isinstance(a, torch.Tensor) else a
                           for a in args))  # fmt: skip

    return kernel


class _StrideBlind(Backend):
    manifest = BackendManifest(
        name="stride_blind",
        device_type="cpu",
        description="the cpu reference reading every tensor argument as contiguous",
        ops=OP_NAMES,
    )

    def probe(self, emulate: bool) -> Availability:
        return Availability(True)

    def load_kernels(self, emulate: bool):
        return {op: _ignores_strides(op) for op in OP_NAMES}


@pytest.mark.parametrize("t", [torch.arange(6), torch.arange(24.0).view(2, 3, 4)])
def test_strided_keeps_the_values_in_a_view_unlike_the_contiguous_one(t):
    v = strided(t)
    assert (
        torch.equal(v, t) and not v.is_contiguous() and v.storage_offset() == sum(v.stride()) // 2
    )
    assert all(s >= 2 for s in v.stride())
    assert list(v.stride()) == sorted(v.stride())  # dim 0 is the innermost in memory


def test_broadcast_expands_the_first_row_with_stride_zero():
    t = torch.arange(12).view(1, 3, 4)
    b = broadcast(t)
    assert b.stride()[1] == 0 and torch.equal(b, t[:, :1].expand(1, 3, 4))
    assert broadcast(torch.ones(1, 1)) is None
    with pytest.raises(ValueError, match="unknown layout 'x'; layouts: strided, broadcast"):
        relayout(t, "x")


def test_the_family_covers_every_tensor_argument_of_every_op_in_both_layouts():
    covered = {(c.op, *c.layout) for c in all_cases() if c.family == "layout"}
    wanted = set()
    for op in OP_NAMES:
        for case in (c for c in all_cases(ops=(op,)) if c.family == "layout"):
            args = case.args()
            names = SPECS[op].arg_names
            wanted |= {
                (op, n, layout)
                for n, a in zip(names, args, strict=True)
                if isinstance(a, torch.Tensor)
                for layout in LAYOUTS
            }
    assert {op for op, *_ in covered} == set(OP_NAMES)
    assert wanted - covered == NO_VARIANT
    # Every optional tensor argument too (bias, scales): some base passes each.
    spec_tensors = {
        (op, n)
        for op in OP_NAMES
        for n, kind in zip(SPECS[op].arg_names, SPECS[op].arg_types, strict=True)
        if "Tensor" in kind
    }
    assert {(op, n) for op, n, _ in covered} == spec_tensors  # fmt: skip


def test_quick_mode_keeps_the_family_small_and_full_mode_adds_the_other_dtypes():
    quick = [c for c in all_cases() if c.family == "layout"]
    full = [c for c in all_cases(full=True) if c.family == "layout"]
    assert len(quick) < 275 < len(full)
    assert {c.dtype for c in quick} < {c.dtype for c in full}
    assert len({c.id for c in full}) == len(full)


def test_the_family_fails_a_backend_that_reads_arguments_as_contiguous():
    """Each tensor argument of each op read as contiguous fails one of its layout
    checks at least, while the plain value cases (contiguous arguments) pass."""
    plain = [c for c in suite_checks() if c.kind == "value" and c.case.family == "tiny"
             and c.case.dtype == torch.float32]  # fmt: skip
    glmport.register_backend(_StrideBlind())
    try:
        records = [(c, run_check(c, "stride_blind")) for c in LAYOUT_CHECKS]
        unlaid = [run_check(c, "stride_blind") for c in plain]
    finally:
        glmport.unregister_backend("stride_blind")
    assert all(r.outcome == "pass" for r in unlaid), [r.id for r in unlaid if r.outcome != "pass"]
    every = {(c.op, c.case.layout[0]) for c, _ in records}
    caught = {(c.op, c.case.layout[0]) for c, r in records if r.outcome in ("fail", "error")}
    assert caught == every, sorted(every - caught)


def test_cuda_token_logprobs_reads_targets_through_their_stride(cuda_module):
    """The issue's reproduction: targets ``[1, 0, 2, 0, 9, 0][::2]`` and a stride-0
    expand, against log_softmax in float64."""
    logprobs = cuda_module("logprobs")
    gen = torch.Generator().manual_seed(0)
    hidden, lm_head = torch.randn(3, 8, generator=gen), torch.randn(10, 8, generator=gen)
    want_all = torch.log_softmax(hidden.double() @ lm_head.double().T, dim=-1)
    for targets in (torch.tensor([1, 0, 2, 0, 9, 0])[::2], torch.tensor([7]).expand(3)):
        logp, _ = logprobs.token_logprobs(hidden, lm_head, targets, 1.0)
        want = want_all.gather(1, targets.contiguous()[:, None])[:, 0]
        torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "generic", "onnxruntime"])
def test_every_layout_case_passes_on(backend):
    bad = [(r.id, r.outcome, r.reason) for r in (run_check(c, backend) for c in LAYOUT_CHECKS)
           if r.outcome != "pass" or not r.own]  # fmt: skip
    assert not bad, bad


# TVM compiles a module per signature: the variants of one argument per op (the
# index-like one where the op has it) and of the router bias.
TVM_LAYOUT_ARGS = {
    "sparse_attention": "indices", "lightning_indexer": "k_end", "indexer_logits": "k_start",
    "moe_gate": "bias", "moe_dispatch": "ids", "moe_combine": "src_row",
    "grouped_gemm": "expert_offsets", "quantize": "x", "quant_gemm": "w_scale",
    "rms_norm": "weight", "rope": "cos", "token_logprobs": "targets", "mla_prolog": "cos",
}  # fmt: skip
TVM_CHECKS = [
    c for c in LAYOUT_CHECKS
    if c.kind == "value" and c.case.layout[0] == TVM_LAYOUT_ARGS[c.op]
    and c.case.dtype != torch.float8_e4m3fn and c.case.scheme in (None, "w8a8", "int8_row")
]  # fmt: skip


@pytest.mark.parametrize("check", TVM_CHECKS, ids=lambda c: c.id)
def test_layout_cases_pass_on_tvm(check):
    rec = run_check(check, "tvm")
    assert (rec.outcome, rec.ran_on) == ("pass", "tvm"), rec.reason


def test_moving_a_call_keeps_a_prefix_view_a_view_of_the_moved_tensor():
    """Absorbed MLA's ``v = k[..., :512]`` moved to a device alone would be a copy, which
    a vendor kernel that takes only the latent view (ascend's) would hand to generic."""
    k = torch.randn(6, 1, 576)
    args = (torch.randn(2, 4, 576), k, k[..., :512], torch.zeros(2, 3, dtype=torch.int32), 0.1)
    moved = to_device(args, torch.device("meta"))
    assert all(m.device.type == "meta" for m in moved[:4]) and moved[4] == 0.1
    assert prefix_width(moved[1], moved[2]) == 512
    assert prefix_width(moved[0], moved[3]) is None and moved[3].dtype == torch.int32
