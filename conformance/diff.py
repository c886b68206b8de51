"""``glmport diff``: the op call and layer where two backends part ways on one model.

The model runs on backend A and on backend B with the same weights and inputs, each
under an op trace (:mod:`glmport.core.trace`: every op call's inputs and outputs, in
the module it came from) and a choice tape (:mod:`glmport.model.choices`: the indexer's
top-k and the experts). Then:

- **on A's inputs**: every op call of A is run again on B with A's inputs and judged
  against A's outputs by that op's conformance judge (tolerances of the op and dtype
  from :mod:`glmport.core.tolerance`). The first call that fails is the *first
  divergence*: B's kernel disagrees with A's on identical inputs, so it is that op,
  not error carried in from upstream. Its inputs go to a replay file that
  :func:`.replay.replay_call` (``glmport diff --replay FILE``) judges on each backend against
  the float64 reference, as the conformance suite does;
- **own run**: the outputs of B's own forward against A's, call by call (matched by
  module, op and occurrence), and each decoder layer's output: how a difference
  spreads;
- **choices**: top-k overlap of the indexer and agreement of the routed experts per
  layer, in B's own run and on A's inputs;
- **logits**: mean / max ``|delta logp|`` of the next tokens, the IcePop pop fraction
  at beta 2, greedy-token agreement.

With ``follow=True`` B's forward replays A's choices (the choice tape RL uses to train
on the rollout's experts and keys), so the comparison goes on downstream of a flipped
top-k instead of drowning in its consequences; B's own choices are then still judged
on A's inputs.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from glmport.core.selection import use_backend
from glmport.core.tolerance import Tolerance, compare, tolerance
from glmport.core.trace import OpCall, trace_ops

from .model_case import pair_metrics
from .replay import (
    backend_device,
    call_dtype,
    describe_inputs,
    fingerprint,
    judge_against_reference,
    judge_on_inputs,
    record_summary,
    write_replay,
)
from .scorecard import worst_ratio

if TYPE_CHECKING:
    from glmport.model.config import GlmMoeDsaConfig

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# Own-run errors are measured, not judged: inputs already differ there.
MEASURE_ONLY = Tolerance(math.inf, math.inf)


# -- one backend's forward -------------------------------------------------------------


@dataclass
class Run:
    """One backend's forward: its op ``calls``, each decoder layer's output
    ``[T, hidden]`` by layer number, the discrete ``choices`` (``{0: Choices}``) and the
    next-token ``logp`` / ``greedy`` token ``[n]`` at the ``n`` real positions."""

    backend: str
    emulate: bool
    calls: list[OpCall]
    layer_outputs: dict[int, torch.Tensor]
    choices: dict
    logp: torch.Tensor
    greedy: torch.Tensor


@contextmanager
def _watched(model: nn.Module, trace, layer_outputs: dict[int, torch.Tensor]) -> Iterator[None]:
    """Name every op call by the module path it runs in, and keep each decoder layer's
    output."""
    from glmport.model.modeling import DecoderLayer

    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: trace.push(n)))

        def post(m, args, out, n=name):
            trace.pop()
            layer = _layer_of(n)
            if isinstance(m, DecoderLayer) and layer is not None:
                layer_outputs[layer] = out[0].detach().float().cpu()  # (hidden, indices)

        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _layer_of(scope: str) -> int | None:
    """The decoder layer a module path lies in (``model.layers.2.mlp`` -> 2), or None."""
    m = _LAYER.search(scope)
    return int(m.group(1)) if m else None


def _next_token_positions(mask: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` bool: position ``t`` predicts a real token ``t + 1``."""
    valid = mask.bool()
    return valid[:, 1:] & valid[:, :-1]


