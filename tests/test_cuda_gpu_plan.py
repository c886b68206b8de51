"""What a GPU would execute of the cuda backend, run in CI under Triton's interpreter.

The interpreter normally runs one large-block config per kernel and the interpreter
branch of every host heuristic. Inside ``runtime.gpu_plan`` the host code plans for an
H200 (132 SMs: head blocks, decode splits, GPU tiles and chunks, the 16-bit dot dtype
with its operands rounded as tensor cores take them) and every launch takes the GPU
autotune config the plan names. Here every config of every tuned kernel meets the
float64 reference on the tiny conformance cases of the ops that launch it, and the
GLM-5-shaped cases run the GPU branches (the latent path of 64 heads, two head blocks in
float32, the split decode path, bf16 dots) with their tolerances unchanged.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

# interpreted: conftest set TRITON_INTERPRET
from glmport.backends.cuda.runtime import row_invariant_dot, to_dot
from glmport.conformance.runner import run_check, suite_checks

pytestmark = pytest.mark.usefixtures("one_thread")

# Which ops launch each tuned kernel (runtime.kernel_name -> ops).
KERNEL_OPS = {
    "attention._attention_kernel": ("sparse_attention",),
    "attention._combine_kernel": ("sparse_attention",),
    "indexer._logits_kernel": ("indexer_logits",),
    "indexer._lightning_kernel": ("lightning_indexer",),
    "quant._quantize_kernel": ("quantize",),
    "gemm._gemm_kernel": ("quant_gemm", "grouped_gemm"),
    "moe._gate_kernel": ("moe_gate",),
    "moe._dispatch_scan_kernel": ("moe_dispatch",),
    "moe._gather_rows_kernel": ("moe_dispatch",),
    "moe._combine_kernel": ("moe_combine",),
    "norm_rope._rms_norm_kernel": ("rms_norm",),
    "norm_rope._rope_kernel": ("rope",),
    "logprobs._vocab_stats_kernel": ("token_logprobs",),
    "logprobs._combine_kernel": ("token_logprobs",),
    "mla._prolog_rows_kernel": ("mla_prolog",),
}
# Config counts as the kernels declare them (the test below checks they agree), so
# that every (kernel, config) pair is its own test for pytest-xdist to spread.
CONFIG_COUNTS = {
    "attention._attention_kernel": 4,
    "attention._combine_kernel": 3,
    "indexer._logits_kernel": 5,
    "indexer._lightning_kernel": 3,
    "quant._quantize_kernel": 2,
    "gemm._gemm_kernel": 5,
    "moe._gate_kernel": 4,
    "moe._dispatch_scan_kernel": 3,
    "moe._gather_rows_kernel": 3,
    "moe._combine_kernel": 3,
    "norm_rope._rms_norm_kernel": 3,
    "norm_rope._rope_kernel": 3,
    "logprobs._vocab_stats_kernel": 4,
    "logprobs._combine_kernel": 1,
    "mla._prolog_rows_kernel": 3,
}
VALUE_CHECKS = [c for c in suite_checks() if c.kind == "value" and c.case.layout is None]
GLM5_CHECKS = [c for c in VALUE_CHECKS if c.case.family == "glm5"]


@pytest.fixture
def runtime(cuda_module):
    """The kernels' runtime with every kernel module imported (all tuned kernels known)."""
    for name in ("attention", "indexer", "quant", "gemm", "moe", "norm_rope", "logprobs", "mla"):
        cuda_module(name)
    return cuda_module("runtime")


