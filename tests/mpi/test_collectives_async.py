"""Handles, process groups, bounded staging memory and repeated-call plans."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.chunking import staging_pool
from collectives.progress import idle

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x2", "1x3", "2x2", why=(
    "handles and groups at a power of two, at three ranks and across nodes (intra-node and "
    "rail groups)"))]


def test_async_handles_return_the_output(world, all_ranks):
    p = world.size
    x = np.arange(6 * p, dtype=np.float32) + world.rank
    want_ar = np.empty_like(x)
    world.comm.Allreduce(x, want_ar)
    want_a2a = np.empty_like(x)
    world.comm.Alltoall(x, want_a2a)
    h1 = C.all_reduce(x, np.empty_like(x), algo="ring", chunk_bytes=8, async_op=True)
    h2 = C.all_to_all(x, algo="pairwise", chunk_bytes=8, async_op=True)
    h3 = C.all_to_all_v(x, [6] * p, async_op=True)
    out3, counts3 = h3.wait()
    all_ranks(np.array_equal(h2.wait(), want_a2a) and np.array_equal(h1.wait(), want_ar)
              and np.array_equal(out3, want_a2a) and list(counts3) == [6] * p)
    all_ranks(h1.test() and h1.done and idle())


@pytest.mark.parametrize("second", ["rabenseifner", "native"])
def test_outstanding_ops_waited_in_different_orders(world, all_ranks, second):
    """Even ranks wait A then B, odd ranks B then A: the waits drive both (B is also
    MPI's own non-blocking call, run directly, beside an algorithm of neocomm's)."""
    x = np.arange(3000, dtype=np.int64) + world.rank
    y = x * 2
    want_x, want_y = np.empty_like(x), np.empty_like(y)
    world.comm.Allreduce(x, want_x)
    world.comm.Allreduce(y, want_y)
    for _ in range(2):  # the second time, both run their plans
        a = C.all_reduce(x, np.empty_like(x), algo="ring", chunk_bytes=64, async_op=True)
        b = C.all_reduce(y, np.empty_like(y), algo=second, chunk_bytes=64, async_op=True)
        one, two = (a, b) if world.rank % 2 == 0 else (b, a)
        one.wait()
        two.wait()
        all_ranks(np.array_equal(a.wait(), want_x) and np.array_equal(b.wait(), want_y))


def test_a_repeated_async_call_of_mpis_own_collective_polls_and_waits(world, all_ranks):
    """The plan of a native async call posts MPI's non-blocking collective: test()
    alone completes it, and its result is the reduction of every rank's data."""
    x = np.arange(64, dtype=np.float32) * (world.rank + 1)
    want = np.arange(64, dtype=np.float32) * (world.size * (world.size + 1) / 2)
    ok = True
    for _ in range(3):
        out = np.full(64, -1.0, np.float32)
        h = C.all_reduce(x, out, algo="native", async_op=True)
        while not h.test():
            pass
        ok &= h.done and h.wait() is out and np.array_equal(out, want)
    all_ranks(ok)


def test_test_polls_to_completion(world, all_ranks):
    """Polling test() alone drives a chunked broadcast to the end: every rank ends with
    the root's data (only the root holds it; the others start from their own values)."""
    root = world.size - 1
    src = np.arange(5000, dtype=np.float64) * 3 + 7
    x = src.copy() if world.rank == root else np.full(5000, -1.0 - world.rank)
    h = C.broadcast(x, root=root, algo="chain", chunk_bytes=512, async_op=True)
    while not h.test():
        pass
    all_ranks(h.done and h.wait() is x and np.array_equal(x, src),
              f"rank {world.rank}: {x[:3]} instead of {src[:3]}")


