"""Buffers of more than 2^31 - 1 elements: MPI's counts are C ints.

Broadcast and AllReduce (elementwise) go through the MPI backend in pieces
that fit; for the other collectives MPI's own call is not selected when a
count or displacement would not fit (the chunked algorithms run instead).
The large runs move 2 GiB per rank, so they run at 2 ranks only and need
12 GiB of free memory (they say so and skip otherwise).
"""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.algorithms import registry
from collectives.fabric import fabric_for
from collectives.select import select
from collectives.types import CollectiveOp, Request

pytestmark = pytest.mark.layouts("1x2", why=(
    "MPI's count limit is the same on any layout, and 2 GiB a rank is moved once"))

N = (1 << 31) + 8  # elements, one byte each


def _free_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.fixture
def big(world):
    if world.size != 2:
        pytest.skip("moves 2 GiB per rank: run at 2 ranks only")
    free = world.comm.allreduce(_free_gib(), op=__import__("mpi4py").MPI.MIN)
    if free < 12:
        pytest.skip(f"needs 12 GiB of free memory, {free:.1f} GiB here")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_of_more_than_int_max_elements(world, all_ranks, big, async_op):
    x = np.zeros(N, np.uint8)
    if world.rank == 0:
        x[:8], x[-8:], x[1 << 30] = 7, 9, 5
    h = C.broadcast(x, root=0, async_op=async_op, algo="native")
    if async_op:
        h.wait()
    all_ranks(x[:8].tolist() == [7] * 8 and x[-8:].tolist() == [9] * 8 and x[1 << 30] == 5,
              f"{x[:8]} {x[-8:]} {x[1 << 30]}")


@pytest.mark.mpi(min_size=2)
def test_all_reduce_of_more_than_int_max_elements(world, all_ranks, big):
    x = np.ones(N, np.int8)
    x[-1] = 100  # 100 + 100 wraps to -56
    C.all_reduce(x, algo="native")
    all_ranks(x[0] == 2 and x[N // 2] == 2 and x[-2] == 2 and x[-1] == -56,
              f"{x[0]} {x[N // 2]} {x[-2]} {x[-1]}")


def test_native_is_not_selected_when_a_count_does_not_fit(world):
    """No allocation: the selection of a request whose counts exceed C ints."""
    native = next(a for a in registry()[CollectiveOp.ALL_TO_ALL] if a.name == "native")
    fabric = fabric_for(world.world)
    p = max(2, world.size)
    huge = Request(CollectiveOp.ALL_TO_ALL, p * N, 1, p, max_block=N)
    assert "C ints" in native.supports(huge, fabric)
    assert select(huge, fabric, None).name != "native"
    fine = Request(CollectiveOp.ALL_TO_ALL, p * 1024, 1, p, max_block=1024)
    assert native.supports(fine, fabric) is None
    bcast = Request(CollectiveOp.BROADCAST, N, 1, p)
    assert native.supports(bcast, fabric) is None  # cut into pieces by the backend
