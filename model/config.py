"""GLM-5 model configuration, read from and written to HF ``config.json`` files.

Field names are those of transformers' ``GlmMoeDsaConfig`` (``model_type
"glm_moe_dsa"``) and ``DeepseekV32Config`` (``"deepseek_v32"``), so a real
checkpoint's ``config.json`` loads unchanged; keys glmport does not use are kept and
written back.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmport.core.errors import ConfigError, check_int

GLM_MOE_DSA = "glm_moe_dsa"
DEEPSEEK_V32 = "deepseek_v32"

# The largest model a config may describe, counted in float32 bytes (the dtype
# from_config builds): 64 TiB, about 20 times GLM-5 (~3 TiB in float32). A size beyond
# it is a typo (an extra digit), not a model, and would fail at allocation or overflow
# an index; such a config is refused at construction with the estimate in the message.
MAX_PARAMETER_BYTES = 2**46

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "max_position_embeddings",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
)
_NON_NEGATIVE_INTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
# float fields and the bound each must exceed (initializer_range may be 0: zero init).
_FLOATS = {
    "routed_scaling_factor": 0.0,
    "rms_norm_eps": 0.0,
    "rope_theta": 0.0,
    "initializer_range": None,
}
_BOOLS = ("norm_topk_prob", "indexer_rope_interleave", "tie_word_embeddings", "attention_bias")


def _show(value: object) -> str:
    """``value`` and its type for a one-line message (long reprs cut)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _check_int(name: str, value: object, minimum: int) -> None:
    check_int(f"config field {name}", value, minimum)


