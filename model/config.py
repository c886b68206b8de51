"""GLM-5 model configuration, read from and written to HF ``config.json`` files.

Field names are those of transformers' ``GlmMoeDsaConfig`` (``model_type
"glm_moe_dsa"``) and ``DeepseekV32Config`` (``"deepseek_v32"``), so a real
checkpoint's ``config.json`` loads unchanged; keys glmport does not use are kept and
written back. The field checks live in :mod:`glmport.model.config_checks`, the
classification of every ``config.json`` key in :mod:`glmport.model.config_fields`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from glmport.core.errors import ConfigError

from .config_checks import (
    BOOLS,
    FLOAT_BOUNDS,
    NON_NEGATIVE_INTS,
    POSITIVE_INTS,
    check_field_float,
    check_field_int,
    normalised_rope,
    show,
)
from .config_fields import FIELD_RULES, REFUSED, indexer_types_of, missing_required

GLM_MOE_DSA = "glm_moe_dsa"
DEEPSEEK_V32 = "deepseek_v32"

# The largest model a config may describe, counted in float32 bytes (the dtype
# from_config builds): 64 TiB, about 20 times GLM-5 (~3 TiB in float32). A size beyond
# it is a typo (an extra digit), not a model, and would fail at allocation or overflow
# an index; such a config is refused at construction with the estimate in the message.
MAX_PARAMETER_BYTES = 2**46


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
        for name in POSITIVE_INTS:
            check_field_int(name, getattr(self, name), minimum=1)
        for name in NON_NEGATIVE_INTS:
            check_field_int(name, getattr(self, name), minimum=0)
        for name, minimum in FLOAT_BOUNDS.items():
            check_field_float(name, getattr(self, name), minimum)
        for name in BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"config field {name} must be true or false, got {show(value)}")
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                check_field_int(name, getattr(self, name), minimum=0)
        eos = self.eos_token_id
        for item in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            check_field_int("eos_token_id", item, minimum=0)
        if not isinstance(self.extra, dict):
            raise ConfigError(f"config field extra must be a dict, got {show(self.extra)}")
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
                f"config field indexer_types must be a list of 'full' / 'shared', got {show(types)}"
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
                f"{show(types)}"
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
                    f"config field {name} = {show(fields[name])} is not implemented: {rule.reason}"
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

    def sliced(self, layers: range) -> GlmMoeDsaConfig:
        """The config of decoder layers ``layers`` (a contiguous ``range``, step 1) alone,
        renumbered from 0, without MTP: each keeps its MLP kind (``mlp_layer_types``)
        and its indexer kind. The first must run its own indexer: a shared (IndexCache)
        layer whose full layer lies before the slice is a :class:`ConfigError` naming
        that layer."""
        n = self.num_hidden_layers
        if not isinstance(layers, range) or layers.step != 1 or not layers:
            raise ConfigError(f"layers must be a non-empty range of step 1, got {show(layers)}")
        if layers.start < 0 or layers.stop > n:
            raise ConfigError(
                f"layers {layers.start}-{layers.stop - 1} lie outside the model's decoder "
                f"layers 0-{n - 1}"
            )
        source = self.indexer_source(layers.start)
        if source != layers.start:
            raise ConfigError(
                f"layers {layers.start}-{layers.stop - 1}: layer {layers.start} reuses layer "
                f"{source}'s index selection (IndexCache's shared layers); start at layer "
                f"{source} or before"
            )
        return dataclasses.replace(
            self,
            num_hidden_layers=len(layers),
            mlp_layer_types=["sparse" if self.is_moe_layer(i) else "dense" for i in layers],
            indexer_types=self.indexer_types[layers.start : layers.stop],
            num_nextn_predict_layers=0,
            extra=dict(self.extra),
        )

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
            raise ConfigError(f"a model config must be a JSON object, got {show(data)}")
        data = dict(data)
        # The legacy rope_scaling wins over rope_parameters, as in transformers.
        params, legacy = data.pop("rope_parameters", None), data.pop("rope_scaling", None)
        rope = legacy or params or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field rope_parameters must be an object, got {show(rope)}")
        rope = dict(rope)
        theta = rope.pop("rope_theta", None)
        top_theta = data.pop("rope_theta", None)
        theta = top_theta if theta is None else theta
        if theta is None:
            theta = 10000.0  # transformers' default when a config names none
        check_field_float("rope_theta", theta, 0.0)
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
        :data:`~glmport.model.config_fields.REQUIRED_FIELDS` (a checkpoint's file
        always does; defaults are for what it may leave out), read as :meth:`from_dict`
        reads it."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read model config {path}: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"model config {path} must hold a JSON object, got {show(data)}")
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
