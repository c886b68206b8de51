"""GLM-5 (and DeepSeek-V3.2) on glmport ops: MLA attention with the lightning indexer
and top-k sparse attention, MoE with a sigmoid router, MTP layers.

Tokens travel packed (``[T_total, ...]``, the op interface's "TND" layout): a padded
batch is packed once (:func:`pack`), every sequence's keys are a contiguous slot range,
and the indexer's ranges and the attention's indices are slots of that packed batch
(or of the paged KV cache, see :mod:`glmport.model.cache`). Parameter names follow
transformers' ``GlmMoeDsaForCausalLM``, so its state dicts load unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError
from glmport.core.prepared import PreparedWeight

from .choices import INDICES, ROUTING, active_tape
from .config import GlmMoeDsaConfig

log = logging.getLogger("glmport")

MLA_NORM_EPS = 1e-6  # q_a / kv_a norms and the indexer's key LayerNorm (not rms_norm_eps)
# The packed forward runs MLA absorbed where some query sees more than this many times
# index_topk keys (the tiny model of bench/vs_transformers.py on the generic backend,
# 1 thread: non-absorbed was 1.5x faster at 2-4x, absorbed 3.4x faster at 8x).
ABSORB_BEYOND = 4


# -- packing -----------------------------------------------------------------------


@dataclass
class Packed:
    """A padded batch ``[B, S]`` packed to its ``T`` real tokens.

    ``positions [T]`` (per sequence, from 0), ``k_start`` / ``k_end [T]`` int32 causal
    key ranges in packed slots, ``flat [T]`` each token's index in the ``B * S`` grid.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    k_start: torch.Tensor
    k_end: torch.Tensor
    flat: torch.Tensor
    batch: int
    seq_len: int

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` back to ``[B, S, ...]``, zeros at padding."""
        out = packed.new_zeros((self.batch * self.seq_len, *packed.shape[1:]))
        out[self.flat] = packed
        return out.view(self.batch, self.seq_len, *packed.shape[1:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Packed:
    """Pack ``input_ids [B, S]`` with a 1/0 ``attention_mask`` (left or right padding).

    Positions count each sequence's real tokens, so padding never shifts them.
    """
    b, s = input_ids.shape
    mask = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool()
    )
    counts = mask.sum(dim=1)
    flat = mask.reshape(-1).nonzero().squeeze(1)
    positions = (mask.long().cumsum(dim=1) - 1).reshape(-1)[flat]
    starts = torch.cat((counts.new_zeros(1), counts.cumsum(0)[:-1]))
    row = flat // s
    k_start = starts[row].to(torch.int32)
    k_end = (k_start + positions + 1).to(torch.int32)
    return Packed(input_ids.reshape(-1)[flat], positions, k_start, k_end, flat, b, s)


def visible_slots(k_start: torch.Tensor, k_end: torch.Tensor) -> torch.Tensor:
    """Every slot of each query's range ``[k_start, k_end)`` as ``[T, max_len]`` int32
    indices, ``-1`` past the range end: dense causal attention through
    ``sparse_attention``."""
    width = int((k_end - k_start).max()) if k_start.numel() else 0
    slots = k_start[:, None] + torch.arange(width, dtype=torch.int32, device=k_start.device)
    return torch.where(slots < k_end[:, None], slots, -1).to(torch.int32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(config: GlmMoeDsaConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[qk_rope_head_dim / 2]`` fp32 of ``config.rope_scaling``
    and the factor on cos / sin, as transformers' ``modeling_rope_utils`` computes them:

    - default: ``theta ** (-2i / d)``;
    - linear: the default divided by ``factor``;
    - yarn (Peng et al. 2023, arXiv 2309.00071): per frequency a ramp between the
      default (fast rotations, above ``beta_fast`` turns over the original length) and
      the default divided by ``factor`` (slow, below ``beta_slow``); the cos / sin
      factor is ``attention_factor``, else ``mscale(factor, mscale) /
      mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor)``;
    - llama3 (Llama 3.1): wavelengths longer than ``original / low_freq_factor``
      divided by ``factor``, shorter than ``original / high_freq_factor`` kept,
      smoothly interpolated between.
    """
    d, theta, p = config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
    kind = p["rope_type"]
    # On the cpu even while a model is built on the meta device (from_pretrained).
    exponents = torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d
    base_freq = theta**exponents  # [d/2]
    inv_freq = 1.0 / base_freq
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        original, factor = p["original_max_position_embeddings"], p["factor"]
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor, original = p["factor"], p["original_max_position_embeddings"]
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else _yarn_mscale(factor)
            )

        def dim_of(turns: float) -> float:
            """The (fractional) dim index that turns ``turns`` times over ``original``."""
            return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(p.get("beta_fast", 32)), dim_of(p.get("beta_slow", 1))
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        dims = torch.arange(d // 2, dtype=torch.float32, device="cpu")
        ramp = ((dims - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp  # weight of the unscaled frequency
        interpolated = 1.0 / (factor * base_freq)
        inv_freq = interpolated * (1 - extrapolated) + inv_freq * extrapolated
        return inv_freq, float(attention_factor)
    return inv_freq, 1.0


def softmax_scale(config: GlmMoeDsaConfig) -> float:
    """The attention's score scale: ``qk_head_dim ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` where a scaled RoPE sets ``mscale_all_dim`` (DeepSeek's
    YaRN; transformers' ``yarn_apply_mscale``)."""
    p = config.rope_scaling
    scale = config.qk_head_dim**-0.5
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        scale *= _yarn_mscale(p["factor"], p["mscale_all_dim"]) ** 2
    return scale


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, d/2]`` fp32 at ``positions [T]`` for ``inv_freq [d/2]`` fp32
    (:func:`rope_frequencies`), both times ``attention_factor``."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


