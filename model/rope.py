"""Rotary position embeddings as transformers computes them: the inverse frequencies
of each ``rope_scaling`` type, the attention's softmax scale, and the cos / sin tables."""

from __future__ import annotations

import math

import torch

from .config import GlmMoeDsaConfig


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(config: GlmMoeDsaConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[qk_rope_head_dim / 2]`` fp32 of ``config.rope_scaling``
    and the factor on cos / sin, as transformers' ``modeling_rope_utils`` computes them:

    - default: ``theta ** (-2i / d)``;
    - linear: the default divided by ``factor``;
    - yarn (Peng et al. 2023, arXiv 2309.00071): per frequency a ramp between the
      default (fast rotations, above ``beta_fast`` turns over the original length) and
      the default divided by ``factor`` (slow, below ``beta_slow``); the cos / sin
      factor is ``attention_factor``, else ``mscale(factor, mscale) /
      mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor)``;
    - llama3 (Llama 3.1): wavelengths longer than ``original / low_freq_factor``
      divided by ``factor``, shorter than ``original / high_freq_factor`` kept,
      smoothly interpolated between.
    """
    d, theta, p = config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
    kind = p["rope_type"]
    # On the cpu even while a model is built on the meta device (from_pretrained).
    exponents = torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d
    base_freq = theta**exponents  # [d/2]
    inv_freq = 1.0 / base_freq
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        original, factor = p["original_max_position_embeddings"], p["factor"]
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        factor, original = p["factor"], p["original_max_position_embeddings"]
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                if mscale and mscale_all_dim
                else _yarn_mscale(factor)
            )

        def dim_of(turns: float) -> float:
            """The (fractional) dim index that turns ``turns`` times over ``original``."""
            return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(p.get("beta_fast", 32)), dim_of(p.get("beta_slow", 1))
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        dims = torch.arange(d // 2, dtype=torch.float32, device="cpu")
        ramp = ((dims - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp  # weight of the unscaled frequency
        interpolated = 1.0 / (factor * base_freq)
        inv_freq = interpolated * (1 - extrapolated) + inv_freq * extrapolated
        return inv_freq, float(attention_factor)
    return inv_freq, 1.0


def softmax_scale(config: GlmMoeDsaConfig) -> float:
    """The attention's score scale: ``qk_head_dim ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` where a scaled RoPE sets ``mscale_all_dim`` (DeepSeek's
    YaRN; transformers' ``yarn_apply_mscale``)."""
    p = config.rope_scaling
    scale = config.qk_head_dim**-0.5
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        scale *= _yarn_mscale(p["factor"], p["mscale_all_dim"]) ** 2
    return scale


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, d/2]`` fp32 at ``positions [T]`` for ``inv_freq [d/2]`` fp32
    (:func:`rope_frequencies`), both times ``attention_factor``."""
    # Non-blocking: a blocking copy of the cpu inv_freq would wait for the device's queue.
    freq = inv_freq.to(positions.device, non_blocking=True)
    angles = positions.float()[:, None] * freq[None, :]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor
