"""Token log-probabilities and entropies: the LM head fused with an online log-sum-exp
over vocabulary tiles, never a ``[T, V]`` logits matrix.

Two kernels:

- :func:`_vocab_stats_kernel`: a program per (block of ``BLOCK_T`` tokens, vocabulary
  split) walks its split ``BLOCK_V`` columns at a time. Each tile of logits
  ``z = hidden @ lm_head_tile^T / temperature`` is a ``tl.dot`` over chunks of ``D``
  with a float32 accumulator; per token the program keeps the running max ``m``,
  ``s = sum exp(z - m)`` and ``u = sum exp(z - m) (z - m)``, and the program whose
  split holds the target writes the target's logit.
- :func:`_combine_kernel` merges the splits: ``lse = m + log s``, ``logp = z_target -
  lse`` and ``entropy = log s - u / s``. Keeping ``u`` relative to the max makes both
  entropy terms non-negative: no cancellation, unlike ``lse - E[z]``.

Splitting the vocabulary keeps a GPU busy when there are few tokens (flash-decoding's
trick); under the interpreter there is one split. A target outside ``[0, V)`` is in no
split, so its logit stays NaN and so does its ``logp`` (the meta-mode rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import dot_dtype, interpreter_plan, next_pow2, sm_count, to_dot, tuned

# The split heuristic (GPU): enough (token block, split) programs to fill every SM
# about twice, counting token blocks of _TOKENS_PER_BLOCK, splits of at least
# _MIN_SPLIT columns, lengths a multiple of every BLOCK_V.
_TOKENS_PER_BLOCK = 64
_MIN_SPLIT = 2048
_SPLIT_MULTIPLE = 256


def vocab_split(t: int, v: int, device: torch.device) -> int:
    """Vocabulary columns per program (``v >= 1``): all of them under the interpreter
    (fewest programs), on a GPU as many splits as the SMs want."""
    if interpreter_plan():
        return v
    token_blocks = triton.cdiv(t, _TOKENS_PER_BLOCK)
    splits = min(triton.cdiv(2 * sm_count(device), token_blocks), v // _MIN_SPLIT)
    split = triton.cdiv(v, max(splits, 1))
    return triton.cdiv(split, _SPLIT_MULTIPLE) * _SPLIT_MULTIPLE


@tuned(
    configs=[
        triton.Config({"BLOCK_T": bt, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bt, bv, bk, w, s in (
            (16, 128, 64, 4, 4),
            (64, 128, 64, 4, 3),
            (128, 128, 64, 8, 3),
            (64, 256, 32, 8, 3),
        )
    ],
    key=["D", "V"],
    interpreter={"BLOCK_T": 32, "BLOCK_V": 4096, "BLOCK_K": 256},
)
@triton.jit
def _vocab_stats_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    u_ptr,
    zt_ptr,
    T,
    V,
    D,
    split_len,
    n_splits,
    stride_ht,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_tgt,
    temperature,
    DOT_DTYPE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    rows = rows.to(tl.int64)
    tgt = tl.load(tgt_ptr + rows * stride_tgt, mask=row_mask, other=-1)
    v_start = split * split_len
    v_end = tl.minimum(v_start + split_len, V)
    ks = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows[:, None] * stride_ht

    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    z_tgt = tl.zeros([BLOCK_T], dtype=tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wv
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + ks
            k_mask = k < D
            h = tl.load(
                h_rows + k[None, :] * stride_hd,
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_cols + k[:, None] * stride_wd,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            h, w = to_dot(h, DOT_DTYPE), to_dot(w, DOT_DTYPE)
            acc = tl.dot(h, w, acc, input_precision="ieee") if IEEE else tl.dot(h, w, acc)
        z = tl.where(col_mask[None, :], acc / temperature, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        e = tl.exp(z - m_new[:, None])  # 0 in the masked columns
        decay = tl.exp(m - m_new)
        # u is relative to the max: moving it to m_new adds s * (m - m_new); the first
        # tile (s = 0, m = -inf) adds nothing. The wheres keep -inf out of products.
        shift = tl.where(s > 0, m - m_new, 0.0) * s
        z_rel = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
        u = decay * (u + shift) + tl.sum(e * z_rel, axis=1)
        s = decay * s + tl.sum(e, axis=1)
        m = m_new
        z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)

    part = rows * n_splits + split
    tl.store(m_ptr + part, m, mask=row_mask)
    tl.store(s_ptr + part, s, mask=row_mask)
    tl.store(u_ptr + part, u, mask=row_mask)
    tl.store(zt_ptr + rows, z_tgt, mask=row_mask & (tgt >= v_start) & (tgt < v_end))


@tuned(
    configs=[triton.Config({"BLOCK_T": 64}, num_warps=4)],
    key=["n_splits"],
    interpreter={"BLOCK_T": 1024},
)
@triton.jit
def _combine_kernel(
    m_ptr,
    s_ptr,
    u_ptr,
    zt_ptr,
    logp_ptr,
    ent_ptr,
    T,
    n_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    rows = rows.to(tl.int64)
    # Padding rows read the last row (stores are masked): no -inf - -inf below.
    part = tl.minimum(rows, T - 1)[:, None] * n_splits + tl.arange(0, BLOCK_S)[None, :]
    mask = (tl.arange(0, BLOCK_S) < n_splits)[None, :]
    m = tl.load(m_ptr + part, mask=mask, other=float("-inf"))
    s = tl.load(s_ptr + part, mask=mask, other=0.0)
    u = tl.load(u_ptr + part, mask=mask, other=0.0)
    # Every split holds at least one column, so m_all is finite (for finite logits).
    m_all = tl.max(m, axis=1)
    diff = tl.where(mask, m - m_all[:, None], 0.0)
    scale = tl.where(mask, tl.exp(diff), 0.0)
    s_all = tl.sum(scale * s, axis=1)
    u_all = tl.sum(scale * (u + s * diff), axis=1)
    log_s = tl.log(s_all)
    z_tgt = tl.load(zt_ptr + rows, mask=row_mask, other=0.0)
    tl.store(logp_ptr + rows, (z_tgt - m_all) - log_s, mask=row_mask)
    tl.store(ent_ptr + rows, log_s - u_all / s_all, mask=row_mask)


def token_logprobs(
    hidden: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target and entropy of each token's distribution over
    ``z = hidden @ lm_head.T / temperature`` (float32 accumulation).

    Args:
        hidden: ``[T, D]`` fp32 | bf16 | fp16, any strides.
        lm_head: ``[V, D]`` same dtype, any strides.
        targets: ``[T]`` int32 | int64, any stride (0 included); one outside ``[0, V)``
            gives ``logp`` NaN.
        temperature: ``> 0``.

    Returns:
        logp: ``[T]`` fp32; entropy: ``[T]`` fp32 (both NaN when ``V = 0``).
    """
    t, d = hidden.shape
    v = lm_head.shape[0]
    dev = hidden.device
    logp = torch.full((t,), float("nan"), dtype=torch.float32, device=dev)
    entropy = torch.full((t,), float("nan"), dtype=torch.float32, device=dev)
    if t == 0 or v == 0:
        return logp, entropy
    split_len = vocab_split(t, v, dev)
    n_splits = triton.cdiv(v, split_len)
    m, s, u = (torch.empty((t, n_splits), dtype=torch.float32, device=dev) for _ in range(3))
    # The target logits: written only for in-range targets, NaN for the rest.
    z_tgt = torch.full((t,), float("nan"), dtype=torch.float32, device=dev)
    dot = dot_dtype(hidden.dtype)
    _vocab_stats_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_T"]), n_splits)](
        hidden,
        lm_head,
        targets,
        m,
        s,
        u,
        z_tgt,
        t,
        v,
        d,
        split_len,
        n_splits,
        *hidden.stride(),
        *lm_head.stride(),
        targets.stride(0),
        temperature,
        DOT_DTYPE=dot,
        IEEE=dot == tl.float32,
    )
    _combine_kernel[lambda meta: (triton.cdiv(t, meta["BLOCK_T"]),)](
        m, s, u, z_tgt, logp, entropy, t, n_splits, BLOCK_S=next_pow2(n_splits, floor=1)
    )
    return logp, entropy
