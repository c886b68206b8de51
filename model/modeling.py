"""GLM-5 (and DeepSeek-V3.2) on glmport ops, assembled: decoder layers (MLA attention
with the lightning indexer, a dense or MoE MLP), MTP layers and the model body.

Tokens travel packed (:mod:`glmport.model.packing`): a padded batch is packed once,
every sequence's keys are a contiguous slot range, and the indexer's ranges and the
attention's indices are slots of that packed batch (or of the paged KV cache, see
:mod:`glmport.model.cache`). The layers' parts live in :mod:`glmport.model.attention`
and :mod:`glmport.model.blocks`, RoPE in :mod:`glmport.model.rope`. Parameter names
follow transformers' ``GlmMoeDsaForCausalLM``, so its state dicts load unchanged.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from .attention import Attention
from .blocks import MLP, MoE, RMSNorm
from .config import GlmMoeDsaConfig
from .packing import Packed
from .rope import rope_frequencies, rope_tables
from .tape_protocol import active_tape


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
