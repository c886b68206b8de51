"""The cuda backend under ``GLMPORT_EMULATE=1``: every op runs its own Triton kernels
through the interpreter (no silent fallback to generic or cpu), ``glmport info`` says
cuda serves every op, a process keeps to one Triton mode, and the tiny GLM-5 runs end
to end on it (logits against the cpu backend, greedy tokens)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from hang_guard import guard_s

import glmport
from glmport.cli import main
from glmport.conformance.cases import all_cases
from glmport.core.registry import REGISTRY
from glmport.core.selection import resolve
from glmport.core.specs import OP_NAMES

pytestmark = pytest.mark.usefixtures("one_thread")

# The kernel module each op's own Triton kernels live in (GEMMs also launch the
# activation-quantisation kernels of ``quant``).
FAMILY = {
    "lightning_indexer": "indexer",
    "indexer_logits": "indexer",
    "sparse_attention": "attention",
    "moe_gate": "moe",
    "moe_dispatch": "moe",
    "moe_combine": "moe",
    "grouped_gemm": "gemm",
    "quantize": "quant",
    "quant_gemm": "gemm",
    "rms_norm": "norm_rope",
    "rope": "norm_rope",
    "token_logprobs": "logprobs",
    "mla_prolog": "mla",
}
PACKAGE = "glmport.backends.cuda"


@pytest.fixture
def launches(monkeypatch, cuda_module):
    """Names (``module.function``) of the Triton kernels the interpreter launches."""
    cuda_module("runtime")
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[str] = []
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        seen.append(f"{self.fn.__module__}.{self.fn.__name__}")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def _cases(op: str) -> list:
    """The op's tiny conformance cases in float32 and bfloat16 (every scheme for the
    GEMMs and formats for quantize), and its fp8 case where it has one."""
    mine = [c for c in all_cases(ops=(op,)) if c.family == "tiny"]
    return [c for c in mine if c.dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_op_runs_its_own_triton_kernels_under_the_interpreter(op, launches, caplog):
    cases = _cases(op)
    assert cases, f"no tiny case for {op}"
    selected = glmport.use_backend("cuda", emulate=True)
    with caplog.at_level(logging.WARNING, logger="glmport"), selected:
        for case in cases:
            res = resolve(op)
            assert res.backend == "cuda" and res.device_type == "cpu"
            before = len(launches)
            getattr(glmport.ops, op)(*case.args())
            ran = launches[before:]
            assert ran, f"{case.id}: no Triton kernel ran"
            assert all(name.startswith(f"{PACKAGE}.") for name in ran), ran
            assert any(name.startswith(f"{PACKAGE}.{FAMILY[op]}.") for name in ran), ran
    assert not [r for r in caplog.records if "falling back" in r.getMessage()]


def test_info_shows_cuda_serving_every_op_in_emulation(capsys, cuda_module):
    assert main(["info", "--backend", "cuda", "--emulate", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["emulate"] and info["selected_backend"] == "cuda"
    served = {op: row["backend"] for op, row in info["ops"].items() if op in OP_NAMES}
    assert served == dict.fromkeys(OP_NAMES, "cuda")
    cuda = next(b for b in info["backends"] if b["name"] == "cuda")
    assert cuda["available"] and cuda["emulated"] and "interpreter" in cuda["reason"]
    assert "not verified on a GPU" in cuda["verified"]


def _probe_in_fresh_process(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLMPORT_", "TRITON_"))}
    report = "a = REGISTRY.availability('cuda', True); print(a.ok, '|', a.reason)"
    proc = subprocess.run(
        [sys.executable, "-c", f"{code}\nfrom glmport.core.registry import REGISTRY\n{report}"],
        env=env, capture_output=True, text=True, timeout=guard_s(20),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_one_triton_mode_per_process(cuda_module):
    """Triton defines its own helpers when first imported, in one mode: emulation
    selected first sets TRITON_INTERPRET itself; after a compiled import it says why it
    cannot run instead of failing inside a kernel."""
    assert _probe_in_fresh_process("import glmport").startswith("True |")
    late = _probe_in_fresh_process("import triton, glmport")
    assert late.startswith("False |") and "imported compiled" in late
    REGISTRY.kernels("cuda", True)  # this process: interpreted, so never compiled
    assert not REGISTRY.get("cuda").probe(False).ok


# -- the tiny GLM-5 end to end -------------------------------------------------------


def _model():
    from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(index_n_heads=16), seed=0)
    with torch.no_grad():  # peaked logits and real index selections (tests/test_model_*)
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


def test_tiny_glm5_logits_and_greedy_tokens_equal_the_cpu_backend(launches):
    from glmport.model.generation import generate

    model = _model()
    ids = torch.tensor([[5, 17, 33, 2, 90, 11, 7, 3, 1, 4]])
    prompts = [[5, 17, 33, 2, 90, 11, 7], [42]]
    with torch.no_grad():
        with glmport.use_backend("cpu"):
            want = model(ids).logits
            want_tokens = generate(model, prompts, 4, block_size=4).output_ids
        with glmport.use_backend("cuda", emulate=True):
            got = model(ids).logits
            got_tokens = generate(model, prompts, 4, block_size=4).output_ids
    ran = {name.split(".")[3] for name in launches}
    assert {"attention", "indexer", "moe", "gemm", "norm_rope"} <= ran, ran
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4, err
    assert got_tokens == want_tokens
