"""The MPI backend against mpi4py's native collectives, on random data."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mpi4py import MPI

import collectives as C
from neocomm import CollectiveArgumentError, ReduceOp
from neocomm.types import bfloat16

pytestmark = pytest.mark.layouts("1x1", "1x2", "1x3", why=(
    "the backend hands over MPI's own calls: what changes them is the group's size (one, a "
    "power of two, three), not where its ranks sit"))

DTYPES = ["float32", "float64", "int32", "int64", "float16"] + (["bfloat16"] if bfloat16 else [])
HYP = settings(max_examples=12, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))


def _random(rng, n, dtype):
    dt = np.dtype(bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        return rng.integers(-8, 8, n).astype(dt)  # small integers: exact in every float type
    return rng.integers(-1000, 1000, n).astype(dt)


@pytest.fixture
def be(world):
    return world.world.backend()


@pytest.mark.parametrize("dtype", DTYPES)
@given(block=st.integers(0, 300))
@HYP
def test_all_to_all_matches_native(world, be, all_ranks, dtype, block):
    rng = np.random.default_rng(block * 7 + world.rank)
    x = _random(rng, block * world.size, dtype)
    got = np.empty_like(x)
    be.all_to_all(x, got)
    want = np.empty_like(x)
    world.comm.Alltoall(x.view(np.uint8), want.view(np.uint8))
    all_ranks(np.array_equal(got.view(np.uint8), want.view(np.uint8)))


@given(seed=st.integers(0, 10_000), zero_prob=st.floats(0, 0.7))
@HYP
def test_all_to_all_v_matches_native(world, be, all_ranks, seed, zero_prob):
    n = world.size
    # Every rank derives the same count matrix from the seed: counts[i][j] from i to j.
    crng = np.random.default_rng(seed)
    counts = crng.integers(0, 50, (n, n))
    counts[crng.random((n, n)) < zero_prob] = 0
    sc, rc = counts[world.rank], counts[:, world.rank]
    x = np.random.default_rng(seed + world.rank).standard_normal(int(sc.sum()))
    got = np.empty(int(rc.sum()))
    h = be.all_to_all_v(x, got, send_counts=sc, recv_counts=rc, async_op=True)
    assert h.wait() is got
    want = np.empty_like(got)
    sd = np.concatenate(([0], np.cumsum(sc[:-1])))
    rd = np.concatenate(([0], np.cumsum(rc[:-1])))
    world.comm.Alltoallv([x, (sc, sd), MPI.DOUBLE], [want, (rc, rd), MPI.DOUBLE])
    all_ranks(np.array_equal(got, want))


@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("dtype", DTYPES)
@given(count=st.integers(0, 2000))
@HYP
def test_all_reduce_matches_native(world, be, all_ranks, op, dtype, count):
    rng = np.random.default_rng(count + 31 * world.rank)
    x = _random(rng, count, dtype)
    if op is ReduceOp.PROD:
        x = (np.abs(x.astype(np.int64)) % 3 + 1).astype(x.dtype)  # no overflow
    wide = x.astype(np.float64)
    want = np.empty_like(wide)
    world.comm.Allreduce(wide, want, op=getattr(MPI, op.name))
    got = np.empty_like(x)
    be.all_reduce(x, got, op=op)
    inplace = x.copy()
    be.all_reduce(inplace, op=op.value)
    all_ranks(np.array_equal(got.astype(np.float64), want) and np.array_equal(inplace, got))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "uint64"])
def test_integer_sums_wrap_around_as_in_numpy(world, be, all_ranks, dtype):
    """Overflowing integer sums wrap (as NCCL, NumPy and C do); Open MPI's vectorised
    MPI_SUM saturates 8- and 16-bit ones, which must not leak through."""
    info = np.iinfo(dtype)
    x = np.full(100, info.max - world.rank, dtype)
    want = x.copy()
    with np.errstate(over="ignore"):
        for r in range(1, world.size):
            want += np.full(100, info.max - r, dtype) if world.rank == 0 else 0
    want = world.comm.bcast(want, root=0)
    be.all_reduce(x, op="sum")
    all_ranks(np.array_equal(x, want), f"{dtype}: {x[:3]} instead of {want[:3]}")


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@given(block=st.integers(0, 500), uneven=st.booleans())
@HYP
def test_reduce_scatter_matches_native(world, be, all_ranks, dtype, block, uneven):
    n = world.size
    counts = np.random.default_rng(block).integers(0, 40, n) if uneven else np.full(n, block)
    x = _random(np.random.default_rng(block + world.rank), int(counts.sum()), dtype)
    got = np.empty(int(counts[world.rank]), x.dtype)
    be.reduce_scatter(x, got, recv_counts=counts if uneven else None)
    total = np.empty(x.size, np.float64)
    world.comm.Allreduce(x.astype(np.float64), total)
    start = int(counts[:world.rank].sum())
    all_ranks(np.array_equal(got.astype(np.float64), total[start:start + got.size]))


@given(count=st.integers(0, 700), root=st.integers(0, 3))
@HYP
def test_all_gather_and_broadcast_match_native(world, be, all_ranks, count, root):
    root %= world.size
    x = _random(np.random.default_rng(count + world.rank), count, "int32")
    got = np.empty(count * world.size, np.int32)
    be.all_gather(x, got)
    want = np.empty_like(got)
    world.comm.Allgather(x, want)
    buf = x.copy()
    be.broadcast(buf, root=root)
    ref = x.copy()
    world.comm.Bcast(ref, root=root)
    all_ranks(np.array_equal(got, want) and np.array_equal(buf, ref))


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@pytest.mark.parametrize("blocking", [True, False])
def test_direct_calls_move_what_the_backend_calls_move(world, be, all_ranks, dtype, blocking):
    """MPI's own calls as the backend hands them out (a plan's repeated calls, control
    exchanges, the benchmark's peer), blocking or as a request, against its calls."""
    n, r = world.size, world.rank
    rng = np.random.default_rng(5 + r)
    x = _random(rng, 3 * n, dtype)
    counts = np.arange(n) % 3 + 1  # rank j gets counts[j] elements from every rank
    xv = _random(rng, int(counts.sum()), dtype)
    sd = [int(v) for v in np.concatenate(([0], np.cumsum(counts)[:-1]))]
    rc, rd = [int(counts[r])] * n, [int(counts[r]) * i for i in range(n)]

    def run(fn, *bufs):
        out = fn(*bufs)
        if not blocking:
            out.Wait()

    def direct(op, **kw):
        return be.direct(op, x.dtype, blocking=blocking, **kw)

    ok = True
    got, want = np.empty_like(x), np.empty_like(x)
    run(direct("all_to_all"), x, got)
    be.all_to_all(x, want)
    ok &= np.array_equal(got, want)
    got, want = np.empty(sum(rc), x.dtype), np.empty(sum(rc), x.dtype)
    run(direct("all_to_all_v", counts=(counts, sd, rc, rd)), xv, got)
    be.all_to_all_v(xv, want, send_counts=counts, recv_counts=rc)
    ok &= np.array_equal(got, want)
    got, want = np.empty_like(x), np.empty_like(x)
    run(direct("all_reduce", reduce_op=ReduceOp.SUM), x, got)
    be.all_reduce(x, want)
    mine = x.copy()
    run(direct("all_reduce", reduce_op=ReduceOp.SUM, in_place=True), mine)
    ok &= np.array_equal(got, want) and np.array_equal(mine, want)
    got, want = np.empty(3, x.dtype), np.empty(3, x.dtype)
    run(direct("reduce_scatter", reduce_op=ReduceOp.MAX), x, got)
    be.reduce_scatter(x, want, op="max")
    ok &= np.array_equal(got, want)
    got, want = np.empty(n * x.size, x.dtype), np.empty(n * x.size, x.dtype)
    run(direct("all_gather"), x, got)
    be.all_gather(x, want)
    ok &= np.array_equal(got, want)
    got, want = x.copy(), x.copy()
    run(direct("broadcast", root=n - 1), got)
    be.broadcast(want, root=n - 1)
    ok &= np.array_equal(got, want)
    parts = [int(c) for c in counts]  # the root's xv, counts[j] elements for rank j
    got = np.empty(parts[r], x.dtype)
    run(direct("scatter_v", root=0, counts=(parts, sd)), *((xv, got) if r == 0 else (got,)))
    root_xv = xv.copy()
    be.broadcast(root_xv, root=0)
    ok &= np.array_equal(got, root_xv[sd[r]:sd[r] + parts[r]])
    run(direct("barrier"))
    all_ranks(ok)


