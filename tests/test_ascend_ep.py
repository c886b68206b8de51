"""The ascend backend's expert parallelism over the MC2 pair
(``npu_moe_distribute_dispatch_v2`` / ``_combine_v2``), emulated across 2 gloo
processes: inference calls inside the pair's documented limits go through it and match
the float64 single-process MoE; calls outside them (grad mode, float32, a repeated
expert, a width the build does not document, an Atlas A2) make every rank take the
generic all-to-all, never a mix that would hang; the emulator refuses the pair's
documented violations by name."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import glmport
from glmport.backends.ascend import emulator
from glmport.backends.ascend.emulator import mc2
from glmport.backends.ascend.emulator.build import BEFORE_2026_03, EmulatedBuild, emulated_build
from glmport.conformance import ep_case

WORLD, TOKENS, E, K = 2, (5, 7), 8, 3
A2_SOC = "Ascend910B3"
OLD_BUILD = {"version": BEFORE_2026_03}  # a TorchNPU 7.3.0 package


class _Calls:
    """Counts the emulated MC2 calls of one process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = {"dispatch": 0, "combine": 0}
        for kind, name in (("dispatch", "npu_moe_distribute_dispatch_v2"),
                           ("combine", "npu_moe_distribute_combine_v2")):  # fmt: skip
            real = getattr(emulator, name)

            def counted(*args, _real=real, _kind=kind, **kwargs):
                self.count[_kind] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(emulator, name, counted)


