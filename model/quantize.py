"""Quantised inference and INT4 quantisation-aware training (QAT) for GLM-5.

:func:`quantize_model` packs the routed experts and the dense projections into the
canonical formats of :mod:`glmport.core.formats` (``w4a8`` experts and ``w8a8``
projections by default, or ``fp8_block``); every GEMM then runs through
``glmport.ops.quant_gemm`` / ``grouped_gemm`` on the selected backend.
:func:`enable_qat` keeps the float weights but makes the same GEMMs fake-quantise them
(straight-through gradients), so training sees the int4 grid that inference will use;
:func:`quantize_model` on a QAT model then packs the trained weights.
:func:`prepare_weights` then converts the packed weights once into the native layout
of the backend that runs them (``glmport.prepare_weight``), so no call converts them.

What stays float, in both modes (the weights are a small share of the model):

* embeddings: a row lookup, not a GEMM; no quantised kernel applies.
* RMSNorm / LayerNorm weights: per-channel gains, a few bytes per layer.
* ``lm_head`` and the MTP ``shared_head.head``: logits feed sampling and the RL
  log-probs, where quantisation noise is paid in full (and there is only one each).
* the router (``mlp.gate``, not an ``nn.Linear``) and the indexer's ``weights_proj``:
  they produce routing / index *choices*; a small error flips a top-k decision and
  changes the computation outright rather than perturbing it.
* ``self_attn.kv_b_proj``: the absorbed (KV-cache) attention folds its weight into the
  queries and outputs (``Attention.attend_latent`` reads ``kv_b_proj.weight``), which no
  quantised GEMM covers; float keeps prefill and cached decoding identical, at ~0.15% of
  GLM-5's weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import glmport.ops as ops
from glmport.core.errors import ConfigError
from glmport.core.formats import FLOAT_WEIGHT, SCHEMES
from glmport.core.prepared import PreparedWeight, prepare_weight

from .attention import Attention, Indexer
from .blocks import Experts, packed_weight
from .causal_lm import GlmMoeDsaForCausalLM
from .modeling import SharedHead

# (owner type, attribute) of the nn.Linear layers kept float; reasons in the module doc.
KEEP_FLOAT: frozenset[tuple[type, str]] = frozenset(
    {
        (Attention, "kv_b_proj"),
        (Indexer, "weights_proj"),
        (SharedHead, "head"),
        (GlmMoeDsaForCausalLM, "lm_head"),
    }
)
# Smallest int4 group tried: below it the fp32 scales outweigh the 4-bit payload.
MIN_INT4_GROUP = 16
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class QuantLinear(nn.Module):
    """A drop-in ``nn.Linear`` (``y = x @ W.T + b``) whose GEMM is ``ops.quant_gemm``.

    Packed mode (inference): buffers ``weight_q`` / ``weight_scale`` in ``scheme``'s
    canonical layout. QAT mode: a float ``weight`` Parameter ``[out, in]`` that the GEMM
    fake-quantises, with straight-through gradients. The bias stays float either way.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: str,
        group_size: int,
        *,
        qat: bool = False,
    ) -> None:
        """``weight [out, in]`` float; ``group_size``: the int4 group (ignored otherwise)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        self.group_size = group_size
        if qat:  # the same Parameter object: an optimiser built before keeps training it
            self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        else:
            q, scale = ops.quantize_weight(weight.detach(), scheme, group_size)
            self.register_buffer("weight_q", q)
            self.register_buffer("weight_scale", scale)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias)
        self.prepared: dict[str, PreparedWeight] = {}

    @classmethod
    def from_linear(
        cls, linear: nn.Linear | QuantLinear, scheme: str, group_size: int, *, qat: bool = False
    ) -> QuantLinear:
        """Convert an ``nn.Linear`` (or a QAT ``QuantLinear``, to pack its trained weight)."""
        return cls(linear.weight, linear.bias, scheme, group_size, qat=qat)

    @property
    def qat(self) -> bool:
        return "weight" in self._parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]`` in ``x``'s dtype."""
        flat = x.reshape(-1, self.in_features)
        if self.qat:
            y = ops.quant_gemm(flat, self.weight, None, self.scheme, self.group_size)
        else:
            w = packed_weight(self, "weight")
            y = ops.quant_gemm(flat, w, self.weight_scale, self.scheme)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        mode = "qat" if self.qat else "packed"
        group = f", group_size={self.group_size}" if _is_int4(self.scheme) else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}{group}, {mode}"
        )


