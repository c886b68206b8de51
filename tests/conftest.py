"""Test isolation: every test starts from the default selection (no GLMPORT_* set)."""

from __future__ import annotations

import os

import pytest

from glmport.core import shadow
from glmport.core.selection import clear_cache


@pytest.fixture(autouse=True)
def _clean_glmport_env(monkeypatch: pytest.MonkeyPatch):
    for var in [v for v in os.environ if v.startswith("GLMPORT_")]:
        monkeypatch.delenv(var)
    clear_cache()
    shadow.reset()
    yield
    clear_cache()
    shadow.reset()
