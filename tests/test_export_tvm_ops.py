"""The glmport ops lowered to Relax (export/tvm_ops.py) and the ``tvm`` backend: chosen
conformance value cases judged against the float64 reference, a torch.export program
of several ops imported with ``custom_convert_map`` and run in the Relax VM against
eager torch, float8 reported unsupported, symbolic sizes sharing one compiled module,
empty reduced axes, and glmport never importing tvm by itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import tvm

import glmport
import glmport.ops as ops
from glmport.conformance.runner import run_check, suite_checks
from glmport.core.errors import UnsupportedError

# Few, telling cases (each compiles a module): -1 padding and N < topk, empty rows and
# ranges, ties, GQA, grouped routing, int4 packing, packed and QAT GEMMs, every float dtype.
VALUE_CASES = (
    "lightning_indexer-n_lt_topk-float32",
    "lightning_indexer-empty_range-bfloat16",
    "lightning_indexer-ties-float16",
    "indexer_logits-empty_range-float32",
    "sparse_attention-all_minus_one-float32",
    "sparse_attention-n_lt_topk-float16",
    "sparse_attention-tiny_gqa-bfloat16",
    "moe_gate-group_ties-float32",
    "moe_gate-grouped_softmax-float32",
    "moe_dispatch-tiny-bfloat16",
    "moe_combine-tiny-float16",
    "grouped_gemm-empty_experts-float32",
    "grouped_gemm-empty_experts-bfloat16-w4a8",
    "quantize-tiny-bfloat16-int4_group",
    "quant_gemm-k_not_128-float16-w8a8",
    "quant_gemm-qat-float32-w4a16",
    "rms_norm-t1_3d-bfloat16",
    "rope-tiny_half-float16",
    "rope-tiny_interleaved-float32",
    "token_logprobs-t1-bfloat16",
    "mla_prolog-tiny-bfloat16",
    "mla_prolog-t0-float32",
)


def _checks(kind: str, ids: tuple[str, ...]):
    ops_wanted = tuple(dict.fromkeys(i.split("-")[0] for i in ids))
    found = {c.case.id: c for c in suite_checks(ops=ops_wanted) if c.kind == kind}
    return [found[i] for i in ids]


@pytest.mark.parametrize("check", _checks("value", VALUE_CASES), ids=lambda c: c.id)
def test_value_cases_pass_on_tvm(check):
    rec = run_check(check, "tvm")
    assert (rec.outcome, rec.ran_on) == ("pass", "tvm"), rec.reason


def test_fp8_is_unsupported_with_the_reason():
    from glmport.export.tvm_ops import op_module

    check = _checks("value", ("lightning_indexer-tiny-float8_e4m3fn",))[0]
    rec = run_check(check, "tvm")
    assert rec.outcome == "unsupported" and "float8_e4m3fn" in rec.reason
    # Called directly (no capability in the way), the lowering says what and why.
    with pytest.raises(UnsupportedError, match=r"lightning_indexer: float8 input .*llvm"):
        op_module("lightning_indexer", check.case.args())
    x = torch.randn(4, 64)
    with pytest.raises(UnsupportedError, match="quantize: format fp8_group returns float8"):
        op_module("quantize", (x, "fp8_group", 32))


def test_symbolic_sizes_share_one_compiled_module_and_views_cross():
    from glmport.export.tvm_backend import COMPILED

    kernel = glmport.get_backend("tvm").load_kernels(False)["rms_norm"]
    before = len(COMPILED)
    for shape in ((3, 4, 32), (1, 7, 96)):
        # A view one element into its storage: not 64-byte aligned, which TVM's DLPack
        # import refuses unless the backend copies it.
        x = torch.randn(torch.Size(shape).numel() + 1, dtype=torch.bfloat16)[1:].view(shape)
        w = torch.rand(shape[-1]) + 0.5
        with glmport.use_backend("cpu"):
            want = ops.rms_norm(x, w.bfloat16(), 1e-6)
        got = kernel(x, w.bfloat16(), 1e-6)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert len(COMPILED) == before + 1


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# Valid calls with a reduced axis of size 0 under a nonempty output, or a 0-size tensor
# whose torch strides are not compact (each with its closed-form result). TVM's lowered
# reductions initialise their output inside the loop over the reduced axis, so these
# returned uninitialised memory (or crashed) until the emitters selected the neutral value.
EMPTY_AXIS_CASES = {
    "moe_dispatch: no token, offsets 0": (
        lambda: ops.moe_dispatch(torch.randn(0, 5), torch.zeros(0, 2, dtype=torch.long), 3)[1],
        lambda: _i32(0, 0, 0, 0),
    ),
    "moe_dispatch: rows of 0 columns": (
        lambda: ops.moe_dispatch(torch.randn(3, 0), torch.tensor([[0, 1], [1, 1], [0, 0]]), 2)[2],
        lambda: _i32(0, 4, 5, 1, 2, 3),
    ),
    "sparse_attention: no slot per query": (
        lambda: ops.sparse_attention(
            torch.randn(3, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 3), _i32().view(3, 0), 0.5
        ),
        lambda: (torch.zeros(3, 2, 3), torch.full((3, 2), float("-inf"))),
    ),
    "indexer_logits: head dim 0": (
        lambda: ops.indexer_logits(
            torch.randn(2, 3, 0), torch.randn(4, 0), torch.rand(2, 3), _i32(0, 1), _i32(3, 4)
        ),
        lambda: torch.tensor([[0.0, 0.0, 0.0, float("-inf")], [float("-inf"), 0.0, 0.0, 0.0]]),
    ),
    "grouped_gemm: K = 0": (
        lambda: ops.grouped_gemm(torch.randn(3, 0), torch.randn(2, 4, 0), _i32(0, 1, 3)),
        lambda: torch.zeros(3, 4),
    ),
}


@pytest.mark.parametrize("case", EMPTY_AXIS_CASES)
def test_reductions_over_an_empty_axis_give_the_neutral_value(case):
    call, expected = EMPTY_AXIS_CASES[case]
    with glmport.use_backend("tvm"):
        got = call()
    torch.testing.assert_close(got, expected(), rtol=0, atol=0)


class _Block(torch.nn.Module):
    """Norm, rope, router, sparse attention and log-probs, as a model calls them."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm = torch.nn.Parameter(torch.rand(32, generator=gen) + 0.5)
        self.router = torch.nn.Parameter(torch.randn(8, 32, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(50, 32, generator=gen))

    def forward(self, x, cos, sin, cache, indices, targets):
        t = x.shape[0]
        h = ops.rope(ops.rms_norm(x, self.norm, 1e-6).view(t, 2, 16), cos, sin)
        weights, ids = ops.moe_gate(h.reshape(t, 32) @ self.router.T, None, 2)
        out, lse = ops.sparse_attention(h, cache, cache, indices, 0.25)
        mixed = out.reshape(t, 32) * weights.sum(-1, keepdim=True)
        logp, entropy = ops.token_logprobs(mixed, self.head, targets, 0.8)
        return logp, entropy, lse, ids


def _block_inputs(t: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(-1, n, (t, 6), generator=gen, dtype=torch.int32)
    indices[0] = -1  # an empty row: out 0, lse -inf
    return (
        torch.randn(t, 32, generator=gen),
        torch.rand(t, 8, generator=gen),
        torch.rand(t, 8, generator=gen),
        torch.randn(n, 2, 16, generator=gen),
        indices,
        torch.randint(0, 50, (t,), generator=gen),
    )


def test_exported_program_runs_in_the_relax_vm():
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    from glmport.export.tvm_ops import convert_map

    block = _Block().eval()
    tokens = torch.export.Dim("T", min=2, max=64)
    dynamic = ({0: tokens}, {0: tokens}, {0: tokens}, None, {0: tokens}, {0: tokens})
    program = torch.export.export(block, _block_inputs(5, 9, 1), dynamic_shapes=dynamic)
    mod = from_exported_program(program, custom_convert_map=convert_map())
    executable = tvm.compile(relax.get_pipeline("zero")(mod), target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    for t in (5, 3):  # one module, token count symbolic
        args = _block_inputs(t, 9, t)
        got = vm["main"](*[tvm.runtime.from_dlpack(a) for a in args])
        with torch.no_grad():
            want = block(*args)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            g = torch.from_dlpack(g)
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        assert torch.isneginf(want[2][0]).all()


def test_glmport_does_not_import_tvm():
    code = (
        "import sys, glmport\n"
        "from glmport.core.registry import REGISTRY\n"
        "assert 'tvm' in glmport.backend_names()\n"
        "assert REGISTRY.availability('tvm', False).ok\n"
        "assert not [m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