def _check_float(name: str, value: object, above: float | None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"config field {name} must be a number, got {_show(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"config field {name} must be finite, got {value}")
    if above is not None and value <= above:
        raise ConfigError(f"config field {name} must be > {above}, got {value}")
    if above is None and value < 0:
        raise ConfigError(f"config field {name} must be >= 0, got {value}")


# -- how glmport treats each config key -----------------------------------------------

HONOURED = "honoured"  # a typed field of GlmMoeDsaConfig the computation uses
BOOKKEEPING = "bookkeeping"  # changes no computation; kept in ``extra``, written back
REFUSED = "refused"  # not implemented: any value glmport cannot run is a ConfigError


@dataclass(frozen=True)
class FieldRule:
    """How glmport treats one ``config.json`` key. ``runs(value, fields)`` says, for a
    REFUSED key, whether glmport computes what transformers does with that value
    (``fields``: every key of the config, typed fields included)."""

    kind: str
    reason: str
    runs: Callable[[object, dict], bool] | None = None


def _equals(default: object) -> Callable[[object, dict], bool]:
    return lambda value, fields: value == default


def _all_indexed_attention(value: object, fields: dict) -> bool:
    return isinstance(value, list) and all(v == "indexed_attention" for v in value)


def _kv_heads_match(value: object, fields: dict) -> bool:
    return value == fields["num_attention_heads"]


_ROUTER = "transformers' router is fixed (sigmoid scores, noaux_tc group-limited top-k)"


def indexer_types_of(fields: dict) -> list[str]:
    """Each decoder layer's indexer mode, ``"full"`` or ``"shared"``, derived as
    transformers' GlmMoeDsaConfig does: ``indexer_types``, else ``index_topk_pattern``
    (``"FSSF..."`` or a list), else layer ``i`` is full when
    ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2, 1)."""
    if fields.get("indexer_types") is not None:
        return list(fields["indexer_types"])
    pattern = fields.get("index_topk_pattern")
    if pattern is not None:
        return (
            [{"F": "full", "S": "shared"}[c] for c in pattern]
            if isinstance(pattern, str)
            else list(pattern)
        )
    freq = max(fields.get("index_topk_freq", 1), 1)
    offset = fields.get("index_skip_topk_offset", 2)
    return [
        "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
        for i in range(fields["num_hidden_layers"])
    ]


# Every field of transformers' GlmMoeDsaConfig and DeepseekV32Config, the generic
# PreTrainedConfig ones they serialise, and the keys real GLM-5 / DeepSeek-V3.2
# checkpoints carry that transformers does not read. A key in none of these lands in
# ``extra`` and is written back; transformers' models do not read it either.
FIELD_RULES: dict[str, FieldRule] = {
    # architecture: typed fields, all honoured
    "model_type": FieldRule(HONOURED, "glm_moe_dsa or deepseek_v32 (indexer RoPE layout)"),
    "vocab_size": FieldRule(HONOURED, "embedding and LM head rows"),
    "hidden_size": FieldRule(HONOURED, "model width"),
    "intermediate_size": FieldRule(HONOURED, "dense MLP width"),
    "moe_intermediate_size": FieldRule(HONOURED, "expert and shared-expert width"),
    "num_hidden_layers": FieldRule(HONOURED, "decoder layers"),
    "num_attention_heads": FieldRule(HONOURED, "MLA query heads"),
    "q_lora_rank": FieldRule(HONOURED, "query latent width"),
    "kv_lora_rank": FieldRule(HONOURED, "key/value latent width"),
    "qk_nope_head_dim": FieldRule(HONOURED, "per-head query/key dims without RoPE"),
    "qk_rope_head_dim": FieldRule(HONOURED, "per-head rotated dims (also the RoPE table width)"),
    "v_head_dim": FieldRule(HONOURED, "per-head value dims"),
    "n_routed_experts": FieldRule(HONOURED, "routed experts"),
    "num_experts": FieldRule(HONOURED, "alias of n_routed_experts (transformers' back-compat)"),
    "num_local_experts": FieldRule(HONOURED, "alias of n_routed_experts (attribute_map)"),
    "n_shared_experts": FieldRule(HONOURED, "shared expert width multiple"),
    "num_experts_per_tok": FieldRule(HONOURED, "experts chosen per token"),
    "n_group": FieldRule(HONOURED, "expert groups of group-limited routing"),
    "topk_group": FieldRule(HONOURED, "groups kept per token"),
    "routed_scaling_factor": FieldRule(HONOURED, "routing weights multiplier"),
    "norm_topk_prob": FieldRule(HONOURED, "routing weights normalised to sum 1"),
    "first_k_dense_replace": FieldRule(HONOURED, "leading dense layers (mlp_layer_types unset)"),
    "mlp_layer_types": FieldRule(HONOURED, "per-layer 'dense' / 'sparse' MLP"),
    "rms_norm_eps": FieldRule(HONOURED, "decoder RMSNorm epsilon"),
    "attention_bias": FieldRule(HONOURED, "biases of q_a_proj, kv_a_proj_with_mqa, o_proj"),
    "max_position_embeddings": FieldRule(HONOURED, "yarn / llama3 default original length"),
    "rope_parameters": FieldRule(HONOURED, "rope_type default, linear, yarn or llama3"),
    "rope_scaling": FieldRule(
        HONOURED, "legacy rope_parameters (wins); glmport's field, less rope_theta"
    ),
    "rope_theta": FieldRule(HONOURED, "legacy top-level theta, moved into rope_parameters"),
    "partial_rotary_factor": FieldRule(HONOURED, "top level: moved into rope_parameters"),
    "original_max_position_embeddings": FieldRule(
        HONOURED, "top level: overrides rope_parameters' for yarn / llama3, as in transformers"
    ),
    "index_n_heads": FieldRule(HONOURED, "indexer heads"),
    "index_head_dim": FieldRule(HONOURED, "indexer head dims"),
    "index_topk": FieldRule(HONOURED, "keys kept per query by the indexer"),
    "indexer_rope_interleave": FieldRule(HONOURED, "glmport's: indexer RoPE layout"),
    "num_nextn_predict_layers": FieldRule(HONOURED, "MTP layers (checkpoint key)"),
    "initializer_range": FieldRule(HONOURED, "std of from_config's random init"),
    # refused: glmport computes something else for any other value
    "hidden_act": FieldRule(REFUSED, "MLPs and experts are SwiGLU with silu", _equals("silu")),
    "num_key_value_heads": FieldRule(
        REFUSED,
        "MLA expands one latent per query head (must equal num_attention_heads)",
        _kv_heads_match,
    ),
    "tie_word_embeddings": FieldRule(
        REFUSED, "the LM head is its own weight, not the input embedding", _equals(False)
    ),
    "attention_dropout": FieldRule(
        REFUSED, "attention has no dropout (transformers drops in training)", _equals(0)
    ),
    "layer_types": FieldRule(
        REFUSED, "every layer runs DSA ('indexed_attention')", _all_indexed_attention
    ),
    "quantization_config": FieldRule(
        REFUSED,
        "pre-quantised checkpoints are not read (see glmport.model.quantize)",
        _equals(None),
    ),
    "scoring_func": FieldRule(REFUSED, _ROUTER, _equals("sigmoid")),
    "topk_method": FieldRule(REFUSED, _ROUTER, _equals("noaux_tc")),
    "rope_interleave": FieldRule(
        REFUSED, "the main attention's RoPE is interleaved (transformers' too)", _equals(True)
    ),
    "moe_layer_freq": FieldRule(
        REFUSED, "transformers makes every layer from first_k_dense_replace MoE", _equals(1)
    ),
    # bookkeeping: no effect on the computation
    "bos_token_id": FieldRule(BOOKKEEPING, "generation settings"),
    "eos_token_id": FieldRule(BOOKKEEPING, "generation settings (glmport's stop tokens)"),
    "pad_token_id": FieldRule(
        BOOKKEEPING, "transformers' Embedding padding_idx: init and its gradient only"
    ),
    "use_cache": FieldRule(BOOKKEEPING, "generation settings"),
    "head_dim": FieldRule(BOOKKEEPING, "transformers overwrites it with qk_rope_head_dim"),
    "qk_head_dim": FieldRule(BOOKKEEPING, "derived: qk_nope_head_dim + qk_rope_head_dim"),
    "mlp_bias": FieldRule(BOOKKEEPING, "transformers' MLPs never read it (bias-free)"),
    "output_router_logits": FieldRule(BOOKKEEPING, "adds router logits to outputs"),
    "output_attentions": FieldRule(BOOKKEEPING, "output options"),
    "output_hidden_states": FieldRule(BOOKKEEPING, "output options"),
    "return_dict": FieldRule(BOOKKEEPING, "output options"),
    "chunk_size_feed_forward": FieldRule(BOOKKEEPING, "not read by these models"),
    "is_encoder_decoder": FieldRule(BOOKKEEPING, "not read by these models"),
    "id2label": FieldRule(BOOKKEEPING, "classification heads only"),
    "label2id": FieldRule(BOOKKEEPING, "classification heads only"),
    "problem_type": FieldRule(BOOKKEEPING, "classification heads only"),
    "architectures": FieldRule(BOOKKEEPING, "class names"),
    "dtype": FieldRule(BOOKKEEPING, "storage dtype; from_pretrained's dtype picks the compute"),
    "torch_dtype": FieldRule(BOOKKEEPING, "legacy name of dtype"),
    "transformers_version": FieldRule(BOOKKEEPING, "provenance"),
    "_name_or_path": FieldRule(BOOKKEEPING, "provenance"),
    "ep_size": FieldRule(BOOKKEEPING, "expert-parallel layout of DeepSeek's training code"),
    # IndexCache (glm_moe_dsa only: transformers' DeepSeek-V3.2 reads none of these keys,
    # so there they are bookkeeping in ``extra`` and every layer is full)
    "indexer_types": FieldRule(HONOURED, "per-layer 'full' / 'shared' indexer (IndexCache)"),
    "index_topk_pattern": FieldRule(HONOURED, "'FSSF...': derives indexer_types when unset"),
    "index_topk_freq": FieldRule(HONOURED, "one full layer in N: derives indexer_types"),
    "index_skip_topk_offset": FieldRule(HONOURED, "shifts index_topk_freq's schedule"),
}

# The fields every GLM-5 / DeepSeek-V3.2 config.json carries (the hub's files do, and
# transformers' save_pretrained writes each of them), as (what to call it, the keys that
# may hold it). A default for one of these (transformers' are GLM-5's own dimensions,
# and RoPE theta 10000) would silently describe another model, so a config.json
# without one is refused. The other fields default to what real checkpoints hold, or
# change no computation: see docs/model.md, "Required config fields".
REQUIRED_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    *(
        (name, (name,))
        for name in ("model_type", *_POSITIVE_INTS, "n_shared_experts")
        if name != "n_routed_experts"  # below, with its aliases
    ),
    ("n_routed_experts", ("n_routed_experts", "num_experts", "num_local_experts")),
    ("routed_scaling_factor", ("routed_scaling_factor",)),
    ("norm_topk_prob", ("norm_topk_prob",)),
    ("rms_norm_eps", ("rms_norm_eps",)),
    ("first_k_dense_replace", ("first_k_dense_replace", "mlp_layer_types")),
    ("rope_theta", ("rope_theta", "rope_parameters.rope_theta", "rope_scaling.rope_theta")),
)


