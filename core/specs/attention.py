"""Sparse attention over selected key slots (DSA's main attention; dense is a special case)."""

from __future__ import annotations

import torch

from ..validate import FLOAT_DTYPES, INDEX_DTYPES, Checker, Level
from .base import OpSpec, invoke


def _check(c: Checker, q, k, v, indices, scale, need_lse=True, k_rope=None, *, values):
    c.tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    t, h, dk = q.shape
    c.tensor("k", k, ndim=3, dtypes=FLOAT_DTYPES)
    n, hkv = k.shape[0], k.shape[1]
    if k_rope is None:
        c.tensor("k", k, shape=(("N", n), ("Hkv", hkv), ("Dk", dk)))
    else:  # k_rope holds the key's columns past k's
        rest = ("Dk - k's width", dk - k.shape[2])
        c.tensor("k_rope", k_rope, shape=(("N", n), ("Hkv", hkv), rest), dtypes=FLOAT_DTYPES)
        c.same_dtype(k=k, k_rope=k_rope)
    c.tensor("v", v, shape=(("N", n), ("Hkv", hkv), None), dtypes=FLOAT_DTYPES)
    c.same_dtype(q=q, k=k, v=v)
    if hkv < 1 or h % hkv != 0:
        c.fail("k", f"a head count Hkv that divides H={h}", f"Hkv={hkv}")
    c.tensor("indices", indices, ndim=2, dtypes=INDEX_DTYPES)
    c.tensor("indices", indices, shape=(("T", t), None))
    c.positive_float("scale", scale)
    # Kernels scale scores by it times log2(e) (exp2 softmax): keep that finite too.
    c.within_range("scale", 2 * scale, "2 * scale")
    c.same_device(q=q, k=k, v=v, indices=indices, k_rope=k_rope)
    if not isinstance(need_lse, bool):
        c.fail("need_lse", "a bool", repr(need_lse))
    if values:
        c.in_range("indices", indices, -1, n)  # T x K ints: what a gather could misuse
    if values >= Level.STRICT:  # max |k|, |v| read the whole cache: as long as a decode step
        # The softmax subtracts the max score: differences reach twice the largest |s|,
        # times log2(e) in an exp2 softmax; q . k is formed before a scale < 1 shrinks it.
        k_max = c.magnitude(k)
        if k_rope is not None:  # bounds max|cat(k, k_rope)|, NaN included
            k_max = k_max + c.magnitude(k_rope)
        scores = max(scale, 1.0) * c.magnitude(q) * k_max * dk
        c.within_range(
            "scale", 3 * scores, "the score spread 3 * max(scale, 1) * max|q| * max|k| * Dk"
        )
        # An online softmax sums up to K rows of v at weight <= 1 before normalising.
        c.within_range("v", indices.shape[1] * c.magnitude(v), "K * max|v|")


def _guarded_outputs(outs, q, k, v, indices, scale, need_lse=True, k_rope=None):
    """Overflowed scores show as NaN or inf in ``out`` and ``lse``, or as an ``lse`` of
    ``-inf`` on a row that has a valid slot (only an empty row's is ``-inf``)."""
    out, lse = outs
    if not need_lse:
        return [("out", out, 0)]
    empty_rows = ~((indices >= 0) & (indices < k.shape[0])).any(dim=1)
    return [("out", out, 0), ("lse", lse, empty_rows.sum() * q.shape[1])]


def _fake(q, k, v, indices, scale, need_lse=True, k_rope=None):
    t, h = q.shape[0], q.shape[1]
    return q.new_empty((t, h, v.shape[-1])), q.new_empty(
        lse_shape(t, h, need_lse), dtype=torch.float32
    )


def lse_shape(t: int, h: int, need_lse: bool) -> tuple[int, ...]:
    """``lse``'s shape: ``[T, H]`` when the caller asked for it, else ``[0]``."""
    return (t, h) if need_lse else (0,)


def lse_as_asked(lse: torch.Tensor, need_lse: bool) -> torch.Tensor:
    """A kernel's computed ``lse [T, H]`` as the op returns it: itself when the caller
    asked for it, else an empty ``[0]`` of its dtype and device."""
    return lse if need_lse else lse.new_empty((0,))


SPARSE_ATTENTION = OpSpec(
    name="sparse_attention",
    schema="(Tensor q, Tensor k, Tensor v, Tensor indices, float scale, bool need_lse=True, "
    "Tensor? k_rope=None) -> (Tensor out, Tensor lse)",
    check=_check,
    fake=_fake,
    features=lambda q, k, v, indices, scale, need_lse=True, k_rope=None: {
        "dtype": q.dtype,
        "q_heads": q.shape[1],
        "kv_heads": k.shape[1],
        "head_dim": q.shape[2],
        "v_head_dim": v.shape[2],
        "topk": indices.shape[1],
        "split_rope": k_rope is not None,
    },
    feature_names=("dtype", "q_heads", "kv_heads", "head_dim", "v_head_dim", "topk", "split_rope"),
    differentiable=("q", "k", "v", "k_rope"),
    result_guard=_guarded_outputs,
)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    need_lse: bool = True,
    k_rope: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its selected key slots only.

    ``out[t, h] = sum_j p[t, h, j] * v[indices[t, j], h // (H // Hkv)]`` with
    ``p = softmax_j(scale * q[t, h] . k[indices[t, j], ...])`` over the valid entries
    (``indices >= 0``); ``-1`` entries are ignored. A slot listed twice counts twice.

    Args:
        q: ``[T, H, Dk]`` fp32 | bf16 | fp16.
        k: ``[N, Hkv, Dk]`` same dtype, ``H % Hkv == 0`` (absorbed MLA: ``Hkv = 1``,
            ``Dk = 576`` = latent 512 + rope 64).
        v: ``[N, Hkv, Dv]`` same dtype; may be a view of ``k`` (absorbed MLA:
            ``k[..., :512]``).
        indices: ``[T, K]`` int32 | int64 physical slot ids in ``[-1, N)``, shared by
            all heads (dense causal attention is ``indices = all earlier slots``).
        scale: softmax scale, finite, ``> 0`` and at most half the float32 maximum.
        need_lse: whether the caller reads ``lse`` (training, replay records, merging
            partial attentions). Inference passes False, so vendor kernels run in their
            inference mode (Ascend's ``npu_sparse_flash_attention`` documents
            ``return_softmax_lse`` for training only).
        k_rope: ``[N, Hkv, Dr]`` or None: the key's last ``Dr`` columns kept apart, as
            paged MLA caches store the rope key beside the latent (Ascend's
            ``key`` / ``key_rope``): the key is then ``cat(k, k_rope, -1)``, ``k`` is
            ``[N, Hkv, Dk - Dr]`` and ``v`` may be ``k`` itself. Nothing is
            concatenated: each tensor is read where it lies.

    Returns:
        out: ``[T, H, Dv]`` in ``q``'s dtype; ``0`` for a row with no valid slot.
        lse: ``[T, H]`` fp32 natural-log log-sum-exp of the scaled scores; ``-inf``
        for a row with no valid slot. With ``need_lse=False`` an empty ``[0]`` fp32
        tensor (and no gradient flows through it).

    Scores beyond float32 (``scale * |q . k|`` over ``~3.4e38``) are refused with an
    ``OpInputError`` naming ``scale``: before the kernel under
    ``GLMPORT_VALIDATE=strict``, from the overflow in the outputs under ``full``.
    """
    return invoke(SPARSE_ATTENTION, q, k, v, indices, scale, need_lse, k_rope)
