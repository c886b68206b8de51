"""Value checks of GLM-5 config fields: each typed field's type and bounds, and RoPE
scaling (transformers' ``rope_parameters``) checked and normalised. Every failure is a
one-line :class:`ConfigError` naming the field."""

from __future__ import annotations

import math

from glmport.core.errors import ConfigError, check_int

# GlmMoeDsaConfig's typed fields by kind: ints >= 1, ints >= 0, floats, bools.
POSITIVE_INTS = (
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
NON_NEGATIVE_INTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
# float fields and the bound each must exceed (initializer_range may be 0: zero init).
FLOAT_BOUNDS = {
    "routed_scaling_factor": 0.0,
    "rms_norm_eps": 0.0,
    "rope_theta": 0.0,
    "initializer_range": None,
}
BOOLS = ("norm_topk_prob", "indexer_rope_interleave", "tie_word_embeddings", "attention_bias")


def show(value: object) -> str:
    """``value`` and its type for a one-line message (long reprs cut)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_field_int(name: str, value: object, minimum: int) -> None:
    """Config field ``name`` must be an int (not a bool) ``>= minimum``."""
    check_int(f"config field {name}", value, minimum)


def check_field_float(name: str, value: object, above: float | None) -> None:
    """Config field ``name`` must be a finite number ``> above`` (``>= 0`` for None)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"config field {name} must be a number, got {show(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"config field {name} must be finite, got {value}")
    if above is not None and value <= above:
        raise ConfigError(f"config field {name} must be > {above}, got {value}")
    if above is None and value < 0:
        raise ConfigError(f"config field {name} must be >= 0, got {value}")


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
        raise ConfigError(f"config field {name} must be a finite number, got {show(value)}")
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
        raise ConfigError(f"config field rope_parameters must be an object, got {show(scaling)}")
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
        check_field_int(
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
            f"{show(out['truncate'])}"
        )
    return {"rope_type": kind, **out}
