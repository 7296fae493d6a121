"""Every call runs through its plan: built once per layout, run again on the same or new
buffers, blocking or not; a planned call still agrees its arguments with the others."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import api, api_v
from neocomm import CollectiveArgumentError


@pytest.fixture
def builds(monkeypatch):
    """How many plans this rank built (every build, whatever the collective)."""
    count = [0]
    real = api.build

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "build", counted)
    monkeypatch.setattr(api_v, "build", counted)
    C.state_of(None).plans.clear()
    return count


def test_repeated_calls_build_one_plan_and_stay_correct(world, all_ranks, builds):
    n = world.size
    y = np.empty(4 * n, np.float32)
    want = np.empty_like(y)
    ok = True
    for step in range(4):
        x = np.arange(4 * n, dtype=np.float32) + 100 * world.rank + step  # new every call
        world.comm.Alltoall(x, want)
        got = C.all_to_all(x, y)
        ok &= got is y and np.array_equal(y, want)
        ok &= np.array_equal(C.all_to_all(x), want)  # no recvbuf: a plan of its own
        ok &= np.array_equal(C.all_to_all(x, async_op=True).wait(), want)
    all_ranks(ok and builds[0] == 2)


def test_a_plan_checks_new_buffers_and_a_bad_one_raises_on_every_rank(world, builds):
    n = world.size
    x, y = np.ones(2 * n, np.float32), np.empty(2 * n, np.float32)
    C.all_to_all(x, y)
    strided = np.empty(4 * n, np.float32)[::2]  # same dtype and size, not contiguous
    bad = strided if world.rank == world.size - 1 else y
    with pytest.raises(CollectiveArgumentError, match="C-contiguous") as err:
        C.all_to_all(x, bad)
    assert err.value.ranks == (world.size - 1,)


def test_a_plan_never_runs_in_place_on_views_of_one_memory(world, all_ranks):
    n = world.size
    base = np.arange(2 * n, dtype=np.float32) + 10 * world.rank
    other = np.empty_like(base)
    C.all_to_all(base.copy(), other)  # a plan for two buffers of this layout
    want = np.empty_like(base)
    world.comm.Alltoall(base, want)
    got = C.all_to_all(base, base[:])  # the same memory through another view
    all_ranks(np.array_equal(got, want))


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


@pytest.mark.mpi(min_size=2)
def test_a_planned_call_meets_the_same_call_made_async_and_both_raise(world):
    x = np.ones(world.size, np.float32)
    C.all_reduce(x, x.copy())
    with pytest.raises(CollectiveArgumentError, match="calls differ"):
        h = C.all_reduce(x, x.copy(), async_op=world.rank == 0)
        if world.rank == 0:
            h.wait()


def _v_counts(n, rank, shift):
    send = np.array([(rank + j + shift) % 3 + 1 for j in range(n)], np.int64)
    recv = np.array([(i + rank + shift) % 3 + 1 for i in range(n)], np.int64)
    return send, recv


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_plans_recheck_counts_when_one_rank_changes_them(world, all_ranks,
                                                                       builds):
    n, r = world.size, world.rank
    results = []
    for shift in (0, 0, 0, 1, 1):  # the counts change on every rank at the fourth call
        sc, rc = _v_counts(n, r, shift)
        x = np.arange(sc.sum(), dtype=np.int32) + 1000 * r
        y = np.empty(int(rc.sum()), np.int32)
        got, counts = C.all_to_all_v(x, sc.tolist(), y, rc.tolist())
        want = np.empty_like(y)
        world.comm.Alltoallv([x, sc], [want, rc])
        results.append(np.array_equal(got, want) and list(counts) == list(rc))
    all_ranks(all(results) and builds[0] == 2)
    # Now one rank keeps its plan's counts while another's are wrong: both raise.
    sc, rc = _v_counts(n, r, 1)
    if r == 0:
        rc = rc.copy()
        rc[[0, 1]] += [1, -1]  # same total, wrong split: a plan of its own, checked
    x = np.zeros(sc.sum(), np.int32)
    with pytest.raises(CollectiveArgumentError, match=r"recv_counts\[") as err:
        C.all_to_all_v(x, sc.tolist(), np.empty(int(rc.sum()), np.int32), rc.tolist())
    assert 0 in err.value.ranks


def test_all_to_all_v_without_recv_counts_learns_them_every_call(world, all_ranks):
    n, r = world.size, world.rank
    ok = True
    for shift in range(3):
        sc, rc = _v_counts(n, r, shift)
        x = np.arange(sc.sum(), dtype=np.float64) + r
        got, counts = C.all_to_all_v(x, sc.tolist())
        want = np.empty(int(rc.sum()))
        world.comm.Alltoallv([x, sc], [want, rc])
        ok &= np.array_equal(got, want) and list(counts) == list(rc)
    all_ranks(ok)


def test_a_group_keeps_at_most_its_limit_of_plans(world, all_ranks):
    plans = C.state_of(None).plans
    saved, plans.limit = plans.limit, 3
    try:
        for size in range(1, 7):
            C.all_reduce(np.ones(size, np.float32), np.empty(size, np.float32))
        all_ranks(len(plans) == 3)
    finally:
        plans.limit = saved
