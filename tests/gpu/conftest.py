"""Device tests: on a real GPU when CuPy sees one, on the device stand-in otherwise.

They are never skipped for want of a GPU: without one, ``tests/devsim``
(a CuPy and NCCL stand-in that enforces their rules, and the CUDA kernels
run on a CPU OpenCL device) takes CuPy's place before any test imports it.
Tests marked ``mpi`` run under ``mpirun`` (``scripts/run_tests.py`` runs
them at 2 and 4 ranks, on one and on two emulated nodes).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "devsim")))
from activate import use_standin  # noqa: E402

#: True when the device tests run on the stand-in (no real GPU here)
STANDIN = use_standin()
# The staged backend's pool is a few pieces of the larger test messages.
os.environ.setdefault("NEOCOMM_STAGING_BYTES", "64KiB")
# The stand-in fails a stalled NCCL call well before the job's watchdog would.
os.environ.setdefault("DEVSIM_STALL", "20")


@pytest.fixture(scope="session")
def world():
    import neocomm

    return neocomm.init()


@pytest.fixture
def all_ranks(world):
    """``all_ranks(ok, msg)`` asserts ``ok`` on every rank at once."""
    from mpi4py import MPI

    def check(ok, msg=""):
        assert world.comm.allreduce(bool(ok), op=MPI.LAND), msg or "failed on at least one rank"

    return check


@pytest.fixture
def rng(world) -> np.random.Generator:
    return np.random.default_rng(4321 + world.rank)


standin_only = pytest.mark.skipif(not STANDIN, reason="checks the device stand-in itself; a "
                                                      "real GPU is in use")


@pytest.fixture(params=["nccl", "staged"])
def device_backend(request, monkeypatch, world):
    """Each device backend in turn (``NEOCOMM_BACKEND``): NCCL, and the staged backend
    (device buffers through host MPI); skipped with the reason when one is unavailable, or
    NCCL on a real host with fewer GPUs than ranks."""
    from gpu_cases import skip_unless_usable

    skip_unless_usable(request.param, world)
    monkeypatch.setenv("NEOCOMM_BACKEND", request.param)
    return request.param
