"""``GlmMoeDsaForCausalLM``: the HF-style entry point (``from_pretrained``,
``save_pretrained``, ``from_config``, ``model(input_ids, attention_mask)``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from glmport.core.errors import ConfigError

from .blocks import Experts, Router
from .config import GlmMoeDsaConfig
from .modeling import CausalLMOutput, GlmMoeDsaModel
from .packing import pack
from .weights import (
    atomic_folder,
    fuse_experts,
    read_tensors,
    recover_folder,
    save_tensors,
    split_experts,
)

log = logging.getLogger("glmport.model")
IGNORE_INDEX = -100
_CHECKPOINT_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements checked for finiteness at a time: bounds the temporary mask's memory.
_FINITE_CHUNK = 1 << 24


def _check_tensor(key: str, value: object, own: torch.Tensor) -> None:
    """Refuse a checkpoint value that cannot replace the parameter or buffer ``own``."""
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"checkpoint tensor {key} is a {type(value).__name__}, not a tensor")
    if value.layout != torch.strided or value.device.type == "meta":
        raise ConfigError(
            f"checkpoint tensor {key} must be a dense tensor with data, got layout "
            f"{value.layout} on {value.device}"
        )
    if tuple(value.shape) != tuple(own.shape):
        raise ConfigError(
            f"checkpoint tensor {key} has shape {list(value.shape)}, expected {list(own.shape)}"
        )
    if own.is_floating_point():
        if value.dtype not in _CHECKPOINT_FLOATS:
            raise ConfigError(
                f"checkpoint tensor {key} has dtype {value.dtype}, expected one of "
                "float16, bfloat16, float32, float64"
            )
        flat = value.detach().reshape(-1)
        for chunk in flat.split(_FINITE_CHUNK):
            if not bool(torch.isfinite(chunk).all()):
                bad = int((~torch.isfinite(flat)).sum())
                raise ConfigError(
                    f"checkpoint tensor {key} holds {bad} NaN or Inf values; a non-finite "
                    "weight would make every output NaN"
                )
    elif value.dtype != own.dtype:
        raise ConfigError(f"checkpoint tensor {key} has dtype {value.dtype}, expected {own.dtype}")


def check_input_ids(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int
) -> None:
    """Refuse what no forward can take (a ConfigError naming it): ``input_ids`` that are
    not an integer ``[B, S]`` tensor of ids in ``[0, vocab_size)``, an ``attention_mask``
    of another shape, or no token at all (B or S 0, or a mask of only zeros: there is
    nothing to attend and no logit to return)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
        raise ConfigError(f"input_ids must be [B, S], got {shape!r}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ConfigError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ConfigError(
            f"attention_mask shape {list(attention_mask.shape)} != "
            f"input_ids shape {list(input_ids.shape)}"
        )
    if not input_ids.numel():
        raise ConfigError(
            f"input_ids must hold at least one token, got shape {list(input_ids.shape)} "
            "(batch and sequence must be at least 1)"
        )
    if attention_mask is not None and not bool(attention_mask.bool().any()):
        raise ConfigError("attention_mask marks no token (all zeros): nothing to run on")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise ConfigError(f"input_ids must lie in [0, {vocab_size})")