@pytest.fixture
def launches(monkeypatch, runtime):
    """``(kernel name, launch keywords)`` of every interpreted launch."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        seen.append((runtime.kernel_name(self), kwargs))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def _passes(check) -> None:
    rec = run_check(check, "cuda", emulate=True)
    assert rec.own, f"{check.id} ran on {rec.ran_on}"
    assert rec.outcome == "pass", f"{check.id}: {rec.outcome}: {rec.reason}"


def test_the_tables_name_every_tuned_kernel_and_config(runtime):
    assert {k: len(v) for k, v in runtime.TUNED_CONFIGS.items()} == CONFIG_COUNTS
    assert set(KERNEL_OPS) == set(CONFIG_COUNTS)


@pytest.mark.parametrize(
    ("kernel", "index"),
    [(k, i) for k, n in CONFIG_COUNTS.items() for i in range(n)],
    ids=[f"{k}-{i}" for k, n in CONFIG_COUNTS.items() for i in range(n)],
)
def test_every_gpu_config_meets_the_reference(
    kernel, index, runtime, launches, cuda_module, monkeypatch
):
    checks = [
        c for c in VALUE_CHECKS if c.case.op in KERNEL_OPS[kernel] and c.case.family == "tiny"
    ]
    assert checks, kernel
    with runtime.gpu_plan(configs={kernel: index}):
        for check in checks:
            _passes(check)
        if kernel.startswith("attention."):  # and split decoding, in splits of 4 slots
            monkeypatch.setattr(cuda_module("attention"), "_MIN_SPLIT", 4)
            for check in checks:
                _passes(check)
    meta = runtime.TUNED_CONFIGS[kernel][index].kwargs
    mine = [kw for name, kw in launches if name == kernel]
    assert mine, f"no launch of {kernel}"
    assert all(kw[key] == value for kw in mine for key, value in meta.items()), (kernel, meta)


@pytest.mark.parametrize("check", GLM5_CHECKS, ids=[c.id for c in GLM5_CHECKS])
def test_glm5_shapes_on_the_gpu_plan(check, runtime):
    with runtime.gpu_plan():
        _passes(check)


def _attention_launches(launches) -> list[dict]:
    return [kw for name, kw in launches if name == "attention._attention_kernel"]


def test_latent_attention_one_program_for_64_heads_split_decode_bf16_dots(runtime, launches):
    """Absorbed MLA in bf16 on a GPU: one program holds all 64 heads and gathers each
    latent row once (SHARED_V), and a two-token batch fills an H200 only through
    splits of the index row (16 of 128 slots each, partials and a combine); the
    interpreter's own plan (4 stand-in SMs) takes 2 splits and float32 dots."""
    check = next(c for c in GLM5_CHECKS if c.id == "sparse_attention-glm5_absorbed-bfloat16")
    with runtime.gpu_plan():
        _passes(check)
    (attention,) = _attention_launches(launches)
    assert attention["HEAD_BLOCKS"] == 1 and attention["BLOCK_H"] == 64
    assert attention["SHARED_V"] and attention["PARTIAL"] and attention["grid"][2] == 16
    assert attention["DOT_DTYPE"] == tl.bfloat16
    assert any(name == "attention._combine_kernel" for name, _ in launches)
    launches.clear()
    _passes(check)
    (attention,) = _attention_launches(launches)
    assert attention["grid"][2] == 2 and attention["DOT_DTYPE"] == tl.float32


def test_float32_attention_takes_two_head_blocks(runtime, launches):
    """Float32 dots are FMA: its accumulator must fit in registers, 32 heads x 512 a
    program, so GLM-5's 64 heads take two head blocks on a GPU."""
    check = next(c for c in GLM5_CHECKS if c.id == "sparse_attention-glm5_absorbed-float32")
    with runtime.gpu_plan():
        _passes(check)
    (attention,) = _attention_launches(launches)
    assert attention["HEAD_BLOCKS"] == 2 and attention["BLOCK_H"] == 32


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, DOT: tl.constexpr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    out = tl.dot(to_dot(a, DOT), to_dot(b, DOT))
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], out)


def test_to_dot_rounds_operands_as_tensor_cores_take_them():
    """A bf16 dot of float32 operands sees them rounded to bf16 (nearest even): the
    emulated product of 1 + 2**-9 (not a bf16 value) and 1 is 1, not 1 + 2**-9."""
    a = torch.zeros(16, 16)
    a[0, 0] = 1 + 2**-9
    b = torch.eye(16)
    for dot, expected in ((tl.bfloat16, 1.0), (tl.float16, 1 + 2**-9), (tl.float32, 1 + 2**-9)):
        out = torch.empty(16, 16)
        _dot_kernel[(1,)](a, b, out, dot)
        assert out[0, 0].item() == expected, dot


@triton.jit
def _rows_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, M: tl.constexpr):
    n, k, m = tl.arange(0, N), tl.arange(0, K), tl.arange(0, M)
    a = tl.load(a_ptr + n[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * M + m[None, :])
    tl.store(out_ptr + n[:, None] * M + m[None, :], row_invariant_dot(a, b, IEEE=True))


def test_identical_rows_give_identical_dots_as_on_a_gpu():
    """The indexer's top-k breaks exact ties by slot, which needs identical keys to
    score bit-identically; the interpreter's float32 ``tl.dot`` (numpy's BLAS) gives
    rows 650 apart different last bits at this shape (8 columns), ``row_invariant_dot``
    does not, and stays within float32 rounding of the float64 product."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 32, generator=g)
    a[650:] = a[:374]
    b = torch.randn(32, 8, generator=g)
    out = torch.empty(1024, 8)
    _rows_kernel[(1,)](a, b, out, 1024, 32, 8)
    assert torch.equal(out[650:], out[:374])
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-6)


def test_gpu_plan_refuses_unknown_kernels_and_configs(runtime):
    unknown = runtime.gpu_plan(configs={"attention._nope": 0})
    with pytest.raises(KeyError, match=r"no tuned kernel 'attention\._nope'"), unknown:
        pass
    past_the_end = runtime.gpu_plan(configs={"attention._attention_kernel": 4})
    with pytest.raises(IndexError, match="has 4 configs, not index 4"), past_the_end:
        pass
    assert runtime.interpreter_plan()  # nothing left behind
