"""The ascend backend as a whole: chip generations, the probe on machines with and
without torch_npu (a stand-in module: torch_npu is never installed here), every op
served by its adapter under ``GLMPORT_EMULATE=1`` (the emulated torch_npu op really
called, no silent fallback), inputs outside the chip limits falling back to generic
with one log line, ``glmport info``, and the tiny GLM-5 end to end."""

from __future__ import annotations

import importlib.machinery
import json
import logging
import sys
import types

import pytest
import torch

import glmport
from glmport.backends.ascend import BACKEND, emulator, gemm
from glmport.backends.ascend.chips import (
    chip_generation,
    indexer_takes_any_heads,
    torch_npu_release,
)
from glmport.cli import main
from glmport.conformance.cases import all_cases
from glmport.core import selection
from glmport.core.extras import pip_command
from glmport.core.selection import resolve
from glmport.core.specs import SPECS

# The ops (expert_parallel, a component, is tested in tests/test_ascend_ep.py).
ASCEND_OPS = tuple(op for op in BACKEND.manifest.ops if op in SPECS)


@pytest.mark.parametrize(
    ("soc", "generation"),
    [
        ("Ascend910B1", "A2"),
        ("Ascend910B4-1", "A2"),
        ("Ascend910B2C", "A2"),
        ("Ascend910_9391", "A3"),
        ("Ascend910_9362", "A3"),
        ("Ascend950PR_9579", "A5"),
        ("Ascend310P3", "310P"),
        ("Ascend910B", "910"),
        ("Ascend910ProB", "910"),
        ("GeForce", None),
    ],
)
def test_chip_generation_from_the_soc_name(soc, generation):
    assert chip_generation(soc) == generation


@pytest.mark.parametrize(
    ("package", "release", "any_heads"),
    [  # Ascend/pytorch COMPATIBILITY.md: package version -> TorchNPU release
        ("2.12.0", (26, 1, 0), True),
        ("2.11.0.post2", (26, 1, 0), True),
        ("2.10.0.post4", (26, 1, 0), True),
        ("2.10.0", (26, 0, 0), False),
        ("2.9.0.post6", (26, 1, 0), True),
        ("2.9.0.post2", (26, 0, 0), False),
        ("2.9.0", (7, 3, 0), False),
        ("2.8.0.post4", (26, 0, 0), False),
        ("2.8.0.post2", (7, 3, 0), False),
        ("2.7.1.post10", (26, 1, 0), True),
        ("2.7.1.post4+gitabc", (26, 0, 0), False),
        ("2.6.0.post5", (7, 3, 0), False),
        ("2.5.1", (7, 0, 0), False),
        ("2.13.0", (26, 1, 0), True),  # newer than the table: its newest release
        ("2.1.0.post17", None, False),  # older than the table
        ("dev", None, False),
    ],
)
def test_the_torch_npu_version_names_its_release_and_indexer_contract(package, release, any_heads):
    assert torch_npu_release(package) == release
    assert indexer_takes_any_heads(package) is any_heads


def test_without_torch_npu_the_probe_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and pip_command(["ascend"], ["torch-npu"]) in avail.reason
    assert "GLMPORT_EMULATE=1" in avail.reason


def _fake_torch_npu(monkeypatch, soc: str, *, available: bool = True, lacks: tuple = ()):
    """Install a stand-in ``torch_npu`` module and ``torch.npu`` reporting ``soc``."""
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    fake.__version__ = "2.11.0.post1"
    for name in emulator.OPS:
        if name not in lacks:
            setattr(fake, name, getattr(emulator, name))
    device = types.SimpleNamespace(is_available=lambda: available, get_device_name=lambda: soc)
    fake.npu = device  # torch_npu.npu is the module torch.npu names
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", device, raising=False)
    # The start-up check's tensors: the stand-in's ops are the emulator's (CPU).
    monkeypatch.setattr("glmport.backends.ascend.npu_device", lambda: torch.device("cpu"))
    return fake


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9391"])
def test_the_probe_accepts_atlas_a2_and_a3(monkeypatch, soc):
    _fake_torch_npu(monkeypatch, soc)
    avail = BACKEND.probe(emulate=False)
    assert avail.ok and not avail.emulated
    assert soc in avail.reason and "torch_npu 2.11.0.post1" in avail.reason
    # The start-up check ran and its findings are in the reason.
    assert "indexer N1 <= 64, fp32 weights, batch-relative indices" in avail.reason


