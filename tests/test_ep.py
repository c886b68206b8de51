"""Expert parallelism over gloo on loopback: 2 and 4 CPU processes, each holding
E / world experts, reproduce the single-process MoE forward and its gradients."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import glmport

TOKENS_PER_RANK, D, F, E, K = 6, 16, 12, 8, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from glmport.backends.generic.ep import ExpertParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)  # every rank builds the same global batch
        t_all = TOKENS_PER_RANK * world
        x_all = torch.randn(t_all, D, generator=gen)
        w = torch.randn(E, F, D, generator=gen)
        weights, ids = glmport.ops.moe_gate(torch.randn(t_all, E, generator=gen), None, K)
        cot = torch.randn(t_all, F, generator=gen)

        x_ref = x_all.clone().requires_grad_()
        xs, off, src = glmport.ops.moe_dispatch(x_ref, ids, E)
        ref = glmport.ops.moe_combine(glmport.ops.grouped_gemm(xs, w, off), src, weights)
        (ref * cot).sum().backward()

        mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        x = x_all[mine].clone().requires_grad_()
        ep = ExpertParallel(E)
        x_local, offsets, handle = ep.dispatch(x, ids[mine])
        w_mine = w[ep.first_expert : ep.first_expert + ep.local_experts]
        out = ep.combine(glmport.ops.grouped_gemm(x_local, w_mine, offsets), handle, weights[mine])
        (out * cot[mine]).sum().backward()

        result = {
            "rows_here": x_local.shape[0],
            "out_err": float((out - ref[mine]).abs().max()),
            "grad_err": float((x.grad - x_ref.grad[mine]).abs().max()),
            "scale": float(ref.abs().max()),
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(tmp_path, world):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert sum(r["rows_here"] for r in results) == TOKENS_PER_RANK * world * K
    for r in results:
        assert r["out_err"] <= 1e-5 * r["scale"], r
        assert r["grad_err"] <= 1e-5 * max(1.0, r["scale"]), r


def test_expert_parallel_needs_an_initialised_group():
    from glmport.backends.generic.ep import ExpertParallel

    with pytest.raises(glmport.ConfigError, match="init_process_group"):
        ExpertParallel(8)