@pytest.mark.parametrize("which", ["intra_node", "rail", "sub"])
def test_collectives_on_groups(world, all_ranks, which):
    if which == "sub":
        ranks = list(range(world.size))[::-1][: max(1, world.size - 1)]
        group = world.world.split(ranks, name="test-sub")
    else:
        group = getattr(world, which)
    ok = True
    if group is not None:
        q = group.size
        x = (np.arange(4 * q) + 100 * group.rank).astype(np.float64)
        want = np.empty_like(x)
        group.comm.Alltoall(x, want)
        ok &= np.array_equal(C.all_to_all(x, group=group, chunk_bytes=8), want)
        group.comm.Allreduce(x, want)
        ok &= np.array_equal(C.all_reduce(x, np.empty_like(x), group=group, algo="ring"), want)
        ok &= np.array_equal(C.all_reduce(x, np.empty_like(x), group=group,
                                          algo="rabenseifner"), want)
        block = np.empty(4, np.float64)
        group.comm.Reduce_scatter_block(x, block)
        ok &= np.array_equal(C.reduce_scatter(x, group=group, algo="ring"), block)
        b = x.copy() if group.rank == q - 1 else np.zeros_like(x)
        ok &= np.array_equal(C.broadcast(b, root=q - 1, group=group, algo="binomial"),
                             (np.arange(4 * q) + 100 * (q - 1)).astype(np.float64))
        got, peers, counts = C.many_to_many(x[:2], [(group.rank + 1) % q], group=group)
        left = (group.rank - 1) % q  # each member sends its first two elements rightwards
        ok &= peers == [left] and list(counts) == [2]
        ok &= np.array_equal(got, np.arange(2.0) + 100 * left)
    all_ranks(ok)


def test_staging_memory_is_bounded(world, all_ranks):
    """A 4 MiB reduction in 64 KiB chunks keeps at most STAGING_BUFFERS chunks."""
    pool = staging_pool(np)
    pool.clear()
    chunk = 64 << 10
    x = np.ones((4 << 20) // 8, np.float64)
    for algo in ("ring", "rabenseifner"):
        C.all_reduce(x, np.empty_like(x), algo=algo, chunk_bytes=chunk)
    C.all_to_all(np.ones(world.size * 40_000, np.float32), algo="bruck", chunk_bytes=chunk)
    all_ranks(pool.held_bytes <= pool.limit * chunk and pool.in_use() == 0,
              f"held {pool.held_bytes} bytes")


def test_plans_reuse_buffers(world, all_ranks):
    """With argument checks off, repeated calls run from a plan: same results."""
    backend = C.state_of(world.world)
    saved = backend.check
    backend.check = False
    try:
        x = np.arange(8 * world.size, dtype=np.float32) + 1000 * world.rank  # differs by rank
        out = np.empty_like(x)
        want = np.empty_like(x)
        ok = True
        for step in range(3):
            x += step
            world.comm.Allreduce(x, want)
            for algo in ("native", "ring"):
                out[:] = 0
                ok &= C.all_reduce(x, out, algo=algo) is out and np.array_equal(out, want)
            world.comm.Alltoall(x, want)
            out[:] = -1
            ok &= C.all_to_all(x, out) is out and np.array_equal(out, want)
    finally:
        backend.check = saved
    all_ranks(ok)


@pytest.mark.mpi(min_size=2)
def test_a_call_after_an_op_completed_by_polling_runs_alike_on_every_rank(world, all_ranks):
    """Odd ranks finish an async op by polling test(), even ranks by wait(): afterwards
    no rank holds it as outstanding, and a blocking OneToMany (whose plan may take MPI's
    own call) runs the same MPI operation on every rank and hands out the root's data."""
    x = np.arange(2000, dtype=np.float64) + world.rank
    h = C.all_reduce(x, np.empty_like(x), algo="ring", chunk_bytes=256, async_op=True)
    if world.rank % 2:
        while not h.test():
            pass
    else:
        h.wait()
    quiet = idle()
    ok = True
    for step in range(3):
        src = np.arange(300, dtype=np.float32) * (step + 2)
        buf = src.copy() if world.rank == 0 else np.full(300, -1.0, np.float32)
        C.one_to_many(buf if world.rank == 0 else None, None if world.rank == 0 else buf,
                      root=0, ranks=list(range(1, world.size)))
        ok &= bool(np.array_equal(buf, src))
    all_ranks(quiet and ok, f"rank {world.rank}: idle {quiet}, data {ok}")
