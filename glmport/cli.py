"""The ``glmport`` command line: ``glmport info [--json]``, ``glmport conformance``,
``glmport diff``, ``glmport generate``, ``glmport indexcache search``,
``glmport export onnx|tvm``, ``glmport rl train|serve|agent``.

Bad input never ends in a traceback: a malformed argument, ``GLMPORT_*`` variable,
checkpoint or selection is one line on stderr, ``glmport: error: ...``, and exit
status 2. What counts as bad input: every :class:`~glmport.GlmportError` (glmport
raises those on purpose, after checking what it was given), argparse's own errors,
and an ``OSError`` on a path the user named (a missing, unreadable or unwritable file).
Anything else (a ``RuntimeError`` from inside torch, a ``TypeError``...) is a bug in
glmport or a backend and keeps its traceback, so it can be reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from glmport.core import environment
from glmport.core.environment import versions
from glmport.core.errors import ConfigError, GlmportError

if TYPE_CHECKING:
    from glmport.model.indexcache import Evaluation, SearchStep
    from glmport.rl.trainer import RLConfig

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # the shell's convention for a SIGINT


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``glmport: error:`` line (argparse's
    message, naming the argument), not a usage block; it still exits with status 2
    (SystemExit) as argparse does."""

    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see '{self.prog} --help')")
        self.exit(EXIT_CONFIG)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]):
        # argparse drops a "--" value (``--seed=--``) and hands the option an empty list
        # without calling its type: refused here, as the missing value it is.
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            self.error(f"argument {'/'.join(action.option_strings)}: expected a value, got '--'")
        return super()._get_values(action, arg_strings)


# Upper bounds of the command line's counts: far above any real use, low enough that a
# typo (an extra digit, 1000000000 for 1000) is one error line here instead of a hang
# or an allocator failure later. Token counts are checked again against the model's
# max_position_embeddings once it is loaded (_fits_model).
MAX_TOKENS = 1 << 24  # tokens of one sequence or request
MAX_WORKERS = 256  # processes or actors, each with its own copy of the model
MAX_COUNT = 1 << 20  # episodes, turns, sessions, calibration sequences, layers
# Plain ASCII integers only: int() also takes "1_000", other scripts' digits and
# strings of any length (and a 5000-digit one raises ValueError).
_INTEGER = re.compile(r"[+-]?[0-9]{1,40}", re.ASCII)


