"""CPU emulation of torch_npu's MC2 expert-parallel pair, ``npu_moe_distribute_dispatch_v2``
and ``npu_moe_distribute_combine_v2``, over ``torch.distributed`` (gloo on CPU).

Pages: Ascend/op-plugin ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``torch_npu-npu_moe_distribute_combine_v2.md`` (read 2026-12). The emulated contract is
the Atlas A3 one without a TP domain, shared-expert ranks, special experts or
quantisation (those arguments are refused with a :class:`NpuContractError` naming them,
as not emulated); an Atlas A2 build (:class:`~.build.EmulatedBuild`'s ``soc_name``) is
refused outright, since A2's pair needs ``expert_scales`` at dispatch and 16 / 32 / 64
ranks. Newest pages: ``H`` in [1024, 8192] for dispatch and [1024, 7168] for combine,
``0 < BS <= 512``, ``0 < K <= 16``; the 7.0 pages (builds before
:data:`~..chips.MC2_WIDTHS_FROM`) allow only ``H = 7168`` and ``K <= 8``.

Layout (documented): ``expand_x [A, H]`` holds the rows this rank received, grouped by
local expert (``expert_token_nums`` counts them); ``A = global_bs * min(local_experts,
K)`` with ``global_bs = BS * ep_world_size`` when passed 0. Undocumented, and left
opaque to callers as the pages demand: the order within an expert (here: by source
rank, then token, then choice), ``assist_info_for_combine`` (here: source rank, token
and choice of each row in the first three of its 128 columns) and ``ep_recv_counts``
(here: per local expert and source rank, cumulative). Rows past the received ones are
unwritten (NaN), so a caller that reads them is caught. Rows travel in their dtype;
combine multiplies and sums in float32 and casts to ``expand_x``'s dtype (the page
gives no accumulation precision).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..chips import chip_generation, mc2_takes_any_width
from .build import current_build
from .contract import require, unwritten

_HALF = (torch.bfloat16, torch.float16)
_MAX_BS = 512  # A3
_ASSIST_COLUMNS = 128
_DISPATCH = "npu_moe_distribute_dispatch_v2"
_COMBINE = "npu_moe_distribute_combine_v2"

# Emulated HCCL communicator names -> process groups (None: the default group).
_GROUPS: dict[str, dist.ProcessGroup | None] = {}
_names = itertools.count()


def hccl_comm_name(group: dist.ProcessGroup | None) -> str:
    """What ``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)`` gives on
    an NPU: the communicator name the MC2 ops take as ``group_ep``."""
    for name, known in _GROUPS.items():
        if known is group:
            return name
    name = f"emulated-hccl-{next(_names)}"
    _GROUPS[name] = group
    return name


def _newest_pages() -> bool:
    return mc2_takes_any_width(current_build().version)


def _domain(
    op: str, group_ep: str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, **absent
) -> dist.ProcessGroup | None:
    """The EP group named ``group_ep``, after the checks both ops share."""
    generation = chip_generation(current_build().soc_name)
    require(
        generation == "A3",
        op,
        f"emulated for Atlas A3 only; this build is {current_build().soc_name} "
        f"({generation}), whose pair takes expert_scales at dispatch and 16 / 32 / 64 ranks",
    )
    for name, (value, default) in absent.items():
        require(
            value is default or value == default,
            op,
            f"{name} is not emulated (leave it {default!r})",
        )
    require(
        1 <= moe_expert_num <= 512,
        op,
        f"moe_expert_num {moe_expert_num} must be in [1, 512] (combine's range)",
    )
    require(group_ep in _GROUPS, op, f"group_ep {group_ep!r} names no HCCL communicator")
    group = _GROUPS[group_ep]
    world = dist.get_world_size(group)
    require(
        ep_world_size == world and 2 <= world <= 384,
        op,
        f"ep_world_size {ep_world_size} must be the EP domain's size {world}, in [2, 384]",
    )
    require(
        ep_rank_id == dist.get_rank(group),
        op,
        f"ep_rank_id {ep_rank_id} is not this card's rank {dist.get_rank(group)}",
    )
    require(
        moe_expert_num % world == 0,
        op,
        f"moe_expert_num {moe_expert_num} must divide over {world} ranks",
    )
    return group


def _width(op: str, h: int, dispatch: bool) -> None:
    if _newest_pages():
        top = 8192 if dispatch else 7168
        require(1024 <= h <= top, op, f"H {h} must be in [1024, {top}] on Atlas A3")
    else:
        require(h == 7168, op, f"H {h}: this build's page allows only H = 7168 on Atlas A3")


def _routing(op: str, expert_ids: torch.Tensor, bs: int, moe_expert_num: int) -> int:
    require(
        expert_ids.dtype == torch.int32 and expert_ids.dim() == 2 and expert_ids.shape[0] == bs,
        op,
        f"expert_ids must be int32 [BS={bs}, K], got {expert_ids.dtype} {list(expert_ids.shape)}",
    )
    k = expert_ids.shape[1]
    top_k = 16 if _newest_pages() else 8
    require(0 < k <= min(top_k, moe_expert_num), op, f"K {k} must be in (0, {top_k}]")
    require(
        bool(((expert_ids >= 0) & (expert_ids < moe_expert_num)).all()),
        op,
        f"expert_ids must lie in [0, {moe_expert_num})",
    )
    ordered = expert_ids.sort(dim=1).values
    require(
        not bool((ordered[:, 1:] == ordered[:, :-1]).any()),
        op,
        "the K values in a row of expert_ids must not repeat",
    )
    return k


def _exchange(group, send: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``all_to_all`` of ``send``'s rows, ``counts[r]`` of them to rank ``r``: the
    received rows (source rank by source rank) and how many came from each."""
    world = dist.get_world_size(group)
    sent = torch.tensor(counts, dtype=torch.int64)
    got = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(got, sent, group=group)
    recv = got.tolist()
    out = send.new_empty((sum(recv), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv, counts, group=group)
    return out, recv


def npu_moe_distribute_dispatch_v2(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_scales: torch.Tensor | None = None,
    elastic_info: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_alg: str = "",
    zero_expert_num: int = 0,
    copy_expert_num: int = 0,
    const_expert_num: int = 0,
) -> tuple[torch.Tensor | None, ...]:
    """Send each token's row to the ranks of its K experts (see the module doc).

    Returns ``(expand_x [A, H], dynamic_scales (None: not quantised), assist_info_for_combine
    [A * 128] int32, expert_token_nums [local_experts] int64, ep_recv_counts
    [ep_world_size * local_experts] int32, tp_recv_counts [tp_world_size] int32,
    expand_scales (None on A3))``. A collective over ``group_ep``.
    """
    op = _DISPATCH
    require(
        x.dim() == 2 and x.dtype in _HALF,
        op,
        f"x must be bfloat16 / float16 [BS, H], got {x.dtype} {list(x.shape)}",
    )
    bs, h = x.shape
    require(0 < bs <= _MAX_BS, op, f"BS {bs} must be in (0, {_MAX_BS}]")
    _width(op, h, dispatch=True)
    k = _routing(op, expert_ids, bs, moe_expert_num)
    require(expert_token_nums_type in (0, 1), op, "expert_token_nums_type must be 0 or 1")
    group = _domain(
        op,
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        scales=(scales, None),
        x_active_mask=(x_active_mask, None),
        expert_scales=(expert_scales, None),  # A3: "暂不支持该参数"
        elastic_info=(elastic_info, None),
        tp_world_size=(tp_world_size if tp_world_size > 1 else 0, 0),
        shared_expert_rank_num=(shared_expert_rank_num, 0),
        quant_mode=(quant_mode, 0),
        zero_expert_num=(zero_expert_num, 0),
        copy_expert_num=(copy_expert_num, 0),
        const_expert_num=(const_expert_num, 0),
    )

    world = ep_world_size
    gathered = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([bs]), group=group)
    sizes = torch.cat(gathered)
    max_bs = int(sizes.max())
    if global_bs == 0:
        require(
            bool((sizes == bs).all()),
            op,
            f"global_bs 0 needs the same BS on every rank, got {sizes.tolist()}; pass "
            "max_bs * ep_world_size",
        )
        global_bs = bs * world
    require(
        global_bs == max_bs * world,
        op,
        f"global_bs {global_bs} must be max BS x ep_world_size = {max_bs * world}",
    )
    local = moe_expert_num // world
    capacity = global_bs * min(local, k)

    flat = expert_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # expert-major, then token, then choice
    token, choice = order // k, order % k
    counts = torch.bincount(flat[order] // local, minlength=world).tolist()
    rows, _ = _exchange(group, x[token], counts)
    meta_sent = torch.stack([flat[order], token, choice], dim=1)
    meta, recv = _exchange(group, meta_sent, counts)
    src = torch.repeat_interleave(torch.arange(world), torch.tensor(recv))
    # Blocks arrive by source rank, each by expert: a stable sort by expert groups the
    # rows by local expert, then source rank.
    by_expert = torch.sort(meta[:, 0], stable=True).indices
    n = rows.shape[0]
    require(n <= capacity, op, f"{n} rows exceed A = {capacity}")
    expand_x = unwritten((capacity, h), x.dtype)
    expand_x[:n] = rows[by_expert]
    local_expert = meta[by_expert, 0] - ep_rank_id * local
    per_expert = torch.bincount(local_expert, minlength=local)
    expert_token_nums = per_expert if expert_token_nums_type == 1 else per_expert.cumsum(0)
    per_source = torch.bincount(local_expert * world + src[by_expert], minlength=local * world)
    assist = unwritten((capacity, _ASSIST_COLUMNS), torch.int32)
    assist[:n, 0] = src[by_expert].to(torch.int32)
    assist[:n, 1:3] = meta[by_expert, 1:3].to(torch.int32)
    tp_recv_counts = torch.zeros(max(tp_world_size, 0), dtype=torch.int32)
    return (
        expand_x,
        None,
        assist.reshape(-1),
        expert_token_nums.to(torch.int64),
        per_source.cumsum(0).to(torch.int32),
        tp_recv_counts,
        None,
    )


def npu_moe_distribute_combine_v2(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor,
    group_ep: str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    tp_send_counts: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expand_scales: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    group_tp: str = "",
    tp_world_size: int = 0,
    tp_rank_id: int = 0,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
) -> torch.Tensor:
    """Send the expert outputs back along dispatch's path and sum each token's K rows
    weighted by ``expert_scales`` (see the module doc).

    Returns ``x [BS, H]`` in ``expand_x``'s dtype. A collective over ``group_ep``.
    """
    op = _COMBINE
    group = _domain(
        op,
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        x_active_mask=(x_active_mask, None),
        expand_scales=(expand_scales, None),  # A3: "暂不支持该参数"
        shared_expert_x=(shared_expert_x, None),
        tp_world_size=(tp_world_size if tp_world_size > 1 else 0, 0),
        shared_expert_rank_num=(shared_expert_rank_num, 0),
        comm_quant_mode=(comm_quant_mode, 0),
    )
    require(
        expand_x.dim() == 2 and expand_x.dtype in _HALF,
        op,
        f"expand_x must be bfloat16 / float16 [A, H], got {expand_x.dtype} {list(expand_x.shape)}",
    )
    capacity, h = expand_x.shape
    _width(op, h, dispatch=False)
    bs = expert_ids.shape[0] if expert_ids.dim() == 2 else -1
    require(0 < bs <= _MAX_BS, op, f"BS {bs} must be in (0, {_MAX_BS}]")
    k = _routing(op, expert_ids, bs, moe_expert_num)
    require(
        expert_scales.dtype == torch.float32 and tuple(expert_scales.shape) == (bs, k),
        op,
        f"expert_scales must be float32 [{bs}, {k}], got {expert_scales.dtype} "
        f"{list(expert_scales.shape)}",
    )
    local = moe_expert_num // ep_world_size
    require(
        assist_info_for_combine.dtype == torch.int32
        and assist_info_for_combine.numel() == capacity * _ASSIST_COLUMNS,
        op,
        f"assist_info_for_combine must be int32 [A * 128 = {capacity * _ASSIST_COLUMNS}] "
        f"(A from expand_x), got {list(assist_info_for_combine.shape)}",
    )
    require(
        ep_send_counts.dtype == torch.int32
        and tuple(ep_send_counts.shape) == (ep_world_size * local,),
        op,
        f"ep_send_counts must be int32 [{ep_world_size * local}], dispatch's ep_recv_counts",
    )
    n = int(ep_send_counts[-1])
    require(0 <= n <= capacity, op, f"ep_send_counts' total {n} exceeds A = {capacity}")
    meta = assist_info_for_combine.reshape(capacity, _ASSIST_COLUMNS)[:n, :3].long()
    require(
        bool(((meta[:, 0] >= 0) & (meta[:, 0] < ep_world_size)).all()),
        op,
        "assist_info_for_combine is not what dispatch returned",
    )
    home = torch.sort(meta[:, 0], stable=True).indices
    counts = torch.bincount(meta[home, 0], minlength=ep_world_size).tolist()
    rows, _ = _exchange(group, expand_x[:n][home], counts)
    back, _ = _exchange(group, meta[home, 1:3], counts)
    require(
        back.shape[0] == bs * k,
        op,
        f"{back.shape[0]} rows came back for {bs} tokens x K {k}: expert_ids differ from "
        "dispatch's",
    )
    token, choice = back[:, 0], back[:, 1]
    weighted = rows.float() * expert_scales[token, choice][:, None]
    out = torch.zeros(bs, h, dtype=torch.float32).index_add_(0, token, weighted)
    return out.to(expand_x.dtype)