def _single_process(x: torch.Tensor, w: torch.Tensor | None, weights, ids) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * w[ids[t, j]] @ x[t]`` in float64, token by token
    (``w`` None: experts that return their rows)."""
    out = []
    for t in range(x.shape[0]):
        rows = [x[t].double() if w is None else w[e].double() @ x[t].double() for e in ids[t]]
        out.append(sum(weights[t, j].double() * row for j, row in enumerate(rows)))
    return torch.stack(out)


def _run(rank: int, scenario: dict) -> dict:
    """One rank of ``scenario``: dispatch -> its experts -> combine on the emulated
    ascend backend; the error against the single-process MoE and the MC2 calls made."""
    gen = torch.Generator().manual_seed(0)
    width, dtype = scenario["width"], getattr(torch, scenario["dtype"])
    x_all = torch.randn(sum(TOKENS), width, generator=gen).to(dtype)
    identity = scenario.get("identity", False)  # experts that return their rows
    w = None if identity else (torch.randn(E, width, width, generator=gen) * width**-0.5).to(dtype)
    weights, ids = glmport.ops.moe_gate(torch.randn(sum(TOKENS), E, generator=gen), None, K)
    if scenario.get("repeat_on_rank") == rank:
        ids = ids.clone()
        ids[sum(TOKENS[:rank]), 1] = ids[sum(TOKENS[:rank]), 0]
    first = sum(TOKENS[:rank])
    mine = slice(first, first + TOKENS[rank])
    mp_ = pytest.MonkeyPatch()
    calls = _Calls(mp_)
    build = EmulatedBuild(**scenario.get("build", {}))
    try:
        with (
            emulated_build(build),
            glmport.use_backend("ascend", emulate=True),
            torch.set_grad_enabled(scenario.get("grad", False)),
        ):
            ep = glmport.expert_parallel(E)
            x = x_all[mine].clone().requires_grad_(scenario.get("grad", False))
            x_local, offsets, handle = ep.dispatch(x, ids[mine])
            if identity:
                y_local = x_local
            else:
                w_mine = w[ep.first_expert : ep.first_expert + ep.local_experts]
                y_local = glmport.ops.grouped_gemm(x_local, w_mine, offsets)
            out = ep.combine(y_local, handle, weights[mine])
            if scenario.get("grad", False):
                out.float().sum().backward()
    finally:
        mp_.undo()
    # A token's output depends on its own routing only, so each rank checks its tokens
    # against the ids it passed (with its own edit, where it made one).
    ref = _single_process(x_all[mine], w, weights[mine], ids[mine])
    result = {
        "calls": calls.count,
        "rows": int(offsets[-1]),
        "dtype": str(out.dtype),
        "grad": x.grad is not None,
    }
    result["err"] = float((out.double() - ref).abs().max() / ref.abs().max())
    return result


def _worker(rank: int, scenarios: list[dict], out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=ep_case.rendezvous(out_dir),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),  # a rank left alone in a collective fails, not hangs
    )
    torch.set_num_threads(1)
    try:
        results = [_run(rank, s) for s in scenarios]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


SCENARIOS = {
    "inference bf16, H 1024": {"width": 1024, "dtype": "bfloat16"},
    "inference fp16, H 1024": {"width": 1024, "dtype": "float16"},
    "GLM-5 width 6144": {"width": 6144, "dtype": "bfloat16", "identity": True},
    "grad mode": {"width": 1024, "dtype": "bfloat16", "grad": True},
    "float32": {"width": 1024, "dtype": "float32"},
    "width 1040 (not a multiple of 32)": {"width": 1040, "dtype": "bfloat16", "identity": True},
    "repeated expert on rank 1 only": {"width": 1024, "dtype": "bfloat16", "repeat_on_rank": 1},
    "a 7.3.0 build at H 1024": {"width": 1024, "dtype": "bfloat16", "build": OLD_BUILD},
    "a 7.3.0 build at H 7168": {
        "width": 7168,
        "dtype": "bfloat16",
        "identity": True,
        "build": OLD_BUILD,
    },
    "Atlas A2": {"width": 1024, "dtype": "bfloat16", "build": {"soc_name": A2_SOC}},
}
THROUGH_MC2 = {
    "inference bf16, H 1024",
    "inference fp16, H 1024",
    "GLM-5 width 6144",
    "a 7.3.0 build at H 7168",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    out_dir = tmp_path_factory.mktemp("mc2")
    scenarios = list(SCENARIOS.values())
    mp.start_processes(
        _worker, (scenarios, str(out_dir)), WORLD, start_method=ep_case.start_method("cpu")
    )
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {name: [ranks[r][i] for r in range(WORLD)] for i, name in enumerate(SCENARIOS)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_path_is_the_same_on_every_rank_and_the_answer_right(results, scenario):
    ranks = results[scenario]
    through = scenario in THROUGH_MC2
    for r in ranks:
        assert r["calls"] == ({"dispatch": 1, "combine": 1} if through else
                              {"dispatch": 0, "combine": 0}), (scenario, r)  # fmt: skip
        tol = 1e-6 if r["dtype"] == "torch.float32" else 1e-2
        assert r["err"] <= tol, (scenario, r)
    assert sum(r["rows"] for r in ranks) == sum(TOKENS) * K
    if SCENARIOS[scenario].get("grad"):
        assert all(r["grad"] for r in ranks)


# -- the emulator's documented refusals (one process: they fail before any exchange) --


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=ep_case.rendezvous(str(tmp_path)), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _dispatch(**overrides):
    args = {
        "x": torch.zeros(4, 1024, dtype=torch.bfloat16),
        "expert_ids": torch.tensor([[0, 1]] * 4, dtype=torch.int32),
        "group_ep": mc2.hccl_comm_name(None),
        "ep_world_size": 2,
        "ep_rank_id": 0,
        "moe_expert_num": 8,
    }
    args.update(overrides)
    return emulator.npu_moe_distribute_dispatch_v2(**args)


REFUSALS = {
    "ep_world_size 1 must be the EP domain's size": {"ep_world_size": 1},
    "x must be bfloat16 / float16": {"x": torch.zeros(4, 1024)},
    "H 512 must be in [1024, 8192]": {"x": torch.zeros(4, 512, dtype=torch.bfloat16)},
    "BS 513 must be in (0, 512]": {
        "x": torch.zeros(513, 1024, dtype=torch.bfloat16),
        "expert_ids": torch.zeros(513, 1, dtype=torch.int32),
    },
    "expert_ids must be int32": {"expert_ids": torch.tensor([[0, 1]] * 4)},
    "K 17 must be in (0, 16]": {"expert_ids": torch.arange(17, dtype=torch.int32).repeat(4, 1)},
    "must not repeat": {"expert_ids": torch.tensor([[1, 1]] * 4, dtype=torch.int32)},
    "expert_ids must lie in [0, 8)": {"expert_ids": torch.tensor([[0, 8]] * 4, dtype=torch.int32)},
    "names no HCCL communicator": {"group_ep": "hccl-nobody"},
    "quant_mode is not emulated": {"quant_mode": 2},
    "expert_scales is not emulated": {"expert_scales": torch.ones(4, 2)},
    "moe_expert_num 1024 must be in [1, 512]": {"moe_expert_num": 1024},
}


@pytest.mark.parametrize("message", list(REFUSALS))
def test_the_emulator_refuses_documented_violations(one_rank_group, message):
    with pytest.raises(emulator.NpuContractError, match="npu_moe_distribute_dispatch_v2") as err:
        _dispatch(**REFUSALS[message])
    assert message in str(err.value)


def test_the_emulator_refuses_an_atlas_a2_and_old_widths(one_rank_group):
    a2 = emulated_build(EmulatedBuild(soc_name=A2_SOC))
    with a2, pytest.raises(emulator.NpuContractError, match="Atlas A3 only"):
        _dispatch()
    old = emulated_build(EmulatedBuild(version=BEFORE_2026_03))
    with old, pytest.raises(emulator.NpuContractError, match="only H = 7168"):
        _dispatch()