def test_persistent_requests_follow_their_buffers(world, be, all_ranks):
    n = world.size
    x, y = np.arange(2 * n, dtype=np.float64) + world.rank, np.empty(2 * n)
    want = np.empty_like(y)
    counts = ([2] * n, [2 * i for i in range(n)]) * 2
    ok = True
    for op, args, kw in (("all_to_all", (x, y), {}), ("all_to_all_v", (x, y), {"counts": counts}),
                         ("broadcast", (y,), {"root": 0})):
        req = be.persistent(op, *args, **kw)
        try:
            for step in range(2):
                x += 10
                if op == "broadcast":
                    y[:] = x
                    want[:] = x
                    be.broadcast(want, root=0)
                else:
                    be.all_to_all(x, want)
                req.Start()
                req.Wait()
                ok &= np.array_equal(y, want)
        finally:
            req.Free()
    all_ranks(ok)


def test_send_recv_ring_blocking_and_async(world, be, all_ranks):
    n, r = world.size, world.rank
    out = np.arange(10, dtype=np.float64) + r
    inc = np.empty(10)
    h_recv = be.recv(inc, (r - 1) % n, tag=7, async_op=True)
    h_send = be.send(out, (r + 1) % n, tag=7, async_op=True)
    h_send.wait()
    assert h_recv.wait() is inc and h_recv.done
    all_ranks(np.array_equal(inc, np.arange(10) + (r - 1) % n))
    be.barrier()


