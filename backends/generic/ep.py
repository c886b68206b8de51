"""Expert parallelism over ``torch.distributed``: each rank of an EP process group
holds ``E / world`` consecutive experts; tokens travel to the ranks of their experts
by all-to-all and come back the same way.

Works with whatever collective backend the device's torch has (gloo on CPU, nccl on
CUDA, hccl on Ascend), and is differentiable: the row exchanges use
``torch.distributed.nn.functional.all_to_all_single``. Numerically it is the
single-process MoE: the same rows meet the same experts and are combined with
``moe_combine`` in the same order::

    ep = ExpertParallel(num_experts=256)
    x_local, offsets, handle = ep.dispatch(x, ids)          # rows for my experts
    y_local = glmport.ops.grouped_gemm(x_local, w_mine, offsets)
    out = ep.combine(y_local, handle, weights)             # [T, D], my tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

import glmport
from glmport.core.errors import ConfigError, OpInputError


@dataclass(frozen=True)
class DispatchHandle:
    """What :meth:`ExpertParallel.combine` needs to send results home.

    ``order [T*k]``: flat ``t * k + j`` of each sent row (rows sorted by expert);
    ``send`` / ``recv``: rows sent to / received from each rank; ``local_src [R]``:
    where each local row came from among the received ones.
    """

    order: torch.Tensor
    send: tuple[int, ...]
    recv: tuple[int, ...]
    local_src: torch.Tensor


class ExpertParallel:
    """MoE dispatch / combine across an expert-parallel process group."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "ExpertParallel needs torch.distributed initialised (init_process_group)"
            )
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

    def _exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor):
        """Send each token copy to the rank owning its expert.

        Args:
            x: ``[T, D]`` this rank's tokens; ids: ``[T, k]`` global expert ids.

        Returns:
            x_local ``[R, D]`` rows for this rank's experts, sorted by local expert;
            offsets ``[E_local + 1]`` int32; a :class:`DispatchHandle`.
        """
        if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise OpInputError(
                "ExpertParallel.dispatch", "ids", f"[T={x.shape[0]}, k]", str(list(ids.shape))
            )
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise OpInputError(
                "ExpertParallel.dispatch",
                "ids",
                f"values in [0, {self.num_experts})",
                "out of range",
            )
        k = ids.shape[1]
        order = torch.sort(flat, stable=True).indices  # by expert, hence by rank
        dest = flat[order] // self.local_experts
        send = torch.zeros(self.world, dtype=torch.long, device=x.device).scatter_add(
            0, dest, torch.ones_like(dest)
        )
        recv = self._exchange_counts(send)
        send_l, recv_l = tuple(send.tolist()), tuple(recv.tolist())
        x_recv = dist_fn.all_to_all_single(
            x.new_empty((sum(recv_l), x.shape[1])),
            x[order // k],
            list(recv_l),
            list(send_l),
            group=self.group,
        )
        local_ids = flat.new_empty(sum(recv_l))
        dist.all_to_all_single(local_ids, flat[order], list(recv_l), list(send_l), group=self.group)
        local_ids = (local_ids - self.first_expert).to(torch.int32)[:, None]
        x_local, offsets, local_src = glmport.ops.moe_dispatch(
            x_recv, local_ids, self.local_experts
        )
        return x_local, offsets, DispatchHandle(order.to(torch.int32), send_l, recv_l, local_src)

    def combine(
        self, y_local: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor
    ) -> torch.Tensor:
        """Send expert outputs home and combine them with the routing weights.

        Args:
            y_local: ``[R, D']`` expert outputs in ``x_local``'s order.
            weights: ``[T, k]`` fp32 routing weights of this rank's tokens.

        Returns:
            ``[T, D']`` in ``y_local``'s dtype.
        """
        ones = torch.ones((y_local.shape[0], 1), dtype=torch.float32, device=y_local.device)
        y_recv = glmport.ops.moe_combine(y_local, handle.local_src, ones)  # undo the local sort
        y_sent = dist_fn.all_to_all_single(
            y_recv.new_empty((sum(handle.send), y_recv.shape[1])),
            y_recv,
            list(handle.send),
            list(handle.recv),
            group=self.group,
        )
        return glmport.ops.moe_combine(y_sent, handle.order, weights)
