"""``glmport indexcache search``: IndexCache's greedy search for the layers that keep
their indexer, printing each step and saving the model with the pattern found."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from glmport.commands import common

if TYPE_CHECKING:
    from glmport.model.indexcache import Evaluation, SearchStep


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport indexcache`` and its subcommand ``search`` with its flags."""
    ic = sub.add_parser("indexcache", help="IndexCache: choose which layers keep their indexer")
    ic_sub = ic.add_subparsers(dest="indexcache_command", required=True)
    ics = ic_sub.add_parser(
        "search",
        help="greedy search for the K layers that keep their indexer (IndexCache)",
        description="IndexCache's training-free greedy search (Bai et al., arXiv 2603.12201): "
        "from the checkpoint's pattern, repeatedly make shared the full layer (never layer "
        "0) whose sharing raises the language-modelling loss on the calibration set least, "
        "until K full layers remain; print each step's loss and pattern and save the model "
        "with that pattern (the shared layers' indexer weights dropped) to --out.",
    )
    common.add_model(ics, help="'tiny' (random, seed 0) or a checkpoint dir")
    calib = ics.add_mutually_exclusive_group(required=True)
    calib.add_argument(
        "--calib", default=None, metavar="FILE", help="token ids, one sequence per line"
    )
    calib.add_argument(
        "--random",
        type=common.integer(1, common.MAX_COUNT, "sequences"),
        metavar="N",
        help="N random sequences",
    )
    ics.add_argument(
        "--seq-len",
        type=common.integer(2, common.MAX_TOKENS, "a token and its next at least"),
        default=64,
        help="length of --random's sequences (64)",
    )
    ics.add_argument("--seed", type=common.seed, default=0, help="seed of --random's tokens (0)")
    ics.add_argument(
        "--keep",
        type=common.integer(1, common.MAX_COUNT, "layers"),
        required=True,
        metavar="K",
        help="full layers kept",
    )
    ics.add_argument(
        "--out", default=None, help="folder for the copy (default: <model>-indexcache-<K>)"
    )
    common.add_backend(ics)
    common.add_json(ics)
    ics.set_defaults(func=run_search)


def run_search(args: argparse.Namespace) -> int:
    """``glmport indexcache search``: search, print each step, save the copy."""
    from glmport.model.indexcache import (
        check_calibration_size,
        check_search,
        pattern_string,
        random_calibration,
        read_calibration,
        search,
    )

    common.check_environment()
    default = f"{Path(args.model)}-indexcache-{args.keep}"
    out = common.check_out(default if args.out is None else args.out, "--out", empty=True)
    if args.random is not None:
        check_calibration_size(args.random, args.seq_len)  # before loading the model
    model = common.load_model(args.model)
    config = model.config
    check_search(config, args.keep)  # before reading a calibration file
    if args.calib is not None:
        sequences = read_calibration(args.calib, config.vocab_size)
    else:
        sequences = random_calibration(args.random, args.seq_len, config.vocab_size, args.seed)
    common.fits_model(model, "--calib" if args.calib else "--seq-len", max(map(len, sequences)))
    if max(map(len, sequences)) <= config.index_topk:
        print(
            f"glmport: warning: no calibration sequence is longer than index_topk "
            f"({config.index_topk}): every indexer selects every visible key, so every "
            "pattern gives the same loss",
            file=sys.stderr,
        )
    start = pattern_string(config.indexer_types)

    def on_evaluation(ev: Evaluation) -> None:
        progress(ev)
        if ev.layer is None and not args.json:
            print(f"baseline: loss {ev.loss:.6f}, pattern {start}")

    began = time.perf_counter()
    with common.select_backend(args.backend, "--backend"), _search_progress(args.json) as progress:
        result = search(
            model,
            sequences,
            args.keep,
            on_evaluation=on_evaluation,
            on_step=None if args.json else _print_step,
        )
    seconds = time.perf_counter() - began
    model.save_pretrained(out)
    if args.json:
        print(json.dumps({**result.to_dict(), "out": str(out), "seconds": seconds}))
        return 0
    if not result.steps:
        print(f"no step: the model has {args.keep} full layers already")
    print(f"pattern {result.pattern} saved to {out} (search {seconds:.1f} s)")
    return 0


def _print_step(step: SearchStep) -> None:
    print(
        f"layer {step.layer} shared: loss {step.loss:.6f} ({step.delta:+.6f}), "
        f"pattern {step.pattern}"
    )


@contextlib.contextmanager
def _search_progress(on_stderr: bool) -> Iterator[Callable[[Evaluation], None]]:
    """A callback for each loss the search measures (an ``Evaluation``): a rich progress
    bar on a terminal when rich is installed (on stderr when stdout carries JSON; on
    stdout, lines printed go above it), else one plain line per evaluation on stderr."""
    from glmport.core.extras import missing, progress_bar

    def describe(ev: Evaluation) -> str:
        return "baseline" if ev.layer is None else f"layer {ev.layer} shared"

    console = None
    if not missing("rich"):
        from rich.console import Console

        console = Console(stderr=on_stderr)
    if console is None or not console.is_terminal:  # a log file gets lines, not a bar
        yield lambda ev: print(
            f"  [{ev.done}/{ev.total}] {describe(ev)}: loss {ev.loss:.6f}", file=sys.stderr
        )
        return
    with progress_bar("indexcache search", console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda ev: bar.update(
            task, completed=ev.done, total=ev.total, description=describe(ev)
        )
