"""Repeated calls run from a plan, and a planned call still agrees its arguments."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import plans
from neocomm import CollectiveArgumentError


def test_repeated_calls_use_a_plan_and_stay_correct(world, all_ranks):
    n = world.size
    x = np.arange(4 * n, dtype=np.float32) + 100 * world.rank
    y = np.empty_like(x)
    for _ in range(3):
        C.all_to_all(x, y)
    want = np.empty_like(x)
    world.comm.Alltoall(x, want)
    all_ranks(np.array_equal(y, want) and len(plans._PLANS) > 0)


@pytest.mark.mpi(min_size=2)
def test_a_planned_call_meets_a_changed_call_and_both_raise(world):
    n = world.size
    x = np.ones(4 * n, np.float32)
    y = np.empty_like(x)
    C.all_reduce(x, y)
    C.all_reduce(x, y)  # every rank has a plan now
    if world.rank == 1:  # this rank changes its dtype: no plan, the full path
        x, y = np.ones(4 * n, np.float64), np.empty(4 * n)
    with pytest.raises(CollectiveArgumentError, match="dtype differs across ranks"):
        C.all_reduce(x, y)


@pytest.mark.mpi(min_size=2)
def test_a_planned_call_meets_another_size_and_both_raise(world):
    n = world.size
    x = np.ones(2 * n, np.int64)
    y = np.empty(2 * n * n, np.int64)
    C.all_gather(x, y)
    C.all_gather(x, y)
    if world.rank == 0:
        x, y = np.ones(3 * n, np.int64), np.empty(3 * n * n, np.int64)
    with pytest.raises(CollectiveArgumentError, match="differs across ranks"):
        C.all_gather(x, y)
