"""How glmport treats each ``config.json`` key of transformers' GlmMoeDsaConfig and
DeepseekV32Config: honoured, bookkeeping or refused (:data:`FIELD_RULES`), the keys
every real config carries (:data:`REQUIRED_FIELDS`), and IndexCache's per-layer
indexer modes derived as transformers derives them (:func:`indexer_types_of`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config_checks import POSITIVE_INTS

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
        HONOURED, "the LM head's weight is the input embedding's (one tensor)"
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
        for name in ("model_type", *POSITIVE_INTS, "n_shared_experts")
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
