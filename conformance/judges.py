"""How an op's outputs are judged against the float64 reference.

Each judge takes the case's arguments, the backend's outputs and the reference's
outputs (float64 where floating) and returns a :class:`Verdict`. Tolerances come
from :mod:`glmport.core.tolerance`, keyed by op and dtype, never by vendor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from glmport.core.formats import FLOAT_WEIGHT, FP8_DTYPE, dequantize_weight
from glmport.core.tolerance import LOGPROB_ULPS, Tolerance, compare, tolerance

from .paging import packed_indexer_call

FP32_EPS = float(torch.finfo(torch.float32).eps)


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _tol_dict(tol: Tolerance, **extra: float) -> dict[str, float]:
    return {"max_rel": tol.max_rel, "mean_rel": tol.mean_rel, **extra}


def close(op, dtype, args, outs, refs) -> Verdict:
    """Floating outputs within the dtype's relative tolerance (``-inf`` must match
    exactly); integer outputs equal."""
    tol = tolerance(op, dtype)
    worst = {"max_rel": 0.0, "mean_rel": 0.0}
    for i, (o, r) in enumerate(zip(_tuple(outs), _tuple(refs), strict=True)):
        if tuple(o.shape) != tuple(r.shape):
            return Verdict(False, f"output {i} has shape {list(o.shape)}, expected {list(r.shape)}")
        if not o.is_floating_point():
            if not torch.equal(o.long(), r.long()):
                bad = int((o.long() != r.long()).sum())
                return Verdict(False, f"integer output {i} differs in {bad} of {o.numel()} entries")
            continue
        cmp = compare(o, r, tol)
        worst = {k: max(worst[k], getattr(cmp, k)) for k in worst}
        if not cmp.ok:
            return Verdict(
                False,
                f"output {i}: max|err|/max|ref| {cmp.max_rel:.3g}, mean {cmp.mean_rel:.3g} "
                f"(tolerance {tol.max_rel:.3g} / {tol.mean_rel:.3g}; inf/nan must match)",
                {"max_rel": cmp.max_rel, "mean_rel": cmp.mean_rel},
                _tol_dict(tol),
            )
    return Verdict(True, "", worst, _tol_dict(tol))


def exact(op, dtype, args, outs, refs) -> Verdict:
    """Every output bit-identical in value (a permutation copies, it does not round)."""
    for i, (o, r) in enumerate(zip(_tuple(outs), _tuple(refs), strict=True)):
        if tuple(o.shape) != tuple(r.shape) or not torch.equal(o.double(), r.double()):
            return Verdict(False, f"output {i} is not identical to the reference")
    return Verdict(True, "", {"max_rel": 0.0})


def gemm(op, dtype, args, outs, refs) -> Verdict:
    """Relative tolerance plus an absolute term for float32 summation over the reduction
    length: ``eps32 * K * mean|x| * mean|w|`` (the forward error bound of a dot product)."""
    x, w = args[0], args[1]
    w_scale, scheme = args[2 if op == "quant_gemm" else 3], args[3 if op == "quant_gemm" else 4]
    k = x.shape[1]
    if scheme == FLOAT_WEIGHT:
        wf = w.double()
    elif w.dim() == 3:
        gs = args[5]
        wf = torch.stack(
            [
                dequantize_weight(w[e], None if w_scale is None else w_scale[e], scheme, gs)
                for e in range(w.shape[0])
            ]
        )
    else:
        wf = dequantize_weight(w, w_scale, scheme, args[4])
    tol = tolerance(op, dtype)
    (o,), (r,) = _tuple(outs), _tuple(refs)
    if tuple(o.shape) != tuple(r.shape):
        return Verdict(False, f"output has shape {list(o.shape)}, expected {list(r.shape)}")
    if r.numel() == 0:  # M = 0 or N = 0: the shape is all there is to judge
        return Verdict(True, "", {"max_rel": 0.0, "max_abs": 0.0}, _tol_dict(tol))
    # The mean of an empty operand (K = 0) is NaN, which would pass any output: there
    # is no summation, so no summation error either.
    mean_x = float(x.double().abs().mean()) if x.numel() else 0.0
    mean_w = float(wf.double().abs().mean()) if wf.numel() else 0.0
    atol = FP32_EPS * k * mean_x * mean_w
    if not torch.isfinite(o).all():
        return Verdict(False, "output has non-finite values")
    err = (o.double() - r.double()).abs()
    scale = float(r.double().abs().max().clamp_min(1e-30))
    max_rel = float(err.max()) / scale if err.numel() else 0.0
    bound = tol.max_rel * scale + atol
    metrics = {"max_rel": max_rel, "max_abs": float(err.max()) if err.numel() else 0.0}
    # The one criterion, under the metric's name: max|err| <= the combined bound.
    tol_d = {"max_abs": bound, "rel_term": tol.max_rel, "abs_term": atol}
    if err.numel() and float(err.max()) > bound:
        return Verdict(
            False,
            f"max|err| {float(err.max()):.3g} > {bound:.3g} "
            f"(rel {tol.max_rel:.3g} of max|ref| + K-scaled {atol:.3g})",
            metrics,
            tol_d,
        )
    return Verdict(True, "", metrics, tol_d)


def quantize(op, dtype, args, outs, refs) -> Verdict:
    """Codes and scales bit-exact (fp8 codes compared as bytes, scales as float32
    bits): the formats define both in float32 (``amax / qmax`` with the amax floored,
    powers of two for ``_pow2``), so a scale one ulp off, or 0 where the floor gives
    7.9e-15, is a different format, whatever its relative size."""
    (q, s), (rq, rs) = outs, refs
    if q.dtype != rq.dtype or tuple(q.shape) != tuple(rq.shape):
        return Verdict(
            False, f"codes are {q.dtype} {list(q.shape)}, expected {rq.dtype} {list(rq.shape)}"
        )
    as_bits = (lambda t: t.view(torch.uint8)) if q.dtype == FP8_DTYPE else (lambda t: t)
    bad = int((as_bits(q) != as_bits(rq)).sum())
    if bad:
        return Verdict(
            False,
            f"{bad} of {q.numel()} codes differ from the canonical format",
            {"codes_differ": bad},
        )
    if s.dtype != torch.float32 or tuple(s.shape) != tuple(rs.shape):
        return Verdict(
            False, f"scales are {s.dtype} {list(s.shape)}, expected float32 {list(rs.shape)}"
        )
    s_bits, r_bits = s.contiguous().view(torch.int32), rs.float().contiguous().view(torch.int32)
    differ = s_bits != r_bits
    if differ.any():
        i = int(differ.reshape(-1).nonzero()[0, 0])
        got, want = float(s.reshape(-1)[i]), float(rs.reshape(-1)[i])
        return Verdict(
            False,
            f"{int(differ.sum())} of {s.numel()} scales differ from the format's "
            f"(first: scale[{i}] = {got:.9g}, expected {want:.9g})",
            {"codes_differ": 0, "scales_differ": int(differ.sum())},
            {"scales_differ": 0},
        )
    return Verdict(True, "", {"codes_differ": 0, "scales_differ": 0}, {"scales_differ": 0})


def identical_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64 labels of the rows of ``rows`` (``[R, ...]``, 2-D or more, any
    dtype): rows with the same bytes share a label ``>= 0``; a row equal to no other
    gets ``-1``. A hash
    of the bytes finds the candidates, an exact comparison of those decides."""
    r = rows.shape[0]
    raw = rows.detach().cpu().flatten(1).contiguous().view(torch.uint8).long()
    labels = torch.full((r,), -1, dtype=torch.long)
    if r < 2 or raw.shape[1] == 0:
        return labels if raw.shape[1] else torch.zeros(r, dtype=torch.long)
    mult = torch.randint(1, 2**40, (raw.shape[1],), generator=torch.Generator().manual_seed(0))
    hashes = (raw * mult).sum(dim=1)  # < 2**63: 255 * 2**40 per byte, < 2**12 bytes
    _, inverse, counts = torch.unique(hashes, return_inverse=True, return_counts=True)
    candidates = (counts[inverse] > 1).nonzero()[:, 0]
    if candidates.numel():
        _, group, sizes = torch.unique(
            raw[candidates], dim=0, return_inverse=True, return_counts=True
        )
        labels[candidates] = torch.where(sizes[group] > 1, group, -1)
    return labels


