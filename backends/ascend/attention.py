"""glmport's ``sparse_attention`` on ``torch_npu.npu_sparse_flash_attention`` (SFA), the
fused sparse MLA attention Ascend deployments of DeepSeek-V3.2 / GLM-5 call.

The op's contract: Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md``
(https://gitcode.com/Ascend/op-plugin), with CANN ops-transformer
``attention/sparse_flash_attention`` (README, aclnn page, tiling checks, golden
reference; https://gitcode.com/cann/ops-transformer); the emulator
(:mod:`glmport.backends.ascend.emulator.attention`) restates it.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F

from glmport.core.selection import log_fallback_once
from glmport.core.specs.attention import lse_as_asked

from ..generic.attention import sparse_attention as generic_sparse_attention

LATENT = 512  # the op's D: query / key / value
INT64_MAX = 2**63 - 1


def sparse_attention(
    npu: ModuleType | SimpleNamespace,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    need_lse: bool = True,
    k_rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA sparse attention through ``npu.npu_sparse_flash_attention``.

    Inside the declared capability: ``q [T, H, 576]`` bf16 | fp16 with ``H`` in
    1/2/4/.../128, ``k [N, 1, 576]`` (latent 512 + rope 64), ``v [N, 1, 512]``,
    ``indices [T, K]`` int32 | int64 global slots (``-1`` ignored). Returns ``out
    [T, H, 512]`` in ``q``'s dtype and ``lse [T, H]`` fp32 (natural log of
    ``sum exp(scale * q . k)`` over the selected slots); a row with no valid slot gives
    ``out = 0``, ``lse = -inf``.

    Docs: Ascend/op-plugin (https://gitcode.com/Ascend/op-plugin)
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md``; CANN ops-transformer
    ``attention/sparse_flash_attention`` (https://gitcode.com/cann/ops-transformer).

    Or, with the rope key stored apart (``k [N, 1, 512]`` with ``v`` = ``k``, ``k_rope
    [N, 1, 64]``: the paged cache's layout), the same over the cache in place.

    How glmport's conventions map onto the op:

    - Layout, split cache in inference: ``layout_kv="PA_BSND"`` over the cache itself.
      ``k`` and ``k_rope`` are viewed as ``[N / bs, bs, 1, D]`` pages (``bs`` the
      largest power of two from 1024 down to 16 that divides ``N``) and one batch's
      ``block_table`` is ``0, 1, 2, ...``: its position ``p`` is slot ``p``, so
      glmport's physical slot ids are the positions the op takes. Nothing is copied or
      read back.
    - Otherwise (``need_lse``: the page documents no ``return_softmax_lse`` with
      PA_BSND; a pool no such ``bs`` divides; a joint cache): one batch holds all ``N``
      slots, ``layout_query = layout_kv = "TND"`` with cumulative lengths ``[T]`` /
      ``[S2]``, so glmport's global slot ids are the batch-relative block ids the op
      takes (``sparse_block_size=1``: one token per id). The split cache goes in as it
      is; the op takes no non-contiguous key, so a joint ``k [N, 1, 576]`` has
      ``k[..., :512]`` and ``k[..., 512:]`` copied on every call.
    - Either way ``sparse_mode=0`` ("only the sparse selection, no extra causal mask"):
      causality is already in the indices, while mode 3's rightDownCausal crop would
      restrict row ``i`` to slots ``<= S2 - T + i``, which glmport's arbitrary (e.g.
      paged) slots do not obey.
    - The op reads only a row's first ``min(K, S2)`` entries, so the kv sequence is
      ``S2 = max(N, K)`` long (rows past ``N``, never selected: zero padding in TND,
      block 0 again in the page table): with ``N < K`` and repeated slots a row can
      hold more than ``N`` valid entries.
    - Indices: entries outside ``[0, N)`` become ``-1`` (glmport's rule, also what
      ``GLMPORT_VALIDATE=meta`` needs: nothing out of bounds reaches the op), then each
      row is sorted descending, which puts the ``-1`` padding last as the op requires
      (its kernel stops at the first ``-1``); the order of a row's slots does not change
      the softmax. A slot listed twice counts twice, as in glmport.
    - MLA-absorb: ``attention_mode=2`` is passed explicitly, like every keyword that
      drifts between builds (torch_npu defaults it to 0, vllm-ascend's ``_C_ascend``
      copy to 2). ``q`` and ``k`` are split into the op's 512-wide ``query`` / ``key`` and
      64-wide ``query_rope`` / ``key_rope`` (contiguous copies: the op takes no
      non-contiguous input). In this mode the op uses ``key`` as the value ("key and
      value share the same data"), so it can only compute glmport's op when ``v`` is
      ``k[..., :512]``: a view of ``k``, recognised from its storage (no sync, what the
      model passes). Any other ``v`` runs the generic backend's composite, logged, even
      one equal in value: comparing it would read the whole cache and sync the host.
    - lse: only when the caller asks (``need_lse``; training and replay records): the
      page documents ``return_softmax_lse=True`` for training only and not in graph
      mode, so inference calls leave it False and get ``lse`` as ``[0]``. With it the op
      gives fp32 ``softmax_max`` (max of the scaled scores) and ``softmax_sum``
      (``sum exp(s - max)``), ``[1, T, H]`` in TND, so
      ``lse = softmax_max + log(softmax_sum)``. The op leaves a row that selects no
      token undefined (measured: ``softmax_max = -2e38``, ``softmax_sum`` = the slot
      count), so such rows are masked here to ``out = 0``, ``lse = -inf``.
    - The op rejects empty ``query`` / ``key`` / ``sparse_indices``: ``T = 0``,
      ``N = 0`` or ``K = 0`` return the empty result without calling it.

    Host data: the two length tensors are built from Python ints (a host-to-device copy,
    no sync); the op's API takes them as device int32 tensors.
    """
    t, h, _ = q.shape
    n, kk = k.shape[0], indices.shape[1]
    valid = (indices >= 0) & (indices < n)  # [T, K]
    has_slot = valid.any(dim=1)  # [T]
    if t == 0 or n == 0 or kk == 0:
        out = torch.zeros((t, h, LATENT), dtype=q.dtype, device=q.device)
        lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse_as_asked(lse, need_lse)
    if not _is_latent_view(k, v):
        log_fallback_once(
            "ascend", "sparse_attention", "generic", "cannot take a v that is not k[..., :512] in"
        )
        return generic_sparse_attention(q, k, v, indices, scale, need_lse, k_rope)
    s2 = max(n, kk)
    page = None if k_rope is None or need_lse else _page_size(k, k_rope)
    if page is not None:
        key, key_rope = k.view(n // page, page, 1, LATENT), k_rope.view(n // page, page, 1, -1)
        # Slot p is position p; positions past N (only when K > N) name block 0 again.
        table = (torch.arange(-(-s2 // page), device=q.device) % (n // page)).to(torch.int32)
        table, layout = table[None, :], "PA_BSND"
    else:
        nope, rope = (k[..., :LATENT], k[..., LATENT:]) if k_rope is None else (k, k_rope)
        key, key_rope, table, layout = _padded(nope, s2), _padded(rope, s2), None, "TND"
    slots = torch.where(valid, indices, -1).to(torch.int32)
    slots = torch.sort(slots, dim=1, descending=True).values.reshape(t, 1, kk).contiguous()
    out, softmax_max, softmax_sum = npu.npu_sparse_flash_attention(
        q[..., :LATENT].contiguous(),
        key,
        key,
        slots,
        float(scale),
        block_table=table,
        actual_seq_lengths_query=torch.tensor([t], dtype=torch.int32, device=q.device),
        # One batch: its length, which is also the TND prefix sum.
        actual_seq_lengths_kv=torch.tensor([s2], dtype=torch.int32, device=q.device),
        query_rope=q[..., LATENT:].contiguous(),
        key_rope=key_rope,
        sparse_block_size=1,
        layout_query="TND",
        layout_kv=layout,
        sparse_mode=0,
        pre_tokens=INT64_MAX,
        next_tokens=INT64_MAX,
        attention_mode=2,
        return_softmax_lse=need_lse,
    )
    out = torch.where(has_slot[:, None, None], out, 0.0)
    if not need_lse:  # the op computed no softmax_max / softmax_sum: lse is [0]
        return out, softmax_max.new_empty((0,))
    lse = (softmax_max + torch.log(softmax_sum))[0]  # [1, T, H] -> [T, H]
    return out, torch.where(has_slot[:, None], lse, float("-inf"))


def _is_latent_view(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when ``v`` is ``k[..., :512]`` by storage: same data, no sync."""
    return (
        torch._C._is_alias_of(v, k)
        and v.storage_offset() == k.storage_offset()
        and v.shape == (*k.shape[:2], LATENT)
        and v.stride() == k.stride()
    )


def _page_size(k: torch.Tensor, k_rope: torch.Tensor) -> int | None:
    """The largest page the op takes (a power of two, 1024 down to 16) that splits the
    ``N`` rows of contiguous ``k`` / ``k_rope`` into whole pages; None if none does."""
    if not (k.is_contiguous() and k_rope.is_contiguous()):
        return None
    n = k.shape[0]
    return next((p for p in (1024, 512, 256, 128, 64, 32, 16) if n % p == 0), None)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [N, 1, D]`` as a contiguous ``[rows, 1, D]``: ``x`` itself when it already is
    one, else a copy with zero rows appended."""
    if x.shape[0] == rows and x.is_contiguous():
        return x
    return F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0])).contiguous()
