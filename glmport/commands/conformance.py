"""``glmport conformance``: the shared conformance suite on one backend, run by pytest;
or instead the mismatch matrix across backends (``--matrix``), the scorecard across
finished runs (``--scorecard``), or the suite's kill rate on mutants (``--mutants``)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from glmport.commands import common
from glmport.core import environment
from glmport.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport conformance`` and its flags."""
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
    common.add_backend(
        conf, "backend to judge (default: the first --plugin's, else GLMPORT_BACKEND, else auto)"
    )
    common.add_plugin(
        conf,
        "register a backend defined in code: MODULE:ATTR names a glmport Backend "
        "instance or a callable returning one, registered in every pytest-xdist worker "
        "before the suite runs (MODULE must be importable there, e.g. via PYTHONPATH); "
        "repeatable",
    )
    common.add_emulate(conf, "run a vendor backend on the CPU")
    conf.add_argument("--full", action="store_true", help="full mode: larger GLM-5 shapes too")
    conf.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    conf.add_argument(
        "-n",
        dest="workers",
        type=common.workers,
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
    conf.set_defaults(func=run)


def _matrix(args: argparse.Namespace) -> int:
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


def _scorecard(args: argparse.Namespace) -> int:
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


def _mutants(args: argparse.Namespace, plugins: list[str]) -> int:
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


def run(args: argparse.Namespace) -> int:
    """``glmport conformance``: the suite on one backend (pytest's exit status), or one
    of --scorecard, --mutants, --matrix instead."""
    import pytest

    from glmport.conformance import suite
    from glmport.core.registry import REGISTRY, register_backend_target

    # Registered here to check them and name the default backend; the suite's plug-in
    # registers them again in every pytest-xdist worker.
    plugins = [register_backend_target(t) for t in args.plugin]
    common.check_environment()
    common.check_out(args.report_dir, "--report-dir")
    if args.scorecard is not None:
        return _scorecard(args)
    if args.bench:
        raise ConfigError("--bench goes with --scorecard (its peaks fill the scorecard)")
    if args.mutants:
        return _mutants(args, plugins)
    if args.matrix:
        return _matrix(args)
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
