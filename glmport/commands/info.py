"""``glmport info``: the installed backends (available or not, and why), the versions,
and where every op runs. :func:`collect_info` gives the same report as plain data."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from glmport.commands import common
from glmport.core import environment
from glmport.core.environment import versions
from glmport.core.errors import GlmportError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``glmport info`` and its flags."""
    info = sub.add_parser(
        "info",
        help="backends, versions, and where each op runs",
        description="Show the installed backends (available or not, and why), the "
        "versions, and where every op and expert_parallel runs: under the current "
        "selection, or with --backend selected.",
    )
    common.add_backend(
        info, "show where each op runs with this backend selected (its fallback chain)"
    )
    common.add_emulate(info, "as selected with GLMPORT_EMULATE=1")
    common.add_json(info)
    info.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    """``glmport info``: the report, as text or JSON."""
    info = collect_info(args.backend, args.emulate, source="--backend")
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0
