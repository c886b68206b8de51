"""The discrete choices of a forward pass, recorded and replayed.

Two choices in GLM-5 are discrete: the experts each MoE layer routes a token to, and
the key positions each layer's lightning indexer selects for a query. A numeric
difference of one ulp between two backends (or dtypes) can flip either, and a flipped
choice changes everything downstream. RL samples on one backend and trains on another,
so the training forward can *replay* the rollout's choices: the same experts and the
same keys, with gradients still flowing through the router's weights for those experts
and through the attention over those keys. ``glmport diff`` uses the same tape to keep
two backends on one path.

A :class:`ChoiceTape` is opened around any forward of a model (packed or cached):

    with choice_tape(model) as tape:                      # record
        generate(...) / model(...)
    choices = tape.recorded()                             # {sequence key: Choices}

    with choice_tape(model, replay=choices, kinds=("routing",)) as tape:
        ...                                               # replay routing, record both

Every token is named by a sequence key and its position in that sequence: the packed
forward uses the batch row, the cached forward the cache's sequence id. Indexer
selections are stored as key *positions* of the same sequence (not slots), so they
replay in a packed batch and in a paged cache alike. The tape is context-local (thread
or asyncio task), like :func:`~glmport.model.attention.record_attention`; MTP layers are
not tracked. Only layers that run their own indexer are tracked: an IndexCache shared
layer attends its full layer's selection, so it records and replays through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from glmport.core.errors import ConfigError

from .blocks import MoE
from .tape_protocol import INDICES, KINDS, ROUTING, tape_opened


@dataclass(frozen=True)
class Choices:
    """One sequence's discrete choices for its first ``L`` tokens.

    ``experts``: ``[n_moe_layers, L, num_experts_per_tok]`` int16, the routed expert
    ids of every MoE decoder layer in layer order (``None`` if not recorded).
    ``indices``: ``[num_full_layers, L, index_topk]`` int32, the key positions (of
    this sequence, ``0 .. t``) each full layer's indexer (``config.full_indexer_layers``,
    in order; every decoder layer unless IndexCache shares some) selected for token
    ``t``, ``-1`` where fewer keys were visible (``None`` if not recorded). Order within
    a row is the indexer's; attention does not depend on it.
    """

    experts: torch.Tensor | None
    indices: torch.Tensor | None

    def __len__(self) -> int:
        held = self.experts if self.experts is not None else self.indices
        return 0 if held is None else int(held.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.experts, self.indices) if t is not None
        )

    def prefix(self, length: int) -> Choices:
        """The choices of the first ``length`` tokens."""
        if not 0 <= length <= len(self):
            raise ConfigError(f"Choices.prefix: length must lie in [0, {len(self)}], got {length}")
        return Choices(
            None if self.experts is None else self.experts[:, :length],
            None if self.indices is None else self.indices[:, :length],
        )

    def get(self, kind: str) -> torch.Tensor | None:
        return self.experts if kind == ROUTING else self.indices


class _Layers:
    """The tracked modules of one kind: module -> layer number, and the row width."""

    def __init__(self, modules: list[nn.Module], width: int, dtype: torch.dtype) -> None:
        self.number = {m: i for i, m in enumerate(modules)}
        self.width = width
        self.dtype = dtype


class ChoiceTape:
    """Records every tracked choice made inside its block and replays given ones.

    Built by :func:`choice_tape`; forward drivers name the rows of each forward with
    :meth:`rows`; a choosing module asks :meth:`replays` / :meth:`replayed` before its
    choice and hands it to :meth:`record` after (the calls of
    :class:`~glmport.model.tape_protocol.TapeHooks`, all the model's modules see).
    """

    def __init__(
        self,
        model: nn.Module,
        replay: Mapping[int, Choices] | Sequence[Choices] | None,
        kinds: Sequence[str],
    ) -> None:
        config = model.config
        layers = model.model.decoder_layers
        moe = [layer.mlp.gate for layer in layers if isinstance(layer.mlp, MoE)]
        indexers = [layer.self_attn.indexer for layer in layers]  # None: a shared layer
        self._layers = {
            ROUTING: _Layers(moe, config.num_experts_per_tok, torch.int16),
            INDICES: _Layers(
                [ix for ix in indexers if ix is not None],
                config.index_topk,
                torch.int32,
            ),
        }
        self._device = model.lm_head.weight.device
        self._chunks: dict[str, list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {
            kind: [[] for _ in self._layers[kind].number] for kind in KINDS
        }
        self._row_keys: torch.Tensor | None = None
        self._row_positions: torch.Tensor | None = None
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ConfigError(f"choice_tape: unknown kinds {unknown}; kinds: {', '.join(KINDS)}")
        self._replay = {} if replay is None else self._load(replay, tuple(kinds))

    # -- replay data ------------------------------------------------------------------

    def _load(self, replay, kinds) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per kind: sorted sequence keys ``[S]``, lengths ``[S]``, and the choices
        ``[layers, S, L_max, width]`` padded with -1."""
        items = dict(enumerate(replay)) if isinstance(replay, Sequence) else dict(replay)
        if not items:
            raise ConfigError("choice_tape: replay holds no sequences")
        for key, item in items.items():
            if not isinstance(item, Choices):
                raise ConfigError(
                    f"choice_tape: replay[{key}] is a {type(item).__name__}, not Choices"
                )
        keys = sorted(items)
        out = {}
        for kind in kinds:
            spec = self._layers[kind]
            expected = (len(spec.number), spec.width)
            held = [items[k].get(kind) for k in keys]
            for key, tensor in zip(keys, held, strict=True):
                if tensor is None:
                    raise ConfigError(f"choice_tape: replay[{key}] holds no {kind} choices")
                if tensor.dim() != 3 or (tensor.shape[0], tensor.shape[2]) != expected:
                    raise ConfigError(
                        f"choice_tape: replay[{key}].{'experts' if kind == ROUTING else 'indices'}"
                        f" has shape {list(tensor.shape)}, this model records "
                        f"[{expected[0]}, L, {expected[1]}]"
                    )
            lengths = torch.tensor([t.shape[1] for t in held], dtype=torch.long)
            dense = torch.full(
                (len(spec.number), len(keys), int(lengths.max()), spec.width), -1, dtype=torch.long
            )
            for s, tensor in enumerate(held):
                dense[:, s, : tensor.shape[1]] = tensor.long()
            out[kind] = (
                torch.tensor(keys, dtype=torch.long, device=self._device),
                lengths.to(self._device),
                dense.to(self._device),
            )
        return out

    # -- driver side --------------------------------------------------------------------

    @contextmanager
    def rows(self, keys: torch.Tensor, positions: torch.Tensor) -> Iterator[None]:
        """Name the ``T`` tokens of the forward inside the block: sequence ``keys [T]``
        and ``positions [T]`` (int64)."""
        saved = self._row_keys, self._row_positions
        self._row_keys, self._row_positions = keys.long(), positions.long()
        try:
            yield
        finally:
            self._row_keys, self._row_positions = saved

    def _current_rows(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._row_keys is None:
            raise ConfigError(
                f"choice_tape: a {kind} choice was made outside a tracked forward "
                "(GlmMoeDsaModel.forward or forward_cached)"
            )
        return self._row_keys, self._row_positions

    # -- module side ----------------------------------------------------------------------

    def tracks(self, kind: str, module: nn.Module) -> bool:
        return module in self._layers[kind].number

    def replays(self, kind: str, module: nn.Module) -> bool:
        return kind in self._replay and self.tracks(kind, module)

    def replayed(self, kind: str, module: nn.Module) -> torch.Tensor:
        """The replayed rows ``[T, width]`` int64 of the current forward's tokens."""
        keys, positions = self._current_rows(kind)
        sorted_keys, lengths, dense = self._replay[kind]
        at = torch.searchsorted(sorted_keys, keys).clamp(max=sorted_keys.numel() - 1)
        known = sorted_keys[at] == keys
        inside = known & (positions < lengths[at])
        if not bool(inside.all()):
            bad = int((~inside).nonzero()[0, 0])
            key, pos = int(keys[bad]), int(positions[bad])
            held = f"it holds {int(lengths[at[bad]])} tokens" if bool(known[bad]) else "none held"
            raise ConfigError(
                f"choice_tape: no {kind} choices to replay for sequence {key} at position "
                f"{pos} ({held})"
            )
        return dense[self._layers[kind].number[module], at, positions]

    def record(self, kind: str, module: nn.Module, values: torch.Tensor) -> None:
        """Keep the rows ``[T, width]`` chosen for the current forward's tokens."""
        keys, positions = self._current_rows(kind)
        number = self._layers[kind].number[module]
        self._chunks[kind][number].append((keys.cpu(), positions.cpu(), values.detach().cpu()))

    # -- result -----------------------------------------------------------------------------

    def recorded(self) -> dict[int, Choices]:
        """``{sequence key: Choices}`` of every token tracked so far, in key order.

        A position computed twice (a rolled-back draft, a re-run) keeps its last
        choice. Raises :class:`ConfigError` if a sequence's positions are not all
        ``0 .. L-1`` in every tracked layer of a kind.
        """
        per_kind = {kind: self._assemble(kind) for kind in KINDS}
        keys = sorted({k for table in per_kind.values() for k in table})
        return {k: Choices(per_kind[ROUTING].get(k), per_kind[INDICES].get(k)) for k in keys}

    def _assemble(self, kind: str) -> dict[int, torch.Tensor]:
        chunks = self._chunks[kind]
        if not any(chunks):
            return {}
        spec = self._layers[kind]
        all_keys = torch.cat([c[0] for layer in chunks for c in layer])
        all_pos = torch.cat([c[1] for layer in chunks for c in layer])
        keys = torch.unique(all_keys)
        dense = torch.full(
            (len(chunks), keys.numel(), int(all_pos.max()) + 1, spec.width), -1, dtype=spec.dtype
        )
        filled = torch.zeros(dense.shape[:3], dtype=torch.bool)
        for number, layer in enumerate(chunks):
            for row_keys, positions, values in layer:  # in call order: the last write wins
                at = torch.searchsorted(keys, row_keys)
                dense[number, at, positions] = values.to(spec.dtype)
                filled[number, at, positions] = True
        out = {}
        for s, key in enumerate(keys.tolist()):
            length = int(filled[:, s].any(dim=0).nonzero().max()) + 1
            if not bool(filled[:, s, :length].all()):
                layer, pos = (~filled[:, s, :length]).nonzero()[0].tolist()
                raise ConfigError(
                    f"choice_tape: sequence {key} has no {kind} choice recorded at position "
                    f"{pos} of layer {layer}; its positions must run 0 .. {length - 1}"
                )
            out[key] = dense[:, s, :length].clone()
        return out


@contextmanager
def choice_tape(
    model: nn.Module,
    *,
    replay: Mapping[int, Choices] | Sequence[Choices] | None = None,
    kinds: Sequence[str] = KINDS,
) -> Iterator[ChoiceTape]:
    """Record the discrete choices of ``model``'s forwards in the block, replaying
    ``replay``'s choices of the given ``kinds`` (``"routing"``, ``"indices"``).

    Args:
        model: a :class:`~glmport.model.GlmMoeDsaForCausalLM`.
        replay: ``{sequence key: Choices}`` (or a list, keyed by index): the packed
            forward's keys are batch rows, the cached forward's the cache sequence ids.
        kinds: which recorded kinds to replay; the others are computed.

    Yields:
        The :class:`ChoiceTape`; :meth:`ChoiceTape.recorded` gives what was used.
    """
    tape = ChoiceTape(model, replay, kinds)
    with tape_opened(tape):
        yield tape
