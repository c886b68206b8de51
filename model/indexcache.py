"""IndexCache's training-free pattern search (Bai et al., "IndexCache: Accelerating
Sparse Attention via Cross-Layer Index Reuse", arXiv 2603.12201).

Starting from the model's ``indexer_types`` (normally every layer full), each step turns
shared, one at a time, every full layer but layer 0, measures the language-modelling
loss on a calibration set, and keeps the layer whose sharing raises it least; it stops
when ``keep`` full layers remain. A candidate is evaluated in place (its indexer is
detached and put back), never on a copy of the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from glmport.core.errors import ConfigError

from .causal_lm import IGNORE_INDEX, GlmMoeDsaForCausalLM
from .config import GLM_MOE_DSA, GlmMoeDsaConfig

FULL, SHARED = "full", "shared"
# extra's keys that derive indexer_types: stale once the pattern is set explicitly.
_DERIVATION_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
# Sequences per forward when measuring the loss (padded to the longest of them).
BATCH_SIZE = 8
# The most calibration tokens a search takes: every step runs the model on all of them
# once per remaining full layer, so more is hours of work (or a typo), and the ids are
# held as Python lists. A --calib file's bytes are bounded by the same budget.
MAX_CALIBRATION_TOKENS = 1 << 20
_MAX_CALIBRATION_BYTES = 64 * MAX_CALIBRATION_TOKENS


def pattern_string(types: Sequence[str]) -> str:
    """``indexer_types`` as ``index_topk_pattern`` writes it: ``"F"`` per full layer,
    ``"S"`` per shared one (``["full", "shared"]`` -> ``"FS"``)."""
    return "".join("F" if t == FULL else "S" for t in types)


def _check_model_type(config: GlmMoeDsaConfig) -> None:
    if config.model_type != GLM_MOE_DSA:
        raise ConfigError(
            f"IndexCache needs model_type {GLM_MOE_DSA!r}, got {config.model_type!r}: "
            "transformers' DeepSeek-V3.2 reads no indexer_types (every layer is full)"
        )


def apply_indexer_types(model: GlmMoeDsaForCausalLM, types: Sequence[str]) -> None:
    """Convert ``model``'s decoder layers to ``types`` (one ``"full"`` / ``"shared"`` per
    layer) in place: a layer made shared drops its indexer module (and so its weights
    from ``state_dict``), and ``config.indexer_types`` becomes ``types``. The config's
    ``index_topk_pattern`` / ``index_topk_freq`` / ``index_skip_topk_offset`` keys are
    dropped, as they would derive another pattern.

    A shared layer cannot become full (it has no indexer weights), and the types are
    checked as the config checks them (length, values, layer 0 full): ConfigErrors
    naming ``indexer_types``."""
    config = model.config
    _check_model_type(config)
    types = list(types)
    replace(config, indexer_types=types)  # the config's own checks, on a throwaway copy
    attentions = [layer.self_attn for layer in model.model.decoder_layers]
    for i, (kind, attention) in enumerate(zip(types, attentions, strict=True)):
        if kind == FULL and attention.indexer is None:
            raise ConfigError(
                f"indexer_types makes layer {i} full, but it is shared in this model and "
                "has no indexer weights"
            )
    for kind, attention in zip(types, attentions, strict=True):
        if kind == SHARED:
            attention.indexer = None
    config.indexer_types = types
    config.extra = {k: v for k, v in config.extra.items() if k not in _DERIVATION_KEYS}


@contextmanager
def shared_layer(model: GlmMoeDsaForCausalLM, layer: int) -> Iterator[None]:
    """Within the block, decoder layer ``layer`` is shared (its indexer detached, the
    config's ``indexer_types`` saying so); afterwards the model is as before, even when
    the block raised."""
    config = model.config
    attention = model.model.decoder_layers[layer].self_attn
    indexer, types, extra = attention.indexer, config.indexer_types, config.extra
    try:
        apply_indexer_types(model, [SHARED if i == layer else t for i, t in enumerate(types)])
        yield
    finally:
        attention.indexer = indexer
        config.indexer_types, config.extra = types, extra


def calibration_loss(model: GlmMoeDsaForCausalLM, sequences: Sequence[Sequence[int]]) -> float:
    """The mean next-token cross-entropy (nats) over every predicted token of
    ``sequences`` (token ids, each at least 2 long): each sequence predicts its
    ``len - 1`` next tokens, and every prediction weighs the same. Batches of
    :data:`BATCH_SIZE` sequences, right-padded to ``[B, S]`` int64 ids with a 1/0 mask
    (padding changes no logit: batches are packed); the loss is the model's float32
    cross-entropy, summed in float64, under ``torch.no_grad``."""
    device = model.lm_head.weight.device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(sequences), BATCH_SIZE):
            chunk = sequences[start : start + BATCH_SIZE]
            width = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
                mask[row, : len(seq)] = 1
            # -100 at padding: the last real token of a row has no next token to predict.
            labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            loss = model(ids, attention_mask=mask, labels=labels).loss
            predicted = sum(len(s) - 1 for s in chunk)
            total += float(loss.double()) * predicted
            count += predicted
    return total / count


@dataclass(frozen=True)
class Evaluation:
    """One loss measured by :func:`search`: the baseline (``layer`` None) or a candidate
    (``layer`` made shared); ``done`` of ``total`` evaluations of the whole search."""

    layer: int | None
    loss: float
    done: int
    total: int


@dataclass(frozen=True)
class SearchStep:
    """A step of the greedy search: ``layer`` made shared, the resulting ``loss`` and its
    change from the previous step's (``delta``), the ``pattern`` after it ("FSSF..."),
    and the loss of every candidate of the step (layer -> loss)."""

    layer: int
    loss: float
    delta: float
    pattern: str
    candidates: dict[int, float]

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "loss": self.loss,
            "delta": self.delta,
            "pattern": self.pattern,
            "candidates": {str(k): v for k, v in self.candidates.items()},
        }


@dataclass(frozen=True)
class SearchResult:
    """The baseline loss and pattern (the model's before the search) and the steps."""

    baseline: float
    start: str
    steps: list[SearchStep]

    @property
    def pattern(self) -> str:
        """The pattern found (the start's when there was no step)."""
        return self.steps[-1].pattern if self.steps else self.start

    def to_dict(self) -> dict:
        return {
            "baseline": self.baseline,
            "start": self.start,
            "pattern": self.pattern,
            "steps": [s.to_dict() for s in self.steps],
        }


def check_search(config: GlmMoeDsaConfig, keep: int) -> None:
    """Refuse a search the model cannot take: a model type without IndexCache
    (``deepseek_v32``), or a ``keep`` (``--keep``) outside 1 .. num_hidden_layers or above
    the number of full layers (a shared layer has no indexer weights to become full)."""
    _check_model_type(config)
    n = config.num_hidden_layers
    if not 1 <= keep <= n:
        raise ConfigError(f"--keep must be from 1 to num_hidden_layers ({n}), got {keep}")
    full = len(config.full_indexer_layers)
    if keep > full:
        raise ConfigError(
            f"--keep {keep} is above the model's {full} full layers (indexer_types "
            f"{pattern_string(config.indexer_types)}): a shared layer has no indexer to restore"
        )


def search(
    model: GlmMoeDsaForCausalLM,
    sequences: Sequence[Sequence[int]],
    keep: int,
    *,
    on_evaluation: Callable[[Evaluation], None] | None = None,
    on_step: Callable[[SearchStep], None] | None = None,
) -> SearchResult:
    """The greedy search down to ``keep`` full layers, on the calibration ``sequences``
    (token ids; see :func:`calibration_loss`). ``model`` ends converted to the pattern
    found (:func:`apply_indexer_types`). Ties go to the lower layer.

    ``on_evaluation`` is called after each loss measured, ``on_step`` after each step.
    A ``keep`` it cannot reach is a ConfigError naming ``--keep`` (:func:`check_search`)."""
    config = model.config
    check_search(config, keep)
    full = len(config.full_indexer_layers)
    # Step s evaluates every full layer but layer 0: full - 1 - s candidates.
    total = 1 + sum(full - 1 - s for s in range(full - keep))
    done = 0

    def measure(layer: int | None) -> float:
        nonlocal done
        loss = calibration_loss(model, sequences)
        done += 1
        if on_evaluation is not None:
            on_evaluation(Evaluation(layer, loss, done, total))
        return loss

    start = pattern_string(config.indexer_types)
    loss = baseline = measure(None)
    steps = []
    while len(config.full_indexer_layers) > keep:
        candidates = {}
        for layer in config.full_indexer_layers[1:]:
            with shared_layer(model, layer):
                candidates[layer] = measure(layer)
        best = min(candidates, key=lambda layer: (candidates[layer], layer))
        apply_indexer_types(
            model, [SHARED if i == best else t for i, t in enumerate(config.indexer_types)]
        )
        step = SearchStep(
            best,
            candidates[best],
            candidates[best] - loss,
            pattern_string(config.indexer_types),
            candidates,
        )
        steps.append(step)
        loss = step.loss
        if on_step is not None:
            on_step(step)
    return SearchResult(baseline, start, steps)


def read_calibration(path: str | Path, vocab_size: int) -> list[list[int]]:
    """``--calib``'s file: one sequence per line, token ids separated by commas and/or
    whitespace; blank lines are skipped. A file that is not UTF-8 text, a token that is
    not a whole number, an id outside ``[0, vocab_size)``, a sequence shorter than 2 or
    a file with no sequence is a ConfigError naming the file (and line)."""
    path = Path(path)
    if path.stat().st_size > _MAX_CALIBRATION_BYTES:
        raise ConfigError(
            f"--calib {path} holds {path.stat().st_size} bytes, more than the "
            f"{_MAX_CALIBRATION_BYTES} a calibration set of {MAX_CALIBRATION_TOKENS} tokens needs"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ConfigError(f"--calib {path} is not UTF-8 text: {err}") from None
    sequences = []
    total = 0
    for number, line in enumerate(lines, start=1):
        tokens = [t for t in re.split(r"[,\s]+", line) if t]
        if not tokens:
            continue
        where = f"--calib {path} line {number}"
        bad = next((t for t in tokens if not (t.isascii() and t.isdigit())), None)
        if bad is not None:
            raise ConfigError(f"{where}: {bad!r} is not a token id (a whole number)")
        ids = [int(t) for t in tokens]
        outside = next((i for i in ids if i >= vocab_size), None)
        if outside is not None:
            raise ConfigError(
                f"{where}: token id {outside} is outside the vocabulary [0, {vocab_size})"
            )
        if len(ids) < 2:
            raise ConfigError(f"{where}: a sequence needs at least 2 tokens, got {len(ids)}")
        total += len(ids)
        if total > MAX_CALIBRATION_TOKENS:
            raise ConfigError(f"{where}: more than {MAX_CALIBRATION_TOKENS} calibration tokens")
        sequences.append(ids)
    if not sequences:
        raise ConfigError(f"--calib {path} holds no sequence")
    return sequences


def check_calibration_size(count: int, seq_len: int) -> None:
    """Refuse ``count`` (``--random``) sequences of ``seq_len`` (``--seq-len``) tokens
    that are more than :data:`MAX_CALIBRATION_TOKENS` in all."""
    if count * seq_len > MAX_CALIBRATION_TOKENS:
        raise ConfigError(
            f"--random {count} x --seq-len {seq_len} is more than the "
            f"{MAX_CALIBRATION_TOKENS} calibration tokens a search takes (each step runs the "
            "model on all of them once per remaining full layer)"
        )


def random_calibration(count: int, seq_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` sequences of ``seq_len`` uniform random token ids (``--random``), drawn
    from a torch generator seeded with ``seed``; at most :data:`MAX_CALIBRATION_TOKENS`
    in all."""
    check_calibration_size(count, seq_len)
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be at least 2 (a token and its next), got {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, seq_len), generator=gen).tolist()
