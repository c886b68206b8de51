"""Test isolation: every test starts from the default selection (no GLMPORT_* set)."""

from __future__ import annotations

import os

# numpy's BLAS threads (the Triton interpreter's block math) contend with the other
# pytest-xdist worker on a small machine: one thread each, set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest
import torch

# The tests run the cuda backend's Triton kernels through the interpreter only; set
# before anything (torch.compile's inductor included) imports triton, which defines its
# own helpers in one mode for the whole process.
os.environ.setdefault("TRITON_INTERPRET", "1")

import glmport
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


@pytest.fixture
def reference_backend():
    """Run the test on the cpu reference backend (``auto`` picks generic on a CPU):
    the reference's own tests use it with ``pytestmark``."""
    with glmport.use_backend("cpu"):
        yield


@pytest.fixture(scope="module")
def one_thread():
    """For modules of many tiny-tensor ops: a second intra-op thread only adds
    synchronisation and contends with the other xdist worker (~10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cuda_module():
    """Import a module of the cuda backend, its Triton kernels interpreted on the CPU
    (``TRITON_INTERPRET`` is set above, before any kernel is defined):
    ``cuda_module("attention")``."""
    import importlib

    def load(name: str):
        return importlib.import_module(f"glmport.backends.cuda.{name}")

    return load


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance (2 CPUs) per test process, started by the first test that
    asks for it and shut down at the end of the session: every Ray start costs seconds
    (much more on a loaded machine), and code under test that enters ``ray_session``
    reuses a running instance."""
    ray = pytest.importorskip("ray", reason="the rl extra (ray) is not installed")
    from glmport.rl.ray_runtime import ray_session

    with ray_session(num_cpus=2):
        yield ray
