"""Batched generation with the paged KV cache: greedy or sampled, stop tokens, and
greedy speculative decoding with the MTP layer as the drafter.

Speculative decoding (greedy only) drafts up to :data:`NUM_DRAFT` tokens per step with
the first MTP layer applied recursively, verifies them all in one cached step of the
main model, and keeps the longest prefix that matches the main model's own greedy
choices plus its next token, so its output is plain greedy decoding's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import glmport.ops as ops
from glmport.core.errors import ConfigError, GlmportError, check_int

from .cache import PagedKVCache, StepOutput, forward_cached, mtp_forward_cached
from .choices import Choices, ChoiceTape, choice_tape
from .sampling import Sampler, SamplingParams, check_sampling

if TYPE_CHECKING:
    from .causal_lm import GlmMoeDsaForCausalLM

NUM_DRAFT = 3  # GLM-5 drafts 3 tokens with its one MTP layer


class GenerationAborted(GlmportError):
    """:func:`generate`'s ``abort`` callback asked it to stop; no output is returned."""


@dataclass
class GenerationResult:
    """What :func:`generate` produced.

    ``output_ids``: the new tokens of each prompt, in prompt order, ending at (and
    including) a stop token or after ``max_new_tokens``. ``seconds`` is
    ``prefill_seconds + decode_seconds``; ``tokens_per_s`` counts new tokens over it.
    ``acceptance_length``: speculative only, the mean over verification steps with at
    least one draft of (accepted drafts + 1), i.e. tokens gained per main-model step.
    ``logprobs`` (``return_logprobs``): per prompt, each new token's log-probability
    ``[n_new]`` fp32 under the temperature-scaled distribution (see :func:`generate`).
    ``choices`` (``record_choices``): per prompt, the discrete choices of every token
    the model consumed (the prompt and every new token but the last), as
    :class:`~glmport.model.choices.Choices`.
    """

    output_ids: list[list[int]]
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    seconds: float
    tokens_per_s: float
    acceptance_length: float | None = None
    verify_steps: int = 0
    logprobs: list[torch.Tensor] | None = None
    choices: list[Choices] | None = None


def check_token_ids(what: str, row: object, vocab: int, *, non_empty: bool) -> None:
    """Refuse a ``row`` that is not a list of Python int token ids in ``[0, vocab)``
    (or is empty, when ``non_empty``), naming it as ``what``."""
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or (non_empty and not row):
        kind = "a non-empty list" if non_empty else "a list"
        raise ConfigError(f"{what} must be {kind} of token ids, got {row!r}")
    bad = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"{what} has token ids outside [0, {vocab}): {bad[:5]}")


def validate_generation(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_tokens: Sequence[int],
    speculative: bool,
) -> None:
    """Refuse (:class:`~glmport.core.errors.ConfigError` naming it) what ``generate``
    cannot take besides the sampling parameters (``sampling``: already checked by
    :func:`~glmport.model.sampling.check_sampling`)."""
    vocab = model.config.vocab_size
    check_int("max_new_tokens", max_new_tokens, 0)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError("prompts must be a non-empty list of token id lists")
    for i, prompt in enumerate(prompts):
        check_token_ids(f"prompt {i}", prompt, vocab, non_empty=True)
        limit = model.config.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ConfigError(
                f"prompt {i} ({len(prompt)} tokens) + max_new_tokens {max_new_tokens} "
                f"exceeds max_position_embeddings {limit}"
            )
    check_token_ids("stop_tokens", stop_tokens, vocab, non_empty=False)
    if speculative and not sampling.greedy:
        raise ConfigError("speculative decoding is greedy only; pass greedy=True")
    if speculative and not model.config.num_nextn_predict_layers:
        raise ConfigError("speculative decoding needs an MTP layer; this model has none")


class DecodeRun:
    """Per-prompt outputs and the stop / length rule shared by both decoding loops."""

    def __init__(self, n: int, max_new_tokens: int, stop_tokens: Sequence[int]) -> None:
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.max_new = max_new_tokens
        self.stop = set(stop_tokens)

    def emit(self, b: int, tokens: Sequence[int]) -> bool:
        """Append ``tokens`` to prompt ``b`` up to a stop token or the length limit;
        returns whether ``b`` is finished."""
        for t in tokens:
            self.out[b].append(t)
            if t in self.stop or len(self.out[b]) == self.max_new:
                return True
        return False


