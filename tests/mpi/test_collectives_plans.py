"""Every call runs through its plan: built once per layout, run again on the same or new
buffers, blocking or not; a planned call still agrees its arguments with the others."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import api, api_sparse, api_v
from neocomm import CollectiveArgumentError

pytestmark = pytest.mark.layouts("all", why=(
    "a plan is built once per layout"))


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
    monkeypatch.setattr(api_sparse, "build", counted)
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


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_without_recv_counts_plans_once_per_counts_learned(world, all_ranks,
                                                                         builds):
    """Rank 0 keeps its send counts while the others alternate between two orders of
    theirs (same total and largest block, so the algorithm stays): each rank builds one
    plan per pair of counts it sees and runs it again when that pair comes back."""
    n, r = world.size, world.rank
    base = np.arange(1, n + 1, dtype=np.int64)
    ok = True
    for step in range(6):
        sc = base.copy() if r == 0 else np.roll(base, step % 2)
        x = np.arange(sc.sum(), dtype=np.float32) + 100 * r + step
        rc = np.empty(n, np.int64)
        world.comm.Alltoall(sc, rc)
        want = np.empty(int(rc.sum()), np.float32)
        world.comm.Alltoallv([x, sc], [want, rc])
        got, counts = C.all_to_all_v(x, sc.tolist())
        ok &= np.array_equal(got, want) and list(counts) == list(rc)
    all_ranks(ok and builds[0] == 2, f"rank {r}: {builds[0]} plans built")


@pytest.mark.mpi(min_size=2)
def test_all_to_all_v_learning_counts_into_a_recvbuf_too_small_raises_on_every_rank(world):
    """A call whose send side is known (checked by an earlier call) still finds, with
    every rank, that the counts it learns do not fit the recvbuf it was given."""
    n, r = world.size, world.rank
    y = np.empty(2 * n, np.int64)
    for _ in range(2):  # every rank sends 2 to every rank: y fits
        C.all_to_all_v(np.full(2 * n, r, np.int64), [2] * n, y)
    sc = [2] * n if r != 1 else [3] + [2] * (n - 1)  # rank 1 now sends rank 0 one more
    with pytest.raises(CollectiveArgumentError, match="recvbuf: the peers send") as err:
        C.all_to_all_v(np.full(sum(sc), r, np.int64), sc, y)
    assert err.value.ranks == (0,)


@pytest.mark.mpi(min_size=2)
def test_many_to_many_plans_replay_and_follow_a_rank_whose_call_changes(world, all_ranks,
                                                                        builds):
    """Each rank sends to its right neighbour: repeated calls run one plan; when one
    rank sends more (and its receiver expects it), every rank goes on as a new call;
    a receiver that expects the old count while the sender's plan is reused raises
    with every rank."""
    n, r = world.size, world.rank
    right, left = (r + 1) % n, (r - 1) % n
    ok = True
    for step, extra in enumerate((0, 0, 0, 2, 2)):  # rank 0 sends 2 more from the 4th
        mine = 3 + (extra if r == 0 else 0)
        theirs = 3 + (extra if left == 0 else 0)
        x = np.arange(mine, dtype=np.float64) + 10 * r + step
        got, peers, counts = C.many_to_many(x, [right], [mine], recv_peers=[left],
                                            recv_counts=[theirs])
        want = np.arange(theirs, dtype=np.float64) + 10 * left + step
        ok &= np.array_equal(got, want) and list(peers) == [left] and list(counts) == [theirs]
    all_ranks(ok and builds[0] == 2, f"rank {r}: {builds[0]} plans built")
    # Rank 0 sends 3 again (its plan of the first calls); rank 1 still expects 5 (its
    # plan of the last ones): the plans were made for other sizes, the counts are checked.
    expect = 5 if r == 1 else 3
    with pytest.raises(CollectiveArgumentError, match=r"recv_counts\[0\] is 5") as err:
        C.many_to_many(np.zeros(3), [right], [3], recv_peers=[left], recv_counts=[expect])
    assert err.value.ranks == (1,)


@pytest.mark.mpi(min_size=2)
def test_one_to_many_plans_replay_and_follow_the_roots_new_payload(world, all_ranks,
                                                                   builds):
    """The root hands each other rank its own slice: receivers without a buffer get one
    from the plan; when the root's payload changes dtype, the others' plans give way
    (their call looks the same to them) and every rank receives the new payload."""
    n, r, root = world.size, world.rank, 0
    others = list(range(1, n))
    counts = [k + 1 for k in range(len(others))]
    ok = True
    for step, dtype in enumerate((np.float32, np.float32, np.float32, np.int64, np.int64)):
        payload = np.arange(sum(counts), dtype=dtype) * (step + 1)
        got = C.one_to_many(payload if r == root else None, root=root, ranks=others,
                            counts=counts)
        if r == root:
            ok &= got is None
        else:
            i = others.index(r)
            lo = sum(counts[:i])
            ok &= got.dtype == dtype and np.array_equal(got, payload[lo:lo + counts[i]])
    all_ranks(ok and builds[0] == 2, f"rank {r}: {ok}, {builds[0]} plans built")


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_lost_its_plans_meets_the_others_call_for_call(world, all_ranks):
    """One rank's cache misses (here: cleared) while the others run their plans: every
    call still agrees exactly once on every rank, so the ranks stay in step through a
    sequence of different collectives, and every result is right."""
    n, r = world.size, world.rank
    others = list(range(1, n))

    def rounds(step):
        x = np.arange(4 * n, dtype=np.float64) + 10 * r + step
        want = {}
        for name, fn in (("a2a", world.comm.Alltoall), ("ar", world.comm.Allreduce)):
            want[name] = np.empty_like(x)
            fn(x, want[name])
        got = {"a2a": C.all_to_all(x), "ar": C.all_reduce(x, np.empty_like(x))}
        b = x.copy() if r == 0 else np.zeros_like(x)
        C.broadcast(b, root=0)
        want_b = np.arange(4 * n, dtype=np.float64) + step
        counts = np.full(len(others), 2, np.int64)
        part = C.one_to_many(want_b[:2 * len(others)] if r == 0 else None, root=0,
                             ranks=others, counts=counts)
        right, left = (r + 1) % n, (r - 1) % n
        m2m, _, _ = C.many_to_many(x[:3], [right], [3], recv_peers=[left], recv_counts=[3])
        ok = all(np.array_equal(got[k], want[k]) for k in got) and np.array_equal(b, want_b)
        ok &= part is None if r == 0 else \
            np.array_equal(part, want_b[2 * (r - 1):2 * r])
        ok &= np.array_equal(m2m, np.arange(3, dtype=np.float64) + 10 * left + step)
        return bool(ok)

    results = [rounds(0), rounds(1)]
    if r == 1:
        C.state_of(None).plans.clear()
    results += [rounds(2), rounds(3)]
    all_ranks(all(results), f"rank {r}: {results}")


def test_a_group_keeps_at_most_its_limit_of_plans(world, all_ranks):
    plans = C.state_of(None).plans
    saved, plans.limit = plans.limit, 3
    try:
        for size in range(1, 7):
            C.all_reduce(np.ones(size, np.float32), np.empty(size, np.float32))
        all_ranks(len(plans) == 3)
    finally:
        plans.limit = saved
