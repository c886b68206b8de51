"""``glmport export onnx|tvm``: export GLM-5's prefill or decode-step graph to ONNX or
to TVM (compiled for the CPU), then check it against the eager model."""

from __future__ import annotations

import argparse
import sys
import time

from glmport.commands import common
from glmport.core.errors import ConfigError, UnsupportedError

# ``export tvm --from onnx --batch``: one compiled call's sequences; the check after the
# export runs the eager model on that many.
_MAX_FIXED_BATCH = 1024


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport export`` and its targets ``onnx`` and ``tvm`` with their flags."""
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
        common.add_model(t, layers=True)
        t.add_argument("--out", required=True, help=out_help)
        t.add_argument("--decode", action="store_true", help="the decode-step graph")
        common.add_dtype(t)
        common.add_backend(t, "backend of the eager reference run")
        t.add_argument("--no-check", action="store_true", help="skip the check against torch")
        t.add_argument(
            "--tolerance",
            type=common.real(0, "NaN or a negative bound would pass or fail every check"),
            default=1e-4,
            help="max |logits - torch|: a finite number >= 0",
        )
        t.set_defaults(func=run)
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
        ("batch", common.integer(1, _MAX_FIXED_BATCH, "sequences"), f"1 to {_MAX_FIXED_BATCH}"),
        (
            "seq",
            common.integer(1, common.MAX_TOKENS, "tokens"),
            "1 to the model's max_position_embeddings",
        ),
        (
            "past",
            common.integer(1, common.MAX_TOKENS, "tokens"),
            "1 to max_position_embeddings - 1",
        ),
    ):
        targets.choices["tvm"].add_argument(
            f"--{axis}", type=size, default=None, help=f"fixed {axis} size (--from onnx): {limit}"
        )


def run(args: argparse.Namespace) -> int:
    """Export, save, and (unless --no-check) run the export against the eager model."""
    from glmport.export.check import compare

    common.check_environment()
    _require_export_extra()
    kind = "decode" if args.decode else "prefill"
    common.check_out(args.out, "--out", folder=args.target == "tvm")
    fixed = _fixed_axes(args, kind) if args.target == "tvm" else None
    model = common.load_model(args.model, args.dtype, args.layers)
    if fixed and "seq" in fixed:
        common.fits_model(model, "--seq", fixed["seq"])
    if fixed and "past" in fixed:
        common.fits_model(model, f"--past {fixed['past']} (+ the new token)", fixed["past"] + 1)
    start = time.perf_counter()
    with common.select_backend(args.backend, "--backend"):
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