@dataclass(frozen=True)
class QuantReport:
    """What a conversion did. Bytes count every parameter and buffer of the model
    (packed values and their scales included); ``expert_*`` only the routed experts.
    ``converted`` maps a scheme to the modules converted to it (an ``Experts`` module,
    holding all ``E`` experts of a layer, counts once)."""

    bytes_before: int
    bytes_after: int
    expert_bytes_before: int
    expert_bytes_after: int
    converted: dict[str, int] = field(default_factory=dict)

    @property
    def saving(self) -> float:
        """``bytes_before / bytes_after`` (``4.0``: a quarter of the memory)."""
        return self.bytes_before / self.bytes_after

    @property
    def expert_saving(self) -> float:
        return self.expert_bytes_before / self.expert_bytes_after

    def __str__(self) -> str:
        schemes = ", ".join(f"{n} {s}" for s, n in sorted(self.converted.items()))
        return (
            f"weights {self.bytes_before / 2**20:.2f} -> {self.bytes_after / 2**20:.2f} MiB "
            f"({self.saving:.2f}x; experts {self.expert_saving:.2f}x); converted: {schemes}"
        )


def quantize_model(
    model: nn.Module,
    *,
    experts: str = "w4a8",
    dense: str = "w8a8",
    group_size: int = 128,
) -> QuantReport:
    """Pack ``model``'s weights for quantised inference, in place.

    Args:
        model: a :class:`GlmMoeDsaForCausalLM` (or any module holding its layers), float
            or prepared by :func:`enable_qat` (its trained weights are packed).
        experts: scheme of the routed experts (``[E, N, K]`` fused weights), or
            ``"none"`` to keep them float.
        dense: scheme of the attention projections (see the module doc for the ones kept
            float), dense MLPs, shared experts and MTP ``eh_proj``, or ``"none"``.
        group_size: the int4 group; a module whose input width ``K`` it does not divide
            gets the largest power of two below it that does (down to 16).

    Returns:
        A :class:`QuantReport`.

    Raises:
        ConfigError: an unknown scheme, an already packed model, or an int4 module
            whose ``K`` no group size fits.
    """
    return _convert(model, experts, dense, group_size, qat=False)


