"""The model's feed-forward building blocks: RMSNorm, the SwiGLU MLP, and the MoE
block (sigmoid router with replayable routing, fused routed experts, shared expert)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError
from glmport.core.prepared import PreparedWeight
from glmport.core.validate import holds

from .config import GlmMoeDsaConfig
from .tape_protocol import ROUTING, active_tape

log = logging.getLogger("glmport")


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
            _check_replayed_ids(ids, c.n_routed_experts)
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


def _check_replayed_ids(ids: torch.Tensor, experts: int) -> None:
    """Refuse replayed expert ``ids [T, k]`` outside ``[0, experts)`` (a record of another
    model): a device-side assert, no sync per layer (see
    :func:`~glmport.core.validate.holds`); a ConfigError at once on the CPU."""
    outside = f"replayed routing holds expert ids outside [0, {experts})"
    if ids.numel() and not holds((ids.min() >= 0) & (ids.max() < experts), outside):
        raise ConfigError(outside)


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
