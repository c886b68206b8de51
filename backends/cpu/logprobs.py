"""Reference token log-probabilities: the full logits matrix, in the compute dtype."""

from __future__ import annotations

import torch

from .precision import acc_dtype, out_dtype


def token_logprobs(hidden, lm_head, targets, temperature=1.0):
    acc = acc_dtype()
    logits = (hidden.to(acc) @ lm_head.to(acc).T) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets.long()[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    dtype = out_dtype(torch.float32)
    return logp.to(dtype), entropy.to(dtype)
