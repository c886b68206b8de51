"""Emulated ``torch_npu.npu_sparse_flash_attention`` (SFA, DeepSeek-V3.2 / GLM-5's
sparse MLA attention on Atlas A2 / A3), following its documented contract.

Sources (the torch_npu page decides where they differ):

- torch_npu: https://gitcode.com/Ascend/op-plugin,
  ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md`` (older copy
  ``docs/context/torch_npu-npu_sparse_flash_attention.md``), and the binding
  ``op_plugin/ops/opapi/SparseFlashAttentionKernelNpuOpApi.cpp`` (empty-tensor checks,
  the softmax outputs' shapes, ``[0]`` when they are not requested).
- CANN ops-transformer ``attention/sparse_flash_attention``
  (https://gitcode.com/cann/ops-transformer): ``README.md``,
  ``docs/aclnnSparseFlashAttention.md``, the parameter checks of
  ``op_host/sparse_flash_attention_tiling.cpp`` and the reference of
  ``tests/pytest/sparse_flash_attention_golden.py`` (which slots a row reads, the
  causal crop, ``softmax_max`` / ``softmax_sum``).
- Mirror: mindspore.ops.sparse_flash_attention,
  https://www.mindspore.cn/docs/en/master/api_python/ops/mindspore.ops.sparse_flash_attention.html
"""

from __future__ import annotations

import math

import torch

from .contract import cumulative_segments, require

OP = "npu_sparse_flash_attention"
INT64_MAX = 2**63 - 1
Q_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # N1 on Atlas A2 / A3
HEAD_DIM = 512
ROPE_DIM = 64
MAX_PAGE_BLOCK = 1024
# The kernel's SOFTMAX_MIN_NUM: the score of a masked slot.
SOFTMAX_MIN_NUM = -2e38
LOW_DTYPES = (torch.float16, torch.bfloat16)
_LQ = "actual_seq_lengths_query"
_LKV = "actual_seq_lengths_kv"


