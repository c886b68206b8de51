"""``glmport diff``: run a model on two backends and find the first op call and layer
where they part ways; or, with ``--replay``, judge one saved op call on each backend."""

from __future__ import annotations

import argparse
import json
import sys

from glmport.commands import common
from glmport.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport diff`` and its flags."""
    dif = sub.add_parser(
        "diff",
        help="the first op call and layer where two backends part ways on a model",
        description="Run a model on two backends with the same weights and inputs, judge "
        "every op call of the first on the second with the same inputs (the conformance "
        "judges and tolerances), and print the first diverging call with its inputs' "
        "fingerprint and a replay file, a per-layer table of errors and choice agreement, "
        "and the logits' mismatch. Exit 0 when they agree, 1 at a divergence. "
        "--replay FILE judges a saved call on each backend against the float64 reference.",
    )
    common.add_model(
        dif,
        required=False,
        default="tiny",
        help="'tiny' (random, seed 0) or a checkpoint dir",
        layers=True,
    )
    dif.add_argument("--backends", default=None, help="A,B: the two backends to compare")
    common.add_dtype(dif)
    ids = dif.add_mutually_exclusive_group()
    ids.add_argument("--input-ids", default=None, help="comma-separated token ids (one sequence)")
    ids.add_argument(
        "--random",
        type=common.integer(2, common.MAX_TOKENS, "tokens of one sequence"),
        default=32,
        metavar="N",
        help="N random tokens (default: %(default)s)",
    )
    dif.add_argument("--seed", type=common.seed, default=0, help="seed of --random's tokens")
    dif.add_argument(
        "--follow",
        default=None,
        metavar="A",
        help="the other backend replays A's discrete choices (indexer top-k, experts)",
    )
    common.add_emulate(dif, "run vendor backends on the CPU")
    common.add_plugin(
        dif,
        "register a backend defined in code (a glmport Backend instance or a callable "
        "returning one), as glmport conformance --plugin does; repeatable",
    )
    dif.add_argument(
        "--out", default="glmport-diff", help="folder for the diverging call's replay file"
    )
    dif.add_argument("--replay", default=None, metavar="FILE", help="judge a saved op call")
    common.add_json(dif)
    dif.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``glmport diff``: exit 0 when the backends agree, 1 at a divergence."""
    import torch

    from glmport.conformance import diff
    from glmport.core.registry import REGISTRY, register_backend_target

    for target in args.plugin:
        register_backend_target(target)
    common.check_environment()
    names = [n.strip() for n in args.backends.split(",")] if args.backends else []
    if args.replay is None and len(names) != 2:
        raise ConfigError(f"--backends must name two backends, A,B; got {args.backends!r}")
    emulate = []
    for name in names:
        REGISTRY.get(name, "--backends")
        ok = REGISTRY.availability(name, args.emulate)
        if not ok.ok:
            hint = "" if args.emulate else " (--emulate runs a vendor backend's CPU emulation)"
            raise ConfigError(f"backend {name!r} is not available: {ok.reason}{hint}")
        emulate.append(args.emulate)
    if args.replay is not None:
        return _replay(args.replay, tuple(names) or None, tuple(emulate) or None, args.json)
    if args.follow is not None:
        if args.follow not in names:
            raise ConfigError(f"--follow must name one of --backends {names}, got {args.follow!r}")
        if args.follow == names[1]:  # the followed backend runs first
            names.reverse()
    common.check_out(args.out, "--out")
    model = common.load_model(args.model, args.dtype, args.layers)
    vocab = model.config.vocab_size
    if args.input_ids is not None:
        ids = common.parse_ids(args.input_ids, "--input-ids")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad or len(ids) < 2:
            raise ConfigError(
                f"--input-ids needs at least 2 token ids in [0, {vocab}), got {args.input_ids!r}"
            )
        common.fits_model(model, "--input-ids", len(ids))
        input_ids = torch.tensor([ids])
    else:
        common.fits_model(model, "--random", args.random)
        gen = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(0, vocab, (1, args.random), generator=gen)
    report = diff.diff_backends(
        model,
        input_ids,
        backends=(names[0], names[1]),
        emulate=(emulate[0], emulate[1]),
        follow=args.follow is not None,
        replay_dir=args.out,
        progress=lambda line: print(f"glmport diff: {line}", file=sys.stderr),
    )
    print(json.dumps(report.to_dict(), default=str) if args.json else diff.format_report(report))
    return 0 if report.first_divergence is None else 1


def _replay(path: str, names: tuple | None, emulate: tuple | None, as_json: bool) -> int:
    """``glmport diff --replay FILE``: exit 0 when every backend passes on the call."""
    from glmport.conformance import replay

    data, records, pair = replay.replay_call(path, names, emulate)
    names = names or tuple(data["backends"])
    summaries = [replay.record_summary(n, r) for n, r in zip(names, records, strict=True)]
    if as_json:
        shown = {k: v for k, v in data.items() if k != "args"}
        pair_json = None if pair is None else {"ok": pair.ok, "reason": pair.reason}
        print(json.dumps({"call": shown, "verdicts": summaries, "pair": pair_json}, default=str))
    else:
        print(
            f"op call {data['op']} #{data['index']} (layer {data['layer']}, {data['scope']}), "
            f"fingerprint {data['fingerprint']}"
        )
        print(f"  inputs: {replay.describe_inputs(data['op'], tuple(data['args']))}")
        for s in summaries:
            reason = f": {s['reason']}" if s["reason"] else ""
            print(
                f"  {s['backend']} (ran on {s['ran_on']}) against the float64 reference: "
                f"{s['outcome'].upper()}{reason}"
            )
        if pair is not None:
            verdict = "agree" if pair.ok else f"DIFFER: {pair.reason}"
            print(f"  {names[1]} against {names[0]} on these inputs: {verdict}")
    good = all(r.outcome == "pass" for r in records) and (pair is None or pair.ok)
    return 0 if good else 1
