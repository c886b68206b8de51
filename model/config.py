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
from dataclasses import dataclass, field
from pathlib import Path

from glmport.core.errors import ConfigError

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
    # bool is an int subclass: JSON true where a size goes is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config field {name} must be an integer, got {_show(value)}")
    if value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ConfigError(f"config field {name} must be {kind}, got {value}")


def _check_float(name: str, value: object, above: float | None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"config field {name} must be a number, got {_show(value)}")
    if not math.isfinite(value):
        raise ConfigError(f"config field {name} must be finite, got {value}")
    if above is not None and value <= above:
        raise ConfigError(f"config field {name} must be > {above}, got {value}")
    if above is None and value < 0:
        raise ConfigError(f"config field {name} must be >= 0, got {value}")


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
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 202752
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
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
        self._check_relations()
        size = 4 * self.parameter_count()
        if size > MAX_PARAMETER_BYTES:
            raise ConfigError(
                f"config describes {self.parameter_count():,} parameters ({size / 2**40:.1f} "
                f"TiB in float32), above glmport's limit of {MAX_PARAMETER_BYTES / 2**40:.0f} "
                "TiB (MAX_PARAMETER_BYTES): check hidden_size, vocab_size, "
                "num_hidden_layers and the expert sizes"
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
        total = 2 * v * h + h + sum(layer(k) for k in range(min(n, self.first_k_dense_replace)))
        total += max(0, n - self.first_k_dense_replace) * layer(n)
        mtp = v * h + 2 * h + 2 * h * h + h + v * h  # embed, enorm, hnorm, eh_proj, head
        total += sum(layer(n + k) + mtp for k in range(self.num_nextn_predict_layers))
        return total

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    # -- HF config.json ------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict) -> GlmMoeDsaConfig:
        """Build from HF ``config.json`` fields; unknown keys are kept in ``extra``."""
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a JSON object, got {_show(data)}")
        data = dict(data)
        rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field rope_parameters must be an object, got {_show(rope)}")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_type {rope.get('rope_type')!r} is not supported (only 'default'); "
                "GLM-5 uses default RoPE with theta 1e6"
            )
        theta = rope.get("rope_theta", data.pop("rope_theta", None))
        if theta is None:
            theta = 10000.0  # transformers' default when a config names none
        data.pop("rope_theta", None)
        _check_float("rope_theta", theta, 0.0)
        if data.get("model_type") == DEEPSEEK_V32:
            data.setdefault("indexer_rope_interleave", False)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, rope_theta=float(theta), extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> GlmMoeDsaConfig:
        """Read and validate a ``config.json`` (a JSON object; see :meth:`from_dict`)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"model config {path} must hold a JSON object, got {_show(data)}")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """HF ``config.json`` fields (``rope_parameters`` as transformers writes them)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.pop("rope_theta")
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
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
