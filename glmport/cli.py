"""The ``glmport`` command line: ``glmport info [--json]``, ``glmport conformance``,
``glmport diff``, ``glmport generate``, ``glmport indexcache search``,
``glmport export onnx|tvm``, ``glmport rl train|serve|agent``.

This module is the dispatcher: it assembles the parser from the command modules of
:mod:`glmport.commands` (each declares its flags and runs its command) and owns the
error-line policy. ``collect_info`` is re-exported: ``glmport info``'s report as data.

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
import sys
from collections.abc import Sequence
from typing import NoReturn

from glmport.commands import conformance, diff, export, generate, indexcache, info, rl
from glmport.commands.info import collect_info
from glmport.core.errors import GlmportError

__all__ = ["EXIT_CONFIG", "EXIT_INTERRUPTED", "build_parser", "collect_info", "main"]

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # the shell's convention for a SIGINT

# In the order ``glmport --help`` lists them.
_COMMANDS = (info, conformance, diff, generate, indexcache, export, rl)


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


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each parsed command line's ``func`` runs it."""
    parser = _Parser(
        prog="glmport",
        description="GLM-5 and its RL post-training on any accelerator. "
        "Select a backend with GLMPORT_BACKEND (see `glmport info`).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(sub)
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
