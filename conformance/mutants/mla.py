"""mla_prolog mutants.

mla_prolog: (x [T, hidden], w_dq [q_lora, hidden], gamma_cq [q_lora], w_uq [H * (nope +
rope), q_lora], w_uk [H, nope, kv_lora], w_dkv [kv_lora + rope, hidden], gamma_ckv
[kv_lora], cos / sin [T, rope / 2] float32, eps, and W8A8's w_dq_scale / w_uq_scale /
w_dkv_scale [rows] or None) -> (q_latent, q_rope, q_norm, kv_latent, k_rope)
"""

from __future__ import annotations

import torch

from .base import add, ones_if_given, replace_args

# (name, kind, what breaks, the family that kills it, the mutation)
_SIMPLE = (
    ("query_gain_ignored", "formula", "never multiplies the query latent by gamma_cq", "tiny",
     replace_args("mla_prolog", gamma_cq=torch.ones_like)),
    ("key_gain_ignored", "formula",
     "normalises the key latent with a gain of 1 (gamma_ckv dropped)", "tiny",
     replace_args("mla_prolog", gamma_ckv=torch.ones_like)),
    ("rotation_reversed", "formula", "rotates the other way (sin negated)", "tiny",
     replace_args("mla_prolog", sin=torch.neg)),
    ("heads_reversed_in_absorption", "layout",
     "absorbs head h's query with head H - 1 - h's W_UK", "tiny",
     replace_args("mla_prolog", w_uk=lambda w: w.flip(0))),
    ("w8a8_channel_scales_ignored", "formula",
     "drops the query up-projection's per-channel weight scales (W8A8)", "tiny",
     replace_args("mla_prolog", w_uq_scale=ones_if_given)),
    ("w8a8_scales_swapped", "layout",
     "reads the key down-projection's scales in reverse row order (W8A8)", "tiny",
     replace_args("mla_prolog", w_dkv_scale=lambda s: None if s is None else s.flip(0))),
)  # fmt: skip
for _name, _kind, _breaks, _needs, _wrap in _SIMPLE:
    add("mla_prolog", _name, _kind, _breaks, _needs, _wrap)
