"""Expert parallelism: over gloo on loopback, 2 and 4 CPU processes holding E / world
experts each reproduce the single-process MoE forward and its gradients through
``glmport.expert_parallel`` (generic all-to-all and cpu reference); the selected
backend's factory is the one used, with fallback along the chain; malformed calls
raise the shared errors; the conformance check catches a broken implementation."""

from __future__ import annotations

import json
import os

import ep_backends
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import glmport
from glmport.backends.cpu.ep import GatherExpertParallel
from glmport.backends.generic.ep import AllToAllExpertParallel
from glmport.conformance import ep_case
from glmport.conformance.runner import run_check, suite_checks

TOKENS_PER_RANK, D, F, E, K = 6, 16, 12, 8, 3
BACKENDS = {"generic": AllToAllExpertParallel, "cpu": GatherExpertParallel}


def _worker(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=ep_case.rendezvous(out_dir), rank=rank, world_size=world
    )
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
        results: dict[str, object] = {}
        for backend in BACKENDS:
            with glmport.use_backend(backend):
                x = x_all[mine].clone().requires_grad_()
                ep = glmport.expert_parallel(E)
                x_local, offsets, handle = ep.dispatch(x, ids[mine])
                w_mine = w[ep.first_expert : ep.first_expert + ep.local_experts]
                y_local = glmport.ops.grouped_gemm(x_local, w_mine, offsets)
                out = ep.combine(y_local, handle, weights[mine])
                (out * cot[mine]).sum().backward()
            results[backend] = {
                "implementation": type(ep).__name__,
                "rows_here": x_local.shape[0],
                "out_err": float((out - ref[mine]).abs().max()),
                "grad_err": float((x.grad - x_ref.grad[mine]).abs().max()),
                "scale": float(ref.abs().max()),
            }
        try:
            glmport.expert_parallel(E + 1)
        except glmport.ConfigError as err:
            results["uneven_split_error"] = str(err)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(tmp_path, world):
    # Started like the conformance check's workers (a preloaded fork server on Linux;
    # test_the_conformance_check_works_in_spawned_workers covers spawn).
    args = (world, str(tmp_path))
    mp.start_processes(_worker, args, world, start_method=ep_case.start_method("cpu"))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for backend, implementation in BACKENDS.items():
        mine = [r[backend] for r in results]
        assert {r["implementation"] for r in mine} == {implementation.__name__}
        assert sum(r["rows_here"] for r in mine) == TOKENS_PER_RANK * world * K
        for r in mine:
            assert r["out_err"] <= 1e-5 * r["scale"], (backend, r)
            assert r["grad_err"] <= 1e-5 * max(1.0, r["scale"]), (backend, r)
    for r in results:
        assert (
            f"{E + 1} experts do not split over an EP group of {world}" in (r["uneven_split_error"])
        )


