"""The staged backend's piecewise logic, run on host arrays against native MPI.

The staged backend moves device buffers through a small pinned pool in
pieces; here the same code runs with NumPy as the "device" module and a tiny
pool, so every operation takes many pieces (the GPU tests repeat this with CuPy).
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from neocomm.backends.staged import StagedBackend

pytestmark = pytest.mark.layouts("1x2", "1x3", why=(
    "the staged pieces are cut by the peers' count (a power of two and three); one rank has "
    "no peer"))


class _HostStaged(StagedBackend):
    device = False  # validate NumPy buffers; the piece logic is the one under test


@pytest.fixture(params=[64, 1000, 1 << 16], ids=["pool64B", "pool1000B", "pool64KiB"])
def staged(world, request):
    return _HostStaged(world.world, xp=np, pool_bytes=request.param)


def test_all_reduce_and_broadcast(world, staged, all_ranks):
    x = np.random.default_rng(world.rank).integers(-50, 50, 777).astype(np.float64)
    want = np.empty_like(x)
    world.comm.Allreduce(x, want)
    got = np.empty_like(x)
    staged.all_reduce(x, got)
    b = x.copy()
    staged.broadcast(b, root=world.size - 1)
    ref = x.copy()
    world.comm.Bcast(ref, root=world.size - 1)
    all_ranks(np.array_equal(got, want) and np.array_equal(b, ref))


def test_all_to_all_and_all_gather(world, staged, all_ranks):
    n = world.size
    x = np.arange(n * 301, dtype=np.int32) + 10_000 * world.rank
    got, want = np.empty_like(x), np.empty_like(x)
    staged.all_to_all(x, got)
    world.comm.Alltoall(x, want)
    g, gw = np.empty(n * x.size, np.int32), np.empty(n * x.size, np.int32)
    staged.all_gather(x, g)
    world.comm.Allgather(x, gw)
    all_ranks(np.array_equal(got, want) and np.array_equal(g, gw))


def test_all_to_all_v_and_reduce_scatter_uneven(world, staged, all_ranks):
    n = world.size
    counts = np.random.default_rng(5).integers(0, 90, (n, n))
    counts[0, :] = 0  # a rank with nothing to send
    sc, rc = counts[world.rank], counts[:, world.rank]
    x = np.random.default_rng(world.rank).standard_normal(int(sc.sum()))
    got, want = np.empty(int(rc.sum())), np.empty(int(rc.sum()))
    staged.all_to_all_v(x, got, send_counts=sc, recv_counts=rc)
    sd, rd = np.concatenate(([0], np.cumsum(sc[:-1]))), np.concatenate(([0], np.cumsum(rc[:-1])))
    world.comm.Alltoallv([x, (sc, sd), MPI.DOUBLE], [want, (rc, rd), MPI.DOUBLE])
    blocks = np.random.default_rng(9).integers(0, 70, n)
    y = np.random.default_rng(world.rank).integers(-9, 9, int(blocks.sum())).astype(np.float32)
    rs = np.empty(int(blocks[world.rank]), np.float32)
    staged.reduce_scatter(y, rs, recv_counts=blocks)
    total = np.empty_like(y)
    world.comm.Allreduce(y, total)
    start = int(blocks[:world.rank].sum())
    all_ranks(np.array_equal(got, want) and np.array_equal(rs, total[start:start + rs.size]))


def test_send_recv_in_pieces(world, staged, all_ranks):
    n, r = world.size, world.rank
    if n == 1:
        pytest.skip("needs a peer")
    out = np.arange(1234, dtype=np.float64) * (r + 1)
    inc = np.empty_like(out)
    if r % 2 == 0:
        staged.send(out, (r + 1) % n)
        staged.recv(inc, (r - 1) % n)
    else:
        staged.recv(inc, (r - 1) % n)
        staged.send(out, (r + 1) % n)
    all_ranks(np.array_equal(inc, np.arange(1234) * (((r - 1) % n) + 1)))


def test_pool_is_reused_not_grown(world, staged, all_ranks):
    """Calls larger than the pool go through the one pool, piece by piece, and still sum
    every rank's data."""
    ok = True
    pool = None
    for n in (10_000, 50_000):
        x = np.arange(n, dtype=np.float64) % 101 * (world.rank + 1)
        want = np.empty_like(x)
        world.comm.Allreduce(x, want)
        staged.all_reduce(x)
        ok &= np.array_equal(x, want)
        pool = staged._pool if pool is None else pool
        ok &= staged._pool is pool and pool.nbytes == staged.pool_bytes
    all_ranks(ok, f"rank {world.rank}: wrong sum or a new pool")
