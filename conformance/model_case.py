"""The model-level check: token log-probabilities of a tiny GLM-5 on the backend
against the reference backend — the train / inference mismatch that RL has to correct.

The tiny model has every part of GLM-5's forward: MLA + DSA attention, the indexer,
group-limited routing (``n_group`` 4, ``topk_group`` 2, so the router's group step
decides) and the MoE. It runs in three weight variants — float, W4A8 experts + W8A8
projections, W4A8 experts + FP8-block projections (packed once, on the reference; the
backend runs the same packed weights after ``prepare_weights``, as inference does) —
and each batch's log-probs are taken at temperature 1 (training) and at a sampling
temperature (rollout), so a wrong ``quant_gemm`` / ``grouped_gemm``, router groups or
``token_logprobs`` temperature shows here as a log-prob mismatch.

A backend that cannot take a quantised variant (an export runtime without float8)
has that variant reported as not judged, with the reason, and the others judged; one
that cannot take the float variant makes the whole check unsupported.

Reports, per variant and temperature and as the worst over them, mean and max
``|delta logp|`` and the fraction of tokens IcePop would pop at ``beta = 2``
(``rho = exp(logp_backend - logp_ref)`` outside ``[1/beta, beta]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import glmport
from glmport.core.errors import UnsupportedError
from glmport.core.formats import FLOAT_WEIGHT
from glmport.core.registry import REGISTRY
from glmport.core.selection import use_backend

from .judges import Verdict

ICEPOP_BETA = 2.0
# Float weights: fp32 must agree to rounding; in bf16, backends may differ up to slime's
# CI bound on mean |logp_train - logp_rollout| (0.1) with at most 1% of tokens popped.
LIMITS = {
    torch.float32: {"max_abs": 1e-3, "mean_abs": 1e-4, "pop_fraction": 0.0},
    torch.bfloat16: {"max_abs": float("inf"), "mean_abs": 0.1, "pop_fraction": 0.01},
}
# Quantised weights: activations are quantised too (int8 per token, fp8 per block), so
# an fp32 rounding difference upstream can move an activation by a whole quantisation
# step and a few tokens by more than rounding (generic vs cpu: max 8e-3, mean 1.6e-4 on
# W4A8 + FP8-block). fp32 bounds the mean at 1e-3 and pops nothing; a 1% scale error
# gives a mean of 0.2 and more.
QUANT_LIMITS = {
    torch.float32: {"max_abs": float("inf"), "mean_abs": 1e-3, "pop_fraction": 0.0},
    torch.bfloat16: LIMITS[torch.bfloat16],
}
# label -> (experts scheme, dense scheme) for ``quantize_model``.
VARIANTS = {
    "float": (FLOAT_WEIGHT, FLOAT_WEIGHT),
    "w4a8+w8a8": ("w4a8", "w8a8"),
    "w4a8+fp8_block": ("w4a8", "fp8_block"),
}
# Training log-probs (1.0) and rollout log-probs at a sampling temperature.
TEMPERATURES = (1.0, 0.7)


def model_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[2, 40]`` and an attention mask ``[2, 40]`` (row 1 padded after 28)."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 128, (2, 40), generator=gen)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 28:] = 0
    return ids, mask


def tiny_model(dtype: torch.dtype, experts: str, dense: str):
    """The tiny GLM-5 in ``dtype`` on the CPU, its experts / dense projections packed
    with ``experts`` / ``dense`` (``"none"``: float) by the reference backend."""
    from glmport.model import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from glmport.model.quantize import quantize_model

    config = GlmMoeDsaConfig.tiny(
        index_n_heads=16,
        index_head_dim=128,  # GLM-5's, the indexer head dim vendor ops are built for
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
    )
    model = GlmMoeDsaForCausalLM.from_config(config, seed=0)
    with torch.no_grad():  # std 0.16 instead of 0.02: peaked distributions, real mismatch
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model = model.to(dtype).eval()
    if (experts, dense) != (FLOAT_WEIGHT, FLOAT_WEIGHT):
        with use_backend(REGISTRY.reference()):  # float32 scales, whatever the dtype
            quantize_model(model, experts=experts, dense=dense)
    return model


def _outputs(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the ``n`` real next tokens of ``ids`` ``[B, S]`` under ``mask`` ``[B, S]``:
    their fp32 CPU log-probabilities ``[len(TEMPERATURES), n]`` (one row per
    temperature) and the greedy tokens ``[n]`` int64 (argmax of the model's logits)."""
    with torch.no_grad():
        out = model(ids, mask)
        valid = mask.bool()
        targets_mask = valid[:, 1:] & valid[:, :-1]
        hidden = model.model.norm(out.hidden_states[:, :-1][targets_mask])
        targets = ids[:, 1:][targets_mask]
        head = model.lm_head.weight.to(hidden.dtype)
        rows = [glmport.ops.token_logprobs(hidden, head, targets, t)[0] for t in TEMPERATURES]
        greedy = out.logits[:, :-1][targets_mask].argmax(dim=-1)
    return torch.stack(rows).float().cpu(), greedy.cpu()