def run_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    backend: str,
    *,
    emulate: bool = False,
    replay: dict | None = None,
) -> Run:
    """Run ``model`` on ``input_ids [B, S]`` int64 / ``attention_mask [B, S]`` with
    ``backend`` selected, recording its op calls, layer outputs and choices (replaying
    ``replay``'s, a :meth:`ChoiceTape.recorded` result, when given)."""
    from glmport.model.choices import choice_tape

    device = backend_device(backend, emulate)
    model.to(device)
    layer_outputs: dict[int, torch.Tensor] = {}
    with (
        use_backend(backend, emulate=emulate),
        torch.no_grad(),
        trace_ops() as trace,
        choice_tape(model, replay=replay) as tape,
        _watched(model, trace, layer_outputs),
    ):
        logits = model(input_ids.to(device), attention_mask.to(device)).logits
    logits = logits[:, :-1][_next_token_positions(attention_mask).to(device)].double().cpu()
    targets = input_ids[:, 1:][_next_token_positions(attention_mask)]
    logp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return Run(
        backend, emulate, trace.calls, layer_outputs, tape.recorded(), logp, logits.argmax(-1)
    )


# -- comparing calls -------------------------------------------------------------------


def _keyed(calls: list[OpCall]) -> dict[tuple[str, str, int], int]:
    """``(scope, op, occurrence) -> index``: how a call of one run finds its match in
    the other (a replayed choice leaves out calls, so positions do not line up)."""
    seen: Counter = Counter()
    out = {}
    for i, c in enumerate(calls):
        out[(c.scope, c.op, seen[(c.scope, c.op)])] = i
        seen[(c.scope, c.op)] += 1
    return out