def npu_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: torch.Tensor | None = None,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_kv: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    attention_mode: int = 0,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA-absorb attention of each query over the KV blocks its row of
    ``sparse_indices`` selects.

    Docs: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md``; CANN
    ops-transformer ``attention/sparse_flash_attention`` (more in the module docstring).

    Layouts: ``layout_query`` BSND (``query [B, S1, N1, 512]``) or TND
    (``[T1, N1, 512]``, ``actual_seq_lengths_query`` CUMULATIVE ``[B]`` int32, required);
    ``layout_kv`` BSND (``key [B, S2, 1, 512]``), TND (``[T2, 1, 512]``,
    ``actual_seq_lengths_kv`` cumulative, required) or PA_BSND (``[block_num,
    block_size, 1, 512]`` with ``block_table [B, >= ceil(max S2 / block_size)]`` int32
    and per-batch ``actual_seq_lengths_kv``, required). BSND / TND kv need
    ``layout_query == layout_kv``. Outside TND the lengths are per batch, optional
    (default: the S axis).

    MLA-absorb (``attention_mode=2``, the only mode): the scores are
    ``scale_value * (query . key + query_rope . key_rope)`` (``query_rope`` /
    ``key_rope``: the same shapes with D = 64) and the values are ``key``'s 512
    columns: key and value must share one tensor's data (checked here by equality).

    ``sparse_indices`` ``[B, S1, 1, K]`` (BSND) / ``[T1, 1, K]`` (TND) int32: block ids
    relative to the batch's kv sequence; entry ``j`` selects tokens
    ``[j * sparse_block_size, (j + 1) * sparse_block_size)``. ``-1`` pads a row, valid
    entries first. Query row ``i`` of a batch with valid lengths ``Lq``, ``Lkv`` may
    read the tokens before ``threshold = Lkv`` (``sparse_mode=0``: selection only) or
    ``Lkv - Lq + i + 1`` (``sparse_mode=3``: rightDownCausal crop on top of the
    selection). The kernel reads the first ``min(K, ceil(threshold /
    sparse_block_size))`` entries up to the first ``-1``; tokens at or past the
    threshold are skipped; a slot listed twice counts twice.

    Returns ``(attention_out, softmax_max, softmax_sum)``: ``attention_out`` the
    query's layout and dtype; with ``return_softmax_lse`` fp32 ``softmax_max`` (the row
    max of the SCALED scores) and ``softmax_sum`` (``sum exp(score - softmax_max)``,
    natural exp) of shape ``[B, 1, S1, N1]`` (BSND) / ``[1, T1, N1]`` (TND), so
    ``lse = softmax_max + log(softmax_sum)``; without it, two empty ``[0]`` fp32
    tensors. A row with nothing to read (causal threshold <= 0, kv length 0, padding
    rows past ``actual_seq_lengths_query``) is 0 in all three. A row whose examined
    entries select no token is not defined by the docs: the kernel softmaxes all-masked
    scores, measured on A3 (sgl-kernel-npu's SFA LSE tests) as ``softmax_max = -2e38``,
    ``softmax_sum`` = the slot count; its ``attention_out`` is unmeasured, so it is NaN
    here: a caller must mask such rows itself.

    Computes in float32; ``exp(score - max)`` is rounded to the query's dtype before
    the value product, as the kernel's second matmul takes it. Raises
    ``NpuContractError`` on every documented constraint (see ``_check``).
    """
    _check(
        query,
        key,
        value,
        sparse_indices,
        block_table,
        actual_seq_lengths_query,
        actual_seq_lengths_kv,
        query_rope,
        key_rope,
        sparse_block_size,
        layout_query,
        layout_kv,
        sparse_mode,
        pre_tokens,
        next_tokens,
        attention_mode,
        return_softmax_lse,
        sinks,
    )
    q_rows = _query_batches(query, layout_query, actual_seq_lengths_query)
    kv_seqs = _kv_batches(key, key_rope, layout_kv, actual_seq_lengths_kv, block_table, len(q_rows))
    n1 = query.shape[-2]
    q = query.reshape(-1, n1, HEAD_DIM).float()
    qr = query_rope.reshape(-1, n1, ROPE_DIM).float()
    idx = sparse_indices.reshape(q.shape[0], -1).long()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row_max = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    row_sum = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    for (start, lq), (kn, kr) in zip(q_rows, kv_seqs, strict=True):
        lkv = kn.shape[0]
        for i in range(lq):
            threshold = lkv if sparse_mode == 0 else lkv - lq + i + 1
            if threshold <= 0:
                continue  # the kernel's all-zero row
            r = start + i
            tokens, slots = _row_tokens(idx[r], threshold, sparse_block_size)
            if tokens.numel() == 0:
                out[r] = float("nan")
                row_max[r] = SOFTMAX_MIN_NUM
                row_sum[r] = float(slots)
                continue
            s = (q[r] @ kn[tokens].T + qr[r] @ kr[tokens].T) * scale_value  # [N1, n]
            m = s.max(dim=-1).values
            e = torch.exp(s - m[:, None])
            total = e.sum(dim=-1)
            out[r] = (e.to(query.dtype).float() @ kn[tokens]) / total[:, None]
            row_max[r], row_sum[r] = m, total
    attention_out = out.to(query.dtype).view(query.shape)
    if not return_softmax_lse:
        empty = torch.empty(0, dtype=torch.float32, device=q.device)
        return attention_out, empty, empty.clone()
    if layout_query == "BSND":
        b, s1 = query.shape[:2]
        return (
            attention_out,
            row_max.view(b, s1, n1).unsqueeze(1),
            row_sum.view(b, s1, n1).unsqueeze(1),
        )
    return attention_out, row_max.unsqueeze(0), row_sum.unsqueeze(0)


def _row_tokens(row: torch.Tensor, threshold: int, block: int) -> tuple[torch.Tensor, int]:
    """The kv positions one query row reads, and how many slots the kernel examines
    (``min(K * block, threshold)``)."""
    examined = row[: min(row.shape[0], math.ceil(threshold / block))]
    pad = (examined == -1).nonzero()
    if pad.numel():
        examined = examined[: int(pad[0])]
    pos = (examined[:, None] * block + torch.arange(block, device=row.device)[None, :]).reshape(-1)
    return pos[pos < threshold], min(row.shape[0] * block, threshold)


def _query_batches(query, layout, lengths) -> list[tuple[int, int]]:
    """``(first flat row, valid length)`` per batch of the query."""
    if layout == "TND":
        return [(s, e - s) for s, e in cumulative_segments(lengths, query.shape[0], OP, _LQ)]
    b, s1 = query.shape[:2]
    valid = [s1] * b if lengths is None else [int(v) for v in lengths.tolist()]
    require(len(valid) == b, OP, f"{_LQ} must hold B={b} lengths, got {len(valid)}")
    require(
        all(0 <= v <= s1 for v in valid),
        OP,
        f"{_LQ}: each batch's valid token count lies in [0, S1={s1}], got {valid}",
    )
    return [(i * s1, v) for i, v in enumerate(valid)]


def _kv_batches(key, key_rope, layout, lengths, block_table, batch) -> list[tuple]:
    """Per batch the valid kv sequence as fp32 ``(nope [Lkv, 512], rope [Lkv, 64])``."""
    kn, kr = key.float(), key_rope.float()
    if layout == "TND":
        segs = cumulative_segments(lengths, key.shape[0], OP, _LKV)
        require(len(segs) == batch, OP, f"{_LKV} must hold B={batch} prefix sums")
        return [(kn[s:e, 0], kr[s:e, 0]) for s, e in segs]
    if layout == "BSND":
        require(
            key.shape[0] == batch, OP, f"key's batch {key.shape[0]} must equal query's B={batch}"
        )
        seq_cap = key.shape[1]
    else:
        require(
            block_table.shape[0] == batch,
            OP,
            f"block_table's first dim {block_table.shape[0]} must equal the batch size {batch}",
        )
        seq_cap = block_table.shape[1] * key.shape[1]
    valid = [seq_cap] * batch if lengths is None else [int(v) for v in lengths.tolist()]
    require(len(valid) == batch, OP, f"{_LKV} must hold B={batch} lengths, got {len(valid)}")
    require(
        all(0 <= v <= seq_cap for v in valid),
        OP,
        f"{_LKV}: each batch's valid token count lies in [0, {seq_cap}], got {valid}",
    )
    if layout == "BSND":
        return [(kn[b, :v, 0], kr[b, :v, 0]) for b, v in enumerate(valid)]
    return _paged(kn, kr, block_table, valid)


def _paged(kn, kr, block_table, valid) -> list[tuple]:
    """PA_BSND: batch ``b``'s token ``p`` lives in block ``block_table[b, p // bs]``."""
    num_blocks, bs = kn.shape[:2]
    seqs = []
    for b, v in enumerate(valid):
        blocks = block_table[b, : math.ceil(v / bs)].long()
        require(
            bool(((blocks >= 0) & (blocks < num_blocks)).all()),
            OP,
            f"block_table[{b}] must map the batch's {v} tokens to blocks in "
            f"[0, block_num={num_blocks}), got {blocks.tolist()}",
        )
        nope = kn[blocks, :, 0].reshape(-1, HEAD_DIM)[:v]
        seqs.append((nope, kr[blocks, :, 0].reshape(-1, ROPE_DIM)[:v]))
    return seqs


def _check(
    query,
    key,
    value,
    sparse_indices,
    block_table,
    lengths_q,
    lengths_kv,
    query_rope,
    key_rope,
    sparse_block_size,
    layout_query,
    layout_kv,
    sparse_mode,
    pre_tokens,
    next_tokens,
    attention_mode,
    return_softmax_lse,
    sinks,
) -> None:
    """The documented constraints (torch_npu page, ops-transformer README / aclnn page /
    tiling checks, op-plugin binding), in the order the real op checks them."""
    require(
        layout_query in ("BSND", "TND"),
        OP,
        f"layout_query supports BSND and TND, got {layout_query!r}",
    )
    require(
        layout_kv in ("BSND", "TND", "PA_BSND"),
        OP,
        f"layout_kv supports BSND, TND and PA_BSND, got {layout_kv!r}",
    )
    require(
        layout_kv == "PA_BSND" or layout_kv == layout_query,
        OP,
        f"layout_kv {layout_kv} (not PA_BSND) must equal layout_query {layout_query}",
    )
    require(
        attention_mode == 2,
        OP,
        f"attention_mode only supports 2 (MLA-absorb), got {attention_mode}",
    )
    require(
        query_rope is not None and key_rope is not None,
        OP,
        "attention_mode=2 (MLA-absorb) needs both query_rope and key_rope",
    )
    require(sparse_mode in (0, 3), OP, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    require(
        pre_tokens == INT64_MAX and next_tokens == INT64_MAX,
        OP,
        f"pre_tokens / next_tokens only support 2^63-1, got {pre_tokens} / {next_tokens}",
    )
    sbs = sparse_block_size
    require(
        1 <= sbs <= 128 and sbs & (sbs - 1) == 0,
        OP,
        f"sparse_block_size must be a power of 2 in [1, 128], got {sbs}",
    )
    require(sinks is None, OP, "sinks is not supported on Atlas A2 / A3")
    require(
        not (return_softmax_lse and layout_kv == "PA_BSND"),
        OP,
        "return_softmax_lse=True is not supported with layout_kv PA_BSND",
    )
    require(
        query.dtype in LOW_DTYPES,
        OP,
        f"query supports float16 and bfloat16, got {query.dtype}",
    )
    floats = (("key", key), ("value", value), ("query_rope", query_rope), ("key_rope", key_rope))
    for name, t in floats:
        require(
            t.dtype == query.dtype,
            OP,
            f"{name} must have query's dtype {query.dtype}, got {t.dtype}",
        )
    named_ints = (
        ("sparse_indices", sparse_indices),
        ("block_table", block_table),
        (_LQ, lengths_q),
        (_LKV, lengths_kv),
    )
    for name, t in named_ints:
        require(
            t is None or t.dtype == torch.int32,
            OP,
            f"{name} must be int32, got {None if t is None else t.dtype}",
        )
    for name, t in ((_LQ, lengths_q), (_LKV, lengths_kv)):
        require(t is None or t.dim() == 1, OP, f"{name} is a 1-D tensor of length B")
    require(
        layout_query != "TND" or lengths_q is not None,
        OP,
        f"{_LQ} is required with layout_query TND",
    )
    require(
        layout_kv == "BSND" or lengths_kv is not None,
        OP,
        f"{_LKV} is required with layout_kv {layout_kv}",
    )
    for name, t in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("sparse_indices", sparse_indices),
        ("query_rope", query_rope),
        ("key_rope", key_rope),
    ):
        require(t.is_contiguous(), OP, f"{name} must be contiguous (non-contiguous is unsupported)")
    for name, t in (("query", query), ("key", key), ("sparse_indices", sparse_indices)):
        require(t.numel() > 0, OP, f"tensor {name} is empty")
    _check_shapes(query, key, value, sparse_indices, query_rope, key_rope, layout_query, layout_kv)
    _check_pages(key, block_table, layout_kv, sbs)
    require(
        bool((sparse_indices >= -1).all()),
        OP,
        "sparse_indices holds block ids >= 0 and -1 (an invalid slot)",
    )
    rows = sparse_indices.reshape(-1, sparse_indices.shape[-1])
    after_pad = torch.cummax((rows == -1).int(), dim=1).values.bool()
    require(
        bool((rows[after_pad] == -1).all()),
        OP,
        "sparse_indices: each row's valid entries come first, its -1 entries last",
    )
    require(
        torch.equal(key, value),
        OP,
        "attention_mode=2 (MLA-absorb): key and value share the same data",
    )


def _check_shapes(query, key, value, indices, query_rope, key_rope, layout_query, layout_kv):
    q_dims = 4 if layout_query == "BSND" else 3
    kv_dims = 3 if layout_kv == "TND" else 4
    require(
        query.dim() == q_dims,
        OP,
        f"query is {q_dims}-D in layout {layout_query}, got shape {tuple(query.shape)}",
    )
    require(
        key.dim() == kv_dims,
        OP,
        f"key is {kv_dims}-D in layout {layout_kv}, got shape {tuple(key.shape)}",
    )
    n1, n2 = query.shape[-2], key.shape[-2]
    require(n1 in Q_HEADS, OP, f"query's head count N1 supports {Q_HEADS}, got {n1}")
    require(n2 == 1, OP, f"key's head count KV_N only supports 1, got {n2}")
    require(
        query.shape[-1] == HEAD_DIM and key.shape[-1] == HEAD_DIM,
        OP,
        f"query / key / value D must be {HEAD_DIM}, got {query.shape[-1]} / {key.shape[-1]}",
    )
    require(
        value.shape == key.shape,
        OP,
        f"value's shape {tuple(value.shape)} must equal key's {tuple(key.shape)}",
    )
    require(
        query_rope.shape == (*query.shape[:-1], ROPE_DIM),
        OP,
        f"query_rope must be query's shape with D_rope={ROPE_DIM}, got {tuple(query_rope.shape)}",
    )
    require(
        key_rope.shape == (*key.shape[:-1], ROPE_DIM),
        OP,
        f"key_rope must be key's shape with D_rope={ROPE_DIM}, got {tuple(key_rope.shape)}",
    )
    want = (*query.shape[:-2], 1)
    require(
        indices.dim() == q_dims and indices.shape[:-1] == want and indices.shape[-1] > 0,
        OP,
        f"sparse_indices must be [{', '.join(map(str, want))}, sparse_size > 0] in layout "
        f"{layout_query}, got {tuple(indices.shape)}",
    )


def _check_pages(key, block_table, layout_kv, sbs) -> None:
    if layout_kv != "PA_BSND":
        require(block_table is None, OP, f"block_table must be None with layout_kv {layout_kv}")
        return
    require(block_table is not None, OP, "layout_kv PA_BSND needs block_table")
    require(
        block_table.dim() == 2 and block_table.shape[1] > 0,
        OP,
        f"block_table is 2-D [B, max blocks > 0], got {tuple(block_table.shape)}",
    )
    bs = key.shape[1]
    require(
        bs % 16 == 0 and 0 < bs <= MAX_PAGE_BLOCK,
        OP,
        f"PA_BSND block_size is a multiple of 16 up to {MAX_PAGE_BLOCK}, got {bs}",
    )
    require(bs % sbs == 0, OP, f"sparse_block_size {sbs} must divide block_size {bs}")