def _holds(data: dict, key: str) -> bool:
    """Whether ``data`` sets ``key`` (``"a.b"``: key b of the object at a) to a value
    (anything but an object at a counts: its own check names what is wrong with it)."""
    head, _, rest = key.partition(".")
    value = data.get(head)
    if rest and isinstance(value, dict):
        return value.get(rest) is not None
    return value is not None


def missing_required(data: dict) -> list[str]:
    """The :data:`REQUIRED_FIELDS` a ``config.json`` object does not set."""
    return [name for name, keys in REQUIRED_FIELDS if not any(_holds(data, k) for k in keys)]


# -- RoPE scaling (transformers' rope_parameters) --------------------------------------

# Keys each implemented rope_type reads, beyond rope_type, rope_theta and
# partial_rotary_factor (transformers' modeling_rope_utils validators).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
_ROPE_REQUIRED = {"linear": {"factor"}, "yarn": {"factor"}, "llama3": _ROPE_KEYS["llama3"]}
# transformers' other rope types, and why glmport does not implement them.
_ROPE_NOT_IMPLEMENTED = {
    "dynamic": "its frequencies change with the longest sequence of each forward call",
    "longrope": "it switches frequency sets with the longest sequence of each forward call",
    "proportional": "a Gemma-4 partial rotation that MLA's rotated slice does not use",
}


