"""Reference token log-probabilities: the full logits matrix, in the compute dtype."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def token_logprobs(hidden, lm_head, targets, temperature=1.0):
    acc = acc_dtype()
    dtype = out_dtype(torch.float32)
    t, v = hidden.shape[0], lm_head.shape[0]
    if v == 0:  # no vocabulary: no target is a token and there is nothing to normalise
        nan = torch.full((t,), float("nan"), dtype=dtype, device=hidden.device)
        return nan, nan.clone()
    logits = (hidden.to(acc) @ lm_head.to(acc).T) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    # A target outside [0, V) (unchecked under GLMPORT_VALIDATE=meta) is no token: NaN.
    valid = (targets >= 0) & (targets < v)
    picked = logp_all.gather(1, torch.where(valid, targets, 0).long()[:, None]).squeeze(1)
    logp = torch.where(valid, picked, float("nan"))
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp.to(dtype), entropy.to(dtype)
