"""Handles, process groups, bounded staging memory and repeated-call plans."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.chunking import staging_pool
from collectives.progress import idle

pytestmark = pytest.mark.mpi(min_size=1)


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


def test_outstanding_ops_waited_in_different_orders(world, all_ranks):
    """Even ranks wait A then B, odd ranks B then A: the waits drive both."""
    x = np.arange(3000, dtype=np.int64) + world.rank
    y = x * 2
    want_x, want_y = np.empty_like(x), np.empty_like(y)
    world.comm.Allreduce(x, want_x)
    world.comm.Allreduce(y, want_y)
    a = C.all_reduce(x, np.empty_like(x), algo="ring", chunk_bytes=64, async_op=True)
    b = C.all_reduce(y, np.empty_like(y), algo="rabenseifner", chunk_bytes=64, async_op=True)
    first, second = (a, b) if world.rank % 2 == 0 else (b, a)
    first.wait()
    second.wait()
    all_ranks(np.array_equal(a.wait(), want_x) and np.array_equal(b.wait(), want_y))


def test_test_polls_to_completion(world, all_ranks):
    x = np.ones(5000, np.float64)
    h = C.broadcast(x, root=0, algo="chain", chunk_bytes=512, async_op=True)
    while not h.test():
        pass
    all_ranks(np.all(h.wait() == 1))


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
        got, peers, _ = C.many_to_many(x[:2], [(group.rank + 1) % q], group=group)
        ok &= peers == [(group.rank - 1) % q]
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
        x = np.arange(8 * world.size, dtype=np.float32)
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
            ok &= np.array_equal(C.all_to_all(x, out), want)
    finally:
        backend.check = saved
    all_ranks(ok)
