"""An exported graph judged against the eager model it came from.

The runtime's logits are compared with :class:`~glmport.model.GlmMoeDsaForCausalLM`'s
own forward on the same tokens (not with the traced graph): prefill over a batch of
prompts longer than ``index_topk`` (so the indexer really selects), and decode steps
fed the runtime's own caches, each step against the eager forward of the whole prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from glmport.model.causal_lm import GlmMoeDsaForCausalLM

from .graph import GraphKind, PrefillGraph

# Runs an exported graph: its inputs as torch tensors -> its outputs.
GraphRunner = Callable[..., tuple[torch.Tensor, ...]]


@dataclass
class Agreement:
    """The largest ``|logits_runtime - logits_eager|`` over ``tokens`` positions."""

    max_abs: float
    tokens: int

    def __str__(self) -> str:
        return f"max |logits - torch| = {self.max_abs:.2e} over {self.tokens} positions"


def sample_ids(model: GlmMoeDsaForCausalLM, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids ``[batch, length]`` int64 of ``model``'s vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


@torch.no_grad()
def compare(
    model: GlmMoeDsaForCausalLM,
    run: GraphRunner,
    kind: GraphKind,
    *,
    batch: int = 2,
    prompt: int | None = None,
    steps: int = 3,
) -> Agreement:
    """Run the exported graph of ``kind`` through ``run`` and compare its logits with the
    eager model's. ``prompt`` defaults to twice ``index_topk`` plus one. For "decode"
    the caches of the prompt come from the eager prefill graph, then ``steps`` steps
    run on the runtime's own caches."""
    length = prompt or 2 * model.config.index_topk + 1
    ids = sample_ids(model, batch, length + steps)
    model.eval()
    eager = model(ids).logits.float()
    if kind == "prefill":
        logits = run(ids[:, :length])[0].float()
        return Agreement(float((logits - eager[:, :length]).abs().max()), batch * length)
    _, latent, keys = PrefillGraph(model)(ids[:, :length])
    worst = 0.0
    for i in range(steps):
        pos = length + i
        logits, latent, keys = run(ids[:, pos : pos + 1], latent, keys)
        worst = max(worst, float((logits[:, 0].float() - eager[:, pos]).abs().max()))
    return Agreement(worst, batch * steps)
