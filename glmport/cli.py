"""The ``glmport`` command line: ``glmport info [--json]``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from importlib import metadata

from glmport.core.errors import GlmportError

EXIT_CONFIG = 2


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_info() -> dict:
    """Everything ``glmport info`` reports, as plain data. Raises GlmportError on a bad
    configuration (unknown backend, malformed variable)."""
    import torch

    import glmport
    from glmport.core.registry import REGISTRY
    from glmport.core.selection import _ENV_VARS, current_settings, primary_backend, resolve
    from glmport.core.specs import OP_NAMES

    settings = current_settings()
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
                ops=list(m.ops),
                fallback=list(m.fallback),
                emulation=m.emulation,
                verified=m.verified,
            )
        except GlmportError as err:
            entry.update(reason=str(err))
        backends.append(entry)
    ops = {}
    for op in OP_NAMES:
        res = resolve(op, settings)
        ops[op] = {"backend": res.backend, "chain": list(res.chain), "device_type": res.device_type}
    cann = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    return {
        "glmport": glmport.__version__,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "torch_npu": _version("torch-npu"),
            "cann": cann,
        },
        "environment": {var: os.environ.get(var) for var in _ENV_VARS},
        "selected_backend": primary,
        "device": settings.device or ("cpu" if primary == "cpu" else None),
        "emulate": settings.emulate,
        "accelerators": {"cuda": torch.cuda.is_available()},
        "backends": backends,
        "ops": ops,
    }


def _print_info(info: dict) -> None:
    v = info["versions"]
    print(f"glmport {info['glmport']}")
    print(
        f"  python {v['python']}, torch {v['torch']}, triton {v['triton'] or 'not installed'}, "
        f"torch_npu {v['torch_npu'] or 'not installed'}, CANN {v['cann'] or 'not found'}"
    )
    print(f"  CUDA device visible to torch: {'yes' if info['accelerators']['cuda'] else 'no'}")
    print("\nselection")
    for var, value in info["environment"].items():
        print(f"  {var:<22} {value if value is not None else '(unset)'}")
    print(
        f"  -> backend {info['selected_backend']!r}, emulate={'on' if info['emulate'] else 'off'}"
    )
    print("\nbackends")
    rows = [("name", "device", "status", "ops", "verified on")]
    for b in info["backends"]:
        status = (
            ("available" + (" (emulated)" if b["emulated"] else ""))
            if b["available"]
            else "unavailable"
        )
        rows.append(
            (
                b["name"],
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
    print("\nops (where each runs under the current selection)")
    _table(
        [("op", "runs on", "path")]
        + [(op, r["backend"], " -> ".join(r["chain"])) for op, r in info["ops"].items()]
    )


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glmport",
        description="GLM-5 and its RL post-training on any accelerator. "
        "Select a backend with GLMPORT_BACKEND (see `glmport info`).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backends, versions, and where each op runs")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GlmportError as err:
        print(f"glmport: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