def test_expert_parallel_needs_an_initialised_group():
    with pytest.raises(glmport.ConfigError, match="init_process_group"):
        glmport.expert_parallel(8)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (validation and selection need an
    initialised group, not peers)."""
    dist.init_process_group(
        "gloo", init_method=ep_case.rendezvous(str(tmp_path)), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def ep_test_backends():
    backends = (ep_backends.VendorBackend(), ep_backends.NoEPBackend())
    for b in backends:
        glmport.register_backend(b)
    yield
    for b in backends:
        glmport.unregister_backend(b.manifest.name)


def test_the_selected_backends_factory_builds_the_expert_parallel(one_rank_group, ep_test_backends):
    expected = {
        "ep_vendor": ep_backends.VendorEP,
        "ep_lacking": AllToAllExpertParallel,  # falls back along its chain to generic
        **BACKENDS,
    }
    for backend, implementation in expected.items():
        with glmport.use_backend(backend):
            ep = glmport.expert_parallel(E)
        assert type(ep) is implementation, backend
        assert (ep.num_experts, ep.world, ep.rank, ep.local_experts, ep.first_expert) == (
            E, 1, 0, E, 0
        )  # fmt: skip


def _bad_ids(x: torch.Tensor) -> dict[str, torch.Tensor]:
    t = x.shape[0]
    return {
        "out of range": torch.full((t, K), E, dtype=torch.int32),
        "negative": torch.full((t, K), -1, dtype=torch.int32),
        "1-D": torch.zeros(t * K, dtype=torch.int32),
        "wrong token count": torch.zeros(t + 1, K, dtype=torch.int32),
        "float": torch.zeros(t, K),
        "k = 0": torch.zeros(t, 0, dtype=torch.int32),
    }


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_malformed_calls_raise_the_shared_errors(one_rank_group, backend):
    x = torch.randn(4, D)
    ids = torch.randint(0, E, (4, K), dtype=torch.int32)
    weights = torch.rand(4, K)
    with glmport.use_backend(backend):
        ep = glmport.expert_parallel(E)
        for what, bad in _bad_ids(x).items():
            with pytest.raises(glmport.OpInputError) as err:
                ep.dispatch(x, bad)
            assert (err.value.op, err.value.arg) == ("expert_parallel.dispatch", "ids"), what
        x_local, _, handle = ep.dispatch(x, ids)
        y_local = x_local[:, :F]
        bad_combines = {
            "y_local": (y_local[1:], handle, weights),
            "weights": (y_local, handle, weights.double()),
            "handle": (y_local, glmport.expert_parallel(E).dispatch(x, ids)[2], weights),
        }
        for arg, args in bad_combines.items():
            with pytest.raises(glmport.OpInputError) as err:
                ep.combine(*args)
            assert (err.value.op, err.value.arg) == ("expert_parallel.combine", arg)
        assert ep.combine(y_local, handle, weights).shape == (4, F)


def _ep_records(backend: str):
    return [run_check(c, backend) for c in suite_checks(ops=("expert_parallel",))]


def test_the_conformance_check_passes_honest_implementations(ep_test_backends):
    for backend, ran_on in [("cpu", "cpu"), ("generic", "generic"), ("ep_vendor", "ep_vendor"),
                            ("ep_lacking", "generic")]:  # fmt: skip
        records = _ep_records(backend)
        assert [(r.family, r.dtype) for r in records] == [
            ("tiny", "float32"), ("tiny", "bfloat16"), ("inference", "bfloat16")
        ]  # fmt: skip
        for r in records:
            assert (r.outcome, r.ran_on) == ("pass", ran_on), (backend, r)
            assert r.metrics["max_rel"] <= r.tolerance["max_rel"]


def test_a_dtype_the_implementation_declines_is_unsupported_not_fatal():
    """A raise in the workers ends that run; the remaining dtypes run afresh."""
    backend = ep_backends.Bf16OnlyBackend()
    glmport.register_backend(backend)
    try:
        records = _ep_records(backend.manifest.name)
    finally:
        glmport.unregister_backend(backend.manifest.name)
    outcomes = [(r.family, r.dtype, r.outcome) for r in records]
    assert outcomes == [
        ("tiny", "float32", "unsupported"),
        ("tiny", "bfloat16", "pass"),
        ("inference", "bfloat16", "pass"),
    ], records
    assert "ep_bf16_only dispatches bfloat16 tokens" in records[0].reason


@pytest.mark.parametrize(
    "broken", [ep_backends.DropsLastRankBackend, ep_backends.UniformWeightsBackend]
)
def test_the_conformance_check_catches_a_broken_implementation(broken):
    backend = broken()
    glmport.register_backend(backend)
    try:
        records = _ep_records(backend.manifest.name)
    finally:
        glmport.unregister_backend(backend.manifest.name)
    for r in records:
        assert (r.outcome, r.ran_on) == ("fail", backend.manifest.name), r
        assert r.reason.startswith("combined output"), r.reason


def test_the_conformance_check_works_in_spawned_workers(monkeypatch):
    """The start method accelerators and macOS use: a backend registered in code reaches
    the workers, and a raise there becomes the check's outcome."""
    monkeypatch.setattr(ep_case, "start_method", lambda device_type: "spawn")
    backend = ep_backends.DropsLastRankBackend()
    glmport.register_backend(backend)
    try:
        check = suite_checks(ops=("expert_parallel",))[0]
        record = run_check(check, backend.manifest.name)
    finally:
        glmport.unregister_backend(backend.manifest.name)
    assert record.outcome == "fail" and record.reason.startswith("combined output"), record
