"""A paged KV cache for GLM-5 decoding and the cached forward step that uses it.

Every cached layer keeps pools of ``num_slots = num_blocks * block_size`` rows: the
MLA latent ``[num_slots, kv_lora]`` (normalised ``c_kv``: absorbed attention's values
and the first columns of its keys), the rotated rope key ``[num_slots, rope]`` beside
it, and the indexer keys ``[num_slots, index_head_dim]``, the last only for layers
that run their own indexer (IndexCache's shared layers attend their full layer's
selection of the same step and store no indexer keys). The latent and the rope key are
stored apart, as Ascend's and FlashMLA's caches keep them: each pool is contiguous, so
a vendor kernel reads it in place (``sparse_attention``'s ``k_rope``). Slots are handed
out in blocks from a free list; a sequence's block table maps its logical positions to
physical slots, which need not be contiguous or ordered.

A cached step (:func:`forward_cached`, :func:`mtp_forward_cached`) takes some new
tokens for each of a batch of sequences (a whole prompt, one decoded token, or a run of
draft tokens to verify), writes their latents and keys into fresh slots, and attends
over everything each sequence has cached, reading every pool in place: the indexer
through each token's block table (its paged call), the attention at physical slots.
Nothing of the cache is gathered into a packed copy. Rolling a sequence back
(speculative decoding) is :meth:`PagedKVCache.truncate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmport.core.errors import ConfigError, GlmportError, check_int
from glmport.core.specs.indexer import slots_of_positions
from glmport.core.validate import describe, holds

from .config import GlmMoeDsaConfig
from .modeling import DecoderLayer
from .packing import Widths
from .tape_protocol import active_tape

if TYPE_CHECKING:
    from .causal_lm import GlmMoeDsaForCausalLM


class CacheCapacityError(GlmportError, RuntimeError):
    """The paged cache has too few free blocks for a request."""


class PagedKVCache:
    """Latent and indexer-key pools for ``num_layers`` layers, shared by many sequences.

    Args:
        num_layers: cached layers (the decoder layers, or one MTP layer).
        latent_dim: ``kv_lora_rank``.
        index_dim: ``index_head_dim``.
        num_blocks: blocks in the pool; ``num_blocks * block_size`` slots per layer.
        block_size: slots per block.
        rope_dim: ``qk_rope_head_dim`` (the ``rope[i]`` pools' width).
        indexed: per layer, whether it keeps indexer keys (``index_keys[i]`` is None
            where not); None: every layer.
    """

    def __init__(
        self,
        num_layers: int,
        latent_dim: int,
        index_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        rope_dim: int = 0,
        indexed: Sequence[bool] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        check_int("PagedKVCache: rope_dim", rope_dim, 0)
        for name, value in (
            ("num_layers", num_layers),
            ("latent_dim", latent_dim),
            ("index_dim", index_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            check_int(f"PagedKVCache: {name}", value, 1)
        self.block_size = block_size
        self.num_blocks = num_blocks
        slots = num_blocks * block_size
        self.latent = [
            torch.zeros(slots, latent_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.rope = [
            torch.zeros(slots, rope_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        indexed = [True] * num_layers if indexed is None else list(indexed)
        if len(indexed) != num_layers:
            raise ConfigError(
                f"PagedKVCache: indexed has {len(indexed)} entries for {num_layers} layers"
            )
        self.index_keys: list[torch.Tensor | None] = [
            torch.zeros(slots, index_dim, dtype=dtype, device=device) if keep else None
            for keep in indexed
        ]
        # Popped from the end: a fresh cache hands out blocks 0, 1, 2, ...
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    @classmethod
    def for_config(
        cls,
        config: GlmMoeDsaConfig,
        num_layers: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> PagedKVCache:
        """A cache sized for ``config``'s latent and indexer key widths, for its first
        ``num_layers`` decoder layers: indexer keys only for those that run their own
        indexer. A one-layer MTP cache matches too (layer 0 is always full)."""
        full = set(config.full_indexer_layers)
        return cls(
            num_layers,
            config.kv_lora_rank,
            config.index_head_dim,
            num_blocks,
            block_size,
            rope_dim=config.qk_rope_head_dim,
            indexed=[i in full for i in range(num_layers)],
            dtype=dtype,
            device=device,
        )

    # -- bookkeeping -----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.latent)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def add_sequence(self) -> int:
        """Register an empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._tables[seq] = []
        self._lengths[seq] = 0
        return seq

    def _check(self, seq: int) -> None:
        if seq not in self._tables:
            raise ConfigError(f"PagedKVCache: unknown sequence id {seq!r}")

    def length(self, seq: int) -> int:
        """Tokens cached for ``seq``."""
        self._check(seq)
        return self._lengths[seq]

    def block_table(self, seq: int) -> list[int]:
        """Physical block ids of ``seq``, in logical order."""
        self._check(seq)
        return list(self._tables[seq])

    def blocks_needed(self, seq: int, n: int) -> int:
        """New blocks that appending ``n`` tokens to ``seq`` would take."""
        total = -(-(self.length(seq) + n) // self.block_size)
        return max(0, total - len(self._tables[seq]))

    def slots(self, seq: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Physical slots ``[end - start]`` int64 of logical positions ``[start, end)``."""
        length = self.length(seq)
        end = length if end is None else end
        if not 0 <= start <= end <= length:
            raise ConfigError(
                f"PagedKVCache: positions [{start}, {end}) are outside sequence {seq} "
                f"of length {length}"
            )
        pos = torch.arange(start, end)
        table = torch.tensor(self._tables[seq], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def append(self, seq: int, n: int) -> torch.Tensor:
        """Extend ``seq`` by ``n`` tokens; returns their physical slots ``[n]`` int64.

        Raises :class:`CacheCapacityError` (and changes nothing) when the free list is short.
        """
        return self.append_batch([seq], [n])[0]

    def append_batch(self, seqs: Sequence[int], counts: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`append` for several sequences, all or nothing."""
        for seq, n in zip(seqs, counts, strict=True):
            check_int("PagedKVCache: token count", n, 0)
            self._check(seq)
        if len(set(seqs)) != len(seqs):
            raise ConfigError(f"PagedKVCache: a sequence appears twice in {list(seqs)}")
        needed = sum(self.blocks_needed(s, n) for s, n in zip(seqs, counts, strict=True))
        if needed > len(self._free):
            raise CacheCapacityError(
                f"paged KV cache is full: {sum(counts)} new tokens need {needed} more blocks "
                f"of {self.block_size} slots, {len(self._free)} of {self.num_blocks} are free; "
                "free finished sequences or build the cache with more blocks"
            )
        out = []
        for seq, n in zip(seqs, counts, strict=True):
            self._tables[seq] += [self._free.pop() for _ in range(self.blocks_needed(seq, n))]
            start = self._lengths[seq]
            self._lengths[seq] = start + n
            out.append(self.slots(seq, start))
        return out

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq`` (speculative rollback); blocks no
        longer needed go back to the free list."""
        if not isinstance(length, int) or not 0 <= length <= self.length(seq):
            raise ConfigError(
                f"PagedKVCache: cannot truncate sequence {seq} of length "
                f"{self.length(seq)} to {length!r}"
            )
        keep = -(-length // self.block_size)
        table = self._tables[seq]
        self._free += reversed(table[keep:])
        del table[keep:]
        self._lengths[seq] = length

    def free(self, seq: int) -> None:
        """Release all of ``seq``'s blocks and forget it."""
        self.truncate(seq, 0)
        del self._tables[seq], self._lengths[seq]


# -- the cached forward step ---------------------------------------------------------


@dataclass
class StepOutput:
    """A cached step's result.

    ``logits``: ``[T, V]`` for every new token, or ``[B, V]`` for each sequence's last
    new token only (``last_only``). ``hidden``: ``[T, hidden]`` pre-norm hidden states
    of every new token (the MTP layer's input). ``counts``: new tokens per sequence, in
    batch order (``hidden`` rows are grouped by sequence).
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    counts: list[int]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sequence views of a ``[T, ...]`` tensor (such as ``hidden``)."""
        return x.split(self.counts)

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """Each sequence's last row ``[B, ...]`` of a ``[T, ...]`` tensor."""
        return x[_to(torch.tensor(self.counts).cumsum(0) - 1, x.device)]


@dataclass
class StepPlan:
    """The host side of one cached step (:func:`plan_step`): where its ``T`` new tokens
    go and what each may see, laid out from the cache's own bookkeeping. Tensors are on
    the model's device; the ints are the host's, so running the step reads nothing
    back from the device.

    ``new_slots [T]`` int64: physical slots written. ``block_table [T, M]`` int32: each
    new token's sequence's blocks in logical order (``M`` the longest table of the step,
    shorter ones padded with block 0, never read), ``block_size`` their slots: the keys
    a token reads are its sequence's logical positions ``[k_start, k_end)`` (``k_start
    [T]`` int32 zeros, ``k_end [T]`` int32 its position plus one), ``widths`` their
    widths. ``last [B]`` int64: each sequence's last new token in ``T``. ``seq_ids`` /
    ``positions [T]`` int64: each new token's sequence id and position. ``cos / sin
    [T, qk_rope_head_dim / 2]`` fp32: the rotary tables at those positions.
    """

    new_slots: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    k_start: torch.Tensor
    k_end: torch.Tensor
    widths: Widths
    last: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def physical(self, picked: torch.Tensor) -> torch.Tensor:
        """Logical positions ``picked [T, K]`` (``-1``: none) of each token's sequence
        as physical slots ``[T, K]`` int64 (``-1`` kept)."""
        return slots_of_positions(picked, self.block_table, self.block_size)

    def paged(self, pool: torch.Tensor) -> torch.Tensor:
        """A cache pool ``[num_slots, D]`` as its blocks ``[num_blocks, block_size, D]``
        (a view: what the indexer's paged call reads)."""
        return pool.view(-1, self.block_size, pool.shape[-1])


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built tensor on ``device``, copied without making the host wait for the
    device's queue (a blocking copy would: a synchronisation per step)."""
    return t.to(device, non_blocking=True)


def plan_step(
    model: GlmMoeDsaForCausalLM,
    cache: PagedKVCache,
    seqs: Sequence[int],
    counts: Sequence[int] | None = None,
) -> StepPlan:
    """Allocate cache slots for ``counts[i]`` new tokens of each sequence ``seqs[i]``
    (default one each: a decode step) and lay out the step: host bookkeeping and
    host-to-device copies only, nothing read back from the device.

    Raises :class:`CacheCapacityError` (changing nothing) when the cache has too few
    free blocks, :class:`~glmport.core.errors.ConfigError` for an unknown or repeated
    sequence or a count below 1.
    """
    counts = [1] * len(seqs) if counts is None else list(counts)
    if not seqs or len(counts) != len(seqs) or any(n < 1 for n in counts):
        raise ConfigError(
            f"a cached step needs >= 1 new token for each of >= 1 sequences, got counts "
            f"{counts} for sequences {list(seqs)}"
        )
    device = model.lm_head.weight.device
    starts = [cache.length(s) for s in seqs]
    new_slots = cache.append_batch(seqs, counts)
    tables = [cache.block_table(s) for s in seqs]
    width = max(len(table) for table in tables)
    padded = torch.tensor([table + [0] * (width - len(table)) for table in tables])
    rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts))
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    positions = _to(pos, device)
    cos, sin = model.model.rope(positions)
    return StepPlan(
        new_slots=_to(torch.cat(new_slots), device),
        seq_ids=_to(torch.tensor(list(seqs))[rows], device),
        positions=positions,
        block_table=_to(padded[rows].to(torch.int32), device),
        block_size=cache.block_size,
        k_start=_to(torch.zeros(len(pos), dtype=torch.int32), device),
        k_end=_to((pos + 1).to(torch.int32), device),
        widths=Widths(tuple((start + 1, n) for start, n in zip(starts, counts, strict=True))),
        last=_to(torch.tensor(counts).cumsum(0) - 1, device),
        cos=cos,
        sin=sin,
    )


def _layer_step(
    layer: DecoderLayer,
    x: torch.Tensor,
    cache: PagedKVCache,
    index: int,
    plan: StepPlan,
    shared: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.forward`` for new tokens ``x [T, hidden]`` over cache layer
    ``index``: the new ``x`` and the ``[T, K]`` int32 logical key positions attended
    (``-1``: none). A layer without an indexer attends ``shared``, the previous
    layer's positions of this step."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    step = attn.prolog(h, plan.cos, plan.sin)
    latent, rope, keys = cache.latent[index], cache.rope[index], cache.index_keys[index]
    latent[plan.new_slots] = step.latent.to(latent.dtype)
    rope[plan.new_slots] = step.k_rope.to(rope.dtype)
    if attn.indexer is None:
        picked = shared
    else:
        if keys is None:
            raise ConfigError(f"PagedKVCache: layer {index} runs an indexer but keeps no keys")
        keys[plan.new_slots] = attn.indexer.keys(h, plan.cos, plan.sin).to(keys.dtype)
        # Logical positions of each token's sequence, read through its block table: the
        # ties break by position exactly as in the uncached forward.
        picked = attn.indexer.select(
            h,
            step.q_res,
            plan.cos,
            plan.sin,
            plan.paged(keys),
            plan.k_start,
            plan.k_end,
            plan.widths,
            plan.block_table,
        )
    x = x + attn.attend_latent(step.q, latent, plan.physical(picked), rope)
    return x + layer.mlp(layer.post_attention_layernorm(x)), picked


def _decoder_step(
    model: GlmMoeDsaForCausalLM, cache: PagedKVCache, plan: StepPlan, ids: torch.Tensor
) -> torch.Tensor:
    """The decoder layers over the cache for the new tokens ``ids [T]``: the pre-norm
    hidden states ``[T, hidden]`` (the tokens stay cached)."""
    x = model.model.embed_tokens(ids)
    tape = active_tape()
    # A choice tape names each token by its cache sequence id and position.
    with nullcontext() if tape is None else tape.rows(plan.seq_ids, plan.positions):
        picked = None  # a shared layer attends what the previous layer attended
        for i, layer in enumerate(model.model.decoder_layers):
            x, picked = _layer_step(layer, x, cache, i, plan, picked)
    return x


def _check_layers(what: str, model: GlmMoeDsaForCausalLM, cache: PagedKVCache) -> None:
    if cache.num_layers != model.config.num_hidden_layers:
        raise ConfigError(
            f"{what}: the cache has {cache.num_layers} layers, the model "
            f"{model.config.num_hidden_layers} decoder layers"
        )


def _as_ids(
    new_ids: Sequence[Sequence[int] | torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], list[int]]:
    rows = [_to(torch.as_tensor(t, dtype=torch.long).reshape(-1), device) for t in new_ids]
    return rows, [int(r.numel()) for r in rows]


@torch.no_grad()
def decode_step(
    model: GlmMoeDsaForCausalLM,
    cache: PagedKVCache,
    plan: StepPlan,
    token_ids: torch.Tensor,
) -> torch.Tensor:
    """One decode step of a :class:`~glmport.model.GlmMoeDsaForCausalLM`: each of ``B``
    sequences takes one new token; returns the logits of the token after it.

    Args:
        model: the causal LM.
        cache: its cache, one layer per decoder layer.
        plan: ``plan_step(model, cache, seqs)`` for the ``B`` sequences, one new token
            each (the default counts): it allocated the slots these tokens fill.
        token_ids: ``[B]`` int64 (or int32) tensor on the model's device, each
            sequence's newest token in the order of ``seqs``, in ``[0, vocab_size)``.

    Returns:
        logits ``[B, vocab_size]`` in the model's dtype; the new tokens stay cached.

    The model and the op checks read no tensor on the host: every decision the layers
    take comes from ``plan`` (host ints), and value checks, the range of ``token_ids``
    included, are device-side asserts under the default ``GLMPORT_VALIDATE=full``
    (:func:`~glmport.core.validate.holds`): on the CPU a bad value raises at once (a
    ConfigError here, an OpInputError from an op; compiled, the assert's RuntimeError
    with the same message), on an accelerator it stops the device at its next
    synchronisation. So the step can be compiled whole (``torch.compile(decode_step,
    fullgraph=True)``), and with kernels that read nothing back either (whether one
    does is its backend's: the generic and cpu kernels do, to pick tile windows and
    expert row ranges) it runs without host synchronisation or in a device graph.
    """
    _check_layers("decode_step", model, cache)
    b, t = plan.last.shape[0], plan.new_slots.shape[0]
    if t != b:
        raise ConfigError(
            f"decode_step takes one new token per sequence; the plan holds {t} new tokens "
            f"for {b} sequences (use forward_cached for longer runs)"
        )
    _check_token_ids(token_ids, b, model.config.vocab_size)
    x = _decoder_step(model, cache, plan, token_ids)
    return model.lm_head(model.model.norm(x))


def _check_token_ids(token_ids: torch.Tensor, b: int, vocab: int) -> None:
    """Refuse ``token_ids`` that are not ``[b]`` int64 / int32 ids in ``[0, vocab)``:
    shapes and dtype on the host, the range as a device-side assert (a ConfigError at
    once on the CPU)."""
    if (
        not isinstance(token_ids, torch.Tensor)
        or tuple(token_ids.shape) != (b,)
        or token_ids.dtype not in (torch.int64, torch.int32)
    ):
        raise ConfigError(
            f"decode_step: token_ids must be a [{b}] int64 or int32 tensor of token ids, "
            f"got {describe(token_ids)}"
        )
    outside = f"decode_step: token_ids must lie in [0, {vocab})"
    if not holds((token_ids.min() >= 0) & (token_ids.max() < vocab), outside):
        raise ConfigError(f"{outside}, got {token_ids.tolist()[:8]}")


@torch.no_grad()
def forward_cached(
    model: GlmMoeDsaForCausalLM,
    cache: PagedKVCache,
    seqs: Sequence[int],
    new_ids: Sequence[Sequence[int] | torch.Tensor],
    *,
    last_only: bool = False,
) -> StepOutput:
    """One cached step of a :class:`~glmport.model.GlmMoeDsaForCausalLM`: a prompt, a
    decoded token or a run of draft tokens per sequence (:func:`plan_step`, then the
    decoder layers as in :func:`decode_step`).

    Args:
        model: the causal LM.
        cache: its cache, one layer per decoder layer.
        seqs: ``B`` sequence ids of ``cache``.
        new_ids: ``B`` runs of new token ids (``>= 1`` each), continuing each sequence
            at its cached length.
        last_only: return logits of each sequence's last new token only.

    Returns:
        :class:`StepOutput`; the new tokens stay cached.
    """
    _check_layers("forward_cached", model, cache)
    rows, counts = _as_ids(new_ids, model.lm_head.weight.device)
    plan = plan_step(model, cache, seqs, counts)
    x = _decoder_step(model, cache, plan, torch.cat(rows))
    out = x[plan.last] if last_only else x
    return StepOutput(model.lm_head(model.model.norm(out)), x, counts)


@torch.no_grad()
def mtp_forward_cached(
    model: GlmMoeDsaForCausalLM,
    cache: PagedKVCache,
    seqs: Sequence[int],
    h_prev: torch.Tensor,
    next_ids: Sequence[Sequence[int] | torch.Tensor],
    *,
    layer: int = 0,
    last_only: bool = False,
) -> StepOutput:
    """One cached step of MTP layer ``layer``: the entry at position ``i`` fuses a
    hidden state for position ``i`` with the embedding of token ``i + 1`` and predicts
    token ``i + 2``.

    Args:
        model: the causal LM.
        cache: that MTP layer's own one-layer cache.
        seqs: ``B`` sequence ids of ``cache``.
        h_prev: ``[T, hidden]`` pre-norm hidden states (the main model's, or this
            layer's own output when drafting recursively), grouped by sequence.
        next_ids: ``B`` runs of the following tokens, one per row of ``h_prev``.
        last_only: return logits of each sequence's last new entry only.

    Returns:
        :class:`StepOutput` with the MTP logits and this layer's output hidden states.
    """
    if cache.num_layers != 1:
        raise ConfigError(f"mtp_forward_cached: expected a one-layer cache, got {cache.num_layers}")
    mtp = model.model.mtp_layers[layer]
    device = model.lm_head.weight.device
    rows, counts = _as_ids(next_ids, device)
    if sum(counts) != h_prev.shape[0]:
        raise ConfigError(
            f"mtp_forward_cached: {sum(counts)} next tokens for {h_prev.shape[0]} hidden states"
        )
    plan = plan_step(model, cache, seqs, counts)
    x, _ = _layer_step(mtp, mtp.fuse(h_prev, torch.cat(rows)), cache, 0, plan)
    out = x[plan.last] if last_only else x
    return StepOutput(mtp.logits(out), x, counts)