# The label of the keys that score exactly 0 for a query (:func:`_exact_ties`).
ZERO_SCORE = -2


def _exact_ties(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What makes two indexer keys tie exactly on every backend, whatever its
    precision: keys with the same bytes (and the same ``k_scale`` for fp8) score the
    same for every query; and a key each of whose products ``q[t, h, d] * k[s, d]`` is
    ``<= 0`` scores exactly 0 for query ``t`` (every dot product is a sum of non-positive
    terms in any rounding, its ReLU 0). Returns the keys' row labels
    (:func:`identical_rows`) and ``[T, D]`` masks of the dims where some head of each
    query is positive / negative (:func:`_zero_keys` reads them)."""
    q, k, k_scale = args[0], args[1], args[7] if len(args) > 7 else None
    rows = k.flatten(1)
    if k_scale is not None:  # fp8: the code bytes and the key's scale
        scale_bytes = k_scale.float().reshape(-1, 1).view(torch.uint8)
        rows = torch.cat((rows.view(torch.uint8), scale_bytes), dim=1)
    qf = q.float()
    return identical_rows(rows), (qf > 0).any(dim=1), (qf < 0).any(dim=1)


def _zero_keys(k: torch.Tensor, q_pos: torch.Tensor, q_neg: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the keys of ``k`` (``[N, D]``, a slice) that score exactly 0 for a
    query whose heads are positive at ``q_pos`` / negative at ``q_neg`` (``[D]``)."""
    kf = k.float()
    same_sign = (kf > 0).float() @ q_pos.float() + (kf < 0).float() @ q_neg.float()
    return same_sign == 0


def _tie_order_error(t, chosen, lo, labels, zero) -> str:
    """Why query ``t``'s ``chosen`` slots (in output order) break the lower-slot rule
    among the exactly tied keys of its range ``[lo, lo + len(labels))`` ("" if not):
    of each class (equal ``labels`` >= 0, or ``zero``) the chosen must be its lowest
    slots, in ascending order."""
    lab = torch.where(zero, ZERO_SCORE, labels)
    picked = lab[chosen - lo]
    for c in picked[picked != -1].unique().tolist():
        members = (lab == c).nonzero()[:, 0] + lo
        mine = chosen[picked == c]
        what = "scoring exactly 0 (ReLU zeros)" if c == ZERO_SCORE else "with identical keys"
        if not torch.equal(mine.sort().values, members[: mine.numel()]):
            skipped = int(members[~torch.isin(members, mine)][0])
            return (
                f"query {t}: of the keys {what}, chose slot {int(mine.max())} over the lower "
                f"slot {skipped}: exact ties go to the lower slot"
            )
        if (mine[1:] < mine[:-1]).any():
            return (
                f"query {t}: keys {what} are not in ascending slot order "
                f"({mine.tolist()[:8]}): exact ties go to the lower slot first"
            )
    return ""


def _ranked_by_reference(idx: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx [T, K]`` (any order, ``-1`` anywhere) with the reference's scores of its
    keys, each row best first, the lower slot first among equal scores, ``-1`` last."""
    i = idx.long().cpu()
    scores = torch.where(i >= 0, ref.gather(1, i.clamp_min(0)), float("-inf"))
    by_slot = torch.where(i >= 0, i, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
    i, scores = i.gather(1, by_slot), scores.gather(1, by_slot)
    best = scores.argsort(dim=1, descending=True, stable=True)
    return i.gather(1, best), scores.gather(1, best)


def indexer(op, dtype, args, outs, refs) -> Verdict:
    """Tie-safe top-k: valid, unique, in-range indices, ``-1`` exactly when fewer keys
    are valid; every chosen key scores at least the reference's k-th best (minus the
    tolerance) and every key scoring above it by more than twice the tolerance is
    chosen (beyond the score error of both, no order of near-ties could drop it);
    returned scores close to the reference scores of the chosen keys. Where scores
    tie exactly on every backend (identical keys, ReLU zeros: :func:`_exact_ties`)
    the documented order is required: the lower slot wins and comes first.
    ``refs`` here is the reference's full ``[T, N]`` score matrix (of the packed
    equivalent of a paged call, :mod:`~glmport.conformance.paging`, which is judged so).
    Without ``need_scores`` the scores must be ``[0]``, a row's order is free, and the
    chosen keys are ranked by the reference's scores before the same checks."""
    (idx, sc), ref = outs, refs
    need_scores = args[9] if len(args) > 9 else True
    if len(args) > 8 and args[8] is not None:
        packed = packed_indexer_call(args)
        args, idx = packed.args, packed.to_packed(idx)
    if not need_scores:
        if sc.numel():
            return Verdict(False, f"scores are {list(sc.shape)}: [0] expected without need_scores")
        idx, sc = _ranked_by_reference(idx, ref)
    k_start, k_end, topk = args[3].long(), args[4].long(), args[5]
    labels, q_pos, q_neg = _exact_ties(args)
    tol = tolerance(op, dtype)
    finite = ref[torch.isfinite(ref)]
    # Errors are relative to the largest finite score; when every one is 0 (or none is
    # finite) they are absolute, as a relative error to 0 is undefined.
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    scale = scale or 1.0
    slack = tol.max_rel * scale
    idx, sc = idx.long().cpu(), sc.double().cpu()
    if tuple(idx.shape) != (ref.shape[0], topk) or tuple(sc.shape) != (ref.shape[0], topk):
        return Verdict(
            False,
            f"outputs have shapes {list(idx.shape)} / {list(sc.shape)}, "
            f"expected [{ref.shape[0]}, {topk}]",
        )
    worst = 0.0
    for t in range(ref.shape[0]):
        count = min(topk, int(k_end[t] - k_start[t]))
        chosen, pad = idx[t, :count], idx[t, count:]
        if (pad != -1).any() or (sc[t, count:] != float("-inf")).any():
            return Verdict(False, f"query {t}: expected -1 / -inf after {count} valid keys")
        if (chosen == -1).any():
            slot = int((chosen == -1).nonzero()[0, 0])
            return Verdict(
                False,
                f"query {t}: slot {slot} is -1, a missing key: {count} valid keys expected "
                f"(min(topk, range length) of [{int(k_start[t])}, {int(k_end[t])}))",
            )
        if ((chosen < k_start[t]) | (chosen >= k_end[t])).any():
            return Verdict(
                False, f"query {t}: an index outside [{int(k_start[t])}, {int(k_end[t])})"
            )
        if chosen.unique().numel() != count:
            return Verdict(False, f"query {t}: repeated indices")
        if count == 0:
            continue
        kth = torch.sort(ref[t], descending=True).values[count - 1]
        got = ref[t, chosen]
        if (got < kth - slack).any():
            return Verdict(
                False,
                f"query {t}: chose a key scoring {float(got.min()):.4g} "
                f"below the k-th best {float(kth):.4g}",
            )
        clear = (ref[t] > kth + 2 * slack).nonzero()[:, 0]
        missed = clear[~torch.isin(clear, chosen)]
        if missed.numel():
            j = int(missed[0])
            return Verdict(
                False,
                f"query {t}: key {j} (score {float(ref[t, j]):.4g}, clearly above the k-th "
                f"best {float(kth):.4g}) was not chosen",
            )
        err = float((sc[t, :count] - got).abs().max()) / scale
        worst = max(worst, err)
        if err > tol.max_rel:
            return Verdict(
                False,
                f"query {t}: scores off by {err:.3g} of max|score| (tolerance {tol.max_rel:.3g})",
                {"max_rel": err},
                _tol_dict(tol),
            )
        if (sc[t, 1:count] > sc[t, : count - 1] + slack).any():
            return Verdict(False, f"query {t}: indices are not ordered best first")
        lo, hi = int(k_start[t]), int(k_end[t])
        zero = _zero_keys(args[1][lo:hi].flatten(1), q_pos[t], q_neg[t])
        tie_error = _tie_order_error(t, chosen, lo, labels[lo:hi], zero)
        if tie_error:
            return Verdict(False, tie_error, {"max_rel": worst}, _tol_dict(tol))
    return Verdict(True, "", {"max_rel": worst}, _tol_dict(tol))


