"""Token log-probabilities with an online log-sum-exp over vocabulary tiles: never a
full fp32 [T, V]. The backward recomputes the tiles the same way."""

from __future__ import annotations

import torch

from .tiling import rows_per_tile

VOCAB_TILE = 16384


def _tiles(hidden, lm_head):
    t, v = hidden.shape[0], lm_head.shape[0]
    vt = min(VOCAB_TILE, max(v, 1))
    return rows_per_tile(4 * vt * 3, t), vt


def _online_stats(h, lm_head, temperature, vt, targets=None):
    """Per token: ``m``, the max raw logit ``h . w`` (before the ``1 / temperature``),
    ``s = sum exp(d)`` and ``u = sum exp(d) d`` with ``d = (h . w - m) / temperature``,
    that is ``z - max z``; with ``targets``, also each target's raw logit, read from
    the same tile products as ``m`` (NaN for a target outside ``[0, V)``).

    The max is subtracted before scaling: at a small temperature ``z`` is large and its
    float32 ulp would swamp ``z - max z``; ``h . w - m`` is exact near the max and the
    division keeps its relative accuracy. The target's logit is an element of the
    tile whose maximum ``m`` is, so ``r_target - m <= 0`` exactly: a separately
    computed dot product may round one ulp above ``m``, which ``1 / temperature``
    magnifies into a positive log-probability.
    """
    rows = h.shape[0]
    m = torch.full((rows,), float("-inf"), device=h.device)
    s = torch.zeros(rows, device=h.device)
    u = torch.zeros(rows, device=h.device)
    r_target = torch.full((rows,), float("nan"), device=h.device)
    for v0 in range(0, lm_head.shape[0], vt):
        r = h @ lm_head[v0 : v0 + vt].float().T
        m_new = torch.maximum(m, r.amax(dim=1))
        shift = (m - m_new) / temperature  # <= 0; -inf before the first tile
        d = (r - m_new[:, None]) / temperature
        e = torch.exp(d)
        decay = torch.exp(shift)
        # ``u`` so far is centred on the old max: move it to the new one (d_old + shift).
        # Terms that decay to 0 move nowhere (always before the first tile, where
        # s = 0 and the shift is -inf; 0 * -inf would be NaN).
        u = torch.where(decay > 0, (u + shift * s) * decay, 0.0) + (e * d).sum(dim=1)
        s = s * decay + e.sum(dim=1)
        m = m_new
        if targets is not None:
            col = targets - v0
            here = (col >= 0) & (col < r.shape[1])
            picked = r.gather(1, col.clamp(0, r.shape[1] - 1).long()[:, None]).squeeze(1)
            r_target = torch.where(here, picked, r_target)
    return m, s, u, r_target


def token_logprobs(hidden, lm_head, targets, temperature=1.0):
    step, vt = _tiles(hidden, lm_head)
    t, v = hidden.shape[0], lm_head.shape[0]
    if v == 0:  # no vocabulary: no target is a token and there is nothing to normalise
        nan = torch.full((t,), float("nan"), device=hidden.device)
        return nan, nan.clone()
    logp = torch.empty(t, device=hidden.device)
    entropy = torch.empty(t, device=hidden.device)
    for t0 in range(0, t, step):
        h = hidden[t0 : t0 + step].float()
        m, s, u, r_target = _online_stats(h, lm_head, temperature, vt, targets[t0 : t0 + step])
        log_s = torch.log(s)  # lse - max z, >= 0: the max's own term is exp(0) = 1
        # logp = z_t - lse = (r_t - m) / temperature - log s <= 0 by construction: the
        # max is subtracted before scaling (a small temperature does not magnify the
        # ulp of a large logit) and r_t is one of the values m is the max of. A target
        # outside [0, V) (unchecked under GLMPORT_VALIDATE=meta) is no token: NaN.
        logp[t0 : t0 + step] = (r_target - m) / temperature - log_s
        # lse - E[z], both relative to max z: log s >= 0 and u <= 0 (every d <= 0).
        entropy[t0 : t0 + step] = log_s - u / s
    return logp, entropy


def token_logprobs_backward(inputs: tuple, grads: tuple) -> tuple:
    """``dz = g_logp (onehot - p) - g_ent p (z - E_p[z])``, then ``dh = dz W / temp`` and
    ``dW = dz^T h / temp``, tile by tile (the statistics are recomputed first)."""
    hidden, lm_head, targets, temperature = inputs
    g_logp, g_ent = (g.float() for g in grads)
    step, vt = _tiles(hidden, lm_head)
    dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    dw = torch.zeros(lm_head.shape, dtype=torch.float32, device=lm_head.device)
    for t0 in range(0, hidden.shape[0], step):
        h = hidden[t0 : t0 + step].float()
        tgt = targets[t0 : t0 + step].long()
        gl, ge = g_logp[t0 : t0 + step, None], g_ent[t0 : t0 + step, None]
        m, s, u, _ = _online_stats(h, lm_head, temperature, vt)
        # Everything relative to max z, as in the forward: d = z - max z.
        log_s, mean_d = torch.log(s)[:, None], (u / s)[:, None]
        for v0 in range(0, lm_head.shape[0], vt):
            w = lm_head[v0 : v0 + vt].float()
            d = (h @ w.T - m[:, None]) / temperature
            p = torch.exp(d - log_s)
            dz = -gl * p - ge * p * (d - mean_d)
            hit = (tgt >= v0) & (tgt < v0 + w.shape[0])
            rows = hit.nonzero().squeeze(1)
            dz[rows, tgt[rows] - v0] += gl[rows, 0]
            dh[t0 : t0 + step] += (dz @ w) / temperature
            dw[v0 : v0 + vt] += (dz.T @ h) / temperature
    return dh.to(hidden.dtype), dw.to(lm_head.dtype), None, None
