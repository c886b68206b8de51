"""Expert parallelism onto torch_npu's MC2 pair, ``npu_moe_distribute_dispatch_v2`` /
``npu_moe_distribute_combine_v2``: the fused dispatch and combine Ascend deployments of
DeepSeek-V3 / GLM-5 run across an EP domain (vllm-ascend's MC2 path).

Docs: Ascend/op-plugin ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``torch_npu-npu_moe_distribute_combine_v2.md`` (read 2026-12). The pair is documented
for inference only and within limits; :class:`MC2ExpertParallel` calls it where a
dispatch fits them on every rank, and otherwise runs the generic backend's all-to-all
(its base class), logged once:

- Atlas A3 only (A2's pair needs the routing weights at dispatch, which glmport's
  ``dispatch(x, ids)`` does not have, and 16 / 32 / 64 ranks);
- no autograd (grad mode off): the pair has no backward;
- bfloat16 / float16 tokens, ``0 < T <= 512`` per rank, ``K <= 8`` distinct experts per
  token (the older pages' bound; GLM-5 routes to 8), ``E <= 512``;
- hidden size ``H`` in [1024, 7168] and a multiple of 32 on builds from
  :data:`.chips.MC2_WIDTHS_FROM`, ``H = 7168`` before.

The ranks agree on the path with one small ``all_reduce`` per dispatch (a rank whose
call does not fit makes every rank take the all-to-all: taking different paths would
hang the collective; none where the chip or the group rules the pair out for every
call), whose answer is read on the host together with the pair's
``global_bs`` (the largest ``T`` times the ranks). ``combine`` goes back the way its
``dispatch`` went.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from glmport.backends.generic.ep import AllToAllExpertParallel
from glmport.core.errors import UnsupportedError
from glmport.core.selection import log_fallback_once

from .chips import chip_generation, mc2_takes_any_width

_HALF = (torch.bfloat16, torch.float16)
_MAX_TOKENS = 512  # per rank, Atlas A3
_MAX_TOP_K = 8
_MAX_EXPERTS = 512  # combine_v2's moe_expert_num range
_WORLD = range(2, 385)  # combine_v2's ep_world_size on Atlas A3
_WIDTHS = range(1024, 7169, 32)
_OLD_WIDTH = 7168
_ASSIST_COLUMNS = 128


def hccl_comm_name(group: dist.ProcessGroup | None) -> str:
    """The HCCL communicator name of ``group`` (None: the default group) that the MC2
    ops take as ``group_ep``, as the pages' examples obtain it."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return pg._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank())


@dataclass(frozen=True)
class MC2State:
    """What combine_v2 needs from dispatch_v2: ``ids [T, k]`` int32, the opaque
    ``assist`` / ``ep_send_counts`` / ``tp_send_counts`` tensors passed back unread,
    ``capacity`` (``A``, the rows of dispatch's ``expand_x``) and ``global_bs``."""

    ids: torch.Tensor
    assist: torch.Tensor
    ep_send_counts: torch.Tensor
    tp_send_counts: torch.Tensor
    capacity: int
    global_bs: int