def prepare_weights(model: nn.Module) -> int:
    """Convert every packed weight of ``model`` once into the native layout of the
    backend that will run it (its ``prepare_weight`` hook), after
    :func:`quantize_model` and after moving the model to its device, under the
    selection it will run with. The canonical buffers stay (checkpoints, other
    backends); a backend that converts holds both. Returns how many weights were
    prepared; moving or reloading the model afterwards makes them stale (then the
    canonical weights are used, with a log line, until this is called again)."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and not module.qat:
            module.prepared["weight"] = prepare_weight(
                "quant_gemm", module.weight_q, module.weight_scale, module.scheme
            )
            count += 1
        elif isinstance(module, Experts) and hasattr(module, EXPERT_WEIGHTS[0] + "_q"):
            for name in EXPERT_WEIGHTS:
                module.prepared[name] = prepare_weight(
                    "grouped_gemm",
                    getattr(module, name + "_q"),
                    getattr(module, name + "_scale"),
                    module.scheme,
                    module.group_size,
                )
                count += 1
    return count


def enable_qat(model: nn.Module, *, scheme: str = "w4a16", group_size: int = 128) -> QuantReport:
    """Quantisation-aware training, in place: the experts and the dense projections that
    :func:`quantize_model` would pack compute with ``scheme``-fake-quantised float
    weights (int4 groups of ``group_size`` for ``w4a*``) and straight-through gradients.
    Weights stay float Parameters (optimisers and ``save_pretrained`` see them as before).
    Pack the trained model with ``quantize_model(model, experts=scheme, dense=scheme,
    group_size=group_size)``: same modules, same group sizes, so the same forward.
    """
    return _convert(model, scheme, scheme, group_size, qat=True)


def _convert(
    model: nn.Module, experts: str, dense: str, group_size: int, *, qat: bool
) -> QuantReport:
    for arg, scheme in (("experts", experts), ("dense", dense)):
        if scheme != FLOAT_WEIGHT and scheme not in SCHEMES:
            raise ConfigError(
                f"{arg}={scheme!r} is not a quantisation scheme; choose one of "
                f"{', '.join(SCHEMES)}, or 'none' to keep them float"
            )
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ConfigError(f"group_size must be a positive even int, got {group_size!r}")
    if any(name.endswith("_q") for name, _ in model.named_buffers()):
        raise ConfigError("this model already holds packed quantised weights")

    expert_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]
    bytes_before, expert_before = _bytes(model), sum(_bytes(m) for _, m in expert_modules)
    # Every group size first, so a module that fits none leaves the model untouched.
    plan_experts = [
        # One group for both GEMMs: QAT mode reads it from Experts.group_size.
        (m, _group_for(n, experts, [getattr(m, w).shape[-1] for w in EXPERT_WEIGHTS], group_size))
        for n, m in (expert_modules if experts != FLOAT_WEIGHT else [])
    ]
    plan_dense = [
        (parent, attr, linear, _group_for(n, dense, [linear.in_features], group_size))
        for n, parent, attr, linear in (_dense_projections(model) if dense != FLOAT_WEIGHT else [])
    ]
    with torch.no_grad():
        for module, group in plan_experts:
            _quantize_experts(module, experts, group, qat)
        for parent, attr, linear, group in plan_dense:
            setattr(parent, attr, QuantLinear.from_linear(linear, dense, group, qat=qat))
    converted = Counter({experts: len(plan_experts)}) + Counter({dense: len(plan_dense)})
    return QuantReport(
        bytes_before,
        _bytes(model),
        expert_before,
        sum(_bytes(m) for _, m in expert_modules),
        dict(converted),  # Counter addition drops the zero counts
    )


def _quantize_experts(module: Experts, scheme: str, group_size: int, qat: bool) -> None:
    """Set ``module``'s scheme; unless ``qat``, replace its float ``[E, N, K]`` weights by
    packed ``<name>_q`` / ``<name>_scale`` buffers (what ``Experts._gemm`` looks for)."""
    module.scheme, module.group_size = scheme, group_size
    if qat:
        return
    for name in EXPERT_WEIGHTS:
        q, scale = ops.quantize_weight(getattr(module, name).detach(), scheme, group_size)
        delattr(module, name)
        module.register_buffer(name + "_q", q)
        module.register_buffer(name + "_scale", scale)


def _dense_projections(
    model: nn.Module,
) -> Iterator[tuple[str, nn.Module, str, nn.Linear | QuantLinear]]:
    """``(qualified name, parent, attribute, layer)`` of every ``nn.Linear`` (or QAT
    ``QuantLinear``) to quantise: all but those in :data:`KEEP_FLOAT`."""
    for path, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not isinstance(child, (nn.Linear, QuantLinear)):
                continue
            if any(isinstance(parent, owner) and attr == a for owner, a in KEEP_FLOAT):
                continue
            yield f"{path}.{attr}" if path else attr, parent, attr, child


def _is_int4(scheme: str) -> bool:
    return SCHEMES[scheme].weight.storage == torch.uint8


def _group_for(name: str, scheme: str, ks: list[int], group_size: int) -> int:
    """The int4 group for a module with input widths ``ks``: the largest of
    ``group_size`` and the powers of two below it (>= MIN_INT4_GROUP) dividing every
    ``K``. Other schemes take ``group_size`` as is (FP8-block fixes its own 128)."""
    if not _is_int4(scheme):
        return group_size
    tried = [group_size]
    g = 1 << (group_size.bit_length() - 1)  # the largest power of two <= group_size
    tried += [g >> i for i in range(g.bit_length()) if MIN_INT4_GROUP <= g >> i < group_size]
    for g in tried:
        if all(k % g == 0 for k in ks):
            return g
    raise ConfigError(
        f"{name}: no int4 group size in {tried} divides its input width(s) {ks}; pass a "
        f"group_size that does, or a non-int4 scheme (w8a8, fp8_block) for these modules"
    )


def _bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (shared tensors counted once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