def test_the_probe_reports_an_older_indexer_contract_and_global_positions(monkeypatch):
    fake = _fake_torch_npu(monkeypatch, "Ascend910B3")
    fake.__version__ = "2.9.0"  # TorchNPU 7.3.0: the pages before 2026-03
    with emulator.emulated_build(emulator.EmulatedBuild("2.9.0", indexer_positions="global")):
        avail = BACKEND.probe(emulate=False)
    assert avail.ok and "indexer N1 = 64 only, global-relative indices" in avail.reason


def test_a_start_up_check_answered_in_no_known_convention_refuses_the_npu(monkeypatch):
    fake = _fake_torch_npu(monkeypatch, "Ascend910_9391")

    def stale(query, key, weights, **kwargs):
        indices = torch.zeros(query.shape[0], 1, kwargs["sparse_count"], dtype=torch.int32)
        return indices, query.new_empty(0)

    fake.npu_lightning_indexer = stale
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and "start-up check failed" in avail.reason
    assert "npu_lightning_indexer" in avail.reason and "[0, 0]" in avail.reason


def test_a_prolog_start_up_check_answered_in_no_known_convention_refuses_an_a3(monkeypatch):
    fake = _fake_torch_npu(monkeypatch, "Ascend910_9391")

    def unrotated(token_x, *args, **kwargs):
        args[9][..., 0] = 1  # kr_cache: the key's rope input, not rotated
        t, heads = token_x.shape[0], args[2].shape[0]
        query_rope = torch.ones(t, heads, 64, dtype=torch.bfloat16)
        return torch.zeros(t, heads, 512, dtype=torch.bfloat16), query_rope, None, None, None

    fake.npu_mla_prolog_v3 = unrotated
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and "start-up check failed" in avail.reason
    assert "npu_mla_prolog_v3" in avail.reason and "columns [0]" in avail.reason


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend950PR_9579", "Ascend910ProB", "Mystery1"])
def test_the_probe_refuses_other_chip_generations_naming_them(monkeypatch, soc):
    _fake_torch_npu(monkeypatch, soc)
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and soc in avail.reason and "A2, A3" in avail.reason


def test_the_probe_names_the_torch_npu_ops_an_old_version_lacks(monkeypatch):
    _fake_torch_npu(monkeypatch, "Ascend910B3", lacks=("npu_lightning_indexer",))
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and "lacks npu_lightning_indexer" in avail.reason


def test_the_probe_reports_no_visible_npu(monkeypatch):
    _fake_torch_npu(monkeypatch, "Ascend910B3", available=False)
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and "found no NPU" in avail.reason


def test_a_torch_npu_that_fails_to_import_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: importlib.machinery.ModuleSpec(name, None),
    )

    def broken(name, *args):
        raise ImportError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr("importlib.import_module", broken)
    avail = BACKEND.probe(emulate=False)
    assert not avail.ok and "libhccl.so" in avail.reason and "set_env.sh" in avail.reason


# -- the adapters under emulation ----------------------------------------------------

# The torch_npu op(s) each glmport op's adapter calls (quant_gemm: W8A8 / W4A16).
NPU_CALLS = {
    "lightning_indexer": {"npu_lightning_indexer"},
    "indexer_logits": {"npu_lightning_indexer"},
    "sparse_attention": {"npu_sparse_flash_attention"},
    "moe_gate": {"npu_moe_gating_top_k"},
    "moe_dispatch": {"npu_moe_init_routing_v2"},
    "moe_combine": {"npu_moe_token_unpermute"},
    "grouped_gemm": {"npu_grouped_matmul"},
    "quant_gemm": {"npu_quant_matmul", "npu_weight_quant_batchmatmul"},
    "rms_norm": {"npu_rms_norm"},
    "rope": {"npu_rotary_mul"},
    "mla_prolog": {"npu_mla_prolog_v3", "npu_format_cast"},
}
COMPONENT_CALLS = {
    "expert_parallel": {"npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"},
}