# -- building blocks ---------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router with a score-correction bias that only steers the choice.

    Under a :func:`~glmport.model.choices.choice_tape` replaying routing, the experts
    come from the tape and only their weights are computed (:meth:`weights_for`)."""

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, k]`` fp32 and expert ids ``[T, k]`` int32."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        tape = active_tape()
        if tape is not None and tape.replays(ROUTING, self):
            ids = tape.replayed(ROUTING, self)
            if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < c.n_routed_experts):
                raise ConfigError(
                    f"replayed routing holds expert ids outside [0, {c.n_routed_experts})"
                )
            weights, ids = self.weights_for(logits, ids), ids.to(torch.int32)
        else:
            weights, ids = ops.moe_gate(
                logits,
                self.e_score_correction_bias.float(),
                c.num_experts_per_tok,
                c.n_group,
                c.topk_group,
                c.routed_scaling_factor,
                c.norm_topk_prob,
                "sigmoid",
            )
        if tape is not None and tape.tracks(ROUTING, self):
            tape.record(ROUTING, self, ids)
        return weights, ids

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``moe_gate``'s weights ``[T, k]`` fp32 for given expert ``ids [T, k]``:
        sigmoid scores of those experts (the correction bias only chooses), normalised
        if ``norm_topk_prob``, times ``routed_scaling_factor``; differentiable in
        ``logits [T, E]`` fp32."""
        c = self.config
        weights = torch.sigmoid(logits).gather(1, ids.long())
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor


def packed_weight(module: nn.Module, name: str) -> torch.Tensor | PreparedWeight:
    """``module``'s packed weight ``<name>_q``, or its prepared form when one was made
    from it (``glmport.model.quantize.prepare_weights``) and is still current; a stale
    one (the module moved or reloaded since) is dropped with a log line."""
    w = getattr(module, name + "_q")
    prepared = module.prepared.get(name)
    if prepared is None:
        return w
    if prepared.is_current(w):
        return prepared
    del module.prepared[name]
    log.warning(
        "glmport: the prepared %s weight of a %s is stale (moved or reloaded since it was "
        "prepared); using the canonical weight. Call prepare_weights(model) again.",
        name,
        type(module).__name__,
    )
    return w


class Experts(nn.Module):
    """Routed experts as fused tensors: ``gate_up_proj [E, 2I, H]`` (gate rows first),
    ``down_proj [E, H, I]``. ``scheme`` / ``group_size`` switch the grouped GEMMs to a
    quantised (packed buffers ``*_q`` / ``*_scale``) or QAT (float weights) mode."""

    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.width = i
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.scheme = "none"
        self.group_size = 128
        self.prepared: dict[str, PreparedWeight] = {}

    def _gemm(self, x: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, name + "_q"):  # float weights: plain ("none") or QAT
            return ops.grouped_gemm(
                x, getattr(self, name), offsets, None, self.scheme, self.group_size
            )
        w = packed_weight(self, name)
        scale = getattr(self, name + "_scale")
        return ops.grouped_gemm(x, w, offsets, scale, self.scheme, self.group_size)

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = self._gemm(x_sorted, "gate_up_proj", offsets)
        return self._gemm(F.silu(h[:, : self.width]) * h[:, self.width :], "down_proj", offsets)


