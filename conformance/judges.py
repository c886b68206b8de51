"""How an op's outputs are judged against the float64 reference.

Each judge takes the case's arguments, the backend's outputs and the reference's
outputs (float64 where floating) and returns a :class:`Verdict`. Tolerances come
from :mod:`glmport.core.tolerance`, keyed by op and dtype, never by vendor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmport.core.formats import FLOAT_WEIGHT, FP8_DTYPE, dequantize_weight
from glmport.core.tolerance import Tolerance, compare, tolerance

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
    """Codes bit-exact (fp8 compared as bytes), scales equal: the formats are definitions."""
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
    cmp = compare(s, rs, Tolerance(1e-6, 1e-7))
    if not cmp.ok:
        return Verdict(False, f"scales differ: rel {cmp.max_rel:.3g}", {"scale_rel": cmp.max_rel})
    return Verdict(True, "", {"codes_differ": 0, "scale_rel": cmp.max_rel})


def indexer(op, dtype, args, outs, refs) -> Verdict:
    """Tie-safe top-k: valid, unique, in-range indices, ``-1`` exactly when fewer keys
    are valid; every chosen key scores at least the reference's k-th best (minus the
    tolerance) and every key scoring above it by more than twice the tolerance is
    chosen (beyond the score error of both, no order of near-ties could drop it);
    returned scores close to the reference scores of the chosen keys.
    ``refs`` here is the reference's full ``[T, N]`` score matrix."""
    (idx, sc), ref = outs, refs
    k_start, k_end, topk = args[3].long(), args[4].long(), args[5]
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
    return Verdict(True, "", {"max_rel": worst}, _tol_dict(tol))


def logprobs(op, dtype, args, outs, refs) -> Verdict:
    """``token_logprobs``: ``logp <= 0`` and ``entropy >= 0`` everywhere (a relative
    judge cannot see ``logp = +1.4`` beside a ``-1e5`` at a small temperature); finite
    wherever the reference is (NaN nowhere); errors relative to ``max(max|ref|, 1
    nat)``: a float32 entropy of a near one-hot distribution is subnormal, and
    ``log(1)`` may round to ``-3e-8``, neither an error worth a nat."""
    logp, entropy = outs
    for name, bad, sign in (("logp", logp > 0, "> 0"), ("entropy", entropy < 0, "< 0")):
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            value = float((logp if name == "logp" else entropy)[i])
            return Verdict(False, f"{name}[{i}] = {value:.4g} {sign}, which no distribution has")
    tol = tolerance(op, dtype)
    worst = {"max_rel": 0.0, "mean_rel": 0.0}
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if tuple(o.shape) != tuple(r.shape):
            return Verdict(False, f"output {i} has shape {list(o.shape)}, expected {list(r.shape)}")
        cmp = compare(o, r, tol, floor=1.0)
        worst = {k: max(worst[k], getattr(cmp, k)) for k in worst}
        if not cmp.ok:
            return Verdict(
                False,
                f"output {i}: max|err|/max(max|ref|, 1) {cmp.max_rel:.3g}, mean "
                f"{cmp.mean_rel:.3g} (tolerance {tol.max_rel:.3g} / {tol.mean_rel:.3g}; "
                "inf/nan must match)",
                {"max_rel": cmp.max_rel, "mean_rel": cmp.mean_rel},
                _tol_dict(tol),
            )
    return Verdict(True, "", worst, _tol_dict(tol))


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