class NpuCalls(list):
    """Names of the emulated torch_npu ops called, in order, and each call's keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.keywords: list[dict] = []


@pytest.fixture
def npu_calls(monkeypatch):
    seen = NpuCalls()
    for name in emulator.OPS:
        op = getattr(emulator, name)

        def recording(*args, _name=name, _op=op, **kwargs):
            seen.append(_name)
            seen.keywords.append(kwargs)
            return _op(*args, **kwargs)

        monkeypatch.setattr(emulator, name, recording)
    return seen


@pytest.fixture
def fresh_fallback_log(monkeypatch):
    """Fallback lines are logged once per process; start this test with none logged."""
    monkeypatch.setattr(selection, "_logged_fallbacks", set())


def _inside_limits(op: str) -> list:
    cap = BACKEND.manifest.capabilities.get(op)
    return [
        c
        for c in all_cases(ops=(op,))
        if cap is None or cap.refusal(SPECS[op].features(*c.args())) is None
    ]


def test_the_manifest_names_an_npu_op_for_every_declared_op():
    assert {*NPU_CALLS, *COMPONENT_CALLS} == set(BACKEND.manifest.ops)
    calls = {**NPU_CALLS, **COMPONENT_CALLS}.values()
    assert set().union(*calls) == set(emulator.OPS) - {
        "npu_convert_weight_to_int4pack"  # load time only: prepare_weight
    }


def _routed_to_generic_inside_the_adapter(op: str, args: tuple) -> bool:
    """The value-dependent calls the GEMM adapters document running on the generic
    composite (no capability feature says them): int4 K / group sizes the ops refuse,
    and a quantised grouped GEMM with float32 activations (``npu_grouped_matmul`` takes
    float32 ``x`` with float weights only; the capability's dtype limit cannot say
    "with a scheme")."""
    if op == "quant_gemm" and args[3] == "w4a16":
        k = args[0].shape[1]
        return not gemm._wqbmm_takes(k, k // args[2].shape[1])
    if op == "grouped_gemm" and args[4] != "none":
        return args[0].dtype == torch.float32 or (
            args[4] == "w4a16" and not gemm._gmm_int4_takes(args[0].shape[1])
        )
    return False


@pytest.mark.parametrize("op", ASCEND_OPS)
def test_every_op_runs_its_adapter_on_the_emulated_torch_npu_op(
    op, npu_calls, fresh_fallback_log, caplog
):
    cases = _inside_limits(op)
    assert cases, f"no conformance case of {op} inside ascend's limits"
    with (
        caplog.at_level(logging.WARNING, logger="glmport"),
        glmport.use_backend("ascend", emulate=True),
    ):
        routed = False
        for case in cases:
            res = resolve(op)
            assert res.backend == "ascend" and res.device_type == "cpu"
            before = len(npu_calls)
            args = case.args()
            getattr(glmport.ops, op)(*args)
            called = set(npu_calls[before:])
            if _routed_to_generic_inside_the_adapter(op, args):
                assert not called, (case.id, called)
                routed = True
            else:
                assert called and called <= NPU_CALLS[op], (case.id, called)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    # Only the adapter's own value-dependent routes to generic, each said once per op.
    assert len(lines) == int(routed), lines
    assert all(f"in '{op}'; falling back to 'generic'" in line for line in lines), lines


def test_an_input_outside_the_chip_limits_falls_back_to_generic_with_one_log_line(
    npu_calls, fresh_fallback_log, caplog
):
    """The indexer op takes head dim 128 only (torch_npu-npu_lightning_indexer.md):
    a 64-dim indexer runs on the generic backend, logged once, never reaching the op —
    which would raise for it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 8, 64, generator=g).bfloat16()
    k = torch.randn(20, 64, generator=g).bfloat16()
    w = torch.randn(6, 8, generator=g)
    start = torch.zeros(6, dtype=torch.int32)
    end = torch.arange(15, 21, dtype=torch.int32)
    with pytest.raises(emulator.NpuContractError, match="128"):
        emulator.npu_lightning_indexer(
            q, k[:, None], w, actual_seq_lengths_query=torch.tensor([6], dtype=torch.int32),
            actual_seq_lengths_key=torch.tensor([20], dtype=torch.int32),
            layout_query="TND", layout_key="TND", sparse_count=4,
        )  # fmt: skip
    called_directly = len(npu_calls)
    with caplog.at_level(logging.WARNING, logger="glmport"):
        with glmport.use_backend("ascend", emulate=True):
            got = [glmport.ops.lightning_indexer(q, k, w, start, end, 4) for _ in range(2)]
        with glmport.use_backend("generic"):
            want = glmport.ops.lightning_indexer(q, k, w, start, end, 4)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert lines == [
        "glmport: backend 'ascend' cannot take head_dim 64 (it takes 128) in "
        "'lightning_indexer'; falling back to 'generic'"
    ]
    assert npu_calls[called_directly:] == []
    for indices, scores in got:
        assert torch.equal(indices, want[0]) and torch.equal(scores, want[1])