class MoE(nn.Module):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        x_sorted, offsets, src_row = ops.moe_dispatch(x, ids, self.config.n_routed_experts)
        routed = ops.moe_combine(self.experts(x_sorted, offsets), src_row, weights)
        return routed + self.shared_experts(x)


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

    def select(self, h, q_res, cos, sin, keys, k_start, k_end) -> torch.Tensor:
        """``[T, index_topk]`` int32 slot ids of ``keys`` (``-1`` where fewer are visible).

        A query that sees at most ``index_topk`` keys would have them all selected, so
        the indexer runs only for the queries that see more (none for short
        sequences, GLM-5's RL samples among them; the first ``index_topk`` tokens of
        every prompt); the others get their visible keys in slot order. Each
        sequence's keys are a contiguous run from ``k_start``, so a slot less
        ``k_start`` is the key's position in its sequence: what a
        :func:`~glmport.model.choices.choice_tape` records and replays."""
        c = self.config
        tape = active_tape()
        if tape is not None and tape.replays(INDICES, self):
            indices = _replayed_slots(tape.replayed(INDICES, self), k_start, k_end)
        else:
            wide = (k_end - k_start) > c.index_topk
            if k_start.numel() and bool(wide.all()):
                indices = self._run(h, q_res, cos, sin, keys, k_start, k_end)
            else:
                narrow = ~wide
                visible = visible_slots(k_start[narrow], k_end[narrow])
                indices = torch.full(
                    (k_start.shape[0], c.index_topk), -1, dtype=torch.int32, device=h.device
                )
                indices[narrow, : visible.shape[1]] = visible
                if bool(wide.any()):
                    hw, qw, cw, sw, ks, ke = (x[wide] for x in (h, q_res, cos, sin, k_start, k_end))
                    indices[wide] = self._run(hw, qw, cw, sw, keys, ks, ke)
        if tape is not None and tape.tracks(INDICES, self):
            tape.record(INDICES, self, torch.where(indices >= 0, indices - k_start[:, None], -1))
        return indices

    def _run(self, h, q_res, cos, sin, keys, k_start, k_end) -> torch.Tensor:
        """``lightning_indexer``'s ``[T, index_topk]`` int32 choice for these queries."""
        q, weights = self.queries(h, q_res, cos, sin)
        with torch.no_grad():  # a selection, not a differentiable quantity
            indices, _ = ops.lightning_indexer(
                q.detach(), keys.detach(), weights.detach(), k_start, k_end, self.config.index_topk
            )
        return indices