def row_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of ``|set(a_row) & set(b_row)| / |set(a_row)|`` for integer
    choices ``[..., k]`` (``-1`` entries ignored; rows of ``a`` with none skipped):
    the top-k overlap of an indexer, the agreement of routed experts. 1.0 when no row
    has a choice."""
    a, b = a.reshape(-1, a.shape[-1]).long(), b.reshape(-1, b.shape[-1]).long()
    valid = a >= 0
    if not bool(valid.any()):
        return 1.0
    hit = ((a[:, :, None] == b[:, None, :]) & (b[:, None, :] >= 0)).any(-1) & valid
    rows = valid.any(-1)
    return float((hit.sum(-1)[rows].double() / valid.sum(-1)[rows]).mean())


_CHOICE_OUTPUT = {"lightning_indexer": (0, "top-k overlap"), "moe_gate": (1, "experts")}


def _output_error(a: tuple, b: tuple, skip: tuple[int, ...]) -> tuple[float, float]:
    """Worst ``max|err|/max|ref|`` and ``mean`` over the floating outputs of one call
    (``skip``: outputs compared as choices); inf for a shape or ``inf`` pattern change."""
    worst = [0.0, 0.0]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if i in skip:
            continue
        if x.is_floating_point():
            cmp = compare(y, x, MEASURE_ONLY)
            worst = [max(worst[0], cmp.max_rel), max(worst[1], cmp.mean_rel)]
        elif x.shape != y.shape or not torch.equal(x, y):
            worst = [math.inf, math.inf]
    return worst[0], worst[1]


@dataclass
class CallDiff:
    """One op call of A: where it ran, B's judgment on A's inputs (``local``), and the
    error of B's own run's matching call (``own_max_rel`` / ``own_mean_rel``; None
    when B's run made no such call: a replayed choice)."""

    index: int
    op: str
    scope: str
    layer: int | None
    dtype: str
    ran_on: str
    ok: bool
    reason: str
    worst: float | None
    own_max_rel: float | None
    own_mean_rel: float | None
    choice_agreement: float | None = None
    own_choice_agreement: float | None = None
    fingerprint: str = ""
    inputs: str = ""


# -- the whole comparison ----------------------------------------------------------------


@dataclass
class DiffReport:
    """What :func:`diff_backends` found (``to_dict`` is the ``--json`` output)."""

    backends: tuple[str, str]
    emulate: tuple[bool, bool]
    dtype: str
    follow: bool
    tokens: int
    calls: list[CallDiff]
    layers: list[dict]
    logits: dict[str, float]
    first_divergence: CallDiff | None
    first_own_divergence: CallDiff | None
    replay_file: str | None = None
    verdicts: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _layer_label(layer: int | None, scope: str) -> str:
    if layer is not None:
        return str(layer)
    return "embed" if "embed" in scope else "final"


def _layer_rows(
    calls: list[CallDiff], a: Run, b: Run, config: GlmMoeDsaConfig, follow: bool
) -> list[dict]:
    """Per layer: each op's worst errors (own run and on A's inputs), the layer
    output's error in B's own run, and the choices' agreement."""
    from glmport.model.choices import INDICES, ROUTING

    rows = []
    labels = list(dict.fromkeys(_layer_label(c.layer, c.scope) for c in calls))
    for label in labels:
        mine = [c for c in calls if _layer_label(c.layer, c.scope) == label]
        ops = {}
        for c in mine:
            row = ops.setdefault(
                c.op,
                {
                    "calls": 0,
                    "ran_on": [],
                    "own_max_rel": None,
                    "own_mean_rel": None,
                    "worst": None,
                    "ok": True,
                },
            )
            row["calls"] += 1
            row["ok"] &= c.ok
            if c.ran_on not in row["ran_on"]:
                row["ran_on"].append(c.ran_on)
            for key, value in (
                ("own_max_rel", c.own_max_rel),
                ("own_mean_rel", c.own_mean_rel),
                ("worst", c.worst),
            ):
                if value is not None:
                    row[key] = value if row[key] is None else max(row[key], value)
            for key, value in (
                ("choice_agreement", c.choice_agreement),
                ("own_choice_agreement", c.own_choice_agreement),
            ):
                if value is not None:
                    row[key] = min(row.get(key, 1.0), value)
        entry: dict = {"layer": label, "ops": ops}
        if label.isdigit():
            n = int(label)
            if n in a.layer_outputs and n in b.layer_outputs:
                cmp = compare(b.layer_outputs[n], a.layer_outputs[n], MEASURE_ONLY)
                entry["output_max_rel"], entry["output_mean_rel"] = cmp.max_rel, cmp.mean_rel
            if not follow:
                entry.update(_tape_agreement(a.choices, b.choices, n, INDICES, ROUTING, config))
        rows.append(entry)
    return rows


def _tape_agreement(
    ca: dict, cb: dict, layer: int, indices: str, routing: str, config: GlmMoeDsaConfig
) -> dict:
    """Top-k overlap and expert agreement of decoder ``layer`` in the two own runs (a
    shared-indexer layer reports the overlap of the full layer whose top-k it reuses)."""
    out = {}
    seq_a, seq_b = ca.get(0), cb.get(0)
    if seq_a is None or seq_b is None:
        return out
    if seq_a.indices is not None and seq_b.indices is not None:
        # Choices.indices holds the full layers only, in order.
        row = config.full_indexer_layers.index(config.indexer_source(layer))
        out["topk_overlap"] = row_overlap(seq_a.indices[row], seq_b.indices[row])
    moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    if seq_a.experts is not None and seq_b.experts is not None and layer in moe:
        row = moe.index(layer)  # Choices.experts holds the MoE layers only, in order
        out["expert_agreement"] = row_overlap(seq_a.experts[row], seq_b.experts[row])
    return out


def _diff_call(
    index: int,
    call: OpCall,
    mate_outputs: tuple | None,
    other: tuple[str, bool],
    this: tuple[str, bool],
) -> CallDiff:
    """A's call ``index`` judged on backend ``other`` (name, emulate) with its inputs,
    and measured against the matching call's outputs of ``other``'s own run
    (``mate_outputs``; None when that run made no such call). ``this``: A."""
    verdict, ran_on, outs = judge_on_inputs(call, *other, *this)
    choice = _CHOICE_OUTPUT.get(call.op)
    skip = () if choice is None else (choice[0],)
    own = None if mate_outputs is None else _output_error(call.outputs, mate_outputs, skip)
    diff = CallDiff(
        index=index,
        op=call.op,
        scope=call.scope,
        layer=_layer_of(call.scope),
        dtype=str(call_dtype(call)).removeprefix("torch."),
        ran_on=ran_on,
        ok=verdict.ok,
        reason=verdict.reason,
        worst=worst_ratio(verdict.metrics, verdict.tolerance),
        own_max_rel=None if own is None else own[0],
        own_mean_rel=None if own is None else own[1],
    )
    if choice is not None:
        if outs:
            diff.choice_agreement = row_overlap(call.outputs[choice[0]], outs[choice[0]])
        if mate_outputs is not None:
            diff.own_choice_agreement = row_overlap(
                call.outputs[choice[0]], mate_outputs[choice[0]]
            )
    if not diff.ok:
        diff.fingerprint = fingerprint(call.op, call.args)
        diff.inputs = describe_inputs(call.op, call.args)
    return diff


def _own_diverges(c: CallDiff) -> bool:
    """Whether B's own run left A's at this call: outputs beyond the op's tolerance,
    or another choice (an inference indexer call returns no scores to compare)."""
    if (
        c.own_max_rel is not None
        and c.own_max_rel > tolerance(c.op, getattr(torch, c.dtype)).max_rel
    ):
        return True
    return c.own_choice_agreement is not None and c.own_choice_agreement < 1.0


def diff_backends(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    backends: tuple[str, str],
    emulate: tuple[bool, bool] = (False, False),
    follow: bool = False,
    replay_dir: str | Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> DiffReport:
    """Compare ``backends = (A, B)`` on ``model`` (a :class:`GlmMoeDsaForCausalLM`,
    its weights as they are) for ``input_ids [B, S]`` int64; ``follow``: B replays A's
    discrete choices. The first diverging call's inputs are saved in ``replay_dir``
    (when given); ``progress`` gets one line per stage."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    (name_a, name_b), (em_a, em_b) = backends, emulate
    progress(f"running the model on {name_a}")
    a = run_forward(model, input_ids, attention_mask, name_a, emulate=em_a)
    progress(
        f"running the model on {name_b}" + (f", replaying {name_a}'s choices" if follow else "")
    )
    b = run_forward(
        model, input_ids, attention_mask, name_b, emulate=em_b, replay=a.choices if follow else None
    )
    progress(f"judging {len(a.calls)} op calls of {name_a} on {name_b} with the same inputs")
    b_index = _keyed(b.calls)
    calls = []
    for i, (key, call) in enumerate(zip(_keyed(a.calls), a.calls, strict=True)):
        mate = b_index.get(key)
        mate_outputs = None if mate is None else b.calls[mate].outputs
        calls.append(_diff_call(i, call, mate_outputs, (name_b, em_b), (name_a, em_a)))
    first = next((c for c in calls if not c.ok), None)
    first_own = next((c for c in calls if _own_diverges(c)), None)
    logits = pair_metrics(a.logp, b.logp, a.greedy, b.greedy)
    report = DiffReport(
        backends=(name_a, name_b),
        emulate=(em_a, em_b),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        follow=follow,
        tokens=int(a.logp.numel()),
        calls=calls,
        layers=_layer_rows(calls, a, b, model.config, follow),
        logits=logits,
        first_divergence=first,
        first_own_divergence=first_own,
    )
    if first is not None:
        call = a.calls[first.index]
        progress(f"judging call #{first.index} ({call.op}) on each backend against float64")
        records = judge_against_reference(call, backends, emulate)
        report.verdicts = [
            record_summary(name, r) for name, r in zip(backends, records, strict=True)
        ]
        if replay_dir is not None:
            path = Path(replay_dir) / f"call-{call.op}-{first.fingerprint}.pt"
            written = write_replay(
                call,
                path,
                backends,
                emulate,
                layer=first.layer,
                index=first.index,
                reason=first.reason,
            )
            report.replay_file = str(written)
    return report


# -- text ---------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def format_report(report: DiffReport) -> str:
    """The terminal report: the first divergence, the per-layer table, the logits."""
    a, b = report.backends
    follow = f", {b} replays {a}'s top-k and experts" if report.follow else ""
    lines = [
        f"glmport diff: {a} vs {b}, {report.dtype}, {report.tokens} next tokens{follow}",
        "",
    ]
    first = report.first_divergence
    if first is None:
        lines.append(
            f"no divergence: every op call of {a}, run on {b} with the same inputs, is within "
            "the conformance tolerance of its op and dtype"
        )
    else:
        where = (
            f"layer {first.layer}" if first.layer is not None else first.scope or "outside layers"
        )
        lines += [
            f"FIRST DIVERGENCE: op call #{first.index} {first.op} ({first.dtype}) in {where} "
            f"[{first.scope}]",
            f"  {b} (ran on {first.ran_on}) on {a}'s inputs: {first.reason}",
            f"  inputs: {first.inputs}",
            f"  fingerprint: {first.fingerprint}",
        ]
        for v in report.verdicts:
            lines.append(
                f"  against the float64 reference: {v['backend']} (ran on {v['ran_on']}) "
                f"{v['outcome'].upper()}" + (f": {v['reason']}" if v["reason"] else "")
            )
        if report.replay_file:
            lines.append(f"  replay: glmport diff --replay {report.replay_file} --backends {a},{b}")
    own = report.first_own_divergence
    if own is not None:
        lines.append(
            f"first call of {b}'s own run beyond its op's tolerance: #{own.index} {own.op} in "
            f"layer {own.layer if own.layer is not None else own.scope}"
        )
    lines += [
        "",
        f"{'':<41}{b + ' own run vs ' + a:^21} {'on ' + a + ' inputs':>14}",
        f"{'layer':<6} {'op':<18} {'calls':>5} {'ran on':<8} {'max rel':>10} {'mean rel':>10} "
        f"{'err/tol':>14}  choices (own run / on {a}'s inputs)",
    ]
    for row in report.layers:
        for op, r in row["ops"].items():
            choice = ""
            if "choice_agreement" in r or "own_choice_agreement" in r:
                name = "top-k overlap" if op == "lightning_indexer" else "experts agree"
                choice = (
                    f"{name} {_num(r.get('own_choice_agreement'), '.3f')} / "
                    f"{_num(r.get('choice_agreement'), '.3f')}"
                )
            flag = "" if r["ok"] else "  <-- diverges"
            lines.append(
                f"{row['layer']:<6} {op:<18} {r['calls']:>5} {','.join(r['ran_on']):<8} "
                f"{_num(r['own_max_rel']):>10} {_num(r['own_mean_rel']):>10} "
                f"{_num(r['worst'], '.3g'):>14}  {choice}{flag}"
            )
        if "output_max_rel" in row:
            extra = "".join(
                f"  {label} {row[key]:.3f}"
                for key, label in (
                    ("topk_overlap", "top-k overlap"),
                    ("expert_agreement", "experts agree"),
                )
                if key in row
            )
            lines.append(
                f"{row['layer']:<6} {'(layer output)':<18} {'':>5} {'':<8} "
                f"{_num(row['output_max_rel']):>10} {_num(row['output_mean_rel']):>10} "
                f"{'':>14}{extra}"
            )
    g = report.logits
    lines += [
        "",
        f"logits: mean |delta logp| {g['mean_abs_dlogp']:.3g}, max {g['max_abs_dlogp']:.3g}, "
        f"IcePop pop fraction (beta 2) {g['icepop_pop_fraction']:.3g}, greedy agreement "
        f"{g['greedy_agreement']:.3f} over {report.tokens} tokens",
    ]
    return "\n".join(lines)