def logprob_bounds(args) -> torch.Tensor:
    """``[T]`` float64: the per-token error bound in nats of ``token_logprobs`` (logp
    and entropy), ``LOGPROB_ULPS * eps32 * (A_t / temperature + log V + 1)`` with
    ``A_t = max_v sum_d |hidden[t, d] * lm_head[v, d]|`` (core/tolerance.py): what
    float32 logits leave, whatever the input dtype."""
    hidden, lm_head, _, temperature = args
    a = (hidden.double().abs() @ lm_head.double().abs().T).amax(dim=1) if lm_head.shape[0] else 0
    log_v = math.log(max(lm_head.shape[0], 1))
    return LOGPROB_ULPS * FP32_EPS * (a / temperature + log_v + 1)


def logprobs(op, dtype, args, outs, refs) -> Verdict:
    """``token_logprobs``: ``logp <= 0`` and ``entropy >= 0`` everywhere (a relative
    judge cannot see ``logp = +1.4`` beside a ``-1e5`` at a small temperature); NaN
    nowhere, infinities where the reference has them; and every token's logp and
    entropy within its bound in nats (:func:`logprob_bounds`: so each token's
    probability ratio ``exp(delta)`` lies within ``exp(+-bound)``), whatever the input
    dtype. The bound is what float32 logits leave: logits rounded to bf16 / fp16 before
    the log-softmax exceed it by 10-100x at LM-sized logits. (A relative bound would
    not do: a float32 entropy near 0 is off by ``eps32 * max|z|``, at LM-sized logits
    far more than a relative error of the entropy allows, while a bf16 tolerance
    relative to ``max|logp|`` lets 0.15 nats through.)"""
    logp, entropy = outs
    for name, bad, sign in (("logp", logp > 0, "> 0"), ("entropy", entropy < 0, "< 0")):
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            value = float((logp if name == "logp" else entropy)[i])
            return Verdict(False, f"{name}[{i}] = {value:.4g} {sign}, which no distribution has")
    bound = logprob_bounds(args)
    metrics: dict[str, float] = {}
    limits = {"logp_bound_frac": 1.0, "entropy_bound_frac": 1.0}
    for i, (name, o, r) in enumerate(zip(("logp", "entropy"), outs, refs, strict=True)):
        if tuple(o.shape) != tuple(r.shape):
            return Verdict(False, f"output {i} has shape {list(o.shape)}, expected {list(r.shape)}")
        o, r = o.double().cpu(), r.double().cpu()
        finite = torch.isfinite(r)
        if torch.isnan(o).any() or not torch.equal(finite, torch.isfinite(o)):
            return Verdict(False, f"{name}: NaN, or infinities where the reference has none")
        if not torch.equal(o[~finite], r[~finite]):
            return Verdict(False, f"{name}: infinities of the wrong sign")
        err = torch.where(finite, o - r, 0.0).abs()
        frac = err / bound
        metrics[f"{name}_bound_frac"] = float(frac.max()) if frac.numel() else 0.0
        metrics[f"max_abs_d{name}"] = float(err.max()) if err.numel() else 0.0
        if frac.numel() and bool((frac > 1).any()):
            t = int(frac.argmax())
            return Verdict(
                False,
                f"{name}[{t}] off by {float(err[t]):.3g} nats (a probability ratio of "
                f"exp({float(err[t]):.3g})), beyond its bound {float(bound[t]):.3g} nats "
                f"({LOGPROB_ULPS:g} float32 ulps of the logits' magnitude / temperature): "
                "logits rounded below float32?",
                metrics,
                limits,
            )
    return Verdict(True, "", metrics, limits)


