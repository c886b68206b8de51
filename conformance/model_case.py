"""The model-level check: token log-probabilities of a tiny GLM-5 on the backend
against the cpu reference — the train / inference mismatch that RL has to correct.

Reports mean and max ``|delta logp|`` and the fraction of tokens IcePop would pop at
``beta = 2`` (``rho = exp(logp_backend - logp_ref)`` outside ``[1/beta, beta]``).
"""

from __future__ import annotations

import torch

import glmport
from glmport.core.selection import use_backend

from .judges import Verdict

ICEPOP_BETA = 2.0
# fp32 must agree to rounding; in bf16, backends may differ up to slime's CI bound on
# mean |logp_train - logp_rollout| (0.1) with at most 1% of tokens popped.
LIMITS = {
    torch.float32: {"max_abs": 1e-3, "mean_abs": 1e-4, "pop_fraction": 0.0},
    torch.bfloat16: {"max_abs": float("inf"), "mean_abs": 0.1, "pop_fraction": 0.01},
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 128, (2, 40), generator=gen)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 28:] = 0
    return ids, mask


def _model():
    from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_config(GlmMoeDsaConfig.tiny(index_n_heads=16), seed=0)
    with torch.no_grad():  # std 0.16 instead of 0.02: peaked distributions, real mismatch
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


def _logprobs(model, ids, mask) -> torch.Tensor:
    """``[n]`` fp32 log-probabilities of every real next token."""
    with torch.no_grad():
        out = model(ids, mask)
        valid = mask.bool()
        targets_mask = valid[:, 1:] & valid[:, :-1]
        hidden = model.model.norm(out.hidden_states[:, :-1][targets_mask])
        targets = ids[:, 1:][targets_mask]
        logp, _ = glmport.ops.token_logprobs(hidden, model.lm_head.weight.to(hidden.dtype), targets)
    return logp.float().cpu()


def run_model_check(dtype: torch.dtype, backend: str, device: torch.device) -> Verdict:
    model = _model().to(dtype)
    ids, mask = _inputs()
    with use_backend("cpu"):  # the same weights in the same precision: only the backend differs
        ref = _logprobs(model, ids, mask)
    model = model.to(device=device)
    with use_backend(backend):
        got = _logprobs(model, ids.to(device), mask.to(device))
    delta = got - ref
    rho = torch.exp(delta)
    popped = ((rho < 1 / ICEPOP_BETA) | (rho > ICEPOP_BETA)).float().mean()
    metrics = {
        "mean_abs_dlogp": float(delta.abs().mean()),
        "max_abs_dlogp": float(delta.abs().max()),
        "icepop_pop_fraction": float(popped),
        "tokens": int(delta.numel()),
    }
    limits = LIMITS[dtype]
    tol = {
        "max_abs_dlogp": limits["max_abs"],
        "mean_abs_dlogp": limits["mean_abs"],
        "icepop_pop_fraction": limits["pop_fraction"],
    }
    bad = [k for k, v in tol.items() if metrics[k] > v]
    reason = ", ".join(f"{k} {metrics[k]:.3g} > {tol[k]:.3g}" for k in bad)
    return Verdict(not bad, reason, metrics, tol)
