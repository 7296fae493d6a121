"""The differential fuzzer of ``tests/mpi/test_fuzz.py`` on device arrays.

The same drawn cases (operation, algorithm, dtype, reduce op, sizes, group)
run on CuPy arrays over the NCCL and the staged backend (the stand-in when
no GPU is here), compared bit for bit with native MPI on the host copies of
the same data. ``FUZZ_DEVICE_EXAMPLES`` sets the budget (100 by default).
"""
from __future__ import annotations

import os

import cupy as cp
import pytest

from gpu_cases import load_mpi_tests

pytestmark = pytest.mark.mpi(min_size=1)
F = load_mpi_tests("test_fuzz")


@pytest.mark.parametrize("backend", ["nccl", "staged"])
def test_fuzz_device_arrays_against_native_mpi(world, all_ranks, monkeypatch, backend):
    monkeypatch.setenv("NEOCOMM_BACKEND", backend)
    F.fuzz(world, all_ranks, cp, int(os.environ.get("FUZZ_DEVICE_EXAMPLES", "100")))
