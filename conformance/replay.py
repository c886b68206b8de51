"""One op call on its own, as ``glmport diff`` meets it: its fingerprint and inputs,
judged on a backend against recorded outputs (the same inputs, another backend's
outputs) or as a conformance case against the float64 reference, and the replay file
(``glmport diff --replay FILE``) that carries it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

import glmport
from glmport.core.errors import ConfigError
from glmport.core.registry import REGISTRY
from glmport.core.selection import use_backend
from glmport.core.specs import SPECS
from glmport.core.trace import OpCall, trace_ops

from .calls import device_for
from .cases.base import Case
from .judges import JUDGE_OF_OP, JUDGES, Verdict
from .paging import logits_args
from .runner import Check, Record, run_check
from .scorecard import worst_ratio

REPLAY_FORMAT = "glmport-op-call"


REPLAY_VERSION = 1


def _tuple(x: object) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def backend_device(backend: str, emulate: bool) -> torch.device:
    return device_for(REGISTRY.get(backend).device_type(emulate))


def call_dtype(call: OpCall) -> torch.dtype:
    return SPECS[call.op].features(*call.args)["dtype"]


def fingerprint(op: str, args: tuple) -> str:
    """A 16-hex-digit SHA-256 of an op call's inputs: names, dtypes, shapes, bytes."""
    h = hashlib.sha256(op.encode())
    for name, a in zip(SPECS[op].arg_names, args, strict=False):
        h.update(name.encode())
        if isinstance(a, torch.Tensor):
            t = a.detach().cpu().contiguous()
            h.update(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(a).encode())
    return h.hexdigest()[:16]


def describe_inputs(op: str, args: tuple) -> str:
    """``"q float32[12, 4, 32], ..., topk=4"``."""
    parts = []
    for name, a in zip(SPECS[op].arg_names, args, strict=False):
        if isinstance(a, torch.Tensor):
            parts.append(f"{name} {str(a.dtype).removeprefix('torch.')}{list(a.shape)}")
        else:
            parts.append(f"{name}={a!r}")
    return ", ".join(parts)


def _references(call: OpCall, backend: str, emulate: bool) -> tuple:
    """What the op's judge compares against: A's outputs, or for the indexer A's full
    ``[T, N]`` score matrix on the same inputs (its judge is tie-safe on scores)."""
    if JUDGE_OF_OP.get(call.op) != "indexer":
        return call.outputs
    device = backend_device(backend, emulate)
    with use_backend(backend, emulate=emulate), torch.no_grad():
        scores = glmport.ops.indexer_logits(*(_on(x, device) for x in logits_args(call.args)))
    return scores.double().cpu()


def _on(x: object, device: torch.device) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def judge_on_inputs(
    call: OpCall, backend: str, emulate: bool, reference: str, reference_emulate: bool
) -> tuple[Verdict, str, tuple]:
    """Run ``call`` again on ``backend`` with the recorded inputs and judge its outputs
    against the recorded ones (``reference``'s, the backend that made ``call``).
    Returns the verdict, the backend whose kernel ran and the outputs (``()`` when it
    raised: the verdict then fails with the error)."""
    device = backend_device(backend, emulate)
    try:
        with use_backend(backend, emulate=emulate), torch.no_grad(), trace_ops() as trace:
            outs = _tuple(getattr(glmport.ops, call.op)(*(_on(a, device) for a in call.args)))
        outs = tuple(o.detach().cpu() for o in outs)
        refs = _references(call, reference, reference_emulate)
        judge = JUDGES[JUDGE_OF_OP.get(call.op, "close")]
        verdict = judge(call.op, call_dtype(call), call.args, outs, refs)
        if verdict.ok and refs is not call.outputs:
            # Judged against the reference's scores, not its choice: its own choice must
            # pass the same judge, or a bug in its top-k (not in its scores) goes unseen.
            own = judge(call.op, call_dtype(call), call.args, call.outputs, refs)
            if not own.ok:
                verdict = Verdict(
                    False, f"{reference}'s own choice: {own.reason}", own.metrics, own.tolerance
                )
        return verdict, trace.calls[-1].backend, outs
    except Exception as err:  # a backend's crash is a divergence, not a crash of the tool
        return Verdict(False, f"raised {type(err).__name__}: {err}"), backend, ()