def _check_one_dtype(state: Mapping[str, torch.Tensor], weights: set[str]) -> None:
    """Refuse a checkpoint whose floating ``weights`` (parameter names) are not all of one
    dtype, naming the odd ones out. Buffers are free: the router's correction bias is
    read in float32 whatever it is stored in."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in sorted(weights):
        by_dtype.setdefault(state[key].dtype, []).append(key)
    if len(by_dtype) < 2:
        return
    most = max(by_dtype, key=lambda d: len(by_dtype[d]))
    odd = "; ".join(
        f"{len(keys)} {str(d).removeprefix('torch.')} ({', '.join(keys[:3])}"
        f"{', ...' if len(keys) > 3 else ''})"
        for d, keys in by_dtype.items()
        if d != most
    )
    raise ConfigError(
        f"checkpoint mixes weight dtypes: {len(by_dtype[most])} weights are "
        f"{str(most).removeprefix('torch.')}, but {odd}; the model computes in one dtype: "
        "load it with from_pretrained(dtype=...) to cast every tensor, or convert the checkpoint"
    )


def _layer_slice(layers: range) -> tuple[Callable[[str], bool], Callable[[str], str]]:
    """``(keep, rename)`` of checkpoint keys for decoder layers ``layers`` (a range
    :meth:`GlmMoeDsaConfig.sliced` accepted): the layers' own keys (renumbered from 0)
    and every key outside ``model.layers`` (embedding, final norm, head); other layers
    and the MTP layers are not read."""

    def layer_of(key: str) -> int | None:
        if not key.startswith(LAYER_PREFIX):
            return None
        head, _, _ = key[len(LAYER_PREFIX) :].partition(".")
        return int(head) if head.isdigit() else None

    def keep(key: str) -> bool:
        index = layer_of(key)
        return index is None or index in layers

    def rename(key: str) -> str:
        index = layer_of(key)
        if index is None:
            return key
        rest = key[len(LAYER_PREFIX) + len(str(index)) :]
        return f"{LAYER_PREFIX}{index - layers.start}{rest}"

    return keep, rename


LAYER_PREFIX = "model.layers."
# The LM head's and the input embedding's keys, one tensor when the config ties them.
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class GlmMoeDsaForCausalLM(nn.Module):
    """GLM-5 with its LM head (and MTP layers under ``model.layers``).

    ``GlmMoeDsaForCausalLM(config)`` is initialised as transformers initialises it
    (:meth:`init_weights`), drawing from the global RNG (``torch.manual_seed``), in the
    default dtype and on the default device; built on the meta device it holds shapes
    only and nothing is drawn. ``initialize=False`` leaves the routed experts and the
    routers uninitialised (``torch.empty``): for callers that fill every weight next.
    With ``config.tie_word_embeddings`` the LM head's weight is the input embedding's
    (one Parameter, both uses; checkpoints hold it once, as ``embed_tokens``).
    """

    def __init__(self, config: GlmMoeDsaConfig, *, initialize: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = GlmMoeDsaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if initialize and self.lm_head.weight.device.type != "meta":
            self.init_weights(seed=None)

    def tie_weights(self) -> None:
        """Make the LM head's weight the input embedding's Parameter when the config
        ties them (again after anything that replaces either, e.g. an assigning load)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- construction ----------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: GlmMoeDsaConfig | str,
        *,
        device: str | torch.device | None = None,
        seed: int | None = 0,
    ) -> GlmMoeDsaForCausalLM:
        """A randomly initialised model (``device="meta"`` for shapes and counts only),
        its weights drawn from a generator seeded with ``seed`` (None: the global RNG)."""
        if isinstance(config, str):
            config = GlmMoeDsaConfig.preset(config)
        with torch.device(device or "cpu"):
            model = cls(config, initialize=False)
        if str(device) != "meta":
            model.init_weights(seed)
        return model

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        """HF's initialisation: normal(0, initializer_range) weights (the routed experts'
        and the routers' too), unit norms, zero biases; each MTP layer's embedding and
        head start as copies of the main ones. Draws on the cpu from a generator seeded
        with ``seed``, or from the global cpu RNG (``torch.manual_seed``) when None, so
        a seed gives the same weights on every device."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range

        def normal(shape: torch.Size) -> torch.Tensor:
            return torch.randn(shape, generator=gen, device="cpu") * std

        for module in self.modules():
            if module is self.lm_head and self.config.tie_word_embeddings:
                continue  # the embedding's draw is its weight
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.copy_(normal(module.weight.shape))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (Experts, Router)):
                for p in module.parameters(recurse=False):
                    p.copy_(normal(p.shape))
            elif hasattr(module, "eps") and isinstance(
                getattr(module, "weight", None), nn.Parameter
            ):
                module.weight.fill_(1.0)
        for mtp in self.model.mtp_layers:
            mtp.embed_tokens.weight.copy_(self.model.embed_tokens.weight)
            mtp.shared_head.head.weight.copy_(self.lm_head.weight)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        layers: range | None = None,
    ) -> GlmMoeDsaForCausalLM:
        """Load a folder with ``config.json`` and HF safetensors (sharded or not).

        ``layers`` (a contiguous range of decoder layers) builds the embedding, those
        layers renumbered from 0 and the head, without MTP
        (:meth:`GlmMoeDsaConfig.sliced`), reading only their tensors (memory-mapped,
        shard by shard): peak memory follows the slice, not the checkpoint.

        The config is validated first, then every shard's header against the index
        (:func:`~glmport.model.weights.checkpoint_plan`), then every tensor
        (:meth:`load_hf_state_dict`); any failure is a :class:`ConfigError` naming the
        file or tensor, raised before a weight is used. A checkpoint without MTP
        tensors (as transformers saves them) loads with ``num_nextn_predict_layers =
        0``; any other missing or unexpected tensor is an error naming it. ``dtype``
        casts every floating tensor as it is read (so a checkpoint of mixed dtypes
        loads as one); without it each keeps its own, and they must agree.
        """
        path = Path(path)
        recover_folder(path)  # a save killed while replacing it left its old version aside
        config = GlmMoeDsaConfig.from_json_file(path / "config.json")
        keep = None
        if layers is not None:
            config = config.sliced(layers)  # the range checked before anything is read
            keep, rename = _layer_slice(layers)
        state = fuse_experts(
            {
                (key if keep is None else rename(key)): tensor.to(dtype)
                if dtype is not None and tensor.is_floating_point()
                else tensor
                for key, tensor in read_tensors(path, keep)
            }
        )
        mtp_prefix = f"model.layers.{config.num_hidden_layers}."
        if config.num_nextn_predict_layers and not any(k.startswith(mtp_prefix) for k in state):
            log.info("glmport: %s has no MTP layer tensors; loading without MTP", path)
            config.num_nextn_predict_layers = 0
        with torch.device("meta"):  # shapes only: every tensor comes from the checkpoint
            model = cls(config, initialize=False)
        model.load_hf_state_dict(state)
        return model.to(device=device)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load fused-expert HF keys (:func:`fuse_experts` output), strictly and all or
        nothing: every name, type, shape, dtype and value is checked before any
        parameter is replaced, so a :class:`ConfigError` leaves the model unchanged.

        Each value must be a dense tensor holding data (not ``meta``) of the
        parameter's shape; floating parameters take float16, bfloat16, float32 or
        float64 tensors (the tensor's dtype is kept) with only finite values (one NaN
        or Inf weight would poison every output), all of one dtype (the model computes
        in one: a float16 ``lm_head`` beside float32 layers would fail at the first
        forward); other buffers take their own dtype.
        """
        if not isinstance(state, Mapping):
            raise ConfigError(f"state must be a mapping of name -> tensor, got {type(state)}")
        state = self._untied(state)
        own = self._stored_state()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(map(str, set(state) - set(own)))
        if missing or unexpected:
            raise ConfigError(
                f"checkpoint does not match the config: missing {missing[:6]}"
                f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                f"{'...' if len(unexpected) > 6 else ''}"
            )
        for key in sorted(state):
            _check_tensor(key, state[key], own[key])
        _check_one_dtype(
            state, {name for name, p in self.named_parameters() if p.is_floating_point()}
        )
        self.load_state_dict(state, assign=True, strict=not self.config.tie_word_embeddings)
        self.tie_weights()

    def _stored_state(self) -> dict[str, torch.Tensor]:
        """The state a checkpoint holds: ``state_dict()`` without a tied LM head's key
        (the embedding's Parameter, stored once)."""
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            del state[TIED_HEAD]
        return state

    def _untied(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` without the tied LM head's key (the embedding holds that weight).
        A checkpoint that carries it anyway must carry the embedding's values there: a
        different head under ``tie_word_embeddings`` is a :class:`ConfigError`."""
        state = dict(state)
        if not self.config.tie_word_embeddings or TIED_HEAD not in state:
            return state
        head, embed = state.pop(TIED_HEAD), state.get(TIED_EMBEDDING)
        same = (
            isinstance(head, torch.Tensor)
            and isinstance(embed, torch.Tensor)
            and (head is embed or (head.shape == embed.shape and torch.equal(head, embed)))
        )
        if not same:
            raise ConfigError(
                f"tie_word_embeddings is true but the checkpoint's {TIED_HEAD} is not "
                f"{TIED_EMBEDDING}: untie them in config.json or drop {TIED_HEAD}"
            )
        return state

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 5 << 30) -> None:
        """Write ``config.json`` and HF-named safetensors (per-expert keys), atomically.

        Everything is written into a temporary folder next to ``path`` and renamed into
        place (:func:`~glmport.model.weights.atomic_folder`): a failed save leaves an
        earlier checkpoint at ``path`` intact and no temporary folder; a successful one
        leaves no shard or index of an earlier save (other files there are kept).
        Only safetensors and JSON are written, never a pickle.
        """
        if any(name.endswith("_q") for name, _ in self.named_buffers()):
            raise ConfigError(
                "save_pretrained writes float weights; this model holds packed quantised "
                "weights (glmport.model.quantize): save the float model"
            )
        state = split_experts(self._stored_state())
        with atomic_folder(path) as tmp:
            self.config.to_json_file(tmp / "config.json")
            save_tensors(state, tmp, max_shard_bytes)

    # -- counting --------------------------------------------------------------------

    def num_parameters(self, *, active: bool = False, include_mtp: bool = False) -> int:
        """Parameter count; ``active``: per token (only ``num_experts_per_tok`` routed
        experts of each MoE layer count)."""
        c = self.config
        layers = self.model.layers if include_mtp else self.model.decoder_layers
        skip = set()
        if not include_mtp:
            for mtp in self.model.mtp_layers:
                skip |= {id(p) for p in mtp.parameters()}
        total = sum(p.numel() for p in self.parameters() if id(p) not in skip)
        if active:
            for layer in layers:
                if hasattr(layer.mlp, "experts"):
                    per_expert = sum(p[0].numel() for p in layer.mlp.experts.parameters())
                    total -= (c.n_routed_experts - c.num_experts_per_tok) * per_expert
        return total

    # -- forward ---------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """``input_ids [B, S]`` (and a 1/0 mask for padded batches) -> logits ``[B, S, V]``.

        ``labels [B, S]``: next-token cross-entropy over positions whose label is not
        ``-100`` (labels are the inputs; the shift happens here).
        """
        check_input_ids(input_ids, attention_mask, self.config.vocab_size)
        batch = pack(input_ids, attention_mask)
        hidden = self.model(batch)
        logits = self.lm_head(self.model.norm(hidden))
        loss = None
        if labels is not None:
            shifted = torch.full_like(labels, IGNORE_INDEX)
            shifted[:, :-1] = labels[:, 1:]
            if attention_mask is not None:
                shifted = shifted.masked_fill(~attention_mask.bool(), IGNORE_INDEX)
            loss = F.cross_entropy(
                logits.float(), shifted.reshape(-1)[batch.flat], ignore_index=IGNORE_INDEX
            )
        return CausalLMOutput(batch.unpack(logits), batch.unpack(hidden), loss)
