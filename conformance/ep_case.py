"""The expert-parallel check: a backend's ``expert_parallel`` across two processes
against the single-process float64 MoE.

Two processes on 127.0.0.1 (gloo for CPU tensors; the device's collective backend and
one device per rank otherwise) each select the backend under test, build the same
global batch, take their own tokens (6 and 9: ranks need not hold equally many),
and run ``expert_parallel(E).dispatch -> grouped_gemm`` on their local experts ``->
combine``, forward and backward. The parent puts the ranks' outputs and x-gradients
back together and judges them against ``moe_dispatch -> grouped_gemm -> moe_combine``
on the reference backend in float64, with the dtype's tolerance
(:mod:`glmport.core.tolerance`). Processes start once per backend: one run covers
every case, and its results are kept for the checks of the other cases.

Two families: ``tiny`` (``D`` 16, ``F`` 12, float32 and bfloat16) runs forward and
backward, as training does; ``inference`` (bfloat16 rows of width 1024, grad mode off)
is the call that inference-only fused pairs take (Ascend's MC2 needs ``H >= 1024``).
A worker records the fallbacks its calls take, so a check whose calls the backend
handed to another is credited to that one (``ran_on``).
"""

from __future__ import annotations

import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import glmport
from glmport.core.errors import BackendUnavailableError, UnsupportedError
from glmport.core.expert_parallel import COMPONENT
from glmport.core.registry import REGISTRY, Backend, chain_for
from glmport.core.selection import current_settings, recording_fallbacks

from .cases.base import Case
from .gradients import Attributed
from .judges import Verdict, close

WORLD = 2
TOKENS = (6, 9)  # per rank
E, K = 8, 3
UNUSED_EXPERT = 2  # no token picks it: an empty expert on rank 0
SEED = 5
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Variant:
    """One expert-parallel case: ``name`` and ``family`` (the case's), token width
    ``d``, expert output width ``f``, ``dtype``, and whether it runs backward too
    (``train``)."""

    name: str
    family: str
    d: int
    f: int
    dtype: torch.dtype
    train: bool

    @property
    def key(self) -> str:
        return f"{self.name}-{str(self.dtype).removeprefix('torch.')}"


VARIANTS = (
    Variant(f"world{WORLD}", "tiny", 16, 12, torch.float32, train=True),
    Variant(f"world{WORLD}", "tiny", 16, 12, torch.bfloat16, train=True),
    Variant(f"world{WORLD}_inference", "inference", 1024, 1024, torch.bfloat16, train=False),
)

# Outcomes of a worker's exception, by what run_check makes of the parent's re-raise.
_UNSUPPORTED, _UNAVAILABLE, _ERROR = "unsupported", "unavailable", "error"


def _batch(gen: torch.Generator, v: Variant) -> tuple[torch.Tensor, ...]:
    """The global batch: ``x [T, d]`` and ``w [E, f, d]`` in ``v.dtype``, routing
    ``weights [T, K]`` fp32 and ``ids [T, K]`` int32, cotangent ``cot [T, f]`` fp32
    (``T = sum(TOKENS)``)."""
    t = sum(TOKENS)
    x = torch.randn(t, v.d, generator=gen).to(v.dtype)
    w = (torch.randn(E, v.f, v.d, generator=gen) * v.d**-0.5).to(v.dtype)
    logits = torch.randn(t, E, generator=gen)
    logits[:, UNUSED_EXPERT] = float("-inf")
    top, ids = logits.topk(K, dim=1)
    weights = torch.softmax(top, dim=1)
    cot = torch.randn(t, v.f, generator=gen)
    return x, w, weights, ids.to(torch.int32), cot


def ep_cases() -> list[Case]:
    """One case per variant; all of them share one run of the processes."""
    return [
        Case(
            COMPONENT,
            v.name,
            v.family,
            v.dtype,
            build=lambda g, v=v: _batch(g, v),
            params=tuple(
                sorted(
                    {"world": WORLD, "tokens": TOKENS, "D": v.d, "F": v.f, "E": E, "k": K}.items()
                )
            ),
            seed=SEED,
        )
        for v in VARIANTS
    ]


def _variant(case: Case) -> Variant:
    return next(v for v in VARIANTS if (v.name, v.dtype) == (case.name, case.dtype))


def rendezvous(folder: str) -> str:
    """A ``torch.distributed`` init method through a file store in ``folder`` (a fresh
    folder per run: the store file must not exist before the first rank opens it)."""
    return (Path(folder) / "rendezvous").resolve().as_uri()


def _kind(err: Exception) -> str:
    if isinstance(err, UnsupportedError):
        return _UNSUPPORTED
    if isinstance(err, BackendUnavailableError):
        return _UNAVAILABLE
    return _ERROR


def _result_path(out_dir: str, v: Variant, rank: int) -> Path:
    return Path(out_dir) / f"{v.key}-rank{rank}.pt"


