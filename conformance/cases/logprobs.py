"""Cases of ``token_logprobs``: GLM-5's vocabulary, T=1, extreme temperatures, ids past
2**16 and partial vocabulary tiles.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .base import FLOATS, WIDE_ID, Case, per_dtype, randn


def logprob_cases() -> Iterator[Case]:
    for name, family, (t, d, v), temp, full in [
        ("tiny", "tiny", (6, 32, 100), 1.0, False),
        ("glm5_reduced", "glm5", (16, 256, 32768), 0.7, False),
        ("glm5_vocab", "glm5", (8, 512, 154880), 1.0, True),
        ("t1", "edge", (1, 32, 50), 0.6, False),
    ]:
        for dtype in FLOATS:
            yield Case(
                "token_logprobs",
                name,
                family,
                dtype,
                build=lambda g, t=t, d=d, v=v, temp=temp, dtype=dtype: (
                    randn(g, t, d, dtype=dtype),
                    randn(g, v, d, scale=d**-0.5, dtype=dtype),
                    torch.randint(0, v, (t,), generator=g),
                    temp,
                ),
                params=(("d", d), ("t", t), ("temperature", temp), ("v", v)),
                judge="logprobs",
                full_only=full,
            )
    yield from _logprob_temperature_cases()
    yield from _logprob_hard_cases()


def _logprob_hard_cases() -> Iterator[Case]:
    """``token_logprobs`` with vocabulary ids past 2**16 (int64 and int32 targets), a
    partial last vocabulary tile (17,384 = 16,384 + 1,000 = 4 x 4,096 + 1,000), and
    LM-sized logits (``lm_logits``: a spread of 8-10, so the largest are 30-40, as a
    language model's are) on ragged vocabularies, where logits rounded to bf16 / fp16
    before the log-softmax are off by 0.01-0.1 nats. Half of the targets are the most
    likely token."""
    hard = [
        ("vocab_2e17", "ids", (4, 8, 2**17 + 100), 1.0, 1.0, "int64", (torch.bfloat16,)),
        ("vocab_2e17_int32", "ids", (4, 8, 2**17 + 100), 1.0, 1.0, "int32", (torch.bfloat16,)),
        ("tail_vocab", "tail", (40, 288, 16384 + 1000), 1.0, 1.0, "int64", FLOATS),
        ("lm_logits", "lm_logits", (24, 128, 5003), 10.0, 1.0, "int64", FLOATS),
        ("lm_logits_t07", "lm_logits", (24, 256, 12289), 8.0, 0.7, "int32", FLOATS),
        ("lm_logits_glm5", "lm_logits", (8, 512, 154880), 10.0, 1.0, "int64", ()),
    ]
    for name, family, (t, d, v), spread, temp, index_dtype, quick in hard:

        def build(g, dtype, t=t, d=d, v=v, spread=spread, temp=temp, index_dtype=index_dtype):
            hidden = randn(g, t, d, dtype=dtype, scale=spread)
            lm_head = randn(g, v, d, scale=d**-0.5, dtype=dtype)
            best = (hidden.double() @ lm_head.double().T).argmax(dim=1)
            if v > WIDE_ID:  # the other half past 2**16
                other = torch.randint(WIDE_ID, v, (t,), generator=g)
            else:
                other = torch.randint(0, v, (t,), generator=g)
            targets = torch.where(torch.arange(t) % 2 == 0, best, other)
            return hidden, lm_head, targets.to(getattr(torch, index_dtype)), temp

        params = {"d": d, "t": t, "temperature": temp, "v": v, "logit_spread": spread}
        for dtype in FLOATS:
            yield from per_dtype(
                "token_logprobs", name, family, params, build, dtypes=(dtype,),
                judge="logprobs", full_only=dtype not in quick,
            )  # fmt: skip


# Temperatures 1e-6 .. 1e6: near 0 the logits' float32 rounding is magnified by
# 1 / temperature (a target's logit one ulp above the max was once a log-probability of
# +1.43), near infinity every distribution is uniform.
LOGPROB_TEMPERATURES = (1e-6, 1e-3, 1e3, 1e6)


def _logprob_temperature_cases() -> Iterator[Case]:
    """``token_logprobs`` at extreme temperatures on a 500-token vocabulary; half of
    the targets are each token's most likely one (its log-probability is about 0 at a
    small temperature, where a rounding error shows as a positive value)."""
    t, d, v = 8, 32, 500
    for temp in LOGPROB_TEMPERATURES:

        def build(g, dtype, temp=temp):
            hidden = randn(g, t, d, dtype=dtype)
            lm_head = randn(g, v, d, scale=d**-0.5, dtype=dtype)
            best = (hidden.double() @ lm_head.double().T).argmax(dim=1)
            targets = torch.where(
                torch.arange(t) % 2 == 0, best, torch.randint(0, v, (t,), generator=g)
            )
            return hidden, lm_head, targets, temp

        yield from per_dtype(
            "token_logprobs",
            f"temperature_{temp:g}",
            "edge",
            {"d": d, "t": t, "temperature": temp, "v": v},
            build,
            judge="logprobs",
        )
