"""Training losses for GLM-5: next-token prediction, multi-token prediction (MTP) and
the lightning indexer's KL loss in DSA's two stages.

Stages (DeepSeek-V3.2, GLM-5):

- ``"dense_warmup"``: the main attention runs dense causal (every visible key) and
  only the indexer trains, on ``KL(p || softmax(I))`` over the visible keys, where
  ``p`` is the main attention's softmax summed over heads and L1-normalised.
- ``"sparse_adaptation"``: the main attention uses the indexer's top-k; the whole
  model trains on the LM (+ MTP) loss, and the indexer on the KL restricted to the
  keys it selected (both distributions renormalised over that set).

In both stages the indexer's inputs are detached, so the KL trains only the indexer
and the LM loss never reaches it (its selection is not differentiable).

With IndexCache's shared layers (``config.indexer_types``), a full layer's selection
serves the shared layers after it too, so its target ``p`` is the mean of the
distributions of every layer it serves (itself and those shared layers): the
training-aware variant of Bai et al., "IndexCache" (arXiv 2603.12201).

Typical use::

    params = configure_stage(model, "dense_warmup")
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for input_ids in data:
        losses = training_step(model, optimizer, input_ids, stage="dense_warmup")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError

from .attention import Attention, AttentionRecord, record_attention
from .causal_lm import IGNORE_INDEX, GlmMoeDsaForCausalLM, check_input_ids
from .packing import pack

DENSE_WARMUP = "dense_warmup"
SPARSE_ADAPTATION = "sparse_adaptation"
STAGES = (DENSE_WARMUP, SPARSE_ADAPTATION)

_TARGET_CHUNK_ELEMENTS = 1 << 24  # bounds the [rows, H, N] score block of one target chunk


@dataclass
class TrainingLosses:
    """Scalar losses of one batch. ``loss`` is what to backpropagate: ``kl_weight *
    indexer_kl`` in the dense warm-up (``lm`` and ``mtp`` are then reported only),
    ``lm + mtp_weight * mtp + kl_weight * indexer_kl`` in sparse adaptation.
    ``indexer_kl`` is the per-query mean KL, averaged over the indexers' calls (every
    full layer, and the MTP layer once per depth)."""

    loss: torch.Tensor
    lm: torch.Tensor
    mtp: torch.Tensor | None
    indexer_kl: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        """``{"loss", "lm", "indexer_kl"}`` (and ``"mtp"`` when computed) as floats."""
        out = {"loss": self.loss, "lm": self.lm, "mtp": self.mtp, "indexer_kl": self.indexer_kl}
        return {k: float(v.detach()) for k, v in out.items() if v is not None}


def check_stage(stage: str) -> str:
    """``stage`` if it names a DSA training stage; otherwise a :class:`ConfigError`."""
    if stage not in STAGES:
        raise ConfigError(f"unknown training stage {stage!r}; stages: {', '.join(STAGES)}")
    return stage


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The lightning indexers' parameters (every full layer's, MTP layers included;
    IndexCache's shared layers have none)."""
    return [
        p
        for m in model.modules()
        if isinstance(m, Attention) and m.indexer is not None
        for p in m.indexer.parameters()
    ]