def _expert_tie_error(logits, bias, ids, n_group: int) -> str:
    """Why the router's ``ids`` (``[T, top_k]``, output order) break the lower-id rule
    among experts that tie exactly on every backend ("" if not): two experts of one
    group with the same logit bits for a token and the same bias bits have equal
    choice scores in any arithmetic, so the lower id must be chosen whenever the
    higher is, and come first."""
    t, e = logits.shape
    bits = logits.float().contiguous().view(torch.int32)
    same = bits[:, :, None] == bits[:, None, :]  # [T, E, E]: i, j
    if bias is not None:
        b = bias.float().contiguous().view(torch.int32)
        same &= (b[:, None] == b[None, :])[None]
    group = torch.arange(e) // (e // n_group)
    lower = torch.arange(e)[:, None] < torch.arange(e)[None, :]
    same &= (lower & (group[:, None] == group[None, :]))[None]
    top_k = ids.shape[1]
    position = torch.full((t, e), top_k, dtype=torch.long)  # top_k: not chosen
    position.scatter_(1, ids, torch.arange(top_k).expand(t, top_k))
    # i before j chosen: i must be chosen, at an earlier position.
    bad = same & (position[:, None, :] < top_k) & (position[:, :, None] > position[:, None, :])
    if not bad.any():
        return ""
    tok, i, j = (int(v) for v in bad.nonzero()[0])
    where = "not chosen" if position[tok, i] == top_k else f"at position {int(position[tok, i])}"
    return (
        f"token {tok}: experts {i} and {j} tie exactly (equal logits and biases); {j} is "
        f"at position {int(position[tok, j])}, {i} {where}: equal scores go to the lower id"
    )