@pytest.mark.mpi(min_size=2)
def test_recv_of_wrong_size_names_both_sizes(world, be):
    if world.rank == 0:
        be.send(np.zeros(5), 1)
    elif world.rank == 1:
        with pytest.raises(CollectiveArgumentError, match="expected 8 elements from rank 0, got 5"):
            be.recv(np.zeros(8), 0)
    be.barrier()


# -- bad input raises on every rank: the collectives check, the backend only moves -----

def _raises_everywhere(fn, match):
    with pytest.raises(CollectiveArgumentError, match=match) as info:
        fn()
    return info.value


@pytest.mark.mpi(min_size=2)
def test_dtype_differing_across_ranks(world, be):
    x = np.ones(4, np.float32 if world.rank == 0 else np.float64)
    err = _raises_everywhere(lambda: C.all_reduce(x), "dtype differs across ranks")
    assert err.field == "dtype" and 0 not in err.ranks


@pytest.mark.mpi(min_size=2)
def test_bad_buffer_on_one_rank(world, be):
    x = np.ones(8)[::2] if world.rank == 1 else np.ones(4)
    err = _raises_everywhere(lambda: C.all_gather(x, np.empty(4 * world.size)), "C-contiguous")
    assert err.ranks == (1,) and err.field == "sendbuf"


def test_wrong_sized_and_wrong_typed_buffers(world, be):
    n = world.size
    _raises_everywhere(lambda: C.all_to_all(np.ones(n * 3), np.ones(n * 3 + 1)), "recvbuf")
    _raises_everywhere(lambda: C.all_to_all(np.ones(n * 3 + 1), np.ones(n * 3 + 1)),
                       "equal blocks" if n > 1 else "recvbuf|equal blocks") if n > 1 else None
    _raises_everywhere(lambda: C.all_gather(np.ones(3), np.ones(3 * n + 2)), "recvbuf")
    _raises_everywhere(lambda: C.all_reduce(np.ones(3, np.float32), np.ones(3)), "dtype")
    _raises_everywhere(lambda: C.all_reduce(np.ones(3, bool)), "cannot be reduced")
    _raises_everywhere(lambda: C.all_reduce([1.0, 2.0]), "NumPy")
    _raises_everywhere(lambda: C.all_reduce(np.ones(3, np.complex64)), "not supported")
    ro = np.ones(3)
    ro.flags.writeable = False
    _raises_everywhere(lambda: C.broadcast(ro, root=0), "read-only")
    _raises_everywhere(lambda: C.broadcast(np.ones(3), root=n), "root")
    _raises_everywhere(lambda: C.reduce_scatter(np.ones(2 * n), np.ones(3)), "recvbuf")


def test_counts_that_do_not_sum_or_are_negative(world, be):
    n = world.size
    x, y = np.ones(n), np.ones(n)
    _raises_everywhere(lambda: C.all_to_all_v(x, [2] * n, y, [1] * n),
                       "send_counts: counts sum to")
    bad = [1] * n
    bad[0] = -1
    bad[-1] += 2 if n > 1 else 0
    if n > 1:
        _raises_everywhere(lambda: C.all_to_all_v(x, bad, y, [1] * n),
                           ">= 0")
    _raises_everywhere(lambda: C.all_to_all_v(x, [1] * (n + 1), y, [1] * n), "one count per rank")
    _raises_everywhere(lambda: C.reduce_scatter(np.ones(n), np.ones(1),
                                                 recv_counts=[1] * (n - 1) + [2]), "recv_counts")


@pytest.mark.mpi(min_size=2)
def test_send_and_recv_counts_disagree(world, be):
    n, r = world.size, world.rank
    sc = [1] * n
    rc = [1] * n
    if r == 1:
        rc = [2] + [1] * (n - 1)  # claims 2 from rank 0, which sends 1
    err = _raises_everywhere(
        lambda: C.all_to_all_v(np.ones(sum(sc)), sc, np.empty(sum(rc)), rc), r"recv_counts\[0\] is 2 but rank 0 sends 1")
    assert err.ranks == (1,)


@pytest.mark.mpi(min_size=2)
def test_ranks_calling_different_ops(world, be):
    if world.rank == 0:
        fn = lambda: C.all_reduce(np.ones(2))  # noqa: E731
    else:
        fn = lambda: C.all_gather(np.ones(2), np.empty(2 * world.size))  # noqa: E731
    err = _raises_everywhere(fn, "the ranks' calls differ")
    assert err.field == "call"
    assert "rank 0: all_reduce(float64, 2, op='sum')" in str(err), str(err)
    assert "rank 1: all_gather(float64, 2)" in str(err), str(err)


@pytest.mark.mpi(min_size=2)
def test_reduce_op_differs(world, be):
    op = "sum" if world.rank == 0 else "max"
    _raises_everywhere(lambda: C.all_reduce(np.ones(2), op=op), "reduce_op differs")


def test_unknown_reduce_op_is_a_value_error(world, be):
    with pytest.raises(ValueError, match="op: expected one of"):
        C.all_reduce(np.ones(2), op="average")
