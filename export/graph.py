"""The GLM-5 forward as one static graph: what ``torch.export`` traces for ONNX and TVM.

The eager model (:mod:`glmport.model.modeling`) picks its work per call from the data:
the indexer runs only for queries that see more than ``index_topk`` keys, the MLA form
follows the widest visible range, a choice tape may replay decisions. A graph cannot
branch on data, so :class:`StepGraph` fixes one path: every query runs the lightning
indexer (a query with fewer visible keys gets them all, ``-1`` padded) and attends in
the absorbed MLA form over the latent rows. Both paths compute the same function (the
export tests compare them); this one reuses the model's own modules and weights.

One step takes ``S`` new tokens of ``B`` sequences that already hold ``P`` cached
positions each: prefill is the step with ``P = 0``, decode the step with ``S = 1``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError, GlmportError
from glmport.model.causal_lm import GlmMoeDsaForCausalLM
from glmport.model.modeling import DecoderLayer

GraphKind = Literal["prefill", "decode"]
GRAPH_KINDS: tuple[GraphKind, ...] = ("prefill", "decode")
GRAPH_INPUTS: dict[str, tuple[str, ...]] = {
    "prefill": ("input_ids",),
    "decode": ("input_ids", "past_latent", "past_index_keys"),
}
GRAPH_OUTPUTS = ("logits", "present_latent", "present_index_keys")


class StepGraph(nn.Module):
    """``S`` new tokens per sequence on top of ``P`` cached ones, as one static graph.

    Inputs: ``input_ids [B, S]`` int64; ``past_latent [L, B, P, kv_lora + rope]`` and
    ``past_index_keys [L, B, P, index_head_dim]`` in the model's dtype (``L`` decoder
    layers; ``P`` may be 0). Outputs: ``logits [B, S, V]`` and both caches grown to
    ``P + S`` positions (``present_latent``, ``present_index_keys``). Every sequence
    holds the same number of positions (no padding inside the graph).

    Every decoder layer runs its own indexer: a config with IndexCache's shared layers
    (``indexer_types``) is a :class:`ConfigError`.
    """

    def __init__(self, model: GlmMoeDsaForCausalLM) -> None:
        super().__init__()
        shared = [i for i, t in enumerate(model.config.indexer_types) if t == "shared"]
        if shared:
            raise ConfigError(
                f"config field indexer_types marks layers {shared} 'shared': export of "
                "shared-indexer layers is not implemented"
            )
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, past_latent: torch.Tensor, past_index_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        body = self.model.model
        b, s = input_ids.shape
        p = past_latent.shape[2]
        total = p + s
        # Queries are packed [B * S]; each sequence's keys are the run [b * total, (b+1) * total).
        # (Broadcasts, not repeat / repeat_interleave: ONNX export bakes their sizes.)
        dev = input_ids.device
        positions = (p + torch.arange(s, device=dev))[None, :].expand(b, s).reshape(-1)
        seq_start = (torch.arange(b, device=dev) * total)[:, None].expand(b, s).reshape(-1)
        k_start = seq_start.to(torch.int32)
        k_end = (k_start + positions + 1).to(torch.int32)
        cos, sin = body.rope(positions)
        x = body.embed_tokens(input_ids.reshape(-1))
        latents, index_keys = [], []
        for i, layer in enumerate(body.decoder_layers):
            x, latent, keys = _layer(
                layer, x, cos, sin, past_latent[i], past_index_keys[i], k_start, k_end
            )
            latents.append(latent)
            index_keys.append(keys)
        # The vocabulary axis named, not inferred: with no position (b * s = 0) a -1
        # cannot be inferred and exporters fill in something else.
        logits = self.model.lm_head(body.norm(x)).view(b, s, self.model.config.vocab_size)
        return logits, torch.stack(latents), torch.stack(index_keys)


def _layer(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    past_latent: torch.Tensor,
    past_keys: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer on the packed new tokens ``x [B*S, hidden]``; returns the new
    ``x`` and this layer's grown caches ``[B, P+S, ...]``."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    step = attn.prolog(h, cos, sin)
    b = past_latent.shape[0]
    row = torch.cat((step.latent, step.k_rope), dim=-1)
    latent = torch.cat((past_latent, row.view(b, -1, row.shape[-1])), dim=1)
    new_keys = attn.indexer.keys(h, cos, sin)
    keys = torch.cat((past_keys, new_keys.view(b, -1, new_keys.shape[-1])), dim=1)
    q, weights = attn.indexer.queries(h, step.q_res, cos, sin)
    indices, _ = ops.lightning_indexer(
        q, keys.reshape(-1, keys.shape[-1]), weights, k_start, k_end, attn.config.index_topk
    )
    out = attn.attend_latent(step.q, latent.reshape(-1, latent.shape[-1]), indices)
    x = x + out
    return x + layer.mlp(layer.post_attention_layernorm(x)), latent, keys


class PrefillGraph(StepGraph):
    """The step with empty caches: ``input_ids [B, S]`` -> logits and caches ``[L, B, S, ...]``."""

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(input_ids, *empty_caches(self.model, input_ids.shape[0]))


def traced_graph(
    model: GlmMoeDsaForCausalLM, kind: GraphKind
) -> tuple[nn.Module, tuple[torch.Tensor, ...], tuple[dict[int, object], ...]]:
    """The module of ``kind``, example inputs and ``torch.export`` dynamic shapes (batch,
    sequence and cached positions are free) for exporting ``model`` (put in eval mode)."""
    if kind not in GRAPH_KINDS:
        raise ValueError(f"graph kind must be one of {GRAPH_KINDS}, got {kind!r}")
    model.eval()
    batch, seq, past = (torch.export.Dim(n, min=1) for n in ("batch", "seq", "past"))
    ids = torch.zeros((2, 3), dtype=torch.long, device=model.lm_head.weight.device)
    if kind == "prefill":
        return PrefillGraph(model).eval(), (ids,), ({0: batch, 1: seq},)
    caches = empty_caches(model, 2, 5)
    dynamic = ({0: batch}, {1: batch, 2: past}, {1: batch, 2: past})
    return StepGraph(model).eval(), (ids[:, :1], *caches), dynamic


@contextmanager
def unwrapped_errors() -> Iterator[None]:
    """Exporters wrap what a translation raises. Inside this block, a glmport error
    behind the wrapping (a translation that cannot take a call names the op) comes out
    as itself; anything else propagates unchanged, a bug to report."""
    try:
        yield
    except Exception as err:
        seen: BaseException | None = err
        while seen is not None and not isinstance(seen, GlmportError):
            seen = seen.__cause__ or seen.__context__
        if seen is None or seen is err:
            raise
        raise seen from err


def empty_caches(
    model: GlmMoeDsaForCausalLM, batch: int, positions: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero caches ``[L, batch, positions, ...]`` in the model's dtype and device (``positions
    = 0``: the inputs of a prefill step)."""
    c = model.config
    w = model.lm_head.weight
    shape = (c.num_hidden_layers, batch, positions)
    return (
        w.new_zeros((*shape, c.kv_lora_rank + c.qk_rope_head_dim)),
        w.new_zeros((*shape, c.index_head_dim)),
    )