def configure_stage(model: nn.Module, stage: str) -> list[nn.Parameter]:
    """Set ``requires_grad`` for ``stage`` and return the parameters to optimise.

    Dense warm-up: only :func:`indexer_parameters`; sparse adaptation: all parameters.
    """
    warmup = check_stage(stage) == DENSE_WARMUP
    indexer = {id(p) for p in indexer_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(not warmup or id(p) in indexer)
    return [p for p in model.parameters() if p.requires_grad]


# -- the indexer's KL --------------------------------------------------------------


def kl_divergence(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(target[t] || softmax(logits[t]))``.

    Args:
        target: ``[T, K]`` fp32 probabilities, rows summing to 1 (0 where ``logits``
            is ``-inf``).
        logits: ``[T, K]`` fp32, ``-inf`` at slots outside the set (differentiable).

    Returns:
        A scalar; rows contribute ``sum_j target (log target - log_softmax(logits))``
        over their ``target > 0`` entries.
    """
    log_q = torch.log_softmax(logits, dim=-1)
    # where, not xlogy: a 0 * -inf at an empty slot would be NaN.
    terms = torch.where(target > 0, target * (target.log() - log_q), 0.0)
    return terms.sum(dim=-1).mean()


@torch.no_grad()
def attention_target(record: AttentionRecord, scale: float) -> torch.Tensor:
    """The indexer's target ``p [T, K]`` fp32 over the slots ``record.indices`` attended.

    ``p[t, j] ∝ sum_h exp(scale * q[t, h] . k[indices[t, j], h] - lse[t, h])``: each
    head's softmax as the main attention computed it (its ``lse`` is over the same
    slots), summed over heads and L1-normalised; 0 at ``-1`` slots.
    """
    q, k, lse, indices = record.q.float(), record.k.float(), record.lse, record.indices.long()
    t, h = q.shape[:2]
    chunk = max(1, _TARGET_CHUNK_ELEMENTS // max(1, h * k.shape[0]))
    rows = []
    for r in range(0, t, chunk):
        idx = indices[r : r + chunk]
        scores = torch.einsum("thd,nhd->thn", q[r : r + chunk], k) * scale  # [c, H, N]
        picked = scores.gather(2, idx.clamp(min=0)[:, None, :].expand(-1, h, -1))  # [c, H, K]
        picked = picked.masked_fill((idx < 0)[:, None, :], -math.inf)
        p = torch.exp(picked - lse[r : r + chunk, :, None]).sum(dim=1)
        rows.append(p / p.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny))
    return torch.cat(rows) if rows else q.new_zeros(indices.shape)


@torch.no_grad()
def served_target(records: Sequence[AttentionRecord], scale: float) -> torch.Tensor:
    """The mean ``[T, K]`` fp32 of :func:`attention_target` over ``records``: one
    forward's records of the layers that attended the same slots (a full layer and the
    shared layers reusing its selection), rows still summing to 1."""
    indices = records[0].indices
    if any(not torch.equal(r.indices, indices) for r in records[1:]):
        raise ConfigError("served_target: the records attended different slots")
    return torch.stack([attention_target(r, scale) for r in records]).mean(dim=0)


def indexer_kl(attention: Attention, records: Sequence[AttentionRecord]) -> torch.Tensor:
    """``KL(p || softmax(I))`` over the slots ``records[0].indices`` (every visible key
    in the dense warm-up, the indexer's top-k in sparse adaptation), mean over queries.

    ``records``: one forward's record of ``attention`` (a layer with an indexer), then
    those of the shared layers it served; ``p`` is their :func:`served_target`. ``I``
    is recomputed from the detached inputs in ``records[0]``, so the gradient reaches
    only ``attention.indexer``'s parameters. ``indexer_logits`` scores all ``[T, N]``
    pairs, so memory grows with ``T * N`` like the warm-up's dense attention.
    """
    ix, record = attention.indexer, records[0]
    q, weights = ix.queries(record.h, record.q_res, record.cos, record.sin)
    keys = ix.keys(record.h, record.cos, record.sin)
    logits = ops.indexer_logits(q, keys, weights, record.k_start, record.k_end)  # [T, N]
    idx = record.indices.long()
    picked = logits.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, -math.inf)
    return kl_divergence(served_target(records, attention.scale), picked)


def served_attentions(model: GlmMoeDsaForCausalLM) -> dict[Attention, list[Attention]]:
    """Each attention with an indexer -> the attentions that attend its selection:
    itself, then IndexCache's shared layers reusing it (``config.indexer_source``)."""
    layers = model.model.layers
    out: dict[Attention, list[Attention]] = {}
    for i, layer in enumerate(layers):
        source = layers[model.config.indexer_source(i)].self_attn
        out.setdefault(source, []).append(layer.self_attn)
    return out


# -- LM and MTP losses -------------------------------------------------------------


def _shift(x: torch.Tensor, mask: torch.Tensor, d: int, fill: int) -> torch.Tensor:
    """``out[b, i] = x[b, i + d]`` where that position is real, else ``fill``; ``[B, S]``."""
    out = torch.full_like(x, fill)
    if d < x.shape[1]:
        out[:, : x.shape[1] - d] = x[:, d:].masked_fill(~mask[:, d:], fill)
    return out


def _nll(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of normed ``hidden [T, D]`` under ``head [V, D]`` at the
    ``targets [T]`` that are not ``IGNORE_INDEX`` (0, still in the graph, if none)."""
    keep = targets != IGNORE_INDEX
    if not bool(keep.any()):
        return hidden.sum() * 0.0
    # token_logprobs: backends never build the full fp32 [T, V] logits.
    logp, _ = ops.token_logprobs(hidden[keep], head, targets[keep])
    return -logp.mean()


def _mtp_loss(
    model: GlmMoeDsaForCausalLM,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    depth: int,
) -> torch.Tensor:
    """Mean over depths ``k = 1..depth`` of the MTP next-token NLL: at depth ``k`` the
    state at ``i`` (the previous depth's, the main model's for ``k = 1``) fused with
    ``Emb(t[i + k])`` predicts ``labels[i + k + 1]``. ``hidden [B, S, D]`` is the main
    model's last hidden state (before its final norm), zeros at padding."""
    layers = model.model.mtp_layers
    losses = []
    for k in range(1, depth + 1):
        layer = layers[min(k, len(layers)) - 1]  # GLM-5: one layer, applied recursively
        mask_k = mask & _shift(mask, mask, k, False)
        batch = pack(_shift(input_ids, mask, k, 0), mask_k)
        if not batch.ids.numel():  # every sequence is too short for this depth
            break
        cos, sin = model.model.rope(batch.positions)
        x = layer.fuse(hidden.reshape(-1, hidden.shape[-1])[batch.flat], batch.ids)
        x, _ = layer(x, batch, cos, sin)  # an MTP layer runs its own indexer
        targets = _shift(labels, mask, k + 1, IGNORE_INDEX).reshape(-1)[batch.flat]
        losses.append(_nll(layer.shared_head.norm(x), layer.shared_head.head.weight, targets))
        hidden = batch.unpack(x)
    return torch.stack(losses).mean() if losses else hidden.sum() * 0.0


def training_losses(
    model: GlmMoeDsaForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    stage: str = SPARSE_ADAPTATION,
    mtp_depth: int = 1,
    mtp_weight: float = 0.3,
    kl_weight: float = 1.0,
) -> TrainingLosses:
    """The losses of one batch for ``stage`` (see the module docstring).

    Args:
        input_ids: ``[B, S]`` token ids.
        attention_mask: ``[B, S]`` 1/0 (left or right padding); ``None``: all real.
        labels: ``[B, S]`` the tokens to predict (``-100``: ignore, e.g. prompts);
            ``None``: ``input_ids``. Shifted here, as in ``GlmMoeDsaForCausalLM``.
        stage: ``"dense_warmup"`` or ``"sparse_adaptation"``.
        mtp_depth: MTP depths to train (0: none); reuses the last MTP layer when the
            model has fewer layers than depths.
        mtp_weight: weight of the depth-averaged MTP loss (DeepSeek-V3: 0.3, then 0.1).
        kl_weight: weight of the indexer KL (it only scales the indexer's gradient,
            whose parameters no other loss reaches).
    """
    warmup = check_stage(stage) == DENSE_WARMUP
    check_input_ids(input_ids, attention_mask, model.config.vocab_size)
    mask = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool()
    )
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ConfigError(
            f"labels shape {list(labels.shape)} != input_ids shape {list(input_ids.shape)}"
        )
    if mtp_depth < 0 or (mtp_depth and not model.model.mtp_layers):
        raise ConfigError(
            f"mtp_depth must be >= 0 and needs MTP layers (got {mtp_depth} with "
            f"{len(model.model.mtp_layers)} MTP layers; num_nextn_predict_layers)"
        )
    # Recording is local to this thread / task: a rollout sharing the model is unaffected.
    served = served_attentions(model)
    attentions = [a for group in served.values() for a in group]
    with record_attention(attentions, dense=warmup) as records:
        # Warm-up trains only the indexer, whose KL inputs are detached: no graph needed.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not warmup):
            batch = pack(input_ids, mask)
            hidden = model.model(batch)
            targets = _shift(labels, mask, 1, IGNORE_INDEX).reshape(-1)[batch.flat]
            lm = _nll(model.model.norm(hidden), model.lm_head.weight, targets)
            mtp = None
            if mtp_depth:
                mtp = _mtp_loss(model, batch.unpack(hidden), input_ids, mask, labels, mtp_depth)
        # One KL per indexer call; a shared layer's k-th record is of the same forward.
        kls = [
            indexer_kl(full, list(recs))
            for full, group in served.items()
            for recs in zip(*(records[a] for a in group), strict=True)
        ]
    kl = torch.stack(kls).mean()
    if warmup:
        loss = kl_weight * kl
    else:
        loss = lm + kl_weight * kl + (mtp_weight * mtp if mtp is not None else 0.0)
    return TrainingLosses(loss, lm, mtp, kl)


def training_step(
    model: GlmMoeDsaForCausalLM,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    *,
    stage: str = SPARSE_ADAPTATION,
    mtp_depth: int = 1,
    mtp_weight: float = 0.3,
    kl_weight: float = 1.0,
) -> dict[str, float]:
    """One optimiser step on :func:`training_losses`; returns the losses as floats.

    The optimiser should hold :func:`configure_stage`'s parameters for ``stage``.
    """
    optimizer.zero_grad(set_to_none=True)
    losses = training_losses(
        model,
        input_ids,
        attention_mask,
        labels,
        stage=stage,
        mtp_depth=mtp_depth,
        mtp_weight=mtp_weight,
        kl_weight=kl_weight,
    )
    losses.loss.backward()
    optimizer.step()
    return losses.as_floats()
