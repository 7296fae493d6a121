"""A loop's steps agree once each: calls inside a step of an unchanged shape run their plans
without agreeing, a new shape anywhere makes the step checked, a shape that differs raises."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.control import StepControl
from neocomm import CollectiveArgumentError

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x1", "1x2", "1x3", why=(
    "a step's agreement follows the group's size alone"))]


def _one_step(world, b: int, step: int):
    """A step's worth of calls whose data depend on every rank: an AlltoAll, an AllReduce
    and an AlltoAllv without recv counts; True when all three are right."""
    n, r = world.size, world.rank
    x = (np.arange(b * n, dtype=np.float64) + 1000 * r + step)
    want = np.empty_like(x)
    world.comm.Alltoall(x, want)
    ok = np.array_equal(C.all_to_all(x), want)
    g = np.full(7, float(r + step))
    total = np.empty_like(g)
    world.comm.Allreduce(g, total)
    out = np.empty_like(g)
    ok &= np.array_equal(C.all_reduce(g, out), total)
    sc = np.array([(r + j + step) % 3 for j in range(n)], np.int64)
    v = np.arange(sc.sum(), dtype=np.float64) + r
    rc = np.empty(n, np.int64)
    world.comm.Alltoall(sc, rc)
    wantv = np.empty(int(rc.sum()))
    world.comm.Alltoallv([v, sc], [wantv, rc])
    got, counts = C.all_to_all_v(v, sc)
    return bool(ok and np.array_equal(got, wantv) and list(counts) == list(rc))


def test_steps_of_one_shape_skip_their_calls_agreements(world, all_ranks, agreements):
    control = StepControl(None, "test step")
    per_step, results, trusted = [], [], []
    for step in range(4):
        before = agreements[0]
        with control.step(batch_size=8) as t:
            results.append(_one_step(world, 8, step))
        trusted.append(t)
        per_step.append(agreements[0] - before)
    all_ranks(all(results), f"rank {world.rank}: {results}")
    # The first step agrees every call; the next ones only the step and the AlltoAllv
    # (whose agreement carries the sizes that choose its algorithm).
    all_ranks(trusted == [False, True, True, True] and per_step[1:] == [2, 2, 2]
              and per_step[0] > 2, f"rank {world.rank}: trusted {trusted}, agreements "
              f"per step {per_step}")
    all_ranks(control.checked == 1 and control.trusted == 3)
    # Outside a step, calls agree again.
    before = agreements[0]
    C.all_reduce(np.ones(7), np.empty(7))
    all_ranks(agreements[0] - before == 1)


@pytest.mark.mpi(min_size=2)
def test_a_new_shape_on_one_rank_checks_the_step_on_every_rank(world, all_ranks):
    control = StepControl(None, "test step")
    seen = []
    for step, (b0, b_rest) in enumerate([(4, 4), (4, 4), (6, 6), (6, 6)]):
        b = b0 if world.rank == 0 else b_rest
        with control.step(batch_size=b) as trusted:
            ok = _one_step(world, b, step)
        seen.append((trusted, ok))
    all_ranks(seen == [(False, True), (True, True), (False, True), (True, True)],
              f"rank {world.rank}: {seen}")


@pytest.mark.mpi(min_size=2)
def test_a_step_whose_shape_differs_across_ranks_raises_on_every_rank(world, all_ranks):
    control = StepControl(None, "test step")
    with control.step(batch_size=8, tables=3):
        pass
    b = 9 if world.rank == 1 else 8
    with pytest.raises(CollectiveArgumentError, match="batch_size differs across ranks") as err:
        with control.step(batch_size=b, tables=3):
            pytest.fail("the step must not start")
    assert 1 in err.value.ranks and "batch_size=9" in str(err.value)
    # Nothing is left trusted: the next call agrees (and so still catches a mismatch).
    x = np.ones(4) if world.rank else np.ones(4, np.float32)
    with pytest.raises(CollectiveArgumentError, match="dtype differs"):
        C.all_reduce(x, np.empty_like(x))


def test_trust_is_per_thread(world, all_ranks, agreements):
    """A call on another thread during a trusted step keeps its own agreement."""
    import threading

    control = StepControl(None, "test step")
    x = np.ones(5)
    for _ in range(2):
        with control.step(batch_size=5) as trusted:
            C.all_reduce(x, np.empty_like(x))
    counted = []

    def other():
        before = agreements[0]
        C.all_reduce(x, np.empty_like(x))
        counted.append(agreements[0] - before)

    with control.step(batch_size=5):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    all_ranks(trusted and counted == [1], f"rank {world.rank}: {trusted}, {counted}")
