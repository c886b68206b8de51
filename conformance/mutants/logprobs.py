"""token_logprobs mutants: (hidden [T, D], lm_head [V, D], targets [T] int64,
temperature) -> (logp [T], entropy [T]) float32.

The normaliser mutants reimplement the op in torch with the bug in it (a vocabulary
tile left out, logits rounded to bfloat16), as a fused kernel would have it."""

from __future__ import annotations

import torch

from .base import (
    IDS_2P16,
    LM_LOGITS,
    LN2,
    TAIL_TILES,
    add,
    ids_16bit,
    mutant,
    on_args,
    replace_args,
)

OP = "token_logprobs"
VOCAB_TILE = 1024  # the vocabulary tile of the tail-tile mutant


def _target_plus_one(args: list) -> None:
    args[2] = (args[2] + 1) % args[1].shape[0]


_SIMPLE = (
    ("temperature_ignored", "temperature", "ignores the temperature (log-probs at 1)",
     "glm5_reduced (temperature 0.7)", replace_args(OP, temperature=lambda t: 1.0)),
    ("temperature_multiplied", "temperature",
     "multiplies the logits by the temperature instead of dividing", "edge: temperature_*",
     replace_args(OP, temperature=lambda t: 1.0 / t)),
    ("target_off_by_one", "range end", "reads the log-probability of token target + 1", "tiny",
     on_args(_target_plus_one)),
    ("target_ids_16bit", "ids width", "stages the target ids as uint16 (token v reads v % 65536)",
     IDS_2P16, replace_args(OP, targets=ids_16bit)),
)  # fmt: skip
for _name, _kind, _breaks, _needs, _wrap in _SIMPLE:
    add(OP, _name, _kind, _breaks, _needs, _wrap)


@mutant(
    OP,
    "logprobs_in_log2",
    "lse base",
    "returns log-probabilities and entropy in bits (exp2 softmax never converted back)",
    "tiny",
)
def _bits(kernel):
    def mutated(*args):
        logp, entropy = kernel(*args)
        return logp / LN2, entropy / LN2

    return mutated


@mutant(
    OP,
    "entropy_ignores_temperature",
    "temperature",
    "computes the entropy at temperature 1",
    "edge: temperature_*",
)
def _entropy_at_one(kernel):
    def mutated(hidden, lm_head, targets, temperature):
        logp, _ = kernel(hidden, lm_head, targets, temperature)
        return logp, kernel(hidden, lm_head, targets, 1.0)[1]

    return mutated


def _logits(hidden, lm_head, temperature) -> torch.Tensor:
    """float32 logits ``[T, V]`` at ``temperature``."""
    return (hidden.float() @ lm_head.float().T) / temperature


def _outputs(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor):
    """``(logp, entropy)`` float32 ``[T]`` from float32 ``logits`` ``[T, V]`` and a
    normaliser ``lse`` ``[T]``."""
    logp_all = logits - lse[:, None]
    picked = logp_all.gather(1, targets.long()[:, None])[:, 0]
    return picked, -(logp_all.exp() * logp_all).nan_to_num(nan=0.0).sum(dim=-1)


@mutant(
    OP,
    "softmax_without_max",
    "low precision",
    "exponentiates the logits without subtracting their maximum (overflows)",
    "edge: temperature_0.001",
)
def _no_max(kernel):
    def mutated(hidden, lm_head, targets, temperature):
        logits = _logits(hidden, lm_head, temperature)
        return _outputs(logits, targets, logits.exp().sum(dim=-1).log())

    return mutated


@mutant(
    OP,
    "last_vocab_tile_dropped",
    "tail element",
    f"leaves the last partial {VOCAB_TILE}-token vocabulary tile out of the normaliser",
    TAIL_TILES,
)
def _tail_tile(kernel):
    def mutated(hidden, lm_head, targets, temperature):
        v = lm_head.shape[0]
        if v <= VOCAB_TILE or v % VOCAB_TILE == 0:
            return kernel(hidden, lm_head, targets, temperature)
        logits = _logits(hidden, lm_head, temperature)
        lse = torch.logsumexp(logits[:, : v - v % VOCAB_TILE], dim=-1)
        return _outputs(logits, targets, lse)

    return mutated


@mutant(
    OP,
    "logits_rounded_to_bf16",
    "low precision",
    "rounds the logits to bfloat16 before the log-softmax",
    LM_LOGITS,
)
def _bf16_logits(kernel):
    def mutated(hidden, lm_head, targets, temperature):
        logits = _logits(hidden, lm_head, temperature).to(torch.bfloat16).float()
        return _outputs(logits, targets, torch.logsumexp(logits, dim=-1))

    return mutated