def _rope_number(key: str, value: object, low: float, *, inclusive: bool = False) -> None:
    """``rope_parameters.<key>`` must be a finite number ``> low`` (``>= low``)."""
    name = f"rope_parameters.{key}"
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"config field {name} must be a finite number, got {_show(value)}")
    if value < low or (value == low and not inclusive):
        raise ConfigError(
            f"config field {name} must be {'>=' if inclusive else '>'} {low}, got {value}"
        )


def normalised_rope(scaling: dict, max_position_embeddings: int) -> dict:
    """``rope_scaling`` checked and in transformers' standard form: ``rope_type``
    (legacy ``type`` read), the keys that type reads, and for yarn / llama3
    ``original_max_position_embeddings`` defaulting to ``max_position_embeddings``.
    A key the type does not read, a missing or bad value, or a type glmport does not
    implement is a ConfigError naming it."""
    if not isinstance(scaling, dict):
        raise ConfigError(f"config field rope_parameters must be an object, got {_show(scaling)}")
    out = dict(scaling)
    legacy = out.pop("type", None)
    kind = out.pop("rope_type", None) or legacy or "default"
    out.pop("rope_theta", None)  # the rope_theta field holds it
    if kind in _ROPE_NOT_IMPLEMENTED:
        raise ConfigError(
            f"config field rope_parameters.rope_type {kind!r} is not implemented: "
            f"{_ROPE_NOT_IMPLEMENTED[kind]} (glmport implements {', '.join(_ROPE_KEYS)})"
        )
    if kind not in _ROPE_KEYS:
        raise ConfigError(
            f"config field rope_parameters.rope_type {kind!r} is unknown; glmport implements "
            f"{', '.join(_ROPE_KEYS)}"
        )
    allowed = _ROPE_KEYS[kind] | {"partial_rotary_factor"}
    unread = sorted(set(out) - allowed)
    if unread:
        raise ConfigError(
            f"config field rope_parameters.{unread[0]} is not read by rope_type {kind!r} "
            f"(it reads {', '.join(sorted(allowed))})"
        )
    missing = sorted(_ROPE_REQUIRED.get(kind, set()) - set(out))
    if missing:
        raise ConfigError(
            f"config field rope_parameters.{missing[0]} is required by rope_type {kind!r}"
        )
    if "original_max_position_embeddings" in _ROPE_KEYS[kind]:
        out.setdefault("original_max_position_embeddings", max_position_embeddings)
        _check_int(
            "rope_parameters.original_max_position_embeddings",
            out["original_max_position_embeddings"],
            minimum=1,
        )
    if "partial_rotary_factor" in out:
        _rope_number("partial_rotary_factor", out["partial_rotary_factor"], 0.0)
        # transformers' default RoPE ignores it; the scaled ones would rotate fewer dims
        # than MLA's rotated slice, which transformers cannot run either.
        if kind != "default" and out["partial_rotary_factor"] != 1:
            raise ConfigError(
                "config field rope_parameters.partial_rotary_factor "
                f"{out['partial_rotary_factor']} is not implemented: MLA rotates all "
                "qk_rope_head_dim dims"
            )
    if "factor" in out:
        _rope_number("factor", out["factor"], 1.0, inclusive=True)
    for key in ("attention_factor", "beta_fast", "beta_slow", "low_freq_factor"):
        if key in out:
            _rope_number(key, out[key], 0.0)
    for key in ("mscale", "mscale_all_dim"):
        if key in out:
            _rope_number(key, out[key], 0.0, inclusive=True)
    fast, slow = out.get("beta_fast", 32), out.get("beta_slow", 1)  # transformers' defaults
    if fast < slow:
        raise ConfigError(
            f"config field rope_parameters.beta_fast {fast} must be >= beta_slow {slow}"
        )
    if "high_freq_factor" in out:
        _rope_number("high_freq_factor", out["high_freq_factor"], 0.0)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ConfigError(
                f"config field rope_parameters.high_freq_factor {out['high_freq_factor']} must "
                f"be > low_freq_factor {out['low_freq_factor']}"
            )
    if not isinstance(out.get("truncate", True), bool):
        raise ConfigError(
            "config field rope_parameters.truncate must be true or false, got "
            f"{_show(out['truncate'])}"
        )
    return {"rope_type": kind, **out}


