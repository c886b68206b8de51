"""``glmport rl``: the group of GLM-5's RL commands, ``train``, ``serve`` and ``agent``,
each in its own module."""

from __future__ import annotations

import argparse

from glmport.commands import rl_agent, rl_serve, rl_train


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport rl`` and its subcommands."""
    rl = sub.add_parser("rl", help="GLM-5's RL post-training on toy verifiable tasks")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True)
    for command in (rl_train, rl_serve, rl_agent):
        command.add_parser(rl_sub)
