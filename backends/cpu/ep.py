"""Reference expert parallelism: every rank gathers the whole group's batch, runs the
single-process MoE ops on it and keeps its own share.

Deliberately simple rather than efficient (each rank holds all ``T_all`` tokens and
all ``T_all * k`` expert rows), so it is obviously the single-process computation.
The gathers are sums of zero-padded tensors (``all_reduce``), which are exact and
differentiable (the gradient of a sum over ranks is the sum of the gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import glmport
from glmport.core.expert_parallel import ExpertParallel


@dataclass(frozen=True)
class GatherState:
    """What :meth:`GatherExpertParallel._combine` needs: ``src [T_all*k]`` int32 from
    ``moe_dispatch`` over the whole batch, ``bounds`` (``world + 1`` row offsets of
    each rank's experts in that order), and this rank's tokens ``[first, first + count)``
    among ``total``."""

    src: torch.Tensor
    bounds: tuple[int, ...]
    first: int
    count: int
    total: int


class _SumOverRanks(torch.autograd.Function):
    """``all_reduce(SUM)`` with its gradient: every rank's output is the sum of all
    inputs, so every input's gradient is the sum of all output gradients."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class GatherExpertParallel(ExpertParallel):
    """Dispatch / combine by gathering everything on every rank."""

    def _everywhere(self, t: torch.Tensor, start: int, total: int) -> torch.Tensor:
        """``[total, ...]``: every rank's ``t`` at its ``start`` row (a differentiable sum
        of zero-padded copies)."""
        pad = (0, 0) * (t.dim() - 1) + (start, total - start - t.shape[0])
        return _SumOverRanks.apply(torch.nn.functional.pad(t, pad), self.group)

    def _token_span(self, count: int, device: torch.device) -> tuple[int, int]:
        """This rank's first row among the group's tokens, and the group's token count."""
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([count], device=device), group=self.group)
        sizes = [int(c) for c in counts]
        return sum(sizes[: self.rank]), sum(sizes)

    def _dispatch(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, GatherState]:
        first, total = self._token_span(x.shape[0], x.device)
        x_all = self._everywhere(x, first, total)
        ids_all = self._everywhere(ids.long(), first, total).to(torch.int32)
        xs, offsets, src = glmport.ops.moe_dispatch(x_all, ids_all, self.num_experts)
        bounds = tuple(offsets[:: self.local_experts].tolist())
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        mine = offsets[self.first_expert : self.first_expert + self.local_experts + 1] - lo
        return xs[lo:hi], mine, GatherState(src, bounds, first, x.shape[0], total)

    def _combine(
        self, y_local: torch.Tensor, state: GatherState, weights: torch.Tensor
    ) -> torch.Tensor:
        y_all = self._everywhere(y_local, state.bounds[self.rank], state.bounds[-1])
        w_all = self._everywhere(weights, state.first, state.total)
        out = glmport.ops.moe_combine(y_all, state.src, w_all)
        return out[state.first : state.first + state.count]
