"""Expert parallelism (EP) as part of the interface: dispatch a rank's tokens to the
ranks that hold their experts, combine the expert outputs back.

Each rank of an EP process group holds ``E / world`` consecutive experts (rank ``r``
holds ``[r * E / world, (r + 1) * E / world)``). A MoE layer on one rank runs::

    ep = glmport.expert_parallel(num_experts=256)            # the selected backend's
    x_local, offsets, handle = ep.dispatch(x, ids)           # rows for my experts
    y_local = glmport.ops.grouped_gemm(x_local, w_mine, offsets)
    out = ep.combine(y_local, handle, weights)               # [T, D'], my tokens

Numerically this is the single-process ``moe_dispatch -> grouped_gemm -> moe_combine``
over the union of all ranks' tokens, restricted to this rank's tokens. A backend
provides its implementation (an all-to-all over ``torch.distributed`` in the generic
backend; DeepEP or Ascend MC2 in a vendor's) as the ``"expert_parallel"`` entry of
its kernel table: a factory ``(num_experts, group) -> ExpertParallel``, found along
the fallback chain like any op. Subclasses implement :meth:`ExpertParallel._dispatch`
and :meth:`ExpertParallel._combine`; the public methods validate first, so every
implementation rejects a malformed call with the same error.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError, UnsupportedError, check_int
from .selection import current_settings, resolve, selected_device
from .validate import FLOAT_DTYPES, INDEX_DTYPES, Checker

COMPONENT = "expert_parallel"

# Its value check reads on the host (reads=True) in every mode: the exchange waits for
# its row counts anyway.
_DISPATCH = Checker(f"{COMPONENT}.dispatch", reads=True)
_COMBINE = Checker(f"{COMPONENT}.combine")


@dataclass(frozen=True)
class EPHandle:
    """What :meth:`ExpertParallel.combine` needs from its :meth:`~ExpertParallel.dispatch`:
    opaque to callers.

    ``owner``: the instance that dispatched; ``tokens`` / ``top_k``: the dispatched
    ``ids`` shape ``[T, k]``; ``rows``: ``R``, the rows of ``x_local``; ``state``: what
    the implementation keeps for the way back.
    """

    owner: ExpertParallel
    tokens: int
    top_k: int
    rows: int
    state: object


class ExpertParallel(abc.ABC):
    """MoE dispatch / combine across an expert-parallel process group.

    Attributes:
        num_experts: ``E``, experts over the whole group.
        group: the process group (None: the default group).
        world: ranks in the group.
        rank: this process's rank in the group.
        local_experts: ``E / world``, the experts this rank holds.
        first_expert: the global id of this rank's first expert.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "expert parallelism needs torch.distributed initialised (init_process_group)"
            )
        check_int("num_experts", num_experts, 1)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ConfigError(
                f"{num_experts} experts do not split over an EP group of {self.world} ranks"
            )
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.first_expert = self.rank * self.local_experts

    def dispatch(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, EPHandle]:
        """Send each ``(token, choice)`` pair to the rank holding its expert.

        A collective: every rank of the group calls it, with its own tokens.

        Args:
            x: ``[T, D]`` float32 / bfloat16 / float16, this rank's tokens (``T`` may
                differ between ranks).
            ids: ``[T, k]`` int32 / int64, global expert ids in ``[0, E)``.

        Returns:
            ``x_local [R, D]`` in ``x``'s dtype: the rows routed to this rank's experts,
            grouped by local expert (expert ``e``'s rows are
            ``x_local[offsets[e]:offsets[e + 1]]``; the order within an expert is the
            implementation's, as only :meth:`combine` reads it back: the generic and
            reference ones keep the single-process order); ``offsets [E_local + 1]``
            int32; a handle for :meth:`combine`. Differentiable in ``x``.
        """
        c = _DISPATCH
        c.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        c.tensor("ids", ids, shape=(("T", x.shape[0]), None), dtypes=INDEX_DTYPES)
        if ids.shape[1] < 1:
            c.fail("ids", "[T, k] with k >= 1", f"shape {list(ids.shape)}")
        c.same_device(x=x, ids=ids)
        # Checked in every mode: an exchange syncs with the host for its row counts
        # anyway, and an id past E would address a rank that does not exist.
        c.in_range("ids", ids, 0, self.num_experts)
        x_local, offsets, state = self._dispatch(x, ids)
        handle = EPHandle(self, ids.shape[0], ids.shape[1], x_local.shape[0], state)
        return x_local, offsets, handle

    def combine(
        self, y_local: torch.Tensor, handle: EPHandle, weights: torch.Tensor
    ) -> torch.Tensor:
        """Send expert outputs home and sum them per token with the routing weights.

        A collective: every rank of the group calls it.

        Args:
            y_local: ``[R, D']`` float32 / bfloat16 / float16, expert outputs in
                ``x_local``'s row order.
            handle: what :meth:`dispatch` returned with ``x_local``.
            weights: ``[T, k]`` float32 routing weights of this rank's tokens.

        Returns:
            ``[T, D']`` in ``y_local``'s dtype: ``out[t] = sum_j weights[t, j] *
            y(t, j)``, where ``y(t, j)`` is the row of ``(t, j)`` wherever it was
            computed. Differentiable in ``y_local`` (hence in ``x`` through dispatch);
            the generic and reference implementations also pass gradients to
            ``weights``.
        """
        c = _COMBINE
        if not isinstance(handle, EPHandle) or handle.owner is not self:
            c.fail("handle", "the handle this instance's dispatch() returned", repr(handle))
        c.tensor("y_local", y_local, shape=(("R", handle.rows), None), dtypes=FLOAT_DTYPES)
        c.tensor(
            "weights",
            weights,
            shape=(("T", handle.tokens), ("k", handle.top_k)),
            dtypes=(torch.float32,),
        )
        c.same_device(y_local=y_local, weights=weights)
        return self._combine(y_local, handle.state, weights)

    @abc.abstractmethod
    def _dispatch(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """:meth:`dispatch` on validated inputs: ``(x_local [R, D], offsets
        [E_local + 1] int32, state)``; ``state`` comes back in :meth:`_combine`."""

    @abc.abstractmethod
    def _combine(self, y_local: torch.Tensor, state: object, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`combine` on validated inputs: ``[T, D']`` in ``y_local``'s dtype."""


ExpertParallelFactory = Callable[[int, dist.ProcessGroup | None], ExpertParallel]


def expert_parallel(
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: str | torch.device | None = None,
) -> ExpertParallel:
    """The selected backend's expert parallelism for ``num_experts`` experts over
    ``group`` (None: the default process group), for tensors on ``device`` (default:
    ``GLMPORT_DEVICE`` / ``use_backend(device=...)``, else the CPU).

    Resolved like an op: the selected backend's ``"expert_parallel"`` factory, else the
    first one along its fallback chain (the generic all-to-all, then the reference).
    Raises :class:`~glmport.ConfigError` without an initialised process group or when
    ``num_experts`` does not split evenly over the group.
    """
    settings = current_settings()
    device_type = torch.device(device).type if device else selected_device(settings).type
    res = resolve(COMPONENT, settings, device_type=device_type)
    if not res.candidates[0].takes(device_type):
        raise UnsupportedError(
            f"glmport.expert_parallel: backend {res.backend!r} runs on {res.device_type} "
            f"tensors, not {device_type}. Select a backend for {device_type} or pass device="
        )
    ep = res.kernel(num_experts, group)
    if not isinstance(ep, ExpertParallel):
        raise TypeError(
            f"backend {res.backend!r}: its expert_parallel factory returned "
            f"{type(ep).__name__}, expected a glmport.core.expert_parallel.ExpertParallel"
        )
    return ep


__all__ = ["EPHandle", "ExpertParallel", "ExpertParallelFactory", "expert_parallel"]