def _replayed_slots(
    positions: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor
) -> torch.Tensor:
    """Replayed key ``positions [T, K]`` (``-1``: none) as slots of the packed keys,
    refusing a position the query cannot see (a record of another prompt)."""
    visible = (k_end - k_start).long()[:, None]
    bad_rows = ((positions < -1) | (positions >= visible)).any(dim=1)
    if bool(bad_rows.any()):
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
            indices = visible_slots(batch.k_start, batch.k_end)
        elif self.indexer is None:
            if shared is None:
                raise ConfigError(
                    "a shared-indexer layer (indexer_types 'shared') needs the top-k of a "
                    "preceding full layer of the same forward"
                )
            indices = shared
        else:
            keys = self.indexer.keys(h, cos, sin)
            indices = self.indexer.select(h, p.q_res, cos, sin, keys, batch.k_start, batch.k_end)
        widest = int((batch.k_end - batch.k_start).max()) if h.shape[0] else 0
        if not dense and widest > ABSORB_BEYOND * c.index_topk:
            out, q, lse = self._absorbed(p, p.latent, indices)
            k = p.latent[:, None, :].expand(-1, c.num_attention_heads, -1)
        else:
            out, q, k, lse = self._non_absorbed(p, indices)
        if records is not None:
            d = [x.detach() for x in (h, p.q_res, cos, sin, q, k, lse)]
            records.append(AttentionRecord(*d, indices, batch.k_start, batch.k_end))
        return out, indices

    def _non_absorbed(
        self, p: MLAProjections, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head keys and values up-projected from the packed tokens' own latents:
        the output ``[T, hidden]``, queries and keys ``[T, H, qk_head_dim]``, lse."""
        c = self.config
        t = p.latent.shape[0]
        kv = self.kv_b_proj(p.latent[:, : c.kv_lora_rank]).view(t, c.num_attention_heads, -1)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
        k_pe = p.latent[:, None, c.kv_lora_rank :].expand(
            t, c.num_attention_heads, c.qk_rope_head_dim
        )
        q = torch.cat((p.q_nope, p.q_pe), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out, lse = ops.sparse_attention(q, k, v.contiguous(), indices, self.scale)
        return self.o_proj(out.reshape(t, -1)), q, k, lse

    def _absorbed(
        self, p: MLAProjections, latent: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, H, kv_lora + rope]`` (``W_UK`` folded in) over the latent rows
        ``[N, kv_lora + rope]`` at ``slots [T, K]`` (``-1``: none), ``W_UV`` applied to
        the result: the output ``[T, hidden]``, those queries, lse ``[T, H]``."""
        c = self.config
        w_uk, w_uv = self._kv_up()
        # Per-head GEMMs over the token axis: [H, T, nope] @ [H, nope, kv_lora].
        q_lat = torch.matmul(p.q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_lat, p.q_pe), dim=-1)
        kv = latent[:, None, :]
        out_lat, lse = ops.sparse_attention(q, kv, kv[..., : c.kv_lora_rank], slots, self.scale)
        out = torch.matmul(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(out.reshape(out.shape[0], -1)), q, lse

    def attend_latent(
        self, p: MLAProjections, latent_cache: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Absorbed attention ``[T, hidden]``: queries over the latent cache
        ``[N, kv_lora + rope]`` at physical ``slots [T, K]`` (``-1``: none)."""
        return self._absorbed(p, latent_cache, slots)[0]


class DecoderLayer(nn.Module):
    def __init__(self, config: GlmMoeDsaConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.is_moe_layer(index)
        self.mlp = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        batch: Packed,
        cos: torch.Tensor,
        sin: torch.Tensor,
        shared: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new hidden states ``[T, hidden]`` and the ``[T, K]`` int32 slots this
        layer attended, which the following shared layers attend (``shared``: the
        previous layer's, see :meth:`Attention.forward`)."""
        out, indices = self.self_attn(self.input_layernorm(x), batch, cos, sin, shared)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), indices


class SharedHead(nn.Module):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """Multi-token prediction: from the hidden state at position ``i`` and the
    embedding of token ``i+1``, predict token ``i+2`` (applied recursively to draft).

    Keys as in GLM-5 checkpoints (``model.layers.{num_hidden_layers}.*``): ``enorm``,
    ``hnorm``, ``eh_proj`` (embedding half first), its own ``embed_tokens`` and
    ``shared_head.{norm,head}``, and a full decoder layer."""

    def __init__(self, config: GlmMoeDsaConfig, index: int) -> None:
        super().__init__(config, index)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def fuse(self, h_prev: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        e = self.enorm(self.embed_tokens(next_ids))
        return self.eh_proj(torch.cat((e, self.hnorm(h_prev)), dim=-1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(x))


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        n = config.num_hidden_layers
        layers += [MTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Once per model, fp32 on the cpu: a plain attribute, not a buffer, so that
        # model.to(bfloat16) cannot round the frequencies (rope_tables moves them).
        self.inv_freq, self.attention_factor = rope_frequencies(config)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers[: self.config.num_hidden_layers])

    @property
    def mtp_layers(self) -> list[MTPLayer]:
        return list(self.layers[self.config.num_hidden_layers :])

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, qk_rope_head_dim / 2]`` fp32 at ``positions [T]`` (prefill,
        training and paged-cache decode all call this)."""
        return rope_tables(positions, self.inv_freq, self.attention_factor)

    def forward(self, batch: Packed) -> torch.Tensor:
        """Last-layer hidden states ``[T, hidden]`` of the packed tokens (before the norm)."""
        cos, sin = self.rope(batch.positions)
        x = self.embed_tokens(batch.ids)
        tape = active_tape()
        # A choice tape names each token by its batch row and position.
        rows = (
            nullcontext()
            if tape is None
            else tape.rows(batch.flat // batch.seq_len, batch.positions)
        )
        with rows:
            indices = None  # a shared layer attends what the previous layer attended
            for layer in self.decoder_layers:
                x, indices = layer(x, batch, cos, sin, indices)
        return x


@dataclass
class CausalLMOutput:
    """``logits [B, S, V]`` (zeros at padding) and the last hidden states ``[B, S, H]``
    before the final norm (the MTP layer's input)."""

    logits: torch.Tensor
    hidden_states: torch.Tensor
    loss: torch.Tensor | None = None