def gate(op, dtype, args, outs, refs) -> Verdict:
    """Tie-safe routing: the chosen experts' choice scores match the reference's
    choice scores as sorted vectors (tie-swaps allowed), ids unique and in range, and
    the weights equal the documented formula on the backend's own choice."""
    logits, bias, top_k, _, _, scaling, norm, score_func = args
    (w, ids), (_, ref_ids) = outs, refs
    lf = logits.double()
    s = torch.sigmoid(lf) if score_func == "sigmoid" else torch.softmax(lf, dim=-1)
    choice = s if bias is None else s + bias.double()
    ids = ids.long().cpu()
    if tuple(ids.shape) != tuple(ref_ids.shape):
        return Verdict(False, f"ids have shape {list(ids.shape)}, expected {list(ref_ids.shape)}")
    if ((ids < 0) | (ids >= logits.shape[1])).any():
        return Verdict(False, "an expert id out of range")
    if any(row.unique().numel() != top_k for row in ids):
        return Verdict(False, "an expert chosen twice for one token")
    tol = tolerance(op, dtype)
    if ids.numel() == 0:  # no token (T = 0) or top_k = 0: only the shapes to judge
        if tuple(w.shape) != tuple(ids.shape):
            return Verdict(False, f"weights have shape {list(w.shape)}, expected {list(ids.shape)}")
        return Verdict(True, "", {"max_rel": 0.0}, _tol_dict(tol))
    mine = torch.sort(choice.gather(1, ids), dim=1).values
    theirs = torch.sort(choice.gather(1, ref_ids.long()), dim=1).values
    if ((mine - theirs).abs() > tol.max_rel * float(choice.abs().max())).any():
        return Verdict(False, "chose different experts than the reference (beyond ties)")
    tie_error = _expert_tie_error(logits, bias, ids, args[3])
    if tie_error:
        return Verdict(False, tie_error)
    want = s.gather(1, ids)
    if norm:
        want = want / (want.sum(dim=-1, keepdim=True) + 1e-20)
    want = want * scaling
    cmp = compare(w.double().cpu(), want, tol)
    if not cmp.ok:
        return Verdict(
            False,
            f"weights off by {cmp.max_rel:.3g} (tolerance {tol.max_rel:.3g})",
            {"max_rel": cmp.max_rel},
            _tol_dict(tol),
        )
    return Verdict(True, "", {"max_rel": cmp.max_rel}, _tol_dict(tol))


JUDGES = {
    "close": close,
    "logits": close,
    "exact": exact,
    "gemm": gemm,
    "quantize": quantize,
    "indexer": indexer,
    "gate": gate,
    "logprobs": logprobs,
}
# The judge of each op's calls (the suite's cases name theirs; ``glmport diff`` judges a
# recorded call with its op's). Ops not listed: "close".
JUDGE_OF_OP = {
    "lightning_indexer": "indexer",
    "indexer_logits": "logits",
    "moe_gate": "gate",
    "moe_dispatch": "exact",
    "grouped_gemm": "gemm",
    "quant_gemm": "gemm",
    "quantize": "quantize",
    "token_logprobs": "logprobs",
}