def generate(
    model: GlmMoeDsaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    speculative: bool = False,
    block_size: int = 16,
    return_logprobs: bool = False,
    record_choices: bool = False,
    abort: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~glmport.model.GlmMoeDsaForCausalLM`.
        prompts: ``B`` non-empty lists of token ids (lengths may differ).
        max_new_tokens: new tokens per prompt at most (``0``: none).
        greedy: argmax decoding; else sampling with ``temperature`` (in ``[1e-6, 1e6]``),
            ``top_k`` (``0``: off) and nucleus ``top_p`` (in ``(0, 1]``, ``1``: off; the
            best token always stays, so ``top_p -> 0`` is greedy). The ranges and why:
            :mod:`glmport.model.sampling`; outside them a
            :class:`~glmport.model.sampling.SamplingParameterError` names the parameter.
        seed: seeds the sampling generator (same seed, same output), an int in
            ``[-2**63, 2**64)``.
        stop_tokens: a sequence ends after emitting one of these; the others continue.
        speculative: greedy MTP speculative decoding (same output as greedy).
        block_size: slots per paged-cache block.
        return_logprobs: also return each new token's log-probability, computed by
            ``token_logprobs`` from the step's final hidden state at ``temperature``
            (1 when greedy): ``log softmax(logits / temperature)`` over the whole
            vocabulary, the quantity a trainer recomputes. ``top_k`` / ``top_p``
            truncate the distribution actually sampled from, so with them the sampled
            token is more likely than this log-probability says (RL should sample
            with neither, the defaults).
        record_choices: also return the discrete choices (routed experts, indexer
            selections) of every consumed token, for replay in a training forward.
        abort: asked before every decode step (not speculative); when it returns True
            generation stops with :class:`GenerationAborted` and its partial output is
            dropped (an asynchronous rollout whose policy was updated meanwhile).

    Returns:
        :class:`GenerationResult`.
    """
    stop_tokens = tuple(stop_tokens)
    sampling = check_sampling(
        greedy=greedy, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    validate_generation(model, prompts, max_new_tokens, sampling, stop_tokens, speculative)
    prompts = [list(p) for p in prompts]
    run = DecodeRun(len(prompts), max_new_tokens, stop_tokens)
    if speculative and (return_logprobs or record_choices or abort is not None):
        raise ConfigError(
            "return_logprobs / record_choices / abort need sampled (non-speculative) decoding"
        )
    if max_new_tokens == 0:
        empty = [torch.zeros(0) for _ in prompts] if return_logprobs else None
        return GenerationResult(run.out, 0, 0.0, 0.0, 0.0, 0.0, logprobs=empty)
    weight = model.lm_head.weight
    # The main cache never holds more than prompt + max_new_tokens - 1 tokens of a
    # sequence (the last new token is not fed back), the MTP cache fewer still.
    blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)

    def new_cache(layers: int) -> PagedKVCache:
        return PagedKVCache.for_config(
            model.config, layers, blocks, block_size, dtype=weight.dtype, device=weight.device
        )

    sampler = Sampler(sampling, weight.device)
    logprobs: list[list[torch.Tensor]] | None = [[] for _ in prompts] if return_logprobs else None
    t0 = time.perf_counter()
    with choice_tape(model) if record_choices else nullcontext() as tape:
        if speculative:
            accepted, steps, t1 = _speculative(model, prompts, run, new_cache)
        else:
            scorer = TokenScorer(model, sampling.temperature, logprobs)
            t1 = _plain(model, prompts, run, new_cache, sampler, scorer, abort)
            accepted, steps = 0, 0
    t2 = time.perf_counter()
    n = sum(len(o) for o in run.out)
    return GenerationResult(
        output_ids=run.out,
        new_tokens=n,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        seconds=t2 - t0,
        tokens_per_s=n / (t2 - t0) if t2 > t0 else 0.0,
        acceptance_length=(accepted / steps if steps else None) if speculative else None,
        verify_steps=steps,
        logprobs=None if logprobs is None else [torch.cat(p) for p in logprobs],
        choices=None if tape is None else _consumed_choices(tape, prompts, run.out),
    )


def _consumed_choices(
    tape: ChoiceTape, prompts: list[list[int]], outputs: list[list[int]]
) -> list[Choices]:
    """Each prompt's recorded choices (its cache sequence id is its index), checked to
    cover exactly the prompt and every new token but the last."""
    recorded = tape.recorded()
    out = []
    for b, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
        choices = recorded[b]
        if len(choices) != len(prompt) + len(new) - 1:
            raise GlmportError(
                f"generate: prompt {b} consumed {len(prompt) + len(new) - 1} tokens but "
                f"{len(choices)} have recorded choices"
            )
        out.append(choices)
    return out


class LogprobContractError(RuntimeError):
    """``token_logprobs`` returned a log-probability that is not finite and ``<= 0`` for
    a sampled token: a bug of the backend serving it, never of the caller's input (so
    not a :class:`~glmport.core.errors.GlmportError`; the gateway answers 500)."""


class TokenScorer:
    """The log-probabilities of sampled tokens, from a cached step's hidden states, by
    ``token_logprobs`` (the op a trainer scores them with); a no-op when not asked.

    Every value it reports is finite and ``<= 0``: sampling parameters inside
    :mod:`~glmport.model.sampling`'s ranges keep them so, and a backend that returns
    anything else raises :class:`LogprobContractError` instead of being reported.
    """

    def __init__(self, model, temperature: float, logprobs: list[list[torch.Tensor]] | None):
        self.model, self.temperature, self.logprobs = model, temperature, logprobs

    def __call__(self, step: StepOutput, batch: Sequence[int], tokens: torch.Tensor) -> None:
        if self.logprobs is None:
            return
        hidden = self.model.model.norm(step.last(step.hidden))
        weight = self.model.lm_head.weight
        logp, _ = ops.token_logprobs(hidden, weight, tokens.to(weight.device), self.temperature)
        logp = logp.float().cpu()
        bad = ~(torch.isfinite(logp) & (logp <= 0))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise LogprobContractError(
                f"token_logprobs returned {float(logp[i])!r} for sampled token "
                f"{int(tokens[i])} at temperature {self.temperature!r}; a log-probability is "
                "finite and <= 0 (the backend serving token_logprobs is wrong: report it)"
            )
        for b, value in zip(batch, logp.split(1), strict=True):
            self.logprobs[b].append(value)


def _plain(
    model, prompts, run: DecodeRun, new_cache, sampler: Sampler, scorer: TokenScorer, abort
) -> float:
    """Prefill all prompts in one step, then one token per live sequence per step
    (``abort``: checked before each). Returns the time prefill ended."""
    cache = new_cache(model.config.num_hidden_layers)
    seqs = [cache.add_sequence() for _ in prompts]
    step = forward_cached(model, cache, seqs, prompts, last_only=True)
    chosen = sampler(step.logits)
    scorer(step, range(len(prompts)), chosen)
    tokens = chosen.tolist()
    t_prefill = time.perf_counter()
    live = []
    for b, t in enumerate(tokens):
        if run.emit(b, [t]):
            cache.free(seqs[b])
        else:
            live.append(b)
    while live:
        if abort is not None and abort():
            raise GenerationAborted(f"generation aborted with {len(live)} sequences unfinished")
        step = forward_cached(
            model, cache, [seqs[b] for b in live], [[run.out[b][-1]] for b in live], last_only=True
        )
        chosen = sampler(step.logits)
        scorer(step, live, chosen)
        tokens = chosen.tolist()
        still = []
        for b, t in zip(live, tokens, strict=True):
            if run.emit(b, [t]):
                cache.free(seqs[b])
            else:
                still.append(b)
        live = still
    return t_prefill


def _speculative(model, prompts, run: DecodeRun, new_cache) -> tuple[int, int, float]:
    """Greedy MTP speculative decoding; returns (sum of acceptance lengths, verification
    steps with drafts, the time prefill ended).

    Invariant between steps, per live sequence: the main cache holds every token but the
    last emitted one (``pending``); the MTP cache holds entries ``0 .. m-1`` where entry
    ``i`` fuses the main hidden state at position ``i`` with token ``i + 1``, and the
    entries ``m .. L-1`` still to add are queued as (hidden states, next tokens).
    """
    cache = new_cache(model.config.num_hidden_layers)
    mtp_cache = new_cache(1)
    seqs = [cache.add_sequence() for _ in prompts]
    mtp_seqs = [mtp_cache.add_sequence() for _ in prompts]
    step = forward_cached(model, cache, seqs, prompts, last_only=True)
    first = step.logits.argmax(dim=-1).tolist()
    t_prefill = time.perf_counter()
    queue_h = list(step.split(step.hidden))
    queue_ids = [[*p[1:], t] for p, t in zip(prompts, first, strict=True)]
    live = []
    for b, t in enumerate(first):
        if run.emit(b, [t]):
            cache.free(seqs[b])
            mtp_cache.free(mtp_seqs[b])
        else:
            live.append(b)
    accepted = steps = 0
    while live:
        # Drafts: never more than the tokens still allowed, less the main model's own.
        k = {b: min(NUM_DRAFT, run.max_new - len(run.out[b]) - 1) for b in live}
        drafts = _draft(
            model, mtp_cache, mtp_seqs, [b for b in live if k[b]], k, queue_h, queue_ids
        )
        lengths = {b: cache.length(seqs[b]) for b in live}
        verify = forward_cached(
            model, cache, [seqs[b] for b in live], [[run.out[b][-1]] + drafts[b] for b in live]
        )
        choices = verify.split(verify.logits.argmax(dim=-1))
        still = []
        for b, hidden, choice in zip(live, verify.split(verify.hidden), choices, strict=True):
            choice = choice.tolist()
            a = 0
            while a < k[b] and drafts[b][a] == choice[a]:
                a += 1
            if k[b]:
                accepted, steps = accepted + a + 1, steps + 1
            if run.emit(b, choice[: a + 1]):
                cache.free(seqs[b])
                mtp_cache.free(mtp_seqs[b])
                continue
            # Keep the pending token and the accepted drafts; their hidden states and
            # successors are the MTP layer's next entries.
            cache.truncate(seqs[b], lengths[b] + 1 + a)
            queue_h[b] = torch.cat((queue_h[b], hidden[: a + 1]))
            queue_ids[b] = queue_ids[b] + choice[: a + 1]
            still.append(b)
        live = still
    return accepted, steps, t_prefill


def _draft(
    model,
    mtp_cache: PagedKVCache,
    mtp_seqs: list[int],
    batch: list[int],
    k: dict[int, int],
    queue_h: list[torch.Tensor],
    queue_ids: list[list[int]],
) -> dict[int, list[int]]:
    """Up to ``k[b]`` greedy draft tokens for each ``b`` in ``batch`` (``[]`` for others).

    Depth 1 adds the queued main-model entries to the MTP cache and drafts from the
    last; depth ``d > 1`` fuses the MTP layer's own output with draft ``d - 1``. The
    deeper entries are speculative and are rolled back before returning.
    """
    drafts: dict[int, list[int]] = {b: [] for b in k}
    if not batch:
        return drafts
    seqs = [mtp_seqs[b] for b in batch]
    step = mtp_forward_cached(
        model,
        mtp_cache,
        seqs,
        torch.cat([queue_h[b] for b in batch]),
        [queue_ids[b] for b in batch],
        last_only=True,
    )
    committed = {b: mtp_cache.length(mtp_seqs[b]) for b in batch}
    for b in batch:
        queue_h[b] = queue_h[b][:0]
        queue_ids[b] = []
    hidden = step.last(step.hidden)
    tokens = step.logits.argmax(dim=-1)
    for depth in range(1, NUM_DRAFT + 1):
        for b, t in zip(batch, tokens.tolist(), strict=True):
            drafts[b].append(t)
        keep = [i for i, b in enumerate(batch) if k[b] > depth]
        if not keep:
            break
        batch = [batch[i] for i in keep]
        hidden, tokens = hidden[keep], tokens[keep]
        step = mtp_forward_cached(
            model, mtp_cache, [mtp_seqs[b] for b in batch], hidden, tokens[:, None]
        )
        hidden, tokens = step.hidden, step.logits.argmax(dim=-1)
    for b in committed:
        mtp_cache.truncate(mtp_seqs[b], committed[b])
    return drafts