class MC2ExpertParallel(AllToAllExpertParallel):
    """Dispatch / combine by the MC2 pair where it fits, else by all-to-all (see the
    module doc). ``npu``: torch_npu or the emulator; ``comm_name``: how to name the
    group's HCCL communicator (:func:`hccl_comm_name`, or the emulator's)."""

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        npu: Any,
        comm_name: Callable[[dist.ProcessGroup | None], str],
    ) -> None:
        super().__init__(num_experts, group)
        self._npu = npu
        version = str(getattr(npu, "__version__", "unknown"))
        self._widths = _WIDTHS if mc2_takes_any_width(version) else (_OLD_WIDTH,)
        soc = npu.npu.get_device_name()
        generation = chip_generation(soc)
        self._unfit = ""  # why no call of this group can take the pair
        if generation != "A3":
            self._unfit = f"has the MC2 pair on Atlas A3 only, not on {soc} ({generation})"
        elif self.world not in _WORLD or num_experts > _MAX_EXPERTS:
            self._unfit = (
                f"takes the MC2 pair for 2..384 ranks and <= {_MAX_EXPERTS} experts, not "
                f"{self.world} ranks and {num_experts} experts"
            )
        self._group_name = "" if self._unfit else comm_name(group)

    def _unfit_call(self, x: torch.Tensor, ids: torch.Tensor) -> str:
        """Why this rank's call cannot take the pair ("" when it can), bar repeated ids."""
        if torch.is_grad_enabled():
            return "runs the MC2 pair for inference only (grad mode is on)"
        tokens, width = x.shape
        if x.dtype not in _HALF:
            return f"takes bfloat16 / float16 tokens for the MC2 pair, not {x.dtype}"
        if not 0 < tokens <= _MAX_TOKENS:
            return f"takes 1..{_MAX_TOKENS} tokens per rank for the MC2 pair, not {tokens}"
        if ids.shape[1] > _MAX_TOP_K:
            return f"takes top-k <= {_MAX_TOP_K} for the MC2 pair, not {ids.shape[1]}"
        if width not in self._widths:
            return f"takes hidden sizes {_describe(self._widths)} for the MC2 pair, not {width}"
        return ""

    def _dispatch(
        self, x: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if self._unfit:  # the same on every rank (chip, ranks, experts): no vote needed
            log_fallback_once("ascend", "expert_parallel", "generic", f"{self._unfit}, in")
            return super()._dispatch(x, ids)
        why = self._unfit_call(x, ids)
        ordered = ids.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any()
        votes = torch.stack([torch.tensor(x.shape[0], device=x.device), repeated.long()])
        votes[1] = torch.maximum(votes[1], torch.tensor(int(bool(why)), device=x.device))
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        max_tokens, refused = votes.tolist()
        if refused:
            why = why or "calls the MC2 pair only with distinct experts per token"
            log_fallback_once("ascend", "expert_parallel", "generic", f"{why}, in")
            return super()._dispatch(x, ids)
        global_bs = max_tokens * self.world
        ids32 = ids.to(torch.int32)
        expand_x, _, assist, per_expert, ep_recv, tp_recv, _ = (
            self._npu.npu_moe_distribute_dispatch_v2(
                x,
                ids32,
                self._group_name,
                self.world,
                self.rank,
                self.num_experts,
                global_bs=global_bs,
                expert_token_nums_type=1,
            )
        )
        offsets = torch.zeros(self.local_experts + 1, dtype=torch.int32, device=x.device)
        offsets[1:] = per_expert.cumsum(0)
        rows = int(offsets[-1])
        state = MC2State(ids32, assist, ep_recv, tp_recv, expand_x.shape[0], global_bs)
        return expand_x[:rows], offsets, state

    def _combine(self, y_local: torch.Tensor, state: Any, weights: torch.Tensor) -> torch.Tensor:
        if not isinstance(state, MC2State):
            return super()._combine(y_local, state, weights)
        width = y_local.shape[1]
        if y_local.dtype not in _HALF or width not in self._widths:
            raise UnsupportedError(
                f"expert_parallel.combine: rows dispatched by the MC2 pair come back through "
                f"it, which takes bfloat16 / float16 rows of width {_describe(self._widths)}; "
                f"got {y_local.dtype} rows of width {width}"
            )
        expand_x = y_local.new_zeros((state.capacity, width))
        expand_x[: y_local.shape[0]] = y_local
        return self._npu.npu_moe_distribute_combine_v2(
            expand_x,
            state.ids,
            state.assist,
            state.ep_send_counts,
            weights,
            self._group_name,
            self.world,
            self.rank,
            self.num_experts,
            tp_send_counts=state.tp_send_counts,
            global_bs=state.global_bs,
        )


def _describe(widths: range | tuple[int, ...]) -> str:
    if isinstance(widths, range):
        return f"{widths.start}..{widths.stop - 1} in steps of {widths.step}"
    return " / ".join(map(str, widths))