def _case(call: OpCall) -> Case:
    """A conformance case whose inputs are ``call``'s (copied at every build)."""
    args = call.args
    return Case(
        call.op,
        f"call-{fingerprint(call.op, args)}",
        "diff",
        call_dtype(call),
        build=lambda _gen: tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
        params=tuple(
            (n, list(a.shape))
            for n, a in zip(SPECS[call.op].arg_names, args, strict=False)
            if isinstance(a, torch.Tensor)
        ),
        judge=JUDGE_OF_OP.get(call.op, "close"),
    )


def judge_against_reference(
    call: OpCall, backends: tuple[str, ...], emulate: tuple[bool, ...]
) -> list[Record]:
    """Each backend's value check of ``call``'s inputs against the float64 reference:
    the conformance suite's judgment of that one call (which of the two is off)."""
    case = _case(call)
    return [
        run_check(Check("value", case), name, emulate=em)
        for name, em in zip(backends, emulate, strict=True)
    ]


def record_summary(backend: str, rec: Record) -> dict:
    """The part of a value check's record a diff reports."""
    return {
        "backend": backend,
        "ran_on": rec.ran_on,
        "outcome": rec.outcome,
        "reason": rec.reason,
        "worst": worst_ratio(rec.metrics, rec.tolerance),
    }


def write_replay(
    call: OpCall,
    path: str | Path,
    backends: tuple[str, str],
    emulate: tuple[bool, bool],
    *,
    layer: int | None,
    index: int,
    reason: str,
) -> Path:
    """Save ``call``'s inputs (``torch.save``; loads with ``weights_only=True``) with
    where the diff of ``backends`` met it: decoder ``layer``, call ``index`` of the
    first backend's forward, and why the second failed there (``reason``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "format": REPLAY_FORMAT,
            "version": REPLAY_VERSION,
            "op": call.op,
            "args": list(call.args),
            "backends": list(backends),
            "emulate": list(emulate),
            "scope": call.scope,
            "layer": layer,
            "index": index,
            "fingerprint": fingerprint(call.op, call.args),
            "reason": reason,
        },
        path,
    )
    return path


def read_replay(path: str | Path) -> dict:
    """A replay file written by :func:`write_replay`, checked."""
    try:
        data = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception:  # torch.load's errors on a foreign file say nothing to a user
        raise ConfigError(
            f"{path} is not a glmport op-call replay file (torch.load cannot read it)"
        ) from None
    if not isinstance(data, dict) or data.get("format") != REPLAY_FORMAT:
        raise ConfigError(f"{path} is not a glmport op-call replay file")
    if data.get("version") != REPLAY_VERSION:
        raise ConfigError(
            f"{path} is a replay file of version {data.get('version')}; this glmport reads "
            f"version {REPLAY_VERSION}"
        )
    if data.get("op") not in SPECS:
        raise ConfigError(f"{path} names an unknown op {data.get('op')!r}")
    SPECS[data["op"]].validate(tuple(data["args"]), values=True)
    return data


def replay_call(
    path: str | Path,
    backends: tuple[str, ...] | None = None,
    emulate: tuple[bool, ...] | None = None,
) -> tuple[dict, list[Record], Verdict | None]:
    """Judge the call saved in ``path`` on each of ``backends`` (default: the two the
    diff compared) against the float64 reference, and the second against the first on
    the same inputs. Returns the file's contents, the records and that verdict."""
    data = read_replay(path)
    names = tuple(backends or data["backends"])
    flags = tuple(emulate or (data["emulate"] if backends is None else [False] * len(names)))
    for name in names:  # the file's own backends may be plug-ins this process lacks
        REGISTRY.get(name, "--backends" if backends else f"the replay file {path}")
    call = OpCall(data["op"], names[0], data["scope"], tuple(data["args"]), ())
    records = judge_against_reference(call, names, flags)
    pair = None
    if len(names) >= 2:
        with use_backend(names[0], emulate=flags[0]), torch.no_grad():
            device = backend_device(names[0], flags[0])
            outs = _tuple(getattr(glmport.ops, call.op)(*(_on(a, device) for a in call.args)))
        call = OpCall(call.op, names[0], call.scope, call.args, tuple(o.cpu() for o in outs))
        pair = judge_on_inputs(call, names[1], flags[1], names[0], flags[0])[0]
    return data, records, pair