def _run_rank(rank: int, v: Variant, device: torch.device) -> dict:
    """This rank's share of the check: ``{"out": [T_r, f], "grad": [T_r, d] or None
    (None also when ``v`` does not train), "fallbacks": [backend used, ...]}``."""
    x_all, w, weights, ids, cot = _batch(torch.Generator().manual_seed(SEED), v)
    first = sum(TOKENS[:rank])
    mine = slice(first, first + TOKENS[rank])
    with recording_fallbacks() as fallbacks, torch.set_grad_enabled(v.train):
        ep = glmport.expert_parallel(E, device=device)
        x = x_all[mine].to(device).clone().requires_grad_(v.train)
        x_local, offsets, handle = ep.dispatch(x, ids[mine].to(device))
        w_mine = w[ep.first_expert : ep.first_expert + ep.local_experts].to(device)
        y_local = glmport.ops.grouped_gemm(x_local, w_mine, offsets)
        out = ep.combine(y_local, handle, weights[mine].to(device))
        if v.train:
            (out.float() * cot[mine].to(device)).sum().backward()
    grad = None if x.grad is None else x.grad.detach().cpu()
    used = [used for _, op, used in fallbacks if op == COMPONENT]
    return {"out": out.detach().cpu(), "grad": grad, "fallbacks": used}


def _worker(
    rank: int,
    backend: str,
    emulate: bool,
    device_type: str,
    collectives: str,
    in_code: list[Backend],
    variants: list[Variant],
    out_dir: str,
) -> None:
    """One rank: runs ``variants`` in order, saving each result for the parent. An
    exception is saved as the result of the variant it stopped, and ends the process:
    the other rank may be waiting in a collective that will never complete, so the
    parent starts afresh for the remaining variants."""
    torch.set_num_threads(1)  # two processes share the cores
    variant = variants[0]
    try:
        for b in in_code:  # a new process knows the parent's in-code backends only so
            glmport.register_backend(b, replace=True)
        device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)
        # Selected first: a vendor backend's probe may import the SDK that registers
        # the device's collectives with torch.distributed.
        with glmport.use_backend(backend, emulate=emulate):
            # Rendezvous through a file of this run's own folder: a free port picked
            # ahead can be taken by another process before the ranks bind it.
            dist.init_process_group(
                collectives,
                init_method=rendezvous(out_dir),
                rank=rank,
                world_size=WORLD,
                timeout=timedelta(seconds=TIMEOUT_S),
                device_id=None if device_type == "cpu" else device,
            )
            for variant in variants:
                result = _run_rank(rank, variant, device)
                torch.save(result, _result_path(out_dir, variant, rank))
    except Exception as err:
        reason = f"rank {rank}: {type(err).__name__}: {err}"
        torch.save({"kind": _kind(err), "reason": reason}, _result_path(out_dir, variant, rank))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch._dynamo", "glmport"]


def start_method(device_type: str) -> str:
    """How to start worker processes: ``forkserver`` on Linux for CPU tensors, whose
    server imports torch, torch._dynamo (which a process's first differentiable
    custom-op call imports, seconds) and glmport once and then only forks, so workers
    start warm; ``spawn`` elsewhere. Never a plain fork of this process: a child forked
    after torch's OpenMP threads ran here hangs in its first parallel region."""
    if device_type == "cpu" and sys.platform == "linux":
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        return "forkserver"
    return "spawn"


def _in_code_backends(backend: str) -> list[Backend]:
    """The backends along ``backend``'s chain that were registered in code (not
    installed): worker processes register them again. They must pickle."""
    installed = REGISTRY.entry_points()
    found = [REGISTRY.get(n) for n in chain_for(backend) if n not in installed]
    try:
        pickle.dumps(found)
    except Exception as err:
        raise BackendUnavailableError(
            f"the expert_parallel check runs in worker processes, and backend(s) "
            f"{[b.manifest.name for b in found]} registered in code cannot be sent there "
            f"({type(err).__name__}: {err}); install the backend through the "
            "'glmport.backends' entry points, or define it at module level of an "
            "importable module with its manifest as a class attribute"
        ) from err
    return found


def _spawn_once(
    backend: str, emulate: bool, device_type: str, collectives: str, variants: list[Variant]
) -> tuple[dict[Variant, list[dict]], str]:
    """Run the workers over ``variants``; the per-rank results of every variant that
    all ranks finished or some rank raised in, and why the run stopped early ("": it
    did not)."""
    method = start_method(device_type)
    in_code = _in_code_backends(backend)
    with tempfile.TemporaryDirectory(prefix="glmport-ep-") as out_dir:
        args = (backend, emulate, device_type, collectives, in_code, variants, out_dir)
        ctx = mp.start_processes(_worker, args, WORLD, join=False, start_method=method)
        stopped = ""
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    stopped = f"the worker processes did not finish within {TIMEOUT_S:.0f} s"
                    break
        except ProcessException as err:
            stopped = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join()
        results: dict[Variant, list[dict]] = {}
        for v in variants:
            paths = [_result_path(out_dir, v, r) for r in range(WORLD)]
            ranks = [torch.load(p, weights_only=True) for p in paths if p.exists()]
            if len(ranks) == WORLD or any("kind" in r for r in ranks):
                results[v] = [r for r in ranks if "kind" in r] or ranks
    return results, stopped


