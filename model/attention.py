"""Multi-head latent attention with DSA: the lightning indexer (top-k key selection,
replayable through a choice tape), the absorbed and non-absorbed MLA forms, and the
recording of packed forwards that the indexer's training loss reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError
from glmport.core.validate import holds

from .blocks import RMSNorm
from .config import GlmMoeDsaConfig
from .packing import Packed, Widths, visible_slots
from .rope import softmax_scale
from .tape_protocol import INDICES, active_tape

MLA_NORM_EPS = 1e-6  # q_a / kv_a norms and the indexer's key LayerNorm (not rms_norm_eps)
# The packed forward runs MLA absorbed where some query sees more than this many times
# index_topk keys (the tiny model of bench/vs_transformers.py on the generic backend,
# 1 thread: non-absorbed was 1.5x faster at 2-4x, absorbed 3.4x faster at 8x).
ABSORB_BEYOND = 4


class Indexer(nn.Module):
    """DSA's lightning indexer: scores every visible key, keeps the top ``index_topk``."""

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.config = config
        d, n = config.index_head_dim, config.index_n_heads
        self.wq_b = nn.Linear(config.q_lora_rank, n * d, bias=False)
        self.wk = nn.Linear(config.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=MLA_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, n, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.config.qk_rope_head_dim  # the FIRST r dims rotate (main attention: the last)
        rotated = ops.rope(x[..., :r].contiguous(), cos, sin, self.config.indexer_rope_interleave)
        return torch.cat((rotated, x[..., r:]), dim=-1)

    def keys(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[T, index_head_dim]`` rotated keys (what the indexer cache stores)."""
        return self._rope(self.k_norm(self.wk(h)), cos, sin)

    def queries(
        self, h: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[T, index_n_heads, index_head_dim]`` and fp32 per-head
        weights ``[T, index_n_heads]`` (the ``q`` and ``weights`` of the indexer ops)."""
        c = self.config
        q = self.wq_b(q_res).view(h.shape[0], c.index_n_heads, c.index_head_dim)
        q = self._rope(q, cos, sin)
        # relu is positively homogeneous: fold both scales into the per-head weights.
        scale = (c.index_n_heads * c.index_head_dim) ** -0.5
        return q, self.weights_proj(h).float() * scale

    def select(
        self,
        h: torch.Tensor,
        q_res: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        k_start: torch.Tensor,
        k_end: torch.Tensor,
        widths: Widths,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, index_topk]`` int32 slot ids of ``keys [N, index_head_dim]`` (``-1``
        where fewer are visible), for queries ``h [T, hidden]`` with ranges ``k_start``
        / ``k_end [T]`` int32, whose widths ``widths`` gives on the host. With a
        ``block_table [T, M]`` int32 the keys are a paged cache ``[blocks, block_size,
        index_head_dim]`` and ids, ranges (``k_start`` 0) are logical positions of each
        query's sequence (``lightning_indexer``'s paged call).

        A query that sees at most ``index_topk`` keys would have them all selected, so
        the indexer runs only for the queries that see more (none for short
        sequences, GLM-5's RL samples among them; the first ``index_topk`` tokens of
        every prompt); the others get their visible keys in slot order. Which case
        holds is decided from ``widths``, never from a device read. Each sequence's
        keys are a contiguous run from ``k_start``, so a slot less ``k_start`` is the
        key's position in its sequence: what a
        :func:`~glmport.model.choices.choice_tape` records and replays."""
        c = self.config
        tape = active_tape()
        t, wide = k_start.shape[0], widths.wider_than(c.index_topk)
        if tape is not None and tape.replays(INDICES, self):
            indices = _replayed_slots(tape.replayed(INDICES, self), k_start, k_end)
        elif t and wide == t:
            indices = self._run(h, q_res, cos, sin, keys, k_start, k_end, block_table)
        else:
            indices = visible_slots(k_start, k_end, c.index_topk)
            if wide:  # the host knows how many: no sync to find them
                mask = (k_end - k_start) > c.index_topk
                rows = torch.nonzero_static(mask, size=wide).squeeze(1)
                hw, qw, cw, sw, ks, ke = (x[rows] for x in (h, q_res, cos, sin, k_start, k_end))
                table = None if block_table is None else block_table[rows]
                indices[rows] = self._run(hw, qw, cw, sw, keys, ks, ke, table)
        if tape is not None and tape.tracks(INDICES, self):
            tape.record(INDICES, self, torch.where(indices >= 0, indices - k_start[:, None], -1))
        return indices

    def _run(self, h, q_res, cos, sin, keys, k_start, k_end, block_table=None) -> torch.Tensor:
        """``lightning_indexer``'s ``[T, index_topk]`` int32 choice for these queries
        (asked for no scores: what vendors' inference calls return)."""
        q, weights = self.queries(h, q_res, cos, sin)
        with torch.no_grad():  # a selection, not a differentiable quantity
            indices, _ = ops.lightning_indexer(
                q.detach(),
                keys.detach(),
                weights.detach(),
                k_start,
                k_end,
                self.config.index_topk,
                None,
                None,
                block_table,
                False,
            )
        return indices


def _replayed_slots(
    positions: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor
) -> torch.Tensor:
    """Replayed key ``positions [T, K]`` (``-1``: none) as slots of the packed keys,
    refusing a position the query cannot see (a record of another prompt): a device-side
    assert, read back into a ConfigError naming the row on the CPU (see
    :func:`~glmport.core.validate.holds`)."""
    visible = (k_end - k_start).long()[:, None]
    bad_rows = ((positions < -1) | (positions >= visible)).any(dim=1)
    message = "replayed indexer positions must be keys each query sees (a record of these tokens)"
    if not holds(~bad_rows.any(), message):
        row = int(bad_rows.nonzero()[0, 0])
        raise ConfigError(
            f"replayed indexer positions {positions[row].tolist()} for a query that sees "
            f"{int(visible[row, 0])} keys: the record does not belong to these tokens"
        )
    return torch.where(positions >= 0, positions + k_start.long()[:, None], -1).to(torch.int32)


@dataclass
class MLAProjections:
    """One layer's projections of ``T`` tokens."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], rotated
    q_res: torch.Tensor  # [T, q_lora], the normalised query latent (indexer input)
    latent: torch.Tensor  # [T, kv_lora + rope]: normalised c_kv | rotated k_pe (the cache entry)


@dataclass
class LatentQueries:
    """One cached step's attention inputs for ``T`` new tokens (the MLA prolog's
    outputs): what the absorbed attention reads and what the cache stores."""

    q: torch.Tensor  # [T, H, kv_lora + rope]: W_UK folded into the nope part, rope rotated
    q_res: torch.Tensor  # [T, q_lora], the normalised query latent (indexer input)
    latent: torch.Tensor  # [T, kv_lora], the normalised c_kv (the cache's latent row)
    k_rope: torch.Tensor  # [T, rope], the rotated rope key (the cache's rope row)


@dataclass
class AttentionRecord:
    """What one packed :meth:`Attention.forward` saw and computed, detached: the
    inputs of the indexer's training loss (:mod:`glmport.model.training`)."""

    h: torch.Tensor  # [T, hidden] the attention input (the indexer's ``h``)
    q_res: torch.Tensor  # [T, q_lora] the indexer's query input
    cos: torch.Tensor  # [T, rope / 2]
    sin: torch.Tensor  # [T, rope / 2]
    q: torch.Tensor  # [T, H, D] main-attention queries, in the form attended
    k: torch.Tensor  # [T, H, D] its keys (the absorbed form: the latent row for every head)
    lse: torch.Tensor  # [T, H] fp32 log-sum-exp of the scaled scores over ``indices``
    indices: torch.Tensor  # [T, K] int32 slots attended (-1: none)
    k_start: torch.Tensor  # [T] int32
    k_end: torch.Tensor  # [T] int32


@dataclass
class AttentionRecording:
    """A recording open in one thread / asyncio task (see :func:`record_attention`):
    ``records`` maps each recorded :class:`Attention` to the records of its forwards;
    ``dense`` makes those attentions attend to every visible key (DSA's warm-up)."""

    dense: bool
    records: dict[Attention, list[AttentionRecord]]


# Context-local, not module flags: a rollout thread running forwards on the same model
# while a training thread records must see neither the records nor the dense switch.
_RECORDING: ContextVar[AttentionRecording | None] = ContextVar(
    "glmport_attention_recording", default=None
)


@contextmanager
def record_attention(
    attentions: Iterable[Attention], dense: bool = False
) -> Iterator[dict[Attention, list[AttentionRecord]]]:
    """Record every packed forward of ``attentions`` run by the current thread or
    asyncio task inside the block (other threads and tasks are unaffected), and run
    them dense if ``dense``. Yields ``{attention: [AttentionRecord, ...]}`` in the
    order of ``attentions``; blocks nest (the inner one wins until it closes)."""
    recording = AttentionRecording(dense, {a: [] for a in attentions})
    token = _RECORDING.set(recording)
    try:
        yield recording.records
    finally:
        _RECORDING.reset(token)


class Attention(nn.Module):
    """Multi-head latent attention with DSA. Absorbed (``[T, H, kv_lora + rope]``
    queries over latent rows) where the indexer selects and over the KV cache;
    non-absorbed (per-head keys and values) where most visible keys are attended.

    Layer ``layer_index`` (decoder layers, then MTP layers) has no indexer (``indexer
    is None``, no weights) when ``config.indexer_types`` marks it ``"shared"``
    (IndexCache): it attends the keys its nearest preceding full layer selected."""

    def __init__(self, config: GlmMoeDsaConfig, layer_index: int) -> None:
        super().__init__()
        c = self.config = config
        h, bias = config.hidden_size, config.attention_bias
        self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, MLA_NORM_EPS)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_attention_heads * c.v_head_dim, h, bias=bias)
        shared = config.indexer_source(layer_index) != layer_index
        self.indexer = None if shared else Indexer(config)
        self.scale = softmax_scale(config)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> MLAProjections:
        c = self.config
        t = h.shape[0]
        q_res = self.q_a_layernorm(self.q_a_proj(h))
        q = self.q_b_proj(q_res).view(t, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(h)
        c_kv = self.kv_a_layernorm(kv[:, : c.kv_lora_rank])
        # One rope call for the query heads and the shared key head (one op call less).
        pe = ops.rope(torch.cat((q_pe, kv[:, None, c.kv_lora_rank :]), dim=1), cos, sin, True)
        heads = c.num_attention_heads  # (not pe[:, -1]: TVM's importer misreads it)
        q_pe, k_pe = pe[:, :heads], pe[:, heads]
        return MLAProjections(q_nope, q_pe, q_res, torch.cat((c_kv, k_pe), dim=-1))

    def prolog(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LatentQueries:
        """The cached step's projections of ``h [T, hidden]``: one ``ops.mla_prolog``
        call (MLAPO) when the layer's weights are what it takes (see
        :meth:`_prolog_weights`) and no gradient is wanted (the op has no backward);
        else the same computation as :meth:`project` and the ``W_UK`` absorption
        (other quantisations, biased projections, training)."""
        c = self.config
        weights = self._prolog_weights(h)
        if weights is not None:
            (w_dq, w_uq, w_dkv), scales = weights
            q_lat, q_pe, q_res, latent, k_rope = ops.mla_prolog(
                h,
                w_dq,
                self.q_a_layernorm.weight,
                w_uq,
                self._kv_up()[0],
                w_dkv,
                self.kv_a_layernorm.weight,
                cos,
                sin,
                MLA_NORM_EPS,
                *scales,
            )
        else:
            p = self.project(h, cos, sin)
            q_lat, q_pe, q_res = self._absorb(p.q_nope), p.q_pe, p.q_res
            latent, k_rope = p.latent[:, : c.kv_lora_rank], p.latent[:, c.kv_lora_rank :]
        return LatentQueries(torch.cat((q_lat, q_pe), dim=-1), q_res, latent, k_rope)

    def _prolog_weights(self, h: torch.Tensor) -> tuple[tuple, tuple] | None:
        """``((w_dq, w_uq, w_dkv), scales)`` as ``ops.mla_prolog`` takes them, or None
        where it cannot serve: a gradient wanted, a bias, a gain or ``kv_b_proj`` (kept
        float by quantisation) not in ``h``'s dtype, or projections that are neither
        all float ``nn.Linear`` in ``h``'s dtype (scales None) nor all packed W8A8
        (``QuantLinear``: the canonical int8 weights and their scales)."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            return None
        up = self.kv_b_proj
        gains = (self.q_a_layernorm.weight, self.kv_a_layernorm.weight)
        if type(up) is not nn.Linear or up.bias is not None:
            return None
        if any(w.dtype != h.dtype for w in (up.weight, *gains)):
            return None
        projections = (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa)
        if any(m.bias is not None for m in projections):
            return None
        if all(type(m) is nn.Linear and m.weight.dtype == h.dtype for m in projections):
            return tuple(m.weight for m in projections), (None, None, None)
        # QuantLinear by its attributes (model/quantize.py imports this module).
        if all(
            getattr(m, "scheme", None) == "w8a8" and hasattr(m, "weight_q") for m in projections
        ):
            return (
                tuple(m.weight_q for m in projections),
                tuple(m.weight_scale for m in projections),
            )
        return None

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, nope]`` with ``W_UK`` folded in: ``[T, H, kv_lora]``."""
        w_uk, _ = self._kv_up()
        # Per-head GEMMs over the token axis: [H, T, nope] @ [H, nope, kv_lora].
        return torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def _kv_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` split per head: ``W_UK [H, nope, kv_lora]``, ``W_UV [H, v, kv_lora]``."""
        c = self.config
        w = self.kv_b_proj.weight.view(
            c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank
        )
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(
        self,
        h: torch.Tensor,
        batch: Packed,
        cos: torch.Tensor,
        sin: torch.Tensor,
        shared: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the packed batch itself (prefill, training): the output
        ``[T, hidden]`` and the ``[T, K]`` int32 slots attended (``-1``: none).

        A layer without an indexer attends ``shared``, the slots its source layer
        attended in this same forward (so valid slots of ``batch``).

        Both MLA forms compute the same function; the shape of the attention picks the
        cheaper one. Where the indexer keeps a small share of the visible keys (some
        query sees more than ``ABSORB_BEYOND`` times ``index_topk``), the absorbed form
        gathers one shared latent row per selected key (``kv_lora + rope`` values)
        instead of ``H`` per-head key and value rows. Where it keeps most of them, or
        every visible key is attended (short sequences, DSA's dense warm-up), the
        non-absorbed form does fewer FLOPs per key (``qk + v`` per head against
        ``kv_lora + rope + kv_lora``) and a backend may attend the whole causal window
        instead of gathering."""
        c = self.config
        p = self.project(h, cos, sin)
        recording = _RECORDING.get()
        records = None if recording is None else recording.records.get(self)
        dense = records is not None and recording.dense
        if dense:
            indices = visible_slots(batch.k_start, batch.k_end, batch.widths.widest)
        elif self.indexer is None:
            if shared is None:
                raise ConfigError(
                    "a shared-indexer layer (indexer_types 'shared') needs the top-k of a "
                    "preceding full layer of the same forward"
                )
            indices = shared
        else:
            keys = self.indexer.keys(h, cos, sin)
            indices = self.indexer.select(
                h, p.q_res, cos, sin, keys, batch.k_start, batch.k_end, batch.widths
            )
        need_lse = records is not None  # only the records read it: inference asks for none
        if not dense and batch.widths.widest > ABSORB_BEYOND * c.index_topk:
            out, q, lse = self._absorbed(p, p.latent, indices, need_lse)
            k = p.latent[:, None, :].expand(-1, c.num_attention_heads, -1)
        else:
            out, q, k, lse = self._non_absorbed(p, indices, need_lse)
        if records is not None:
            d = [x.detach() for x in (h, p.q_res, cos, sin, q, k, lse)]
            records.append(AttentionRecord(*d, indices, batch.k_start, batch.k_end))
        return out, indices

    def _non_absorbed(
        self, p: MLAProjections, indices: torch.Tensor, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head keys and values up-projected from the packed tokens' own latents:
        the output ``[T, hidden]``, queries and keys ``[T, H, qk_head_dim]``, lse
        (``[0]`` unless ``need_lse``)."""
        c = self.config
        t = p.latent.shape[0]
        kv = self.kv_b_proj(p.latent[:, : c.kv_lora_rank]).view(t, c.num_attention_heads, -1)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
        k_pe = p.latent[:, None, c.kv_lora_rank :].expand(
            t, c.num_attention_heads, c.qk_rope_head_dim
        )
        q = torch.cat((p.q_nope, p.q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out, lse = ops.sparse_attention(q, k, v.contiguous(), indices, self.scale, need_lse)
        return self.o_proj(out.reshape(t, -1)), q, k, lse

    def _absorbed(
        self, p: MLAProjections, latent: torch.Tensor, slots: torch.Tensor, need_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_attend_absorbed` of the packed tokens' projections ``p`` over their
        own latent rows ``[N, kv_lora + rope]``: the output ``[T, hidden]``, the
        absorbed queries ``[T, H, kv_lora + rope]``, lse."""
        q = torch.cat((self._absorb(p.q_nope), p.q_pe), dim=-1)
        out, lse = self._attend_absorbed(q, latent, slots, need_lse)
        return out, q, lse

    def _attend_absorbed(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        slots: torch.Tensor,
        need_lse: bool,
        rope: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed queries ``q [T, H, kv_lora + rope]`` over the latent rows ``[N,
        kv_lora + rope]`` at ``slots [T, K]`` (``-1``: none), ``W_UV`` applied to the
        result: the output ``[T, hidden]`` and lse ``[T, H]`` (``[0]`` unless
        ``need_lse``). With ``rope [N, rope]`` the latent is ``[N, kv_lora]`` and the
        rope keys lie apart (a paged cache's pools, read in place)."""
        c = self.config
        _, w_uv = self._kv_up()
        kv = latent[:, None, :]
        v = kv[..., : c.kv_lora_rank]
        k_rope = None if rope is None else rope[:, None, :]
        out_lat, lse = ops.sparse_attention(q, kv, v, slots, self.scale, need_lse, k_rope)
        out = torch.matmul(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(out.shape[0], -1)), lse

    def attend_latent(
        self,
        q: torch.Tensor,
        latent_cache: torch.Tensor,
        slots: torch.Tensor,
        rope_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed attention ``[T, hidden]``: :meth:`prolog`'s queries ``q [T, H,
        kv_lora + rope]`` over the latent cache ``[N, kv_lora + rope]`` at physical
        ``slots [T, K]`` (``-1``: none); or over ``[N, kv_lora]`` with the rope keys
        ``rope_cache [N, rope]`` stored apart."""
        return self._attend_absorbed(q, latent_cache, slots, False, rope_cache)[0]