def _integer(low: int, high: int, why: str = "", *, shown: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` in ASCII digits, or one
    error line naming the range (``shown`` instead of the numbers) and ``why``. The
    bounds stay readable on it (``.low``, ``.high``) for help and tests."""
    span = shown or f"from {low} to {high}"
    reason = f" ({why})" if why else ""

    def parse(text: str) -> int:
        if not _INTEGER.fullmatch(text) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"expected an integer {span}{reason}, got {text!r}")
        return int(text)

    parse.low, parse.high = low, high
    return parse


def _real(low: float, why: str) -> Callable[[str], float]:
    """An argparse type: a finite number of at least ``low``, or one error line saying
    ``why``. The bound stays readable on it (``.low``) for help and tests."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(
                f"expected a finite number >= {low:g} ({why}), got {text!r}"
            )
        return value

    parse.low = low
    return parse


_seed = _integer(-(1 << 63), (1 << 64) - 1, "64 bits", shown="from -2**63 to 2**64-1")
_xdist_count = _integer(0, MAX_WORKERS)


def _workers(text: str) -> str:
    """pytest-xdist's -n: auto, logical, or a number of workers (0: none)."""
    if text in ("auto", "logical"):
        return text
    try:
        return str(_xdist_count(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected auto, logical or a number of workers from 0 (none) to {MAX_WORKERS}, "
            f"got {text!r}"
        ) from None


def _check_out(path: str, flag: str, *, folder: bool = True, empty: bool = False) -> Path:
    """Check, before any work, that ``flag``'s ``path`` can be written: nothing there
    yet, or a folder (``folder=False``: a file), inside a folder that lets a file be
    created (tried: permissions alone do not say it for root or a read-only mount);
    with ``empty``, an existing folder must hold nothing a run would overwrite. Creates
    nothing. A ConfigError naming ``flag`` otherwise."""
    if not path:
        raise ConfigError(f"{flag} must name a path, got ''")
    out = Path(path)
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"{flag} {out} is a link to nothing ({os.readlink(out)})")
    if out.exists():
        if folder and not out.is_dir():
            raise ConfigError(f"{flag} {out} exists and is not a folder")
        if not folder and out.is_dir():
            raise ConfigError(f"{flag} {out} is a folder; expected a file to write")
        if empty and any(out.iterdir()):
            raise ConfigError(
                f"{flag} {out} already holds files this would overwrite; choose another {flag}"
            )
    where = out if out.is_dir() else out.parent
    while not where.exists():  # the nearest folder that exists: the rest is made later
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"{flag} {out}: {where} is a file, so nothing can be made under it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".glmport-probe-", dir=where)
    except OSError as err:
        raise ConfigError(f"{flag} {out}: cannot write in {where} ({err.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return out


def _fits_model(model, flag: str, tokens: int) -> None:
    """``tokens`` (from ``flag``) must fit the loaded model's context."""
    limit = model.config.max_position_embeddings
    if tokens > limit:
        raise ConfigError(
            f"{flag}: {tokens} tokens exceed the model's max_position_embeddings {limit}"
        )


def _select(name: str | None, flag: str):
    """``use_backend`` for the backend a command-line ``flag`` named (None: the
    selection in force), so an unknown, unavailable or empty one is reported as
    ``flag``'s."""
    from glmport.core.selection import use_backend

    if name == "":  # not "the selection": a flag given must name something
        raise ConfigError(f"{flag} must name a backend, got ''")
    return use_backend(name, source=flag)


def _check_environment() -> None:
    """Parse every ``GLMPORT_*`` variable (the tile budget too, which the library reads
    only when the generic backend tiles) and check that ``GLMPORT_DEVICE`` exists here,
    so a malformed one fails before any work (ConfigError naming it)."""
    from glmport.core.selection import current_settings, selected_device

    environment.read_all()
    selected_device(current_settings())


def collect_info(
    backend: str | None = None, emulate: bool = False, source: str | None = None
) -> dict:
    """Everything ``glmport info`` reports, as plain data, under the current selection
    or with ``backend`` selected (and ``emulate``: vendor backends on the CPU). Raises
    GlmportError on a bad configuration (unknown or unavailable backend, named as
    ``source``'s; malformed variable)."""
    from glmport.core.selection import use_backend

    with use_backend(backend, emulate=emulate or None, source=source):
        return _collect_info()


def _collect_info() -> dict:
    import torch

    import glmport
    from glmport.core.registry import REGISTRY, chain_for
    from glmport.core.selection import (
        current_settings,
        primary_backend,
        resolve,
        selected_device,
    )
    from glmport.core.specs import INTERFACE_NAMES

    environment.read_all()  # the tile budget too, though no op runs here
    settings = current_settings()
    selected_device(settings)  # GLMPORT_DEVICE names a device present here
    primary = primary_backend(settings)
    backends = []
    for name in REGISTRY.names():
        avail = REGISTRY.availability(name, settings.emulate)
        entry = {
            "name": name,
            "available": avail.ok,
            "reason": avail.reason,
            "emulated": avail.emulated,
        }
        try:
            m = REGISTRY.get(name).manifest
            entry.update(
                device_type=m.device_type,
                description=m.description,
                role=m.role,
                ops=list(m.ops),
                fallback=list(chain_for(name)[1:]),
                capabilities={op: c.describe() for op, c in m.capabilities.items()},
                stack=list(m.stack),
                emulation=m.emulation,
                verified=m.verified,
            )
        except GlmportError as err:
            entry.update(reason=str(err))
        backends.append(entry)
    ops = {}
    for op in INTERFACE_NAMES:
        res = resolve(op, settings)
        ops[op] = {
            "backend": res.backend,
            "chain": list(res.chain),
            "device_type": res.device_type,
            "emulated": res.emulated,
            # calls outside the backend's declared limits go to the next of these
            "limits": res.capability.describe() if res.capability is not None else {},
            "beyond_limits": [c.backend for c in res.alternatives],
        }
    return {
        "glmport": glmport.__version__,
        "versions": versions(),
        "environment": {var: os.environ.get(var) for var in environment.VARIABLES},
        "selected_backend": primary,
        "device": settings.device or ("cpu" if primary == "cpu" else None),
        "emulate": settings.emulate,
        "accelerator": (
            torch.accelerator.current_accelerator().type
            if torch.accelerator.is_available()
            else None
        ),
        "backends": backends,
        "ops": ops,
    }


def _print_info(info: dict) -> None:
    v = info["versions"]
    print(f"glmport {info['glmport']}")
    stack = ", ".join(
        f"{name} {value or ('not set' if name.startswith('$') else 'not installed')}"
        for name, value in v.items()
        if name not in ("glmport", "python", "torch")
    )
    print(
        f"  python {v['python']}, torch {v['torch']}"
        + (f"; backends' stack: {stack}" if stack else "")
    )
    print(f"  accelerator visible to torch: {info['accelerator'] or 'none'}")
    print("\nselection")
    for var, value in info["environment"].items():
        print(f"  {var:<22} {value if value is not None else '(unset)'}")
    print(
        f"  -> backend {info['selected_backend']!r}, emulate={'on' if info['emulate'] else 'off'}"
    )
    print("\nbackends")
    rows = [("name", "role", "device", "status", "ops", "verified on")]
    for b in info["backends"]:
        status = (
            ("available" + (" (emulated)" if b["emulated"] else ""))
            if b["available"]
            else "unavailable"
        )
        rows.append(
            (
                b["name"],
                b.get("role", "?"),
                b.get("device_type", "?"),
                status,
                str(len(b.get("ops", []))),
                b.get("verified", ""),
            )
        )
    _table(rows)
    for b in info["backends"]:
        if not b["available"]:
            print(f"  {b['name']}: {b['reason']}")
    where = f"backend {info['selected_backend']!r}" + (", emulated" if info["emulate"] else "")
    print(f"\nops (where each runs under {where})")
    rows = [("op", "runs on", "path", "limits (beyond them: next along)")]
    for op, r in info["ops"].items():
        limits = ", ".join(f"{k} {v}" for k, v in r["limits"].items())
        if limits:
            limits += f" (else {' -> '.join(r['beyond_limits']) or 'none'})"
        runs_on = r["backend"] + (" (emulated)" if r["emulated"] else "")
        rows.append((op, runs_on, " -> ".join(r["chain"]), limits))
    if not any(row[3] for row in rows[1:]):  # no limits anywhere: no column for them
        rows = [row[:3] for row in rows]
    _table(rows)


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info(args.backend, args.emulate, source="--backend")
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def _conformance_matrix(args: argparse.Namespace) -> int:
    """``glmport conformance --matrix``: the mismatch matrix instead of the suite."""
    from glmport.conformance.html import write_html
    from glmport.conformance.matrix import markdown, mismatch_matrix, parse_dtypes, write_matrix

    suite_only = [f for f, v in (("--backend", args.backend), ("--ops", args.ops)) if v]
    suite_only += [f for f, v in (("--full", args.full), ("--emulate", args.emulate)) if v]
    suite_only += ["--mustpass"] if args.mustpass is not None else []
    if suite_only:
        raise ConfigError(
            f"{', '.join(suite_only)}: not with --matrix (it runs every backend in --backends, "
            "emulated where that is the only way it runs here)"
        )
    names = args.backends.split(",") if args.backends is not None else None
    dtypes = parse_dtypes(args.dtypes if args.dtypes is not None else "fp32,bf16")
    result = mismatch_matrix(names, dtypes, lambda line: print(line, file=sys.stderr, flush=True))
    paths = [*write_matrix(result, args.report_dir), write_html(args.report_dir)]
    if result["heatmap"]["file"] is None:
        print(f"glmport: warning: no heatmap: {result['heatmap']['why']}", file=sys.stderr)
    print(markdown(result))
    print("reports: " + ", ".join(str(p) for p in paths))
    return 0


def _conformance_scorecard(args: argparse.Namespace) -> int:
    """``glmport conformance --scorecard RUN...``: one table across the runs' reports."""
    from glmport.conformance.html import write_html
    from glmport.conformance.report import combined_scorecard
    from glmport.conformance.scorecard import markdown, write_scorecard

    given = {"--backend": args.backend, "--ops": args.ops, "--full": args.full,
             "--emulate": args.emulate, "--matrix": args.matrix, "--backends": args.backends,
             "--dtypes": args.dtypes, "--mutants": args.mutants}  # fmt: skip
    if any(given.values()):
        flags = ", ".join(f for f, v in given.items() if v)
        raise ConfigError(f"{flags}: not with --scorecard (it reads finished runs)")
    if not args.scorecard:
        raise ConfigError("--scorecard: name at least one run (a conformance.json or its folder)")
    card = combined_scorecard(args.scorecard, args.bench, args.mustpass)
    paths = [*write_scorecard(card, args.report_dir), write_html(args.report_dir)]
    print(markdown(card))
    print("reports: " + ", ".join(str(p) for p in paths))
    return 0


def _conformance_mutants(args: argparse.Namespace, plugins: list[str]) -> int:
    """``glmport conformance --mutants``: the suite's kill rate on mutants of a backend."""
    from glmport.conformance import mutation, mutation_report, mutation_suite
    from glmport.core.selection import current_settings, primary_backend, use_backend

    not_with_mutants = [
        f for f, v in (("--matrix", args.matrix), ("--backends", args.backends)) if v
    ]
    not_with_mutants += ["--dtypes"] if args.dtypes is not None else []
    not_with_mutants += ["--mustpass"] if args.mustpass is not None else []
    if not_with_mutants:
        raise ConfigError(f"{', '.join(not_with_mutants)}: not with --mutants")
    emulate = args.emulate or current_settings().emulate
    base = args.backend or (plugins[0] if plugins else environment.read("GLMPORT_BACKEND"))
    if base == "auto":
        with use_backend(emulate=emulate):
            base = primary_backend()
    mutation.check_mutable(base, emulate)
    ops = environment.parse_op_names(args.ops, "--ops") if args.ops else None
    chosen, inapplicable = mutation.mutants_for(base, ops)
    if not chosen:
        raise ConfigError(
            f"--mutants: no mutant applies to {base!r}"
            + (f" among --ops {args.ops}" if ops else "")
            + f" ({next(iter(inapplicable.values()), 'the library is empty')})"
        )
    command = " ".join(
        ["glmport conformance --mutants --backend", base, *(["--emulate"] if emulate else [])]
        + [*(["--full"] if args.full else []), *(["--ops", args.ops] if args.ops else [])]
        + [f"--plugin {t}" for t in args.plugin] + ["-n", args.workers]
    )  # fmt: skip
    plan = mutation_suite.Plan(base, emulate, args.full, tuple(m.id for m in chosen))
    start = time.perf_counter()
    results = mutation_suite.run_suite(plan, args.workers, plugins=args.plugin)
    report = mutation_report.build_report(
        results, base=base, emulate=emulate, full=args.full, inapplicable=inapplicable,
        command=command, workers=args.workers, seconds=time.perf_counter() - start,
    )  # fmt: skip
    paths = mutation_report.write_reports(report, args.report_dir)
    print(mutation_report.markdown(report))
    print("reports: " + ", ".join(str(p) for p in paths))
    return 1 if report["broken"] else 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    import pytest

    from glmport.conformance import suite
    from glmport.core.registry import REGISTRY, register_backend_target

    # Registered here to check them and name the default backend; the suite's plug-in
    # registers them again in every pytest-xdist worker.
    plugins = [register_backend_target(t) for t in args.plugin]
    _check_environment()
    _check_out(args.report_dir, "--report-dir")
    if args.scorecard is not None:
        return _conformance_scorecard(args)
    if args.bench:
        raise ConfigError("--bench goes with --scorecard (its peaks fill the scorecard)")
    if args.mutants:
        return _conformance_mutants(args, plugins)
    if args.matrix:
        return _conformance_matrix(args)
    if args.mustpass is not None:
        from glmport.conformance.mustpass import load

        load(args.mustpass)  # unknown: an error listing the known versions
        if args.full:
            raise ConfigError("--full: not with --mustpass (the list decides which checks run)")
    for flag, value in (("--backends", args.backends), ("--dtypes", args.dtypes)):
        if value is not None:
            raise ConfigError(f"{flag} goes with --matrix (the suite judges one --backend)")
    default = plugins[0] if plugins else environment.read("GLMPORT_BACKEND")
    backend = default if args.backend is None else args.backend
    if backend != "auto":
        REGISTRY.get(backend, "--backend")  # unknown: an error listing the valid names
    if args.ops is not None:
        environment.parse_op_names(args.ops, "--ops")
    # An unavailable backend still runs: its checks are reported as skipped, with the
    # reason, and the run exits non-zero because nothing passed.
    pytest_args = [
        suite.__file__,
        "-c",
        os.devnull,  # the caller's pytest configuration must not change the suite
        "--rootdir",
        os.getcwd(),
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        "--glmport-backend",
        backend,
        "--glmport-report-dir",
        args.report_dir,
        "-n",
        args.workers,
    ]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest_args += ["-p", "pytest_glmport", "-p", "xdist.plugin"]
    for target in args.plugin:
        pytest_args += ["--glmport-plugin", target]
    if args.emulate:
        pytest_args.append("--glmport-emulate")
    if args.full:
        pytest_args.append("--glmport-full")
    if args.ops:
        pytest_args += ["--glmport-ops", args.ops]
    if args.mustpass is not None:
        pytest_args += ["--glmport-mustpass", args.mustpass]
    return int(pytest.main(pytest_args))


def _cmd_diff(args: argparse.Namespace) -> int:
    """``glmport diff``: exit 0 when the backends agree, 1 at a divergence."""
    import torch

    from glmport.conformance import diff
    from glmport.core.registry import REGISTRY, register_backend_target

    for target in args.plugin:
        register_backend_target(target)
    _check_environment()
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
        return _replay_diff(args.replay, tuple(names) or None, tuple(emulate) or None, args.json)
    if args.follow is not None:
        if args.follow not in names:
            raise ConfigError(f"--follow must name one of --backends {names}, got {args.follow!r}")
        if args.follow == names[1]:  # the followed backend runs first
            names.reverse()
    _check_out(args.out, "--out")
    model = _load_model(args.model, args.dtype)
    vocab = model.config.vocab_size
    if args.input_ids is not None:
        ids = _parse_ids(args.input_ids, "--input-ids")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad or len(ids) < 2:
            raise ConfigError(
                f"--input-ids needs at least 2 token ids in [0, {vocab}), got {args.input_ids!r}"
            )
        _fits_model(model, "--input-ids", len(ids))
        input_ids = torch.tensor([ids])
    else:
        _fits_model(model, "--random", args.random)
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


def _replay_diff(path: str, names: tuple | None, emulate: tuple | None, as_json: bool) -> int:
    """``glmport diff --replay FILE``: exit 0 when every backend passes on the call."""
    from glmport.conformance import diff

    data, records, pair = diff.replay_call(path, names, emulate)
    names = names or tuple(data["backends"])
    summaries = [diff.record_summary(n, r) for n, r in zip(names, records, strict=True)]
    if as_json:
        shown = {k: v for k, v in data.items() if k != "args"}
        pair_json = None if pair is None else {"ok": pair.ok, "reason": pair.reason}
        print(json.dumps({"call": shown, "verdicts": summaries, "pair": pair_json}, default=str))
    else:
        print(
            f"op call {data['op']} #{data['index']} (layer {data['layer']}, {data['scope']}), "
            f"fingerprint {data['fingerprint']}"
        )
        print(f"  inputs: {diff.describe_inputs(data['op'], tuple(data['args']))}")
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


def _parse_ids(text: str, flag: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"{flag} must be comma-separated integers such as 1,2,3, got {text!r}"
        ) from None


def _load_model(spec: str, dtype: str = "fp32"):
    """``--model``: "tiny" (random, seed 0) or a checkpoint folder, in ``dtype``."""
    import torch

    from glmport.model import GlmMoeDsaForCausalLM

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if spec == "tiny":
        model = GlmMoeDsaForCausalLM.from_config("tiny", seed=0)
    elif Path(spec).is_dir():  # cast as read: a checkpoint of mixed dtypes loads as one
        model = GlmMoeDsaForCausalLM.from_pretrained(spec, dtype=torch_dtype)
    else:
        raise ConfigError(
            f"--model must be 'tiny' or a checkpoint folder with config.json, got {spec!r}"
        )
    return model.to(torch_dtype).eval()


def _cmd_generate(args: argparse.Namespace) -> int:
    from glmport.model.generation import generate
    from glmport.model.sampling import SamplingNames, check_sampling

    sampling = {
        flag: value
        for flag, value in (
            ("--temperature", args.temperature),
            ("--top-p", args.top_p),
            ("--top-k", args.top_k),
            ("--seed", args.seed),
        )
        if value is not None
    }
    for flag, given in (("--greedy", args.greedy), ("--speculative", args.speculative)):
        if given and sampling:  # speculative decoding accepts the greedy choice only
            raise ConfigError(f"{flag} cannot be combined with {', '.join(sampling)}")
    params = check_sampling(
        greedy=not sampling,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        top_k=args.top_k or 0,
        seed=args.seed,
        names=SamplingNames("--temperature", "--top-p", "--top-k", "--seed", "--greedy"),
    )
    _check_environment()
    input_ids = _parse_ids(args.input_ids, "--input-ids")
    stop_tokens = _parse_ids(args.stop_tokens, "--stop-tokens") if args.stop_tokens else []
    model = _load_model(args.model)
    with _select(args.backend, "--backend"):
        result = generate(
            model,
            [input_ids],
            args.max_new_tokens,
            greedy=params.greedy,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop_tokens=stop_tokens,
            speculative=args.speculative,
        )
    report = {
        "input_ids": input_ids,
        "output_ids": result.output_ids[0],
        "new_tokens": result.new_tokens,
        "seconds": result.seconds,
        "tokens_per_s": result.tokens_per_s,
    }
    if args.speculative:
        report["acceptance_length"] = result.acceptance_length
    if args.json:
        print(json.dumps(report))
        return 0
    print("output_ids: " + ",".join(map(str, report["output_ids"])))
    line = (
        f"{result.new_tokens} new tokens in {result.seconds:.3f} s "
        f"({result.tokens_per_s:.1f} tokens/s)"
    )
    if args.speculative and result.acceptance_length is not None:
        line += f", mean acceptance length {result.acceptance_length:.2f}"
    print(line)
    return 0


def _cmd_indexcache_search(args: argparse.Namespace) -> int:
    import time

    from glmport.model.indexcache import (
        check_calibration_size,
        check_search,
        pattern_string,
        random_calibration,
        read_calibration,
        search,
    )

    _check_environment()
    default = f"{Path(args.model)}-indexcache-{args.keep}"
    out = _check_out(default if args.out is None else args.out, "--out", empty=True)
    if args.random is not None:
        check_calibration_size(args.random, args.seq_len)  # before loading the model
    model = _load_model(args.model)
    config = model.config
    check_search(config, args.keep)  # before reading a calibration file
    if args.calib is not None:
        sequences = read_calibration(args.calib, config.vocab_size)
    else:
        sequences = random_calibration(args.random, args.seq_len, config.vocab_size, args.seed)
    _fits_model(model, "--calib" if args.calib else "--seq-len", max(map(len, sequences)))
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
    with _select(args.backend, "--backend"), _search_progress(args.json) as progress:
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


def _overrides(text: str) -> dict:
    """``key=value,...`` model config overrides; values are ints, floats or words."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value pairs, got {item!r}")
        for kind in (int, float):
            try:
                out[key.strip()] = kind(raw)
                break
            except ValueError:
                continue
        else:
            out[key.strip()] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


def _async_options(args: argparse.Namespace) -> dict:
    """The asynchronous trainer's runtime options given on the command line."""
    given = {"ray_address": args.ray_address, "worker_threads": args.worker_threads}
    return {k: v for k, v in given.items() if v is not None}


# rl train's flags that set an RLConfig field (by their dest; the field has the same
# name but for _FIELD_OF's). Each defaults to None, not given: a fresh run takes
# RLConfig's default, a resumed one the run's own value.
_RL_FLAGS = (
    "task", "steps", "prompts", "group_size", "minibatches", "lr", "temperature",
    "icepop_beta", "kl_coef", "kl_decay_steps", "normalize_std", "rollout_backend",
    "train_backend", "rollout_dtype", "replay", "opd_teacher", "shuffle_rewards", "init",
    "model", "seed", "checkpoint_every", "eval_every", "mode", "max_staleness",
    "rollout_workers", "async_loss", "publish_every",
)  # fmt: skip
_FIELD_OF = {"prompts": "prompts_per_step", "digits": "task_args"}


def _rl_settings(args: argparse.Namespace) -> dict:
    """The RLConfig fields the command line gives (flags left out are absent)."""
    given = {
        _FIELD_OF.get(d, d): getattr(args, d) for d in _RL_FLAGS if getattr(args, d) is not None
    }
    if "icepop_beta" in given:
        given["icepop_beta"] = given["icepop_beta"] or None  # 0: IcePop off
    if "replay" in given:
        given["replay"] = tuple(filter(None, given["replay"].split(",")))
    if args.digits is not None:
        given["task_args"] = {"digits": args.digits}
    return given


def _flag(field: str) -> str:
    """The rl train flag that sets RLConfig ``field``."""
    dest = next((d for d, f in _FIELD_OF.items() if f == field), field)
    return "--" + dest.replace("_", "-")


def _resume_changes(given: dict, saved: RLConfig) -> list[str]:
    """The flags in ``given`` whose values differ from the resumed run's ``saved``
    config (``--steps`` aside, which may change), as ``--flag VALUE (the run: V)``."""
    from glmport.rl.tasks import make_task

    changed = []
    for field, value in given.items():
        old = getattr(saved, field)
        if field == "task_args":  # compare the tasks: {"digits": 3} is the default's {}
            same = vars(make_task(saved.task, **value)) == vars(make_task(saved.task, **old))
        else:
            same = value == old or (field == "replay" and tuple(value) == tuple(old))
        if field != "steps" and not same:
            changed.append(f"{_flag(field)} {value!r} (the run: {old!r})")
    return changed


def _cmd_rl_train(args: argparse.Namespace) -> int:
    from glmport.core.extras import require
    from glmport.rl.checkpoint import read_state
    from glmport.rl.run import train
    from glmport.rl.trainer import ASYNC_FIELDS, CHECKPOINT, RLConfig

    _check_environment()
    _check_out(args.out, "--out")
    for flag, name in (
        ("--rollout-backend", args.rollout_backend),
        ("--train-backend", args.train_backend),
    ):
        with _select(name, flag):  # unknown or unavailable: said now, as the flag's
            pass
    given = _rl_settings(args)
    options = _async_options(args)
    if args.resume:
        saved = read_state(os.path.join(args.out, CHECKPOINT)).config
        changed = _resume_changes(given, saved)
        if changed:
            raise ConfigError(
                f"--resume continues the run in {args.out} with its own settings; only "
                f"--steps may change, and {'; '.join(changed)} differ"
            )
        mode = saved.mode
    else:
        mode = given.get("mode", RLConfig.mode)
    if mode != "async":
        extra = [_flag(f) for f in ASYNC_FIELDS if f in given] + [
            "--" + k.replace("_", "-") for k in options
        ]
        if extra:
            raise ConfigError(f"{', '.join(extra)}: options of --mode async (this run: {mode})")
    # curves.png, the progress bar and the asynchronous trainer's workers, before any work.
    needs = ("matplotlib", *(() if args.quiet else ("rich",)))
    require("glmport rl train", *needs, *(("ray",) if mode == "async" else ()))
    if args.resume:
        records = train(
            None,
            args.out,
            resume=True,
            steps=given.get("steps"),
            progress=not args.quiet,
            options=options,
        )
    else:
        config = RLConfig(**given)
        records = train(config, args.out, progress=not args.quiet, options=options)
    if records:
        last = records[-1]
        keys = ("step", "reward", "mismatch_mean", "pop_fraction", "reverse_kl")
        print("  ".join(f"{k} {last[k]:.4g}" for k in keys if last.get(k) is not None))
    print(f"run folder: {args.out} (metrics.jsonl, curves.png, checkpoint/)")
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_rl_serve(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from glmport.core.extras import require

    require("glmport rl serve", "fastapi", "uvicorn", *(() if args.local else ("ray",)))

    from glmport.rl.gateway import policy_source, serve_forever, start_local_pool, start_ray_pool
    from glmport.rl.gateway_app import check_token, create_app

    source = "--token" if args.token is not None else "GLMPORT_GATEWAY_TOKEN"
    token = args.token if args.token is not None else os.environ.get(source)
    if token is not None:  # set but empty is refused, never "no auth"
        check_token(token, source)
    elif not _is_loopback(args.host):
        raise ConfigError(
            f"--host {args.host} is not a loopback address: serving beyond this machine needs "
            "a bearer token (--token or GLMPORT_GATEWAY_TOKEN)"
        )
    _check_environment()
    with _select(args.backend, "--backend"):  # the workers' backend, checked here first
        pass
    spec, version = policy_source(args.model)
    model = _load_model(spec)
    if args.max_new_tokens_limit is not None:
        _fits_model(model, "--max-new-tokens-limit", args.max_new_tokens_limit)
    options = dict(
        workers=args.workers, backend=args.backend, dtype=args.dtype, max_sessions=args.max_sessions
    )
    with ExitStack() as stack:
        if args.local:
            pool = start_local_pool(model, version, **options)
            kind = "in-process"
        else:
            from glmport.rl.ray_runtime import ray_session

            stack.enter_context(ray_session(args.ray_address))
            pool = start_ray_pool(model, version, **options)
            kind = "Ray actors"
        stack.callback(pool.close)
        limit = args.max_new_tokens_limit
        app = create_app(
            pool,
            token=token,
            openapi=args.openapi,
            **({} if limit is None else {"max_new_tokens_limit": limit}),
        )

        def announce(url: str) -> None:
            print(
                f"gateway on {url} ({pool.size} worker{'s' * (pool.size != 1)}, {kind}, "
                f"policy version {version}); "
                "POST /generate, GET /health; Ctrl-C stops",
                flush=True,
            )

        serve_forever(app, args.host, args.port, announce=announce)
    print("gateway stopped", flush=True)
    return 0


def _cmd_rl_agent(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from glmport.core.extras import require

    remote = args.gateway is not None
    require("glmport rl agent", "httpx", *(() if remote else ("fastapi", "uvicorn")))

    from glmport.model.sampling import SamplingNames
    from glmport.rl.agent import (
        GatewayClient,
        episode_summary,
        local_gateway,
        mean_summary,
        run_episodes,
    )
    from glmport.rl.agent_env import AgentEnv
    from glmport.rl.context import parse_context
    from glmport.rl.sessions import session_sampling

    if args.token and not remote:
        raise ConfigError("--token is the bearer token of --gateway; the in-process one needs none")
    session_sampling(args.temperature, names=SamplingNames(temperature="--temperature"))
    context = parse_context(args.context)
    env = AgentEnv(args.task, max_turns=args.max_turns, max_context=args.max_context)
    with ExitStack() as stack:
        if remote:
            client = stack.enter_context(
                GatewayClient(args.gateway, args.token, source="--gateway")
            )
        else:
            from glmport.rl.gateway import policy_source

            _check_environment()
            spec, version = policy_source("tiny" if args.model is None else args.model)
            model = _load_model(spec)
            _fits_model(model, "--max-context", args.max_context)
            client = stack.enter_context(local_gateway(model, version))
        trajectories = run_episodes(
            env,
            client,
            episodes=args.episodes,
            context=context,
            seed=args.seed,
            temperature=args.temperature,
        )
    episodes = [episode_summary(t) for t in trajectories]
    summary = mean_summary(episodes)
    if args.json:
        report = {"env": env.describe(), "context": context.spec(), "episodes": episodes}
        print(json.dumps({**report, "summary": summary}))
        return 0
    print(f"env {env.describe()}; context {context.spec()}")
    for i, e in enumerate(episodes):
        print(
            f"episode {i}: reward {e['reward']:.3f} ({e['end']}), {e['turns']} turns "
            f"({e['calls']} calls, {e['errors']} malformed), {e['generated_tokens']} tokens "
            f"generated, {e['folded_tokens']} folded, {e['dropped_tokens']} dropped, "
            f"cache reuse {e['cache_reuse']:.2f}"
        )
    print(
        f"{summary['episodes']} episodes: mean reward {summary['mean_reward']:.3f}, solved "
        f"{summary['solved']}/{summary['episodes']}, {summary['turns']} turns, "
        f"{summary['generated_tokens']} tokens generated, {summary['folded_tokens']} folded, "
        f"{summary['dropped_tokens']} dropped, cache reuse {summary['cache_reuse']:.2f}"
    )
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Export, save, and (unless --no-check) run the export against the eager model."""
    import time

    from glmport.core.errors import UnsupportedError
    from glmport.export.check import compare

    _check_environment()
    _require_export_extra()
    kind = "decode" if args.decode else "prefill"
    _check_out(args.out, "--out", folder=args.target == "tvm")
    fixed = _fixed_axes(args, kind) if args.target == "tvm" else None
    model = _load_model(args.model, args.dtype)
    if fixed and "seq" in fixed:
        _fits_model(model, "--seq", fixed["seq"])
    if fixed and "past" in fixed:
        _fits_model(model, f"--past {fixed['past']} (+ the new token)", fixed["past"] + 1)
    start = time.perf_counter()
    with _select(args.backend, "--backend"):
        if args.target == "onnx":
            from glmport.export.onnx_model import OnnxRuntimeModel, export_onnx, save_onnx

            proto = export_onnx(model, kind, inline=args.inline)
            path = save_onnx(proto, args.out)
            print(f"wrote {path}: {kind} graph, {_node_summary(proto)}")
        else:
            from glmport.export.tvm_model import TvmModel

            compiled = TvmModel.build(model, kind, source=args.source, fixed=fixed)
            path = compiled.save(args.out)
            shapes = f", fixed {fixed}" if fixed else ""
            print(f"wrote {path}: {kind} graph from {args.source}{shapes}, compiled for llvm")
        print(f"export took {time.perf_counter() - start:.1f} s")
        if args.no_check:
            return 0
        try:
            run = compiled.run if args.target == "tvm" else OnnxRuntimeModel.load(proto).run
        except UnsupportedError as err:  # written, but this runtime cannot run it here
            print(f"glmport: the check against torch cannot run: {err}", file=sys.stderr)
            return 0
        sizes = {}
        if fixed:  # a graph of fixed axes runs its own shapes only
            prompt = fixed["seq"] if kind == "prefill" else fixed["past"]
            sizes = {"batch": fixed["batch"], "prompt": prompt, "steps": 1}
        found = compare(model, run, kind, **sizes)
        print(f"check against eager torch: {found}")
        if found.max_abs > args.tolerance:
            print(f"glmport: error: above the tolerance {args.tolerance:g}", file=sys.stderr)
            return 1
    return 0


def _require_export_extra() -> None:
    """``glmport export`` needs the ``export`` extra: say which package is missing."""
    from glmport.core.extras import require

    require("glmport export", "onnx", "onnxruntime", "onnxscript", "tvm")


# ``export tvm --from onnx --batch``: one compiled call's sequences; the check after the
# export runs the eager model on that many.
_MAX_FIXED_BATCH = 1024


def _fixed_axes(args: argparse.Namespace, kind: str) -> dict[str, int] | None:
    """``--batch`` / ``--seq`` / ``--past`` for ``export tvm --from onnx`` (fixed shapes)."""
    given = {k: v for k, v in (("batch", args.batch), ("seq", args.seq), ("past", args.past))
             if v is not None}  # fmt: skip
    if args.source == "torch":
        if given:
            flags = ", ".join(f"--{k}" for k in given)
            raise ConfigError(f"{flags}: fixed axes belong to --from onnx only")
        return None
    return given


def _node_summary(proto) -> str:
    """``"12 ai.glmport nodes (rms_norm x7, ...) and 301 standard nodes"``."""
    from collections import Counter

    from glmport.export.onnx_ops import DOMAIN

    ours = Counter(n.op_type for n in proto.graph.node if n.domain == DOMAIN)
    rest = len(proto.graph.node) - sum(ours.values())
    listed = ", ".join(f"{op} x{n}" for op, n in sorted(ours.items()))
    return f"{sum(ours.values())} {DOMAIN} nodes ({listed or 'inlined'}) and {rest} standard nodes"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="glmport",
        description="GLM-5 and its RL post-training on any accelerator. "
        "Select a backend with GLMPORT_BACKEND (see `glmport info`).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser(
        "info",
        help="backends, versions, and where each op runs",
        description="Show the installed backends (available or not, and why), the "
        "versions, and where every op and expert_parallel runs: under the current "
        "selection, or with --backend selected.",
    )
    info.add_argument(
        "--backend",
        default=None,
        help="show where each op runs with this backend selected (its fallback chain)",
    )
    info.add_argument("--emulate", action="store_true", help="as selected with GLMPORT_EMULATE=1")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)

    conf = sub.add_parser(
        "conformance",
        help="judge a backend against the float64 reference; writes conformance.json/.md/.html",
        description="Run the shared conformance suite on a backend (quick mode by default) "
        "and write conformance.json, conformance.md and conformance.html. Exit 0 only if "
        "every check passed, was unsupported by the backend's manifest, or was skipped, "
        "and at least one passed. With --mustpass VERSION: exactly that list's checks. With "
        "--matrix: instead of the suite, the model-level mismatch of every pair of backends "
        "(matrix.json/.md/.png, and the HTML page). With --scorecard RUN...: one table "
        "across finished runs (scorecard.json/.md, and the HTML page).",
    )
    conf.add_argument(
        "--backend",
        default=None,
        help="backend to judge (default: the first --plugin's, else GLMPORT_BACKEND, else auto)",
    )
    conf.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="register a backend defined in code: MODULE:ATTR names a glmport Backend "
        "instance or a callable returning one, registered in every pytest-xdist worker "
        "before the suite runs (MODULE must be importable there, e.g. via PYTHONPATH); "
        "repeatable",
    )
    conf.add_argument("--emulate", action="store_true", help="run a vendor backend on the CPU")
    conf.add_argument("--full", action="store_true", help="full mode: larger GLM-5 shapes too")
    conf.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    conf.add_argument(
        "-n",
        dest="workers",
        type=_workers,
        default="auto",
        help="pytest-xdist workers: auto, logical or a number (0: none)",
    )
    conf.add_argument("--report-dir", default="conformance-report")
    conf.add_argument(
        "--matrix",
        action="store_true",
        help="instead of the suite: the tiny GLM-5's mismatch between every pair of backends "
        "(matrix.json/.md/.png and conformance.html in --report-dir)",
    )
    conf.add_argument(
        "--mutants",
        action="store_true",
        help="instead of the suite: its kill rate on the library of porting mutants of "
        "--backend (each op's kernel with one standard bug), mutants.json/.md in --report-dir",
    )
    conf.add_argument(
        "--backends",
        default=None,
        metavar="A,B,...",
        help="with --matrix: the backends to compare, the reference always among them "
        "(default: every one that runs here, natively or else emulated)",
    )
    conf.add_argument(
        "--dtypes", default=None, metavar="fp32,bf16", help="with --matrix (default: fp32,bf16)"
    )
    conf.add_argument(
        "--mustpass",
        default=None,
        metavar="VERSION",
        help="run exactly the checks of this mustpass list (of --ops when given): exit 1 when "
        "a required check fails or is missing; with --scorecard, the version to score against "
        "(default: the newest)",
    )
    conf.add_argument(
        "--scorecard",
        nargs="+",
        default=None,
        metavar="RUN",
        help="instead of the suite: one scorecard across finished runs, each RUN a "
        "conformance.json or a --report-dir holding one (scorecard.json/.md and "
        "conformance.html in --report-dir)",
    )
    conf.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="FILE",
        help="with --scorecard: a benchmark's results on the hardware, for the fraction of "
        "peak (repeatable; without one every peak is 'not measured')",
    )
    conf.set_defaults(func=_cmd_conformance)

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
    dif.add_argument("--model", default="tiny", help="'tiny' (random, seed 0) or a checkpoint dir")
    dif.add_argument("--backends", default=None, help="A,B: the two backends to compare")
    dif.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ids = dif.add_mutually_exclusive_group()
    ids.add_argument("--input-ids", default=None, help="comma-separated token ids (one sequence)")
    ids.add_argument(
        "--random",
        type=_integer(2, MAX_TOKENS, "tokens of one sequence"),
        default=32,
        metavar="N",
        help="N random tokens (default 32)",
    )
    dif.add_argument("--seed", type=_seed, default=0, help="seed of --random's tokens")
    dif.add_argument(
        "--follow",
        default=None,
        metavar="A",
        help="the other backend replays A's discrete choices (indexer top-k, experts)",
    )
    dif.add_argument("--emulate", action="store_true", help="run vendor backends on the CPU")
    dif.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="register a backend defined in code (a glmport Backend instance or a callable "
        "returning one), as glmport conformance --plugin does; repeatable",
    )
    dif.add_argument(
        "--out", default="glmport-diff", help="folder for the diverging call's replay file"
    )
    dif.add_argument("--replay", default=None, metavar="FILE", help="judge a saved op call")
    dif.add_argument("--json", action="store_true", help="print machine-readable JSON")
    dif.set_defaults(func=_cmd_diff)

    gen = sub.add_parser(
        "generate",
        help="continue a token id prompt with a GLM-5 model (greedy, sampled or speculative)",
        description="Generate with the paged KV cache. Greedy by default; any of "
        "--temperature, --top-p, --top-k, --seed switches to sampling.",
    )
    gen.add_argument(
        "--model", required=True, help="'tiny' (random, seed 0) or a checkpoint folder"
    )
    gen.add_argument("--input-ids", required=True, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=_integer(0, MAX_TOKENS, "tokens"), required=True)
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    gen.add_argument(
        "--temperature",
        type=float,  # its range is check_sampling's, the one check for every caller
        default=None,
    )
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=_integer(0, MAX_TOKENS, "0: off"), default=None)
    gen.add_argument("--seed", type=_seed, default=None, help="-2**63 to 2**64-1")
    gen.add_argument("--speculative", action="store_true", help="greedy MTP speculative decoding")
    gen.add_argument("--stop-tokens", default=None, help="token ids that end generation, e.g. 1,2")
    gen.add_argument("--backend", default=None, help="glmport backend (default: the selection)")
    gen.add_argument("--json", action="store_true", help="print machine-readable JSON")
    gen.set_defaults(func=_cmd_generate)

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
    ics.add_argument("--model", required=True, help="'tiny' (random, seed 0) or a checkpoint dir")
    calib = ics.add_mutually_exclusive_group(required=True)
    calib.add_argument(
        "--calib", default=None, metavar="FILE", help="token ids, one sequence per line"
    )
    calib.add_argument(
        "--random", type=_integer(1, MAX_COUNT, "sequences"), metavar="N", help="N random sequences"
    )
    ics.add_argument(
        "--seq-len",
        type=_integer(2, MAX_TOKENS, "a token and its next at least"),
        default=64,
        help="length of --random's sequences (64)",
    )
    ics.add_argument("--seed", type=_seed, default=0, help="seed of --random's tokens (0)")
    ics.add_argument(
        "--keep",
        type=_integer(1, MAX_COUNT, "layers"),
        required=True,
        metavar="K",
        help="full layers kept",
    )
    ics.add_argument(
        "--out", default=None, help="folder for the copy (default: <model>-indexcache-<K>)"
    )
    ics.add_argument("--backend", default=None, help="glmport backend (default: the selection)")
    ics.add_argument("--json", action="store_true", help="print machine-readable JSON")
    ics.set_defaults(func=_cmd_indexcache_search)

    exp = sub.add_parser(
        "export",
        help="export GLM-5 to ONNX (onnxruntime) or TVM (compiled for the CPU)",
        description="Export the model's prefill graph (input_ids [batch, seq] -> logits, "
        "latent and indexer caches) or, with --decode, one decode step on those caches; "
        "batch, sequence and cache axes stay dynamic. Then run the export on sample tokens "
        "and compare its logits with eager torch (skip with --no-check). Needs the export "
        "extra (onnx, onnxruntime, onnxscript, apache-tvm).",
    )
    targets = exp.add_subparsers(dest="target", required=True)
    for target, out_help in (("onnx", "the .onnx file to write"), ("tvm", "folder to write")):
        t = targets.add_parser(target, help=f"export to {target.upper()}")
        t.add_argument(
            "--model", required=True, help="'tiny' (random, seed 0) or a checkpoint folder"
        )
        t.add_argument("--out", required=True, help=out_help)
        t.add_argument("--decode", action="store_true", help="the decode-step graph")
        t.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
        t.add_argument("--backend", default=None, help="backend of the eager reference run")
        t.add_argument("--no-check", action="store_true", help="skip the check against torch")
        t.add_argument(
            "--tolerance",
            type=_real(0, "NaN or a negative bound would pass or fail every check"),
            default=1e-4,
            help="max |logits - torch|: a finite number >= 0",
        )
        t.set_defaults(func=_cmd_export)
    targets.choices["onnx"].add_argument(
        "--inline", action="store_true", help="standard ops only (no ai.glmport nodes)"
    )
    targets.choices["tvm"].add_argument(
        "--from",
        dest="source",
        choices=("torch", "onnx"),
        default="torch",
        help="torch.export -> Relax (default, dynamic axes), or the inlined ONNX export -> "
        "Relax (fixed axes: give --batch and --seq, or --batch and --past with --decode)",
    )
    for axis, size, limit in (
        ("batch", _integer(1, _MAX_FIXED_BATCH, "sequences"), f"1 to {_MAX_FIXED_BATCH}"),
        ("seq", _integer(1, MAX_TOKENS, "tokens"), "1 to the model's max_position_embeddings"),
        ("past", _integer(1, MAX_TOKENS, "tokens"), "1 to max_position_embeddings - 1"),
    ):
        targets.choices["tvm"].add_argument(
            f"--{axis}", type=size, default=None, help=f"fixed {axis} size (--from onnx): {limit}"
        )

    rl = sub.add_parser("rl", help="GLM-5's RL post-training on toy verifiable tasks")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True)
    tr = rl_sub.add_parser(
        "train",
        help="GRPO + IcePop (or on-policy distillation) on a tiny GLM-5",
        description="Synchronous RL: rollout on --rollout-backend in --rollout-dtype, "
        "training on --train-backend in fp32, the mismatch between them reported every "
        "step. Asynchronous RL (--mode async): Ray rollout workers on --rollout-backend, "
        "bounded staleness, double-sided importance sampling. Writes metrics.jsonl, "
        "curves.png and checkpoint/ (and ledger.jsonl when async) into --out.",
    )
    from glmport.rl.tasks import MAX_DIGITS
    from glmport.rl.trainer import DEFAULT_KL_COEF, DEFAULT_LR, DEFAULT_LR_DISTILL, RLConfig

    d = RLConfig()
    tr.add_argument("--task", choices=("reverse", "add"), default=None, help=f"default: {d.task}")
    tr.add_argument(
        "--digits",
        type=_integer(1, MAX_DIGITS, "a CPU-sized toy task"),
        default=None,
        help="digits per number (task default)",
    )
    tr.add_argument("--steps", type=int, default=None, help=f"RL steps (default {d.steps})")
    tr.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    tr.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    tr.add_argument(
        "--minibatches", type=int, default=d.minibatches, help="optimizer steps per rollout"
    )
    tr.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"Adam learning rate ({DEFAULT_LR:g}, {DEFAULT_LR_DISTILL:g} when distilling)",
    )
    tr.add_argument("--temperature", type=float, default=d.temperature, help="rollout temperature")
    tr.add_argument(
        "--icepop-beta", type=float, default=d.icepop_beta, help="IcePop band [1/b, b] (0: off)"
    )
    tr.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help=f"k3 KL to the initial policy ({DEFAULT_KL_COEF:g}, 0 when distilling; GLM-5: 0)",
    )
    tr.add_argument(
        "--kl-decay-steps",
        type=int,
        default=d.kl_decay_steps,
        help=f"steps over which the KL coefficient decays linearly to a fifth ({d.kl_decay_steps}; "
        "0: constant)",
    )
    tr.add_argument(
        "--normalize-std",
        action=argparse.BooleanOptionalAction,
        default=d.normalize_std,
        help="divide GRPO advantages by the group's std (GLM-5: no)",
    )
    tr.add_argument("--rollout-backend", default=None, help="default: the selection")
    tr.add_argument("--train-backend", default=None, help="default: the selection")
    tr.add_argument("--rollout-dtype", choices=("fp32", "bf16", "fp16"), default=d.rollout_dtype)
    tr.add_argument(
        "--replay",
        default="",
        help="rollout choices the training forward replays: routing, indices or both "
        "(comma-separated)",
    )
    tr.add_argument("--opd-teacher", default=None, help="checkpoint folder: distil it")
    tr.add_argument("--init", default=None, help="checkpoint folder to start the policy from")
    tr.add_argument("--shuffle-rewards", action="store_true", help="control: permuted rewards")
    tr.add_argument(
        "--model",
        type=_overrides,
        default={},
        help="tiny GLM-5 overrides, e.g. index_topk=4,hidden_size=96",
    )
    tr.add_argument("--out", required=True, help="run folder")
    tr.add_argument("--seed", type=_seed, default=d.seed, help=f"-2**63 to 2**64-1 ({d.seed})")
    tr.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints"
    )
    tr.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between greedy evaluations on held-out prompts (0: none)",
    )
    tr.add_argument(
        "--mode",
        choices=("sync", "async"),
        default=d.mode,
        help="sync: rollout then training each step; async: Ray rollout workers sample "
        "continuously, training takes groups up to --max-staleness versions old",
    )
    tr.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help=f"async: policy versions a trained group may lag ({d.max_staleness})",
    )
    tr.add_argument(
        "--rollout-workers",
        type=int,
        default=d.rollout_workers,
        help=f"async: Ray rollout workers ({d.rollout_workers})",
    )
    tr.add_argument(
        "--async-loss",
        choices=("dsis", "pg"),
        default=d.async_loss,
        help="async: dsis, direct double-sided importance sampling (GLM-5), or pg, plain "
        "policy gradient (the control)",
    )
    tr.add_argument(
        "--publish-every",
        type=int,
        default=d.publish_every,
        help="async: policy versions between weight updates of the rollout workers "
        f"({d.publish_every})",
    )
    tr.add_argument(
        "--ray-address",
        default=None,
        help="async: join this Ray cluster (default: start a local instance)",
    )
    tr.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="async: torch threads per rollout worker (default: cores / workers)",
    )
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=_cmd_rl_train, **dict.fromkeys(_RL_FLAGS))

    sv = rl_sub.add_parser(
        "serve",
        help="the token-in-token-out gateway: POST /generate, GET /health",
        description="Serve a policy over HTTP, token ids in and out (never text), with each "
        "session pinned to one rollout worker (consistent hashing) that reuses its KV cache. "
        "Binds 127.0.0.1 by default; another --host needs a bearer token (--token or "
        "GLMPORT_GATEWAY_TOKEN). Workers are Ray actors (a local Ray instance unless "
        "--ray-address), or in-process with --local.",
    )
    sv.add_argument(
        "--model",
        required=True,
        help="'tiny' (random, seed 0), a checkpoint folder, or an RL checkpoint "
        "(out/checkpoint: its policy and policy version)",
    )
    sv.add_argument(
        "--workers",
        type=_integer(1, MAX_WORKERS, "each holds a model"),
        default=1,
        help="rollout workers",
    )
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    sv.add_argument(
        "--port", type=_integer(0, 65535, "0: a free port"), default=8000, help="0: a free port"
    )
    sv.add_argument("--token", default=None, help="bearer token every request must send")
    sv.add_argument("--openapi", action="store_true", help="serve the schema at /openapi.json")
    sv.add_argument("--backend", default=None, help="workers' glmport backend")
    sv.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="workers' dtype")
    sv.add_argument(
        "--max-sessions",
        type=_integer(1, MAX_COUNT, "each holds a KV cache"),
        default=64,
        help="cached sessions per worker",
    )
    sv.add_argument(
        "--max-new-tokens-limit",
        type=_integer(1, MAX_TOKENS, "tokens"),
        default=None,
        help="largest max_new_tokens a request may ask (default 1024)",
    )
    where_sv = sv.add_mutually_exclusive_group()
    where_sv.add_argument("--ray-address", default=None, help="join this Ray cluster")
    where_sv.add_argument("--local", action="store_true", help="in-process workers, no Ray")
    sv.set_defaults(func=_cmd_rl_serve)

    ag = rl_sub.add_parser(
        "agent",
        help="multi-turn tool-use episodes of a toy agent through the token gateway",
        description="Plays toy agent episodes (sum numbers with an ADD tool, or values "
        "hidden behind a LOOKUP tool) through a token-in-token-out gateway: --gateway URL, "
        "or --model served in-process on a loopback port. Prints each episode's reward, "
        "turns, tokens generated / folded / dropped and KV-cache reuse.",
    )
    where = ag.add_mutually_exclusive_group()
    where.add_argument("--gateway", default=None, help="gateway URL, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--model",
        default=None,
        help="'tiny' (default), a model folder or an RL checkpoint, served in-process",
    )
    ag.add_argument("--token", default=None, help="bearer token of --gateway")
    ag.add_argument("--task", choices=("lookup", "add"), default="lookup")
    ag.add_argument("--episodes", type=_integer(1, MAX_COUNT, "episodes"), default=4)
    ag.add_argument(
        "--context",
        default="none",
        help="none | keep-recent:K | discard-all:T | hybrid:K,T (GLM-5's context management)",
    )
    ag.add_argument(
        "--max-turns",
        type=_integer(1, MAX_COUNT, "turns"),
        default=8,
        help="policy turns per episode",
    )
    ag.add_argument(
        "--max-context",
        type=_integer(1, MAX_TOKENS, "tokens"),
        default=256,
        help="request tokens (input + new) at most",
    )
    ag.add_argument("--temperature", type=float, default=1.0, help="sampling (0: greedy)")
    ag.add_argument("--seed", type=_seed, default=0, help="problems and sampling seeds")
    ag.add_argument("--json", action="store_true", help="one JSON object")
    ag.set_defaults(func=_cmd_rl_agent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; bad input is one ``glmport: error:`` line on stderr and
    exit status 2 (returned; raised as SystemExit for a malformed command line, as
    argparse does). The module docstring says what counts as bad input."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except GlmportError as err:
        return _fail(str(err))
    except OSError as err:
        if err.filename is None:  # not about a path the user named: a bug to report
            raise
        return _fail(f"{err.strerror or err}: {err.filename}")
    except KeyboardInterrupt:
        print("glmport: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _fail(message: str) -> int:
    # One line, whatever the message holds: a path or a value with a newline in it
    # must not start a second line that looks like output of its own.
    line = " ".join(message.split())
    print(f"glmport: error: {line}", file=sys.stderr)
    return EXIT_CONFIG