def _run_all(
    backend: str, emulate: bool, device_type: str, collectives: str
) -> dict[Variant, list[dict]]:
    """Every variant's per-rank results, starting the processes again only after a
    failure stopped them early."""
    results: dict[Variant, list[dict]] = {}
    pending = list(VARIANTS)
    while pending:
        got, stopped = _spawn_once(backend, emulate, device_type, collectives, pending)
        results.update(got)
        pending = [v for v in pending if v not in got]
        if pending and not got:  # nothing came back: blame the first variant, go on
            reason = stopped or "the worker processes ended without a result"
            results[pending.pop(0)] = [{"kind": _ERROR, "reason": reason}]
    return results


def _collectives(device_type: str) -> str:
    """The ``torch.distributed`` backend for tensors of ``device_type`` (gloo for CPU
    tensors); the device must have one per rank."""
    if device_type == "cpu":
        return "gloo"
    count = torch.get_device_module(device_type).device_count()
    if count < WORLD:
        raise BackendUnavailableError(
            f"the expert_parallel check needs {WORLD} {device_type} devices, found {count}"
        )
    name = dist.Backend.default_device_backend_map.get(device_type)
    if name is None:
        raise BackendUnavailableError(
            f"torch.distributed has no collective backend for {device_type} tensors"
        )
    return name


# Per (backend, emulate, device type, registry generation): each variant's per-rank results.
_runs: dict[tuple, dict[Variant, list[dict]]] = {}


def _results(backend: str, emulate: bool, device: torch.device) -> dict[Variant, list[dict]]:
    collectives = _collectives(device.type)
    # The registry's generation changes when a backend is (re)registered, so a new
    # backend under an old name runs afresh.
    key = (backend, emulate, device.type, REGISTRY.generation)
    if key not in _runs:
        _runs[key] = _run_all(backend, emulate, device.type, collectives)
    return _runs[key]


def _reference(
    x: torch.Tensor,
    w: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    cot: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``out [T, F]`` and ``d(sum(out * cot)) / dx [T, D]`` of the
    single-process MoE on the reference backend."""
    name = REGISTRY.reference()
    kernels = REGISTRY.kernels(name, False)
    x64 = x.detach().double().requires_grad_()
    with REGISTRY.get(name).float64():
        xs, offsets, src = kernels["moe_dispatch"](x64, ids, E)
        out = kernels["moe_combine"](kernels["grouped_gemm"](xs, w, offsets), src, weights)
    (grad,) = torch.autograd.grad((out * cot.double()).sum(), x64)
    return out.detach(), grad


def run_ep_check(case: Case, device: torch.device, backend: str) -> Verdict:
    """Judge ``backend``'s expert parallelism on ``case`` (see the module doc)."""
    v = _variant(case)
    ranks = _results(backend, current_settings().emulate, device)[v]
    raised = next((r for r in ranks if "kind" in r), None)
    if raised is not None:
        if raised["kind"] == _UNSUPPORTED:
            raise UnsupportedError(raised["reason"])
        if raised["kind"] == _UNAVAILABLE:
            raise BackendUnavailableError(raised["reason"])
        raise RuntimeError(f"in a worker process, {raised['reason']}")
    if v.train and any(r["grad"] is None for r in ranks):
        return Verdict(False, "no gradient reached 'x' through dispatch and combine")
    # Whose code ran: the backend a fallback handed the calls to.
    ran_on = next((used for r in ranks for used in r["fallbacks"]), "")
    handed = f"{backend}'s expert_parallel handed the calls to {ran_on}" if ran_on else ""
    x, w, weights, ids, cot = case.args()
    ref_out, ref_grad = _reference(x, w, weights, ids, cot)
    out = torch.cat([r["out"] for r in ranks])

    def failed(what: str, bad: Verdict) -> Attributed:
        return Attributed(False, f"{what}: {bad.reason}", bad.metrics, bad.tolerance, ran_on=ran_on)

    verdict = close(COMPONENT, case.dtype, (), out, ref_out)
    if not verdict.ok:
        return failed("combined output", verdict)
    worst = verdict.metrics
    if v.train:
        grads = torch.cat([r["grad"] for r in ranks])
        grad = close(COMPONENT, case.dtype, (), grads, ref_grad)
        if not grad.ok:
            return failed("gradient of 'x'", grad)
        worst = {k: max(verdict.metrics[k], grad.metrics[k]) for k in verdict.metrics}
    return Attributed(True, handed, worst, verdict.tolerance, ran_on=ran_on)