def test_info_shows_ascend_serving_its_ops_in_emulation(capsys):
    assert main(["info", "--backend", "ascend", "--emulate", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["emulate"] and info["selected_backend"] == "ascend"
    served = {op: row["backend"] for op, row in info["ops"].items() if op in SPECS}
    assert {op for op, b in served.items() if b == "ascend"} == set(ASCEND_OPS)
    assert {op for op, b in served.items() if b != "ascend"} == {"quantize", "token_logprobs"}
    ascend = next(b for b in info["backends"] if b["name"] == "ascend")
    assert ascend["available"] and ascend["emulated"] and "emulator" in ascend["reason"]
    assert "not verified on Ascend hardware" in ascend["verified"]


# -- the tiny GLM-5 end to end -------------------------------------------------------


def test_tiny_glm5_with_glm5_head_dims_generates_like_the_cpu_backend(npu_calls):
    """bf16, GLM-5's per-head dims (absorbed attention 512 + 64, indexer 128): prefill
    and cached decode, where the absorbed attention runs npu_sparse_flash_attention."""
    from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from glmport.model.generation import generate

    config = GlmMoeDsaConfig.tiny(
        kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, index_n_heads=16
    )
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    with torch.no_grad():  # peaked logits and real index selections (tests/test_model_*)
        for p in model.parameters():
            p.mul_(4.0)
    model = model.bfloat16().eval()
    prompts = [[5, 17, 33, 2, 90, 11, 7], [42]]
    with torch.no_grad():
        with glmport.use_backend("cpu"):
            want = generate(model, prompts, 4, block_size=16).output_ids
        with glmport.use_backend("ascend", emulate=True):  # pages the indexer op takes
            got = generate(model, prompts, 4, block_size=16).output_ids
    assert got == want
    assert set(npu_calls) >= {
        "npu_sparse_flash_attention", "npu_lightning_indexer", "npu_moe_gating_top_k",
        "npu_moe_init_routing_v2", "npu_moe_token_unpermute", "npu_grouped_matmul",
        "npu_rms_norm", "npu_rotary_mul",
    }  # fmt: skip
    # Generation reads no lse: every attention call runs in the op's inference mode, and
    # the indexer's is the only training-mode keyword left (its scores order each row).
    attention = [kw for n, kw in zip(npu_calls, npu_calls.keywords, strict=True) if "flash" in n]
    assert attention and not any(kw["return_softmax_lse"] for kw in attention)
