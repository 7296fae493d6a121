"""Every collective algorithm against mpi4py's native collective, on random data.

Runs at any world size and node layout (NEOCOMM_RANKS_PER_NODE emulates
nodes); an algorithm that cannot run on the layout (hierarchical on one
node, doubling on 3 ranks) is skipped for that case, and each test checks
that at least one algorithm ran.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import collectives as C
from collectives.algorithms import names
from collectives.types import CollectiveOp
from neocomm import CollectiveArgumentError
from neocomm.types import bfloat16

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("all", why=(
    "each algorithm's schedule follows the rank count and the nodes: one rank, powers of two,"
    " three ranks and one or two ranks a node take different paths"))]

HYP = settings(max_examples=6, deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))
DTYPES = ["float32", "float64", "int32", "int64", "float16"] + (["bfloat16"] if bfloat16 else [])
CHUNKS = [None, 8, 4096]  # bytes: default, tiny (many chunks), one MTU


def _data(rng, n, dtype):
    dt = np.dtype(bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return rng.integers(-8, 8, n).astype(dt)  # small integers: exact sums in every dtype


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _each_algorithm(op, fn):
    """Run ``fn(algo)`` for every algorithm of ``op`` that can run here; return the names run."""
    ran = []
    for algo in names(op):
        try:
            fn(algo)
        except CollectiveArgumentError as exc:
            if exc.field == "algo" and "cannot run" in str(exc):
                continue
            raise
        ran.append(algo)
    assert ran, f"no algorithm ran for {op.value}"
    return ran


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@given(block=st.integers(0, 700))
@HYP
def test_all_to_all(world, all_ranks, dtype, block):
    comm, p = world.comm, world.size
    x = _data(np.random.default_rng(block + 31 * world.rank), block * p, dtype)
    want = np.empty_like(x)
    comm.Alltoall(_bytes(x), _bytes(want))

    def check(algo):
        for chunk in CHUNKS:
            got = C.all_to_all(x, algo=algo, chunk_bytes=None if chunk is None else
                               max(chunk, x.itemsize) // x.itemsize * x.itemsize)
            all_ranks(np.array_equal(_bytes(got), _bytes(want)), f"{algo} chunk {chunk}")

    _each_algorithm(CollectiveOp.ALL_TO_ALL, check)


def test_all_to_all_with_other_chunks_across_nodes(world, all_ranks, monkeypatch):
    """Chunk sizes that differ between intra- and inter-node links (as between the hosts
    of a real cluster, where the inter-node link has its own): a rank whose send peer is
    on another node than its receive peer cuts the two directions differently. Bruck's
    in-place steps once let such a receive overwrite blocks before they were sent."""
    from collectives import settings

    comm, p = world.comm, world.size
    for intra, inter in (("64K", "16K"), ("16K", "64K")):
        monkeypatch.setenv("NEOCOMM_CHUNK_BYTES_INTRA", intra)
        monkeypatch.setenv("NEOCOMM_CHUNK_BYTES_INTER", inter)
        settings.reload()
        try:
            x = _data(np.random.default_rng(7 + world.rank), (1 << 16) * p, "float32")
            want = np.empty_like(x)
            comm.Alltoall(_bytes(x), _bytes(want))

            def check(algo):
                got = C.all_to_all(x, algo=algo)
                all_ranks(np.array_equal(_bytes(got), _bytes(want)),
                          f"{algo}: intra chunks {intra}, inter {inter}")

            _each_algorithm(CollectiveOp.ALL_TO_ALL, check)
        finally:
            monkeypatch.undo()
            settings.reload()


@given(seed=st.integers(0, 10_000), zero_prob=st.floats(0, 0.8))
@HYP
def test_all_to_all_v_uneven_and_zero_counts(world, all_ranks, seed, zero_prob):
    comm, p, r = world.comm, world.size, world.rank
    crng = np.random.default_rng(seed)  # the same count matrix on every rank
    counts = crng.integers(0, 300, (p, p))
    counts[crng.random((p, p)) < zero_prob] = 0
    sc, rc = counts[r], counts[:, r]
    x = _data(np.random.default_rng(seed + r), int(sc.sum()), "int32")
    want = np.empty(int(rc.sum()), x.dtype)
    comm.Alltoallv([x, (sc.tolist(), None)], [want, (rc.tolist(), None)])

    def check(algo):
        for chunk in (None, 4, 64):
            got, got_counts = C.all_to_all_v(x, sc, algo=algo, chunk_bytes=chunk)
            all_ranks(np.array_equal(got, want) and np.array_equal(got_counts, rc), algo)
            out = np.full(int(rc.sum()), -1, x.dtype)
            got2, _ = C.all_to_all_v(x, sc, out, rc, algo=algo, chunk_bytes=chunk)
            all_ranks(got2 is out and np.array_equal(out, want), algo)

    _each_algorithm(CollectiveOp.ALL_TO_ALL_V, check)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 13, 3001])
def test_all_reduce(world, all_ranks, dtype, n):
    x = _data(np.random.default_rng(n + 7 * world.rank), n, dtype)
    want = x.astype(np.float64)
    world.comm.Allreduce(np.ascontiguousarray(x.astype(np.float64)), want)

    def check(algo):
        for chunk in CHUNKS:
            c = None if chunk is None else max(chunk, x.itemsize)
            got = C.all_reduce(x, np.empty_like(x), algo=algo, chunk_bytes=c)
            inplace = x.copy()
            C.all_reduce(inplace, algo=algo, chunk_bytes=c)
            all_ranks(np.array_equal(got.astype(np.float64), want)
                      and np.array_equal(inplace.astype(np.float64), want), f"{algo} {chunk}")

    _each_algorithm(CollectiveOp.ALL_REDUCE, check)


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_all_reduce_other_ops(world, all_ranks, op):
    x = np.random.default_rng(world.rank).integers(1, 3, 257).astype(np.int64)
    want = np.empty_like(x)
    from mpi4py import MPI

    world.comm.Allreduce(x, want, op=getattr(MPI, op.upper()))
    _each_algorithm(CollectiveOp.ALL_REDUCE, lambda algo: all_ranks(np.array_equal(
        C.all_reduce(x, np.empty_like(x), op=op, algo=algo, chunk_bytes=64), want), algo))


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
@pytest.mark.parametrize("block", [0, 1, 1000])
def test_reduce_scatter_equal_blocks(world, all_ranks, dtype, block):
    p = world.size
    x = _data(np.random.default_rng(block + 5 * world.rank), block * p, dtype)
    full = np.empty(x.size)
    world.comm.Allreduce(np.ascontiguousarray(x.astype(np.float64)), full)
    want = full[world.rank * block:(world.rank + 1) * block]

    def check(algo):
        for chunk in CHUNKS:
            c = None if chunk is None else max(chunk, x.itemsize)
            got = C.reduce_scatter(x, algo=algo, chunk_bytes=c)
            all_ranks(np.array_equal(got.astype(np.float64), want), f"{algo} {chunk}")

    _each_algorithm(CollectiveOp.REDUCE_SCATTER, check)


@given(seed=st.integers(0, 10_000))
@HYP
def test_reduce_scatter_variable_blocks(world, all_ranks, seed):
    p, r = world.size, world.rank
    counts = np.random.default_rng(seed).integers(0, 200, p)
    counts[seed % p] = 0
    x = _data(np.random.default_rng(seed + r), int(counts.sum()), "float64")
    full = x.copy()
    world.comm.Allreduce(x, full)
    lo = int(counts[:r].sum())
    want = full[lo:lo + counts[r]]
    _each_algorithm(CollectiveOp.REDUCE_SCATTER, lambda algo: all_ranks(np.array_equal(
        C.reduce_scatter(x, recv_counts=counts, algo=algo, chunk_bytes=16), want), algo))


@pytest.mark.parametrize("n", [0, 3, 2000])
def test_all_gather(world, all_ranks, n):
    x = _data(np.random.default_rng(n + world.rank), n, "float32")
    want = np.empty(n * world.size, x.dtype)
    world.comm.Allgather(x, want)

    def check(algo):
        for chunk in CHUNKS:
            got = C.all_gather(x.reshape(1, -1) if n else x, algo=algo, chunk_bytes=chunk)
            all_ranks(got.shape[0] == world.size and np.array_equal(got.ravel(), want), algo)

    _each_algorithm(CollectiveOp.ALL_GATHER, check)


@pytest.mark.parametrize("n", [0, 5, 3000])
def test_broadcast_every_root(world, all_ranks, n):
    for root in range(world.size):
        src = _data(np.random.default_rng(n + root), n, "float64")

        def check(algo):
            for chunk in CHUNKS:
                buf = src.copy() if world.rank == root else np.zeros(n)
                out = C.broadcast(buf, root=root, algo=algo, chunk_bytes=chunk)
                all_ranks(out is buf and np.array_equal(buf, src), f"{algo} root {root}")

        _each_algorithm(CollectiveOp.BROADCAST, check)


@pytest.mark.parametrize("n", [1, 1000])
def test_one_to_many_identical(world, all_ranks, n):
    p, r = world.size, world.rank
    for root in range(p):
        ranks = [q for q in range(p) if q % 2 == 0 or q == root][::-1]  # any order, root in
        src = np.arange(n, dtype=np.float32) + root

        def check(algo):
            out = C.one_to_many(src if r == root else None,
                                np.zeros(n, np.float32) if r in ranks else None,
                                root=root, ranks=ranks, algo=algo, chunk_bytes=8)
            ok = np.array_equal(out, src) if r in ranks else out is None
            all_ranks(ok, f"{algo} root {root}")

        _each_algorithm(CollectiveOp.ONE_TO_MANY, check)


def test_one_to_many_distinct_payloads(world, all_ranks):
    p, r = world.size, world.rank
    root = p - 1
    ranks = [q for q in range(p) if q != 0 or p == 1]
    counts = [(i * 3) % 5 for i in range(len(ranks))]  # zero counts included
    src = np.arange(sum(counts), dtype=np.int16)
    out = C.one_to_many(src if r == root else None, root=root, ranks=ranks, counts=counts,
                        chunk_bytes=2)
    if r in ranks:
        i = ranks.index(r)
        a = sum(counts[:i])
        all_ranks(np.array_equal(out, src[a:a + counts[i]]))
    else:
        all_ranks(out is None)


@given(seed=st.integers(0, 10_000))
@HYP
def test_many_to_many(world, all_ranks, seed):
    p, r = world.size, world.rank
    grng = np.random.default_rng(seed)  # the same traffic matrix on every rank
    talk = grng.random((p, p)) < 0.5
    counts = grng.integers(0, 40, (p, p)) * talk
    peers = [q for q in range(p) if talk[r, q]][::-1]
    sc = [int(counts[r, q]) for q in peers]
    x = (np.arange(sum(sc)) + 10_000 * r).astype(np.float64)
    senders = [q for q in range(p) if talk[q, r]]

    def expected():
        parts = []
        for q in senders:
            q_peers = [t for t in range(p) if talk[q, t]][::-1]
            q_counts = [int(counts[q, t]) for t in q_peers]
            off = sum(q_counts[:q_peers.index(r)])
            parts.append(np.arange(off, off + counts[q, r]) + 10_000 * q)
        return np.concatenate(parts) if parts else np.empty(0)

    want = expected()

    def check(algo):
        got, rpeers, rcounts = C.many_to_many(x, peers, sc, algo=algo, chunk_bytes=16)
        ok = rpeers == senders and list(rcounts) == [int(counts[q, r]) for q in senders]
        all_ranks(ok and np.array_equal(got, want), f"{algo} discovered")
        got2, _, _ = C.many_to_many(x, peers, sc, recv_peers=senders,
                                    recv_counts=[int(counts[q, r]) for q in senders],
                                    algo=algo)
        all_ranks(np.array_equal(got2, want), f"{algo} given")

    _each_algorithm(CollectiveOp.MANY_TO_MANY, check)


def test_default_selection_runs_every_op(world, all_ranks):
    """No algo= and no NEOCOMM_ALGO_*: the cost model picks; results still match."""
    p = world.size
    x = np.arange(4 * p, dtype=np.float32) + world.rank
    a2a = C.all_to_all(x)
    want = np.empty_like(x)
    world.comm.Alltoall(x, want)
    ar = C.all_reduce(x, np.empty_like(x))
    want_ar = np.empty_like(x)
    world.comm.Allreduce(x, want_ar)
    all_ranks(np.array_equal(a2a, want) and np.array_equal(ar, want_ar))