class GraphInputError(GlmportError, ValueError):
    """An input that an exported graph (:data:`GRAPH_INPUTS`) cannot compute correctly,
    refused by glmport's runner before the runtime sees it.

    Attributes:
        graph: the graph kind, ``"prefill"`` or ``"decode"``.
        input: the offending input, e.g. ``"input_ids"``.
        expected: what the graph takes.
        got: what came.
    """

    def __init__(self, graph: str, input: str, expected: str, got: str) -> None:
        self.graph, self.input, self.expected, self.got = graph, input, expected, got
        super().__init__(f"exported {graph} graph: input '{input}' must be {expected}, got {got}")


def cache_widths(config: Mapping[str, object]) -> dict[str, int]:
    """The last axis of each cache input: ``past_latent`` holds ``kv_lora_rank +
    qk_rope_head_dim``, ``past_index_keys`` ``index_head_dim`` (``config`` as
    ``GlmMoeDsaConfig.to_dict()`` writes it)."""
    return {
        "past_latent": config["kv_lora_rank"] + config["qk_rope_head_dim"],
        "past_index_keys": config["index_head_dim"],
    }


def check_graph_inputs(
    kind: GraphKind,
    config: Mapping[str, object],
    dtype: torch.dtype | None,
    inputs: Sequence[object],
    fixed: Mapping[str, int] | None = None,
) -> None:
    """Raise :class:`GraphInputError` naming the first input of the graph of ``kind``
    that it cannot compute correctly; what a runner checks before the runtime runs.

    ``inputs`` are :data:`GRAPH_INPUTS` ``[kind]`` in order: ``input_ids [batch, seq]``
    int64 (``seq = 1`` for decode), every id in ``[0, vocab_size)``, at least one
    sequence of one position (the graph was traced for sizes from 1, and the eager
    model refuses an empty batch too); for decode ``past_latent`` and
    ``past_index_keys`` ``[num_hidden_layers, batch, past, width]`` in ``dtype`` (the
    model's; None for prefill), of ``input_ids``' batch and one ``past`` (0 allowed), widths
    :func:`cache_widths`. ``fixed``: the static axes of a graph compiled for one shape
    (``batch`` and ``seq`` or ``past``). ``config`` is ``GlmMoeDsaConfig.to_dict()``'s.
    Cache values are not read: a cache of the right shape from another prompt gives
    that prompt's logits."""
    names = GRAPH_INPUTS[kind]

    def refuse(name: str, expected: str, got: str) -> GraphInputError:
        return GraphInputError(kind, name, expected, got)

    if len(inputs) != len(names):
        raise refuse("inputs", f"{len(names)} tensors ({', '.join(names)})", str(len(inputs)))
    for name, value in zip(names, inputs, strict=True):
        if not isinstance(value, torch.Tensor):
            raise refuse(name, "a torch.Tensor", type(value).__name__)
        want_dtype, want_ndim = (torch.int64, 2) if name == "input_ids" else (dtype, 4)
        if value.dtype != want_dtype:
            raise refuse(name, _dtype_name(want_dtype), _dtype_name(value.dtype))
        if value.dim() != want_ndim:
            raise refuse(name, f"a {want_ndim}-d tensor", f"shape {list(value.shape)}")
    ids = inputs[0]
    batch, seq = ids.shape
    if batch < 1 or seq < 1:
        raise refuse(
            "input_ids", "[batch, seq] with batch and seq >= 1", f"shape {list(ids.shape)}"
        )
    if kind == "decode" and seq != 1:
        raise refuse(
            "input_ids", "[batch, 1]: one new token a sequence", f"shape {list(ids.shape)}"
        )
    vocab = config["vocab_size"]
    outside = (ids < 0) | (ids >= vocab)
    if bool(outside.any()):
        at = outside.nonzero()[0].tolist()
        raise refuse("input_ids", f"token ids in [0, {vocab})", f"{int(ids[tuple(at)])} at {at}")
    sizes = {"batch": batch, "seq": seq}
    if kind == "decode":
        layers, widths = config["num_hidden_layers"], cache_widths(config)
        for name, cache in zip(names[1:], inputs[1:], strict=True):
            want = [layers, batch, cache.shape[2], widths[name]]
            if list(cache.shape) != want:
                expected = f"[{layers} layers, batch {batch} as input_ids, past, {widths[name]}]"
                raise refuse(name, expected, f"shape {list(cache.shape)}")
        past, keys_past = inputs[1].shape[2], inputs[2].shape[2]
        if keys_past != past:
            expected = f"past_latent's {past} cached positions (axis 2)"
            raise refuse("past_index_keys", expected, str(keys_past))
        sizes = {"batch": batch, "past": past}
    positions = batch * (sizes.get("past", 0) + seq)
    if positions >= 2**31:  # the graph's key ranges are int32
        raise refuse("input_ids", "batch * (past + seq) below 2**31", str(positions))
    for axis, size in (fixed or {}).items():
        if sizes[axis] != size:
            name = "past_latent" if axis == "past" else "input_ids"
            raise refuse(
                name, f"{axis} {size}, the fixed axis it was compiled for", str(sizes[axis])
            )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
