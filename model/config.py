"""GLM-5 model configuration, read from and written to HF ``config.json`` files.

Field names are those of transformers' ``GlmMoeDsaConfig`` (``model_type
"glm_moe_dsa"``) and ``DeepseekV32Config`` (``"deepseek_v32"``), so a real
checkpoint's ``config.json`` loads unchanged; keys glmport does not use are kept and
written back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from glmport.core.errors import ConfigError

GLM_MOE_DSA = "glm_moe_dsa"
DEEPSEEK_V32 = "deepseek_v32"


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
        if self.model_type not in (GLM_MOE_DSA, DEEPSEEK_V32):
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; expected "
                f"{GLM_MOE_DSA!r} or {DEEPSEEK_V32!r}"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                "qk_rope_head_dim must be even and at most index_head_dim "
                f"(got {self.qk_rope_head_dim}, index_head_dim {self.index_head_dim})"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_group {self.n_group} must divide n_routed_experts {self.n_routed_experts}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace

    # -- HF config.json ------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict) -> GlmMoeDsaConfig:
        """Build from HF ``config.json`` fields; unknown keys are kept in ``extra``."""
        data = dict(data)
        rope = data.pop("rope_parameters", None) or data.pop("rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_type {rope.get('rope_type')!r} is not supported (only 'default'); "
                "GLM-5 uses default RoPE with theta 1e6"
            )
        theta = rope.get("rope_theta", data.pop("rope_theta", None))
        if theta is None:
            theta = 10000.0  # transformers' default when a config names none
        data.pop("rope_theta", None)
        if data.get("model_type") == DEEPSEEK_V32:
            data.setdefault("indexer_rope_interleave", False)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, rope_theta=float(theta), extra=extra)

    @classmethod
    def from_json_file(cls, path: str | Path) -> GlmMoeDsaConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from err
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
