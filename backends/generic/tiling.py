"""The generic backend's memory budget: how large a tile of intermediate values may be.

Every chunked op sizes its tiles so that one tile's intermediates stay under
``GLMPORT_TILE_MB`` mebibytes (default 256): extra memory is then O(budget), not
O(T * N) or O(T * V).
"""

from __future__ import annotations

from glmport.core import environment


def budget_bytes() -> int:
    """The tile budget in bytes (``GLMPORT_TILE_MB``, default 256 MiB), as parsed and
    checked by :mod:`glmport.core.environment` (a malformed value: ConfigError)."""
    return int(environment.read("GLMPORT_TILE_MB") * (1 << 20))


def rows_per_tile(bytes_per_row: int, total_rows: int) -> int:
    """How many rows of ``bytes_per_row`` intermediates fit the budget (at least 1)."""
    return max(1, min(total_rows, budget_bytes() // max(1, bytes_per_row)))
