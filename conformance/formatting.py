"""How the reports' cells and lines read, shared by the Markdown / terminal reports
(:mod:`.report`, :mod:`.matrix`) and the HTML page (:mod:`.html`)."""

from __future__ import annotations

# The environment keys every report names on their own line; the rest is the stack.
NOT_STACK = ("glmport", "python", "torch", "device", "device_name")


def stack_text(environment: dict) -> str:
    """The environment's other versions (``"triton 3.1, torch_npu -"``; "" when none)."""
    return ", ".join(f"{k} {v or '-'}" for k, v in environment.items() if k not in NOT_STACK)


def worst_text(worst: float | None) -> str:
    """A worst error / tolerance ratio: ``"0.123"``, or ``"-"`` when none was measured."""
    return "-" if worst is None else f"{worst:.3f}"


def shapes_text(params: dict) -> str:
    """A case's sizes, compactly: ``t=5, h=4, shape=5x32``."""
    shown = ("x".join(map(str, v)) if isinstance(v, list) else str(v) for v in params.values())
    return ", ".join(f"{k}={s}" for k, s in zip(params, shown, strict=True)) or "-"


def md_cell(text: str) -> str:
    """``text`` safe in one Markdown table cell (pipes escaped, on one line)."""
    return text.replace("|", "\\|").replace("\n", " ")


def sci(value: float) -> str:
    """Two significant digits (``"3.1e-05"``, ``"0.12"``); ``"0"`` for zero."""
    return "0" if value == 0 else f"{value:.2g}"


def pair_text(pair: dict | None, sep: str) -> str:
    """A mismatch-matrix cell: mean |delta logp| and greedy agreement, joined by ``sep``
    (``"0"`` on the diagonal, ``pair`` None)."""
    if pair is None:
        return "0"
    return f"{sci(pair['mean_abs_dlogp'])}{sep}{pair['greedy_agreement']:.0%}"