def _logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of :func:`_outputs`, ``[len(TEMPERATURES), n]`` fp32."""
    return _outputs(model, ids, mask)[0]


def _runner_outputs(
    runner: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_outputs` through a backend's whole-model runner (``input_ids [1, S] ->
    logits [1, S, V]``, see ``Backend.model_runner``): each sequence alone, unpadded;
    log-softmax of the logits over the temperatures in fp32 on the CPU."""
    rows, greedy = [], []
    for seq, valid in zip(ids, mask.bool(), strict=True):
        tokens = seq[valid]
        logits = runner(tokens[None]).float().cpu()[0, :-1]
        targets = tokens[1:].cpu()
        rows.append(
            torch.stack(
                [
                    torch.log_softmax(logits / t, dim=-1).gather(1, targets[:, None])[:, 0]
                    for t in TEMPERATURES
                ]
            )
        )
        greedy.append(logits.argmax(dim=-1))
    return torch.cat(rows, dim=1), torch.cat(greedy)


def backend_outputs(
    model, backend: str, ids: torch.Tensor, mask: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_outputs` of ``model`` run on ``backend`` (emulated or not as the caller
    selected), inputs on ``device``: eagerly on its kernels after ``prepare_weights``
    (its own layout of the same weights; this changes ``model``), or through its
    ``model_runner``. Log-probs ``[len(TEMPERATURES), n]`` fp32, greedy ``[n]`` int64."""
    from glmport.model.quantize import prepare_weights

    model = model.to(device=device)
    ids, mask = ids.to(device), mask.to(device)
    with use_backend(backend):
        runner = REGISTRY.get(backend).model_runner(model)
        if runner is None:
            prepare_weights(model)
            return _outputs(model, ids, mask)
        return _runner_outputs(runner, ids, mask)


def _mismatch(delta: torch.Tensor) -> dict[str, float]:
    """Metrics of ``delta = logp_backend - logp_ref`` ``[n]``."""
    rho = torch.exp(delta)
    popped = ((rho < 1 / ICEPOP_BETA) | (rho > ICEPOP_BETA)).float().mean()
    return {
        "max_abs_dlogp": float(delta.abs().max()),
        "mean_abs_dlogp": float(delta.abs().mean()),
        "icepop_pop_fraction": float(popped),
    }


def pair_metrics(
    logp_a: torch.Tensor, logp_b: torch.Tensor, greedy_a: torch.Tensor, greedy_b: torch.Tensor
) -> dict[str, float]:
    """Mean / max ``|logp_b - logp_a|``, the IcePop pop fraction at ``beta = 2`` and
    the greedy agreement (fraction of equal tokens) of two backends' log-probs ``[n]``
    fp32 and greedy tokens ``[n]`` int64 over the same ``n`` positions."""
    return {
        **_mismatch(logp_b - logp_a),
        "greedy_agreement": float((greedy_a == greedy_b).double().mean()),
    }


def _tolerance(limits: dict[str, float]) -> dict[str, float]:
    """``{metric: bound}`` from a row of :data:`LIMITS` / :data:`QUANT_LIMITS`."""
    return {
        "max_abs_dlogp": limits["max_abs"],
        "mean_abs_dlogp": limits["mean_abs"],
        "icepop_pop_fraction": limits["pop_fraction"],
    }


def run_model_check(dtype: torch.dtype, backend: str, device: torch.device) -> Verdict:
    """Judge ``backend`` (inputs on ``device``) on every variant and temperature in
    ``dtype``. Metrics and tolerances are keyed ``"<variant> T=<t>: <metric>"``; the
    plain metric names hold the float variant's worst over the temperatures."""
    ids, mask = model_inputs()
    headline: dict[str, float] = {}  # the float variant's worst, under the plain names
    metrics: dict[str, float] = {}
    tol = _tolerance(LIMITS[dtype])
    failures: list[str] = []
    unjudged: list[str] = []  # quantised variants the backend cannot take, with why
    for label, (experts, dense) in VARIANTS.items():
        quantised = (experts, dense) != (FLOAT_WEIGHT, FLOAT_WEIGHT)
        bounds = _tolerance((QUANT_LIMITS if quantised else LIMITS)[dtype])
        model = tiny_model(dtype, experts, dense)
        # The same weights in the same precision: only the backend differs.
        with use_backend(REGISTRY.reference()):
            ref = _logprobs(model, ids, mask)
        try:
            got = backend_outputs(model, backend, ids, mask, device)[0]
        except UnsupportedError as err:
            if not quantised:  # the float variant is the check's headline: none without it
                raise
            unjudged.append(f"{label} not judged: {err}")
            continue
        for temperature, delta in zip(TEMPERATURES, got - ref, strict=True):
            where = f"{label} T={temperature:g}"
            found = _mismatch(delta)
            bad = [k for k, v in bounds.items() if found[k] > v]
            if bad:
                shown = ", ".join(f"{k} {found[k]:.3g} > {bounds[k]:.3g}" for k in bad)
                failures.append(f"{where}: {shown}")
            for k, v in found.items():
                metrics[f"{where}: {k}"], tol[f"{where}: {k}"] = v, bounds[k]
                if not quantised:
                    headline[k] = max(headline.get(k, 0.0), v)
    metrics = {**headline, "tokens": int(ref.shape[1]), **metrics}
    return Verdict(not failures, "; ".join(failures + unjudged), metrics, tol)
