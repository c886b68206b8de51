"""Expert parallelism over ``torch.distributed`` all-to-all: the generic
implementation of :class:`glmport.core.expert_parallel.ExpertParallel`.

Tokens travel to the ranks of their experts by all-to-all and come back the same way.
Works with whatever collective backend the device's torch has (gloo on CPU, nccl on
CUDA, hccl on Ascend), and is differentiable: the gradient of a row exchange is the
reverse exchange (:class:`_ExchangeRows`). Numerically it is the
single-process MoE: the same rows meet the same experts and are combined with
``moe_combine`` in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import glmport
from glmport.core.expert_parallel import ExpertParallel


@dataclass(frozen=True)
class AllToAllState:
    """What :meth:`AllToAllExpertParallel._combine` needs to send results home.

    ``order [T*k]`` int32: flat ``t * k + j`` of each sent row (rows sorted by expert);
    ``send`` / ``recv``: rows sent to / received from each rank; ``local_src [R]``
    int32: where each local row came from among the received ones.
    """

    order: torch.Tensor
    send: tuple[int, ...]
    recv: tuple[int, ...]
    local_src: torch.Tensor


class _ExchangeRows(torch.autograd.Function):
    """``all_to_all_single`` of rows: send ``send[r]`` rows of ``x`` to rank ``r``,
    receive ``recv[r]`` from it; the gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: tuple, recv: tuple, group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), list(ctx.send), list(ctx.recv), group=ctx.group
        )
        return back, None, None, None


class AllToAllExpertParallel(ExpertParallel):
    """MoE dispatch / combine by two all-to-all exchanges each way (counts, then rows)."""

    def _exchange_counts(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def _dispatch(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        k = ids.shape[1]
        flat = ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices  # by expert, hence by rank
        dest = flat[order] // self.local_experts
        send = torch.zeros(self.world, dtype=torch.long, device=x.device).scatter_add(
            0, dest, torch.ones_like(dest)
        )
        recv = self._exchange_counts(send)
        send_l, recv_l = tuple(send.tolist()), tuple(recv.tolist())
        x_recv = _ExchangeRows.apply(x[order // k], send_l, recv_l, self.group)
        local_ids = flat.new_empty(sum(recv_l))
        dist.all_to_all_single(local_ids, flat[order], list(recv_l), list(send_l), group=self.group)
        local_ids = (local_ids - self.first_expert).to(torch.int32)[:, None]
        # Received rows arrive rank by rank, each rank's in flat-index order, so a stable
        # sort by local expert gives the single-process order within each expert.
        x_local, offsets, local_src = glmport.ops.moe_dispatch(
            x_recv, local_ids, self.local_experts
        )
        return x_local, offsets, AllToAllState(order.to(torch.int32), send_l, recv_l, local_src)

    def _combine(
        self, y_local: torch.Tensor, state: AllToAllState, weights: torch.Tensor
    ) -> torch.Tensor:
        ones = torch.ones((y_local.shape[0], 1), dtype=torch.float32, device=y_local.device)
        y_recv = glmport.ops.moe_combine(y_local, state.local_src, ones)  # undo the local sort
        y_sent = _ExchangeRows.apply(y_recv, state.recv, state.send, self.group)
        return glmport.ops.moe_combine(y_sent, state.order, weights)