@dataclass
class GlmMoeDsaConfig:
    """Architecture hyper-parameters (defaults: GLM-5, 744B total / ~40B active).

    The DeepSeek-V3.2 variant (``model_type="deepseek_v32"``) differs in the indexer's
    RoPE layout (half-split instead of interleaved) and in its dimensions and routing
    groups, which come from its own config.
    """

    model_type: str = GLM_MOE_DSA
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    # Per decoder layer "dense" or "sparse" (MoE), as transformers builds them; None:
    # the first first_k_dense_replace layers dense (transformers' default).
    mlp_layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    # transformers' rope_parameters less rope_theta: rope_type and the keys it reads
    # (see normalised_rope; transformers' legacy name for this dict).
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 202752
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    # IndexCache: per decoder layer "full" (runs its own indexer) or "shared" (reuses the
    # top-k of the nearest preceding full layer; no indexer weights). None: derived from
    # ``extra``'s index_topk_pattern / index_topk_freq as transformers does (all "full"
    # for deepseek_v32, whose transformers model reads none of these keys).
    indexer_types: list[str] | None = None
    indexer_rope_interleave: bool = True
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check every field here, at construction (and so at load), not at the first
        forward: a wrong type, a non-positive size, an impossible routing or a model too
        large to ever allocate is a one-line :class:`ConfigError` naming the field."""
        if not isinstance(self.model_type, str) or self.model_type not in (
            GLM_MOE_DSA,
            DEEPSEEK_V32,
        ):
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected "
                f"{GLM_MOE_DSA!r} or {DEEPSEEK_V32!r}"
            )
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name), minimum=1)
        for name in _NON_NEGATIVE_INTS:
            _check_int(name, getattr(self, name), minimum=0)
        for name, minimum in _FLOATS.items():
            _check_float(name, getattr(self, name), minimum)
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"config field {name} must be true or false, got {_show(value)}")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        eos = self.eos_token_id
        for item in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            _check_int("eos_token_id", item, minimum=0)
        if not isinstance(self.extra, dict):
            raise ConfigError(f"config field extra must be a dict, got {_show(self.extra)}")
        self.rope_scaling = normalised_rope(self.rope_scaling, self.max_position_embeddings)
        self._check_mlp_layer_types()
        self._check_relations()
        self._check_refused()
        # Sized before indexer_types is derived (counted as all full until then): a
        # typo'd num_hidden_layers must fail here, not build a list that long.
        size = 4 * self.parameter_count()
        if size > MAX_PARAMETER_BYTES:
            raise ConfigError(
                f"config describes {self.parameter_count():,} parameters ({size / 2**40:.1f} "
                f"TiB in float32), above glmport's limit of {MAX_PARAMETER_BYTES / 2**40:.0f} "
                "TiB (MAX_PARAMETER_BYTES): check hidden_size, vocab_size, "
                "num_hidden_layers and the expert sizes"
            )
        self._set_indexer_types()

    def _set_indexer_types(self) -> None:
        """Derive ``indexer_types`` when unset and check it: one ``"full"`` / ``"shared"``
        per decoder layer, layer 0 full (a shared layer needs a preceding full one)."""
        if self.indexer_types is None:
            if self.model_type == DEEPSEEK_V32:
                self.indexer_types = ["full"] * self.num_hidden_layers
            else:
                fields = {**self.extra, "num_hidden_layers": self.num_hidden_layers}
                try:
                    self.indexer_types = indexer_types_of(fields)
                except (KeyError, TypeError, ValueError) as err:
                    raise ConfigError(
                        "config fields index_topk_pattern / index_topk_freq / "
                        f"index_skip_topk_offset do not give indexer_types: {err!r}"
                    ) from err
        types = self.indexer_types
        if not isinstance(types, list) or any(t not in ("full", "shared") for t in types):
            raise ConfigError(
                "config field indexer_types must be a list of 'full' / 'shared', got "
                f"{_show(types)}"
            )
        if len(types) != self.num_hidden_layers:
            raise ConfigError(
                f"config field indexer_types has {len(types)} entries for num_hidden_layers "
                f"{self.num_hidden_layers}"
            )
        if types[0] != "full":
            raise ConfigError(
                "config field indexer_types must start with 'full': a shared layer reuses the "
                "top-k of a preceding full layer, and layer 0 has none"
            )

    def _check_mlp_layer_types(self) -> None:
        types = self.mlp_layer_types
        if types is None:
            return
        if not isinstance(types, list) or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(
                f"config field mlp_layer_types must be a list of 'dense' / 'sparse', got "
                f"{_show(types)}"
            )
        if len(types) != self.num_hidden_layers:
            raise ConfigError(
                f"config field mlp_layer_types has {len(types)} entries for "
                f"num_hidden_layers {self.num_hidden_layers}"
            )

    def _check_refused(self) -> None:
        """A key of FIELD_RULES glmport does not implement, set to a value it cannot run
        (e.g. ``hidden_act "gelu"``), is a ConfigError naming the key and the value."""
        fields = {**self.extra, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        for name, rule in FIELD_RULES.items():
            if rule.kind == REFUSED and name in fields and not rule.runs(fields[name], fields):
                raise ConfigError(
                    f"config field {name} = {_show(fields[name])} is not implemented: {rule.reason}"
                )

    def _check_relations(self) -> None:
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                "config field qk_rope_head_dim must be even and at most index_head_dim "
                f"(got {self.qk_rope_head_dim}, index_head_dim {self.index_head_dim})"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"config field n_group {self.n_group} must divide n_routed_experts "
                f"{self.n_routed_experts}"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(
                f"config field topk_group {self.topk_group} must be at most n_group {self.n_group}"
            )
        # Group-limited routing picks experts only inside the kept groups.
        reachable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise ConfigError(
                f"config field num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                f"{reachable} experts of the topk_group {self.topk_group} kept groups "
                f"(n_routed_experts {self.n_routed_experts}, n_group {self.n_group})"
            )

    def parameter_count(self) -> int:
        """Exact element count of the model's ``state_dict`` (parameters, the router's
        score-correction bias and the MTP layers), from the dimensions alone."""
        h, v, heads = self.hidden_size, self.vocab_size, self.num_attention_heads
        q, kv, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim
        bias = int(self.attention_bias)
        index = (
            q * self.index_n_heads * self.index_head_dim
            + h * self.index_head_dim
            + 2 * self.index_head_dim  # k_norm, a LayerNorm
            + h * self.index_n_heads
        )
        attention = (
            (h + bias) * q
            + q
            + q * heads * self.qk_head_dim
            + (h + bias) * (kv + rope)
            + kv
            + kv * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * h
            + bias * h
            + index
        )
        e, i = self.n_routed_experts, self.moe_intermediate_size
        moe = e * h + e + 3 * e * h * i + 3 * h * i * self.n_shared_experts
        dense = 3 * h * self.intermediate_size

        def layer(index: int) -> int:
            return 2 * h + attention + (moe if self.is_moe_layer(index) else dense)

        n = self.num_hidden_layers
        n_shared = 0 if self.indexer_types is None else self.indexer_types.count("shared")
        # Counted, not summed per layer: a typo'd num_hidden_layers must not loop.
        n_dense = (
            min(n, self.first_k_dense_replace)
            if self.mlp_layer_types is None
            else self.mlp_layer_types.count("dense")
        )
        total = 2 * v * h + h + n_dense * (2 * h + attention + dense)
        total += (n - n_dense) * (2 * h + attention + moe) - n_shared * index  # no indexer
        mtp = v * h + 2 * h + 2 * h * h + h + v * h  # embed, enorm, hnorm, eh_proj, head
        total += sum(layer(n + k) + mtp for k in range(self.num_nextn_predict_layers))
        return total

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def indexer_source(self, index: int) -> int:
        """The layer whose indexer selects the keys layer ``index`` (decoder layers, then
        MTP layers) attends: itself when full (MTP layers always), else the nearest
        preceding full decoder layer (IndexCache's shared layers)."""
        if index < self.num_hidden_layers:
            while self.indexer_types[index] == "shared":
                index -= 1  # layer 0 is full (checked at construction)
        return index

    @property
    def full_indexer_layers(self) -> list[int]:
        """The decoder layers that run their own indexer, in layer order."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (decoder layers, then MTP layers) has the MoE MLP:
        ``mlp_layer_types`` where it names the layer, else ``first_k_dense_replace``."""
        types = self.mlp_layer_types
        if types is not None and index < len(types):
            return types[index] == "sparse"
        return index >= self.first_k_dense_replace

    # -- HF config.json ------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict) -> GlmMoeDsaConfig:
        """Build from HF ``config.json`` fields, read as transformers reads them (RoPE
        keys merged into ``rope_parameters``, expert-count aliases); keys glmport does
        not read are kept in ``extra`` (refused ones checked, see FIELD_RULES)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a JSON object, got {_show(data)}")
        data = dict(data)
        # The legacy rope_scaling wins over rope_parameters, as in transformers.
        params, legacy = data.pop("rope_parameters", None), data.pop("rope_scaling", None)
        rope = legacy or params or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field rope_parameters must be an object, got {_show(rope)}")
        rope = dict(rope)
        theta = rope.pop("rope_theta", None)
        top_theta = data.pop("rope_theta", None)
        theta = top_theta if theta is None else theta
        if theta is None:
            theta = 10000.0  # transformers' default when a config names none
        _check_float("rope_theta", theta, 0.0)
        if "partial_rotary_factor" in data:
            rope.setdefault("partial_rotary_factor", data.pop("partial_rotary_factor"))
        # A top-level original length overrides the rope dict's (transformers' Phi-3 rule).
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if "original_max_position_embeddings" in data and kind in ("yarn", "llama3"):
            rope["original_max_position_embeddings"] = data.pop("original_max_position_embeddings")
        for alias in ("num_local_experts", "num_experts"):  # the later wins, as there
            if data.get(alias) is not None:
                data["n_routed_experts"] = data.pop(alias)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if data.get("model_type") == DEEPSEEK_V32:
            data.setdefault("indexer_rope_interleave", False)
            names.discard("indexer_types")  # read by transformers' glm_moe_dsa only
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, rope_theta=float(theta), rope_scaling=rope, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> GlmMoeDsaConfig:
        """Read and validate a ``config.json``: a JSON object that sets every one of
        :data:`REQUIRED_FIELDS` (a checkpoint's file always does; defaults are for
        what it may leave out), read as :meth:`from_dict` reads it."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"model config {path} must hold a JSON object, got {_show(data)}")
        absent = missing_required(data)
        if absent:
            raise ConfigError(
                f"model config {path} does not set {', '.join(absent)}: every GLM-5 / "
                "DeepSeek-V3.2 config.json carries these, and a default would describe "
                "another model"
            )
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """HF ``config.json`` fields (``rope_parameters`` as transformers writes them)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.pop("rope_theta")
        out["rope_parameters"] = {**out.pop("rope_scaling"), "rope_theta": self.rope_theta}
        if self.mlp_layer_types is None:
            out.pop("mlp_layer_types")  # transformers derives the same default
        if self.model_type == DEEPSEEK_V32:
            out.pop("indexer_types")  # all full; a key given stays in extra, as written
        out["num_key_value_heads"] = self.num_attention_heads
        out["architectures"] = [
            "GlmMoeDsaForCausalLM" if self.model_type == GLM_MOE_DSA else "DeepseekV32ForCausalLM"
        ]
        return {**self.extra, **out}

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    # -- presets -------------------------------------------------------------------

    @classmethod
    def glm5(cls) -> GlmMoeDsaConfig:
        """GLM-5's real dimensions (instantiate on the meta device)."""
        return cls()

    @classmethod
    def tiny(cls, **overrides) -> GlmMoeDsaConfig:
        """A CPU-sized GLM-5: every feature of the architecture, ~0.3M parameters."""
        base = dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=24,
            qk_rope_head_dim=8,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            index_n_heads=4,
            index_head_dim=16,
            index_topk=4,
            max_position_embeddings=4096,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def preset(cls, name: str) -> GlmMoeDsaConfig:
        presets = {"glm5": cls.glm5, "tiny": cls.tiny}
        if name not in presets:
            raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(presets)}")
        return presets[name]()
