"""The mismatch matrix: the model-level mismatch of every pair of backends.

Each backend (the reference always among them) runs the tiny GLM-5 of
:mod:`.model_case` once per dtype, float weights, on the fixed prompt set: the
log-probability of every real next token at temperature 1 and the greedy token (argmax
of the logits) at every real position. Every unordered pair then gets mean / max
``|delta logp|``, the fraction of tokens IcePop would pop at ``beta = 2`` (the model
check's metrics) and the fraction of positions where the greedy tokens agree.

A backend available only under emulation runs emulated (and is marked so); one that
raises on the model is recorded with its error and left out of the pairs.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from glmport.core.environment import device_name, versions
from glmport.core.errors import ConfigError
from glmport.core.extras import install_command
from glmport.core.formats import FLOAT_WEIGHT
from glmport.core.registry import REGISTRY
from glmport.core.selection import use_backend

from .calls import device_for
from .formatting import md_cell, pair_text, sci
from .model_case import (
    ICEPOP_BETA,
    TEMPERATURES,
    backend_outputs,
    model_inputs,
    pair_metrics,
    tiny_model,
)
from .runner import dtype_name

SCHEMA_VERSION = 1
# --dtypes spellings -> dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A grid cell whose pair did not run: one of its backends raised on the model.
NO_PAIR = "error"


def parse_dtypes(text: str, flag: str = "--dtypes") -> tuple[torch.dtype, ...]:
    """``"fp32,bf16"`` -> ``(torch.float32, torch.bfloat16)``; ConfigError naming
    ``flag`` for anything else."""
    names = [part.strip() for part in text.split(",")]
    bad = [n for n in names if n not in DTYPES]
    if bad:
        raise ConfigError(
            f"{flag} takes comma-separated dtypes from {', '.join(DTYPES)}, got {text!r}"
        )
    return tuple(dict.fromkeys(DTYPES[n] for n in names))


def select_backends(names: Sequence[str] | None) -> tuple[list[tuple[str, bool]], list[dict]]:
    """The backends to run, as ``(name, emulated)`` with the reference first, and the
    registered ones left out as unavailable (``{name, reason}``; only when ``names``
    is None: every backend that runs here, natively or else emulated). A backend
    named explicitly must exist (else the registry's error listing the valid names)
    and run here (else ConfigError with the reason)."""
    reference = REGISTRY.reference()
    explicit = names is not None
    wanted = list(dict.fromkeys([reference, *(names if explicit else REGISTRY.names())]))
    chosen, unavailable = [], []
    for name in wanted:
        REGISTRY.get(name, "--backends")
        native = REGISTRY.availability(name, False)
        emulated = native if native.ok else REGISTRY.availability(name, True)
        if emulated.ok:
            chosen.append((name, not native.ok))
            continue
        reason = native.reason
        if emulated.reason != native.reason:
            reason += f"; emulated: {emulated.reason}"
        if explicit:
            raise ConfigError(f"--backends: backend {name!r} cannot run here: {reason}")
        unavailable.append({"name": name, "reason": reason})
    return chosen, unavailable


def mismatch_matrix(
    backends: Sequence[str] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the tiny GLM-5 once per backend and dtype and compare every pair.

    Args:
        backends: names to compare (the reference is always added); None: every
            registered backend that runs here, natively or else emulated.
        dtypes: the model's dtypes.
        progress: called with one line per backend and dtype as each finishes.

    Returns:
        ``{schema_version, environment, dtypes, icepop_beta, tokens, backends:
        [{name, emulated, device, seconds, runs: {dtype: {seconds, error}}}],
        unavailable: [{name, reason}], pairs: [{a, b, dtype, mean_abs_dlogp,
        max_abs_dlogp, icepop_pop_fraction, greedy_agreement}]}``; dtypes by name
        (``"float32"``), ``error`` None or the exception the backend raised.
    """
    chosen, unavailable = select_backends(backends)
    entries = {
        name: {
            "name": name,
            "emulated": emulated,
            "device": str(device_for(REGISTRY.get(name).device_type(emulated))),
            "seconds": 0.0,
            "runs": {},
        }
        for name, emulated in chosen
    }
    ids, mask = model_inputs()
    pairs, tokens = [], 0
    for dtype in dtypes:
        dt = dtype_name(dtype)
        model = tiny_model(dtype, FLOAT_WEIGHT, FLOAT_WEIGHT)
        done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for entry in entries.values():
            name, error = entry["name"], None
            start = time.perf_counter()
            try:
                with use_backend(name, emulate=entry["emulated"]):
                    logp, greedy = backend_outputs(
                        copy.deepcopy(model), name, ids, mask, torch.device(entry["device"])
                    )
                done[name] = (logp[TEMPERATURES.index(1.0)], greedy)
                tokens = int(logp.shape[1])
            except Exception as err:  # a backend's failure is a result, never the run's end
                error = f"{type(err).__name__}: {err}"
            seconds = round(time.perf_counter() - start, 3)
            entry["runs"][dt] = {"seconds": seconds, "error": error}
            entry["seconds"] = round(entry["seconds"] + seconds, 3)
            if progress is not None:
                how = " (emulated)" if entry["emulated"] else ""
                what = f"error: {error}" if error else f"{seconds:.1f} s"
                progress(f"matrix: {name}{how} {dt}: {what}")
        names = list(done)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                (la, ga), (lb, gb) = done[a], done[b]
                pairs.append({"a": a, "b": b, "dtype": dt, **pair_metrics(la, lb, ga, gb)})
    return {
        "schema_version": SCHEMA_VERSION,
        "environment": {**versions(), "host": device_name(torch.device("cpu"))},
        "dtypes": [dtype_name(d) for d in dtypes],
        "icepop_beta": ICEPOP_BETA,
        "tokens": tokens,
        "backends": list(entries.values()),
        "unavailable": unavailable,
        "pairs": pairs,
    }


def grid(result: dict, dtype: str) -> tuple[list[str], list[list[dict | str | None]]]:
    """The ``dtype`` panel: every backend's name and an ``[n][n]`` grid of the pairs'
    metrics: None on the diagonal, :data:`NO_PAIR` where a backend raised."""
    names = [b["name"] for b in result["backends"]]
    failed = {b["name"] for b in result["backends"] if b["runs"][dtype]["error"]}
    pairs = {(p["a"], p["b"]): p for p in result["pairs"] if p["dtype"] == dtype}
    return names, [
        [
            NO_PAIR if {a, b} & failed else None if a == b else pairs.get((a, b), pairs.get((b, a)))
            for b in names
        ]
        for a in names
    ]


def backend_errors(result: dict, backend: dict) -> str:
    """``"bfloat16: <error>; ..."``: what ``backend`` (an entry of ``result["backends"]``)
    raised on the model, per dtype ("" when nothing)."""
    runs = backend["runs"]
    return "; ".join(f"{d}: {runs[d]['error']}" for d in result["dtypes"] if runs[d]["error"])


def markdown(result: dict) -> str:
    """``matrix.md``: per dtype a backends x backends table (mean |delta logp| and
    greedy agreement), then every pair, the backends with their times and errors."""
    env = result["environment"]
    lines = [
        "# glmport mismatch matrix",
        "",
        f"Tiny GLM-5, float weights, {result['tokens']} next tokens of a fixed prompt set, "
        f"temperature 1; IcePop beta {result['icepop_beta']:g}. "
        f"glmport {env['glmport']}, torch {env['torch']}, python {env['python']}; {env['host']}.",
        "",
    ]
    heatmap = result.get("heatmap")
    if heatmap is not None and heatmap["file"] is None:
        lines += [f"No heatmap: {heatmap['why']}.", ""]
    for dtype in result["dtypes"]:
        names, cells = grid(result, dtype)
        lines += [
            f"## {dtype}: mean |delta logp| / greedy agreement",
            "",
            "| | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        for a, row in zip(names, cells, strict=True):
            shown = (p if isinstance(p, str) else pair_text(p, " / ") for p in row)
            lines.append(f"| **{a}** | " + " | ".join(shown) + " |")
        lines.append("")
    lines += [
        "## Pairs",
        "",
        "| dtype | a | b | mean abs dlogp | max abs dlogp | IcePop pop | greedy agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        lines.append(
            f"| {p['dtype']} | {p['a']} | {p['b']} | {sci(p['mean_abs_dlogp'])} | "
            f"{sci(p['max_abs_dlogp'])} | {p['icepop_pop_fraction']:.1%} | "
            f"{p['greedy_agreement']:.1%} |"
        )
    lines += [
        "",
        "## Backends",
        "",
        "| backend | emulated | device | "
        + " | ".join(f"{d} s" for d in result["dtypes"])
        + " | errors |",
        "|---" * (4 + len(result["dtypes"])) + "|",
    ]
    for b in result["backends"]:
        runs = [b["runs"][d] for d in result["dtypes"]]
        errors = backend_errors(result, b)
        lines.append(
            f"| {b['name']} | {'yes' if b['emulated'] else 'no'} | {b['device']} | "
            + " | ".join(f"{r['seconds']:.1f}" for r in runs)
            + f" | {md_cell(errors) or '-'} |"
        )
    if any(r["error"] for b in result["backends"] for r in b["runs"].values()):
        lines += ["", "A backend that raised on the model is left out of that dtype's pairs."]
    for u in result["unavailable"]:
        lines.append(f"- not available here: {u['name']} ({md_cell(u['reason'])})")
    return "\n".join(lines) + "\n"


def heatmap(result: dict, path: Path) -> None:
    """``matrix.png``: one panel per dtype, cells coloured by mean |delta logp| on a
    log scale shared by the panels (exact agreement, the diagonal included, in a colour
    of its own: a log scale has no 0), each annotated with the value and the greedy
    agreement. Needs matplotlib (ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    panels = [(d, *grid(result, d)) for d in result["dtypes"]]
    values = [
        p["mean_abs_dlogp"]
        for _, _, cells in panels
        for row in cells
        for p in row
        if isinstance(p, dict) and math.isfinite(p["mean_abs_dlogp"]) and p["mean_abs_dlogp"] > 0
    ]
    low, high = (min(values), max(values)) if values else (1e-8, 1.0)
    if high <= low:
        low, high = low / 10, high * 10
    norm = LogNorm(vmin=low, vmax=high)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")  # 0 and error cells
    size = len(result["backends"]) or 1
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.2 * size * len(panels) + 2.5, 1.1 * size + 1.6), squeeze=False
    )
    labels = [b["name"] + (" (emulated)" if b["emulated"] else "") for b in result["backends"]]
    image = None
    for ax, (dtype, names, cells) in zip(axes[0], panels, strict=True):
        data = [[_shade(p) for p in row] for row in cells] or [[float("nan")]]
        image = ax.imshow(data, cmap=cmap, norm=norm)
        ax.set_title(f"{dtype}: mean |Δ logp|, greedy agreement", fontsize=9)
        ax.set_xticks(range(len(names)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_yticks(range(len(names)), labels if ax is axes[0][0] else [], fontsize=8)
        for i, row in enumerate(cells):
            for j, p in enumerate(row):
                text = p if isinstance(p, str) else pair_text(p, "\n")
                value = data[i][j]
                dark = math.isfinite(value) and norm(value) < 0.6  # viridis: dark at the low end
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")  # fmt: skip
    fig.colorbar(
        image, ax=list(axes[0]), shrink=0.8, label="mean |Δ logp| (log scale; grey: 0 or not run)"
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _shade(pair: dict | str | None) -> float:
    """A cell's colour value: mean |delta logp|, NaN (grey) for 0 and errors."""
    if not isinstance(pair, dict) or not pair["mean_abs_dlogp"] > 0:
        return float("nan")
    return pair["mean_abs_dlogp"]


def write_matrix(result: dict, directory: str | Path) -> list[Path]:
    """Write ``matrix.json``, ``matrix.md`` and (with matplotlib) ``matrix.png`` into
    ``directory``; the result gains ``heatmap``: ``{file, why}`` (``file`` None and
    ``why`` the reason when there is no image). Returns the paths written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "matrix.png"
    try:
        heatmap(result, png)
        result["heatmap"] = {"file": png.name, "why": ""}
    except ImportError:
        png.unlink(missing_ok=True)  # a stale image would show another run's figures
        why = f"matplotlib is not installed: {install_command(['matplotlib'])}"
        result["heatmap"] = {"file": None, "why": why}
    json_path, md_path = out / "matrix.json", out / "matrix.md"
    json_path.write_text(json.dumps(result, indent=2))
    md_path.write_text(markdown(result))
    return [json_path, md_path] + ([png] if result["heatmap"]["file"] else [])
