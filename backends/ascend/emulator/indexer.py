"""CPU emulator of ``torch_npu.npu_lightning_indexer`` (DeepSeek Sparse Attention's
lightning indexer), written from its documentation:

- torch_npu: ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md`` in
  https://gitcode.com/Ascend/op-plugin (mirror github.com/Ascend/op-plugin, read at
  commit 517f2e7d, Aug 2026; older copies under ``docs/context/`` and ``docs/en/``);
- CANN's ``aclnnLightningIndexer``: ``attention/lightning_indexer/docs/aclnnLightningIndexer.md``
  in https://gitcode.com/cann/ops-transformer (same parameters, the error table);
- MindSpore's mirror ``mindspore.ops.lightning_indexer``
  (https://www.mindspore.cn/docs/en/master/api_python/ops/mindspore.ops.lightning_indexer.html).

Where the versions disagree this follows the newest torch_npu page: up to 64 query
heads on Atlas A2 / A3 (earlier pages and MindSpore: exactly 64, "only 64 in TND"),
float32 ``weights`` allowed (earlier: the query's dtype), ``sparse_count`` in
``[1, 2048]`` or ``3072 .. 8192`` in steps of 1024 (earlier: ``[1, 2048]``).

The emulated build (:mod:`.build`) picks the contract: a version before TorchNPU
26.1.0 takes exactly 64 query heads with weights in the query's dtype.

What the pages leave open and this emulator fixes (adapters must not rely on it):
the order of ``sparse_indices`` within a row (CANN's own test compares them as sorted
sets; here best first, ties to the lower key position, as its golden's stable sort),
the ``sparse_values`` of ``-1`` slots (here ``-inf``), and what the indices of a
multi-batch TND call count from: each batch's own keys by default, the whole key
tensor when the emulated build says ``indexer_positions="global"``.
"""

from __future__ import annotations

import torch

from ..chips import indexer_takes_any_heads
from .build import current_build
from .contract import cumulative_segments, require

OP = "npu_lightning_indexer"
INT64_MAX = 2**63 - 1
# Documented sparse_count values above the contiguous [1, 2048].
LARGE_SPARSE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)
MAX_QUERY_HEADS = 64  # Atlas A2 / A3: N1 <= 64
HEAD_DIM = 128
MAX_BLOCK_SIZE = 1024


def npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_key: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = INT64_MAX,
    next_tokens: int = INT64_MAX,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``sparse_count`` key positions of every query token.

    ``score[s1, s2] = sum_g weights[s1, g] * relu(query[s1, g] . key[s2])`` (one key
    head, N2 = 1, shared by the N1 query heads), computed here in float32.

    Layouts (``layout_query`` / ``layout_key``; without PageAttention they must match):

    - ``BSND``: query ``[B, S1, N1, D]``, weights ``[B, S1, N1]``, key ``[B, S2, N2, D]``;
      ``actual_seq_lengths_*`` (optional) are per-batch lengths ``<= S1`` / ``S2``.
    - ``TND``: query ``[T1, N1, D]``, weights ``[T1, N1]``, key ``[T2, N2, D]``;
      ``actual_seq_lengths_*`` are required and CUMULATIVE (their count is B).
    - ``PA_BSND`` (key only): key ``[block_count, block_size, N2, D]``, batch ``b``'s
      position ``p`` at ``key[block_table[b, p // block_size], p % block_size]``;
      ``actual_seq_lengths_key`` (per-batch lengths) and ``block_table [B, >= blocks]``
      are required.

    ``sparse_mode`` 0 lets every valid query see every valid key of its batch; 3
    (rightDownCausal) lets query ``i`` of a batch with S1 queries and S2 keys (actual
    lengths) see keys ``j <= i + S2 - S1``.

    Returns:
        sparse_indices: int32 ``[B, S1, N2, sparse_count]`` (BSND query) or
        ``[T1, N2, sparse_count]`` (TND query): positions within the batch's own key
        sequence (0-based; in the whole TND key tensor under a ``"global"`` build),
        ``min(sparse_count, visible keys)`` of them, then ``-1``
        (also every slot of a query row past ``actual_seq_lengths_query``).
        sparse_values: the matching scores in ``query``'s dtype, same shape (``-inf``
        at ``-1`` slots), or an empty ``[0]`` tensor unless ``return_value``.

    Raises ``NpuContractError`` where the documentation restricts an argument: dtypes
    (query / key bf16 or fp16 and equal; weights bf16 / fp16 / fp32, equal to query's
    unless fp32; equal before 26.1.0), contiguity, empty tensors, N1 in ``[1, 64]``
    (Atlas A2 / A3; exactly 64 before 26.1.0), N2 = 1,
    D = 128, layouts and their combination, sequence lengths (int32, ``[0, S]`` or
    non-decreasing prefix sums ending at T), block_size a multiple of 16 up to 1024,
    block_table's shape, sparse_count in ``[1, 2048]`` or 3072 / 4096 / 5120 / 6144 /
    7168 / 8192, sparse_mode 0 or 3, pre_tokens / next_tokens only ``2**63 - 1``,
    return_value not with a PA_BSND key.

    Documentation: ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md``
    (Ascend/op-plugin) and ``attention/lightning_indexer/docs/aclnnLightningIndexer.md``
    (cann/ops-transformer); see the module docstring.
    """
    _check_attributes(
        layout_query, layout_key, sparse_count, sparse_mode, pre_tokens, next_tokens, return_value
    )
    build = current_build()
    any_heads = indexer_takes_any_heads(build.version)  # the contract this build documents
    _check_inputs(query, key, weights, any_heads)
    batches = _batches(
        query,
        key,
        weights,
        block_table,
        actual_seq_lengths_query,
        actual_seq_lengths_key,
        layout_query,
        layout_key,
        any_heads,
    )
    n1 = query.shape[-2]
    q_rows = query.reshape(-1, n1, HEAD_DIM).float()
    w_rows = weights.reshape(-1, n1).float()
    rows = q_rows.shape[0]
    indices = torch.full((rows, sparse_count), -1, dtype=torch.int32)
    values = torch.full((rows, sparse_count), float("-inf"), dtype=torch.float32)
    for q0, s1, keys, key_start in batches:
        s2 = keys.shape[0]
        dots = torch.einsum("sgd,nd->sgn", q_rows[q0 : q0 + s1], keys).relu()
        scores = torch.einsum("sg,sgn->sn", w_rows[q0 : q0 + s1], dots)  # [S1, S2]
        position = torch.arange(s2)
        if sparse_mode == 3:
            last = torch.arange(s1)[:, None] + (s2 - s1)  # right-down causal diagonal
            visible = position[None, :] <= last
        else:
            visible = torch.ones(s1, s2, dtype=torch.bool)
        scores = scores.masked_fill(~visible, float("-inf"))
        # Best first; a stable sort keeps the lower position first among equal scores.
        best, order = torch.sort(scores, dim=1, descending=True, stable=True)
        width = min(sparse_count, s2)
        keep = torch.arange(width)[None, :] < visible.sum(dim=1, keepdim=True)
        if build.indexer_positions == "global":
            order = order + key_start
        indices[q0 : q0 + s1, :width] = torch.where(keep, order[:, :width], -1).to(torch.int32)
        values[q0 : q0 + s1, :width] = torch.where(keep, best[:, :width], float("-inf"))
    if layout_query == "BSND":
        shape = (query.shape[0], query.shape[1], 1, sparse_count)
    else:
        shape = (query.shape[0], 1, sparse_count)
    out_values = values.to(query.dtype).reshape(shape) if return_value else query.new_empty((0,))
    return indices.reshape(shape), out_values


def _check_attributes(
    layout_query, layout_key, sparse_count, sparse_mode, pre_tokens, next_tokens, return_value
) -> None:
    require(
        layout_query in ("BSND", "TND"),
        OP,
        f"layout_query must be 'BSND' or 'TND', got {layout_query!r}",
    )
    require(
        layout_key in ("PA_BSND", "BSND", "TND"),
        OP,
        f"layout_key must be 'PA_BSND', 'BSND' or 'TND', got {layout_key!r}",
    )
    require(
        layout_key in ("PA_BSND", layout_query),
        OP,
        f"layout_key must equal layout_query without PageAttention, got "
        f"layout_query={layout_query!r}, layout_key={layout_key!r}",
    )
    require(
        1 <= sparse_count <= 2048 or sparse_count in LARGE_SPARSE_COUNTS,
        OP,
        f"sparse_count must be in [1, 2048] or one of {LARGE_SPARSE_COUNTS}, got {sparse_count}",
    )
    require(sparse_mode in (0, 3), OP, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    for name, value in (("pre_tokens", pre_tokens), ("next_tokens", next_tokens)):
        require(value == INT64_MAX, OP, f"{name} supports only its default 2**63-1, got {value}")
    require(
        not (return_value and layout_key == "PA_BSND"),
        OP,
        "return_value=True is supported only when layout_key is not 'PA_BSND'",
    )


def _check_inputs(
    query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, any_heads: bool
) -> None:
    half = (torch.bfloat16, torch.float16)
    require(query.dtype in half, OP, f"query must be bfloat16 or float16, got {query.dtype}")
    require(
        key.dtype == query.dtype,
        OP,
        f"key must have query's dtype {query.dtype}, got {key.dtype}",
    )
    if any_heads:
        require(
            weights.dtype in (query.dtype, torch.float32),
            OP,
            f"weights must be float32 or query's dtype {query.dtype}, got {weights.dtype}",
        )
    else:
        require(
            weights.dtype == query.dtype,
            OP,
            f"weights must have query's dtype {query.dtype} (pages before 2026-03), "
            f"got {weights.dtype}",
        )
    for name, t in (("query", query), ("key", key), ("weights", weights)):
        require(t.numel() > 0, OP, f"{name} must not be an empty tensor, got {list(t.shape)}")
        # Atlas A2 / A3: no non-contiguous query, key or weights.
        require(t.is_contiguous(), OP, f"{name} must be contiguous")


def _lengths(
    lengths: torch.Tensor | None, name: str, batch: int, bound: int, *, required: bool
) -> list[int]:
    """Per-batch actual lengths (BSND / PA_BSND): ``[B]`` int32 in ``[0, bound]``."""
    if lengths is None:
        require(not required, OP, f"{name} is required with this layout")
        return [bound] * batch
    _check_length_tensor(lengths, name)
    require(
        lengths.shape[0] == batch,
        OP,
        f"{name} must hold B={batch} entries, got {lengths.shape[0]}",
    )
    values = [int(v) for v in lengths.tolist()]
    require(
        all(0 <= v <= bound for v in values),
        OP,
        f"{name} entries must lie in [0, {bound}], got {values}",
    )
    return values


def _check_length_tensor(lengths: object, name: str) -> None:
    require(
        isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int32 and lengths.dim() == 1,
        OP,
        f"{name} must be a 1-D int32 tensor",
    )


def _batches(
    query, key, weights, block_table, act_q, act_k, layout_query, layout_key, any_heads
) -> list[tuple[int, int, torch.Tensor, int]]:
    """``(first query row, S1, keys [S2, D] float32, first key row)`` per batch, after
    the shape checks. Query rows are counted in ``query.reshape(-1, N1, D)``; the first
    key row is the batch's offset in a TND key tensor (0 in the other layouts)."""
    if layout_query == "BSND":
        require(query.dim() == 4, OP, f"query must be [B, S1, N1, D], got {list(query.shape)}")
        b, s1 = query.shape[:2]
        q_lens = _lengths(act_q, "actual_seq_lengths_query", b, s1, required=False)
        q_starts = [i * s1 for i in range(b)]
    else:
        require(query.dim() == 3, OP, f"query must be [T1, N1, D], got {list(query.shape)}")
        require(
            act_q is not None, OP, "actual_seq_lengths_query is required with layout_query 'TND'"
        )
        _check_length_tensor(act_q, "actual_seq_lengths_query")
        segments = cumulative_segments(act_q, query.shape[0], OP, "actual_seq_lengths_query")
        b = len(segments)
        q_starts = [s for s, _ in segments]
        q_lens = [e - s for s, e in segments]
    n1, d = query.shape[-2:]
    if any_heads:
        require(
            1 <= n1 <= MAX_QUERY_HEADS,
            OP,
            f"query's N1 must be at most {MAX_QUERY_HEADS} (Atlas A2 / A3), got {n1}",
        )
    else:
        require(
            n1 == MAX_QUERY_HEADS,
            OP,
            f"query's N1 must be {MAX_QUERY_HEADS} (pages before 2026-03), got {n1}",
        )
    require(d == HEAD_DIM, OP, f"query's D must be {HEAD_DIM}, got {d}")
    w_shape = (*query.shape[:-2], n1)
    require(
        tuple(weights.shape) == w_shape,
        OP,
        f"weights must be {list(w_shape)} for this query, got {list(weights.shape)}",
    )
    key_dims = 3 if layout_key == "TND" else 4
    require(
        key.dim() == key_dims,
        OP,
        f"key must have {key_dims} dims with layout_key {layout_key!r}, got {list(key.shape)}",
    )
    require(key.shape[-2] == 1, OP, f"key's N2 must be 1, got {key.shape[-2]}")
    require(key.shape[-1] == HEAD_DIM, OP, f"key's D must be {HEAD_DIM}, got {key.shape[-1]}")
    flat_keys = key.reshape(*key.shape[:-2], HEAD_DIM).float()
    if layout_key == "TND":
        require(act_k is not None, OP, "actual_seq_lengths_key is required with layout_key 'TND'")
        _check_length_tensor(act_k, "actual_seq_lengths_key")
        segments = cumulative_segments(act_k, key.shape[0], OP, "actual_seq_lengths_key")
        require(
            len(segments) == b,
            OP,
            f"actual_seq_lengths_key must hold B={b} entries, got {len(segments)}",
        )
        keys = [flat_keys[s:e] for s, e in segments]
        key_starts = [s for s, _ in segments]
    elif layout_key == "BSND":
        require(key.shape[0] == b, OP, f"key's B must be the query's {b}, got {key.shape[0]}")
        k_lens = _lengths(act_k, "actual_seq_lengths_key", b, key.shape[1], required=False)
        keys = [flat_keys[i, :n] for i, n in enumerate(k_lens)]
        key_starts = [0] * b
    else:
        keys = _paged_keys(flat_keys, block_table, act_k, b)
        key_starts = [0] * b
    return [(q_starts[i], q_lens[i], keys[i], key_starts[i]) for i in range(b)]


def _paged_keys(
    blocks: torch.Tensor, block_table: torch.Tensor | None, act_k: torch.Tensor | None, b: int
) -> list[torch.Tensor]:
    """Each batch's keys ``[S2, D]`` read through ``block_table`` from ``blocks``
    ``[block_count, block_size, D]``."""
    block_count, block_size = blocks.shape[:2]
    require(
        block_size % 16 == 0 and block_size <= MAX_BLOCK_SIZE,
        OP,
        f"block_size (key.shape[1]) must be a multiple of 16 up to {MAX_BLOCK_SIZE}, "
        f"got {block_size}",
    )
    require(act_k is not None, OP, "actual_seq_lengths_key is required with layout_key 'PA_BSND'")
    k_lens = _lengths(act_k, "actual_seq_lengths_key", b, 2**31 - 1, required=True)
    require(block_table is not None, OP, "block_table is required with layout_key 'PA_BSND'")
    require(
        block_table.dtype == torch.int32 and block_table.dim() == 2,
        OP,
        "block_table must be a 2-D int32 tensor",
    )
    need = max(-(-n // block_size) for n in k_lens)
    require(
        block_table.shape[0] == b and block_table.shape[1] >= need,
        OP,
        f"block_table must be [B={b}, >= {need}] (blocks of the longest key sequence), "
        f"got {list(block_table.shape)}",
    )
    keys = []
    for i, n in enumerate(k_lens):
        used = block_table[i, : -(-n // block_size)].long()
        require(
            bool(((used >= 0) & (used < block_count)).all()),
            OP,
            f"block_table[{i}] names a block outside [0, {block_count})",
        )
        keys.append(blocks[used].reshape(-1, blocks.shape[-1])[:n])
    return keys
