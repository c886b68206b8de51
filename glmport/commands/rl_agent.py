"""``glmport rl agent``: multi-turn tool-use episodes of a toy agent through the token
gateway, remote (``--gateway``) or served in-process."""

from __future__ import annotations

import argparse
import json

from glmport.commands import common
from glmport.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport rl agent`` and its flags."""
    ag = sub.add_parser(
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
    ag.add_argument("--episodes", type=common.integer(1, common.MAX_COUNT, "episodes"), default=4)
    ag.add_argument(
        "--context",
        default="none",
        help="none | keep-recent:K | discard-all:T | hybrid:K,T (GLM-5's context management)",
    )
    ag.add_argument(
        "--max-turns",
        type=common.integer(1, common.MAX_COUNT, "turns"),
        default=8,
        help="policy turns per episode",
    )
    ag.add_argument(
        "--max-context",
        type=common.integer(1, common.MAX_TOKENS, "tokens"),
        default=256,
        help="request tokens (input + new) at most",
    )
    ag.add_argument("--temperature", type=float, default=1.0, help="sampling (0: greedy)")
    ag.add_argument("--seed", type=common.seed, default=0, help="problems and sampling seeds")
    ag.add_argument("--json", action="store_true", help="one JSON object")
    ag.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``glmport rl agent``: play the episodes; print each one and the mean."""
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

            common.check_environment()
            spec, version = policy_source("tiny" if args.model is None else args.model)
            model = common.load_model(spec)
            common.fits_model(model, "--max-context", args.max_context)
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
