"""``glmport rl serve``: the token-in-token-out gateway over HTTP, its rollout workers
Ray actors or in-process."""

from __future__ import annotations

import argparse
import os

from glmport.commands import common
from glmport.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport rl serve`` and its flags."""
    sv = sub.add_parser(
        "serve",
        help="the token-in-token-out gateway: POST /generate, GET /health",
        description="Serve a policy over HTTP, token ids in and out (never text), with each "
        "session pinned to one rollout worker (consistent hashing) that reuses its KV cache. "
        "Binds 127.0.0.1 by default; another --host needs a bearer token (--token or "
        "GLMPORT_GATEWAY_TOKEN). Workers are Ray actors (a local Ray instance unless "
        "--ray-address), or in-process with --local.",
    )
    common.add_model(
        sv,
        help="'tiny' (random, seed 0), a checkpoint folder, or an RL checkpoint "
        "(out/checkpoint: its policy and policy version)",
    )
    sv.add_argument(
        "--workers",
        type=common.integer(1, common.MAX_WORKERS, "each holds a model"),
        default=1,
        help="rollout workers",
    )
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    sv.add_argument(
        "--port",
        type=common.integer(0, 65535, "0: a free port"),
        default=8000,
        help="0: a free port",
    )
    sv.add_argument("--token", default=None, help="bearer token every request must send")
    sv.add_argument("--openapi", action="store_true", help="serve the schema at /openapi.json")
    common.add_backend(sv, "workers' glmport backend")
    common.add_dtype(sv, "workers' dtype")
    sv.add_argument(
        "--max-sessions",
        type=common.integer(1, common.MAX_COUNT, "each holds a KV cache"),
        default=64,
        help="cached sessions per worker",
    )
    sv.add_argument(
        "--max-new-tokens-limit",
        type=common.integer(1, common.MAX_TOKENS, "tokens"),
        default=None,
        help="largest max_new_tokens a request may ask (default 1024)",
    )
    where_sv = sv.add_mutually_exclusive_group()
    where_sv.add_argument("--ray-address", default=None, help="join this Ray cluster")
    where_sv.add_argument("--local", action="store_true", help="in-process workers, no Ray")
    sv.set_defaults(func=run)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """``glmport rl serve``: serve until Ctrl-C."""
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
    common.check_environment()
    with common.select_backend(
        args.backend, "--backend"
    ):  # the workers' backend, checked here first
        pass
    spec, version = policy_source(args.model)
    model = common.load_model(spec)
    if args.max_new_tokens_limit is not None:
        common.fits_model(model, "--max-new-tokens-limit", args.max_new_tokens_limit)
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
