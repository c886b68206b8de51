"""Log-probabilities of given continuations under the model: the training side of RL
(and of ``glmport diff``), through the packed forward and ``token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import glmport.ops as ops
from glmport.core.errors import ConfigError

from .choices import KINDS, Choices, choice_tape
from .generation import check_token_ids
from .packing import pack
from .sampling import check_sampling


@dataclass
class Scores:
    """Per-token results of :func:`continuation_logprobs`, padded to ``[B, L]`` with
    ``L`` the longest continuation.

    ``logprobs`` / ``entropy``: fp32, 0 at padding (``logprobs`` differentiable when
    grad is enabled). ``mask``: bool, True at real tokens. ``choices``: per sequence,
    the discrete choices the forward used (``record=True`` or a replay), else None.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    choices: list[Choices] | None = None


def continuation_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    replay: Sequence[Choices] | Mapping[int, Choices] | None = None,
    kinds: Sequence[str] = KINDS,
    record: bool = False,
) -> Scores:
    """``log p(continuation[b][j] | prompt[b], continuation[b][:j])`` for every ``b, j``.

    One packed forward over each prompt followed by its continuation but the last token
    (the tokens a generation consumed), then ``token_logprobs`` at ``temperature`` on
    the positions that predict the continuation.

    Args:
        model: a :class:`~glmport.model.GlmMoeDsaForCausalLM`.
        prompts: ``B`` non-empty token id lists.
        continuations: ``B`` token id lists (may be empty).
        temperature: the sampling temperature the continuations were drawn at, in
            :func:`~glmport.model.sampling.check_sampling`'s range ``[1e-6, 1e6]``.
        replay: per sequence (index ``b``), recorded choices to replay (for example
            :attr:`GenerationResult.choices`); each must cover the consumed tokens.
        kinds: which kinds of ``replay`` to use (``"routing"``, ``"indices"``).
        record: also return the choices the forward used.

    Returns:
        :class:`Scores`.
    """
    _check(model, prompts, continuations, temperature)
    consumed = [
        [*p, *c][: len(p) + len(c) - 1] if c else list(p)
        for p, c in zip(prompts, continuations, strict=True)
    ]
    device = model.lm_head.weight.device
    width = max(len(s) for s in consumed)
    ids = torch.zeros(len(consumed), width, dtype=torch.long)
    mask = torch.zeros(len(consumed), width, dtype=torch.bool)
    for b, seq in enumerate(consumed):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = True
    batch = pack(ids.to(device), mask.to(device))
    tracking = replay is not None or record
    with choice_tape(model, replay=replay, kinds=kinds) if tracking else nullcontext() as tape:
        hidden = model.model(batch)
    starts = torch.tensor([0, *(len(s) for s in consumed)]).cumsum(0)
    rows, targets = [], []
    for b, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        first = int(starts[b]) + len(p) - 1
        rows.append(torch.arange(first, first + len(c)))
        targets.append(torch.tensor(list(c), dtype=torch.long))
    rows_t = torch.cat(rows).to(device)
    logp, entropy = ops.token_logprobs(
        model.model.norm(hidden[rows_t]),
        model.lm_head.weight,
        torch.cat(targets).to(device),
        float(temperature),
    )
    lengths = torch.tensor([len(c) for c in continuations])
    longest = int(lengths.max())
    out_mask = torch.arange(longest)[None, :] < lengths[:, None]
    out_mask = out_mask.to(device)
    padded_logp = logp.new_zeros(out_mask.shape).masked_scatter(out_mask, logp)
    padded_entropy = entropy.new_zeros(out_mask.shape).masked_scatter(out_mask, entropy.detach())
    choices = None
    if tape is not None:
        recorded = tape.recorded()
        choices = [recorded[b] for b in range(len(consumed))]
    return Scores(padded_logp, padded_entropy, out_mask, choices)


def _check(model, prompts, continuations, temperature) -> None:
    vocab = model.config.vocab_size
    if not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError("prompts must be a non-empty list of token id lists")
    if not isinstance(continuations, Sequence) or len(continuations) != len(prompts):
        raise ConfigError(
            f"continuations must be a list with one token id list per prompt ({len(prompts)})"
        )
    check_sampling(temperature=temperature)  # the range the continuations were sampled in
    limit = model.config.max_position_embeddings
    for b, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        check_token_ids(f"prompt {b}", p, vocab, non_empty=True)
        check_token_ids(f"continuation {b}", c, vocab, non_empty=False)
        if len(p) + len(c) > limit:
            raise ConfigError(
                f"prompt {b} + continuation ({len(p) + len(c)} tokens) exceeds "
                f"max_position_embeddings {limit}"
            )
