"""Test isolation: every test starts from the default selection (no GLMPORT_* set)."""

from __future__ import annotations

import os

import pytest
import torch

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


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny-tensor ops: a second intra-op thread only adds
    synchronisation and contends with the other xdist worker (~10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
