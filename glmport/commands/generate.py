"""``glmport generate``: continue a prompt of token ids with a GLM-5 model, greedy,
sampled or by MTP speculative decoding, on the paged KV cache."""

from __future__ import annotations

import argparse
import json

from glmport.commands import common
from glmport.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport generate`` and its flags."""
    gen = sub.add_parser(
        "generate",
        help="continue a token id prompt with a GLM-5 model (greedy, sampled or speculative)",
        description="Generate with the paged KV cache. Greedy by default; any of "
        "--temperature, --top-p, --top-k, --seed switches to sampling.",
    )
    common.add_model(gen, layers=True)
    gen.add_argument("--input-ids", required=True, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument(
        "--max-new-tokens", type=common.integer(0, common.MAX_TOKENS, "tokens"), required=True
    )
    gen.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    gen.add_argument(
        "--temperature",
        type=float,  # its range is check_sampling's, the one check for every caller
        default=None,
    )
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=common.integer(0, common.MAX_TOKENS, "0: off"), default=None)
    gen.add_argument("--seed", type=common.seed, default=None, help="-2**63 to 2**64-1")
    gen.add_argument("--speculative", action="store_true", help="greedy MTP speculative decoding")
    gen.add_argument("--stop-tokens", default=None, help="token ids that end generation, e.g. 1,2")
    common.add_backend(gen)
    common.add_json(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``glmport generate``: the output ids and the speed, as text or JSON."""
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
    common.check_environment()
    input_ids = common.parse_ids(args.input_ids, "--input-ids")
    stop_tokens = common.parse_ids(args.stop_tokens, "--stop-tokens") if args.stop_tokens else []
    model = common.load_model(args.model, layers=args.layers)
    with common.select_backend(args.backend, "--backend"):
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
