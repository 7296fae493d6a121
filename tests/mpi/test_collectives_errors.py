"""Bad input to the collectives raises CollectiveArgumentError on every rank, never hangs."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import settings
from neocomm import CollectiveArgumentError

pytestmark = pytest.mark.mpi(min_size=1)


def raises_everywhere(all_ranks, fn, field=None, match=None):
    """``fn()`` must raise CollectiveArgumentError here (and so on every rank)."""
    try:
        fn()
    except CollectiveArgumentError as exc:
        ok = (field is None or exc.field == field) and (match is None or match in str(exc))
        all_ranks(ok, f"wrong error: field={exc.field!r} {exc}")
        return exc
    all_ranks(False, "no error raised")


def test_unknown_algorithm(world, all_ranks):
    x = np.zeros(4 * world.size, np.float32)
    exc = raises_everywhere(all_ranks, lambda: C.all_to_all(x, algo="fastest"), "algo",
                            "unknown algorithm 'fastest'")
    all_ranks("pairwise" in str(exc))


def test_algorithm_that_cannot_run_here(world, all_ranks):
    x = np.zeros(4 * world.size, np.float32)
    if world.num_nodes == 1:  # hierarchical needs two nodes
        raises_everywhere(all_ranks, lambda: C.all_to_all(x, algo="hierarchical"), "algo",
                          "needs at least 2 nodes")
    raises_everywhere(all_ranks, lambda: C.all_reduce(x, algo="bruck"), "algo",
                      "unknown algorithm 'bruck'")


def test_algorithm_forced_by_setting(world, all_ranks, monkeypatch):
    x = np.zeros(2 * world.size, np.float32)
    monkeypatch.setenv("NEOCOMM_ALGO_ALL_GATHER", "nonexistent")
    settings.reload()
    try:
        raises_everywhere(all_ranks, lambda: C.all_gather(x), "algo", "NEOCOMM_ALGO_ALL_GATHER")
    finally:
        monkeypatch.delenv("NEOCOMM_ALGO_ALL_GATHER")
        settings.reload()


@pytest.mark.parametrize("chunk", [0, -8, 6, 4.0])
def test_bad_chunk_sizes(world, all_ranks, chunk):
    x = np.zeros(8 * world.size, np.float64)
    raises_everywhere(all_ranks, lambda: C.all_reduce(x, chunk_bytes=chunk), "chunk_bytes")


def test_bad_chunk_on_one_rank_only(world, all_ranks):
    x = np.zeros(8 * world.size, np.float32)
    chunk = 3 if world.rank == world.size - 1 else 4096
    exc = raises_everywhere(all_ranks, lambda: C.reduce_scatter(x, chunk_bytes=chunk),
                            "chunk_bytes")
    all_ranks(world.size - 1 in exc.ranks)


def test_chunk_setting_zero(world, all_ranks, monkeypatch):
    monkeypatch.setenv("NEOCOMM_CHUNK_BYTES", "0")
    settings.reload()
    try:
        x = np.zeros(16, np.float32)
        raises_everywhere(all_ranks, lambda: C.broadcast(x, root=0), "chunk_bytes",
                          "NEOCOMM_CHUNK_BYTES")
    finally:
        monkeypatch.delenv("NEOCOMM_CHUNK_BYTES")
        settings.reload()


def test_backend_rejections(world, all_ranks):
    p = world.size
    raises_everywhere(all_ranks, lambda: C.all_to_all(np.zeros(2 * p + 1, np.float32)),
                      "sendbuf", "equal blocks" if p > 1 else None) if p > 1 else None
    raises_everywhere(all_ranks, lambda: C.all_to_all([1, 2, 3]), "sendbuf")
    raises_everywhere(all_ranks, lambda: C.all_reduce(np.zeros(4, bool)), "sendbuf",
                      "cannot be reduced")
    raises_everywhere(all_ranks, lambda: C.all_reduce(np.zeros((4, 4))[:, 0]), "sendbuf",
                      "C-contiguous")
    ro = np.zeros(4)
    ro.flags.writeable = False
    raises_everywhere(all_ranks, lambda: C.all_reduce(ro), "sendbuf", "read-only")
    raises_everywhere(all_ranks, lambda: C.all_gather(np.zeros(3), np.zeros(3 * p + 1)),
                      "recvbuf")
    raises_everywhere(all_ranks, lambda: C.all_reduce(np.zeros(3), np.zeros(3, np.float32)),
                      "recvbuf", "dtype")


@pytest.mark.mpi(min_size=2)
def test_mismatch_across_ranks(world, all_ranks):
    n = 4 + world.rank  # a different count on every rank
    raises_everywhere(all_ranks, lambda: C.all_reduce(np.zeros(n)), "count",
                      "differs across ranks")
    dtype = np.float32 if world.rank == 0 else np.float64
    raises_everywhere(all_ranks, lambda: C.broadcast(np.zeros(4, dtype), root=0), "dtype")


def test_bad_counts(world, all_ranks):
    p = world.size
    x = np.zeros(10, np.int32)
    raises_everywhere(all_ranks, lambda: C.all_to_all_v(x, [10] + [0] * (p - 1) + [1]),
                      "send_counts")
    raises_everywhere(all_ranks, lambda: C.all_to_all_v(x, [-1] + [0] * (p - 2) + [11]
                                                        if p > 1 else [-1]), "send_counts")
    sc = [10] + [0] * (p - 1)
    rc = [1] * p  # wrong: only rank 0 sends, and 10 elements
    raises_everywhere(all_ranks, lambda: C.all_to_all_v(x, sc, np.zeros(p, np.int32), rc),
                      "recv_counts")
    raises_everywhere(all_ranks, lambda: C.reduce_scatter(np.zeros(5), recv_counts=[6] * p),
                      "recv_counts")


def test_one_to_many_root_outside_the_group(world, all_ranks):
    x = np.zeros(4, np.float32)
    raises_everywhere(all_ranks, lambda: C.one_to_many(x, x.copy(), root=world.size,
                                                       ranks=[0]), "root", "group rank")
    raises_everywhere(all_ranks, lambda: C.one_to_many(x, x.copy(), root=-1, ranks=[0]),
                      "root")
    raises_everywhere(all_ranks, lambda: C.one_to_many(x, x.copy(), root=0,
                                                       ranks=[world.size + 3]), "ranks")
    raises_everywhere(all_ranks, lambda: C.one_to_many(x, x.copy(), root=0, ranks=[0, 0]),
                      "ranks", "twice")


def test_one_to_many_receiver_buffer_mismatch(world, all_ranks):
    r = world.rank
    src = np.arange(8, dtype=np.float32)
    recv = np.zeros(7 if r == world.size - 1 else 8, np.float32)
    raises_everywhere(all_ranks, lambda: C.one_to_many(src if r == 0 else None, recv, root=0,
                                                       ranks=list(range(world.size))),
                      "recvbuf")


def test_many_to_many_disagreeing_peers(world, all_ranks):
    """Receivers name senders that do not send to them: detected on every rank."""
    p, r = world.size, world.rank
    x = np.zeros(2, np.float64)
    to = (r + 1) % p
    wrong_from = (r + 1) % p if p > 2 else r  # should be (r - 1) % p
    if p == 1:
        wrong_from = None
    recv_peers = [] if wrong_from is None else [wrong_from]
    exc = raises_everywhere(all_ranks, lambda: C.many_to_many(x, [to], recv_peers=recv_peers),
                            "recv_peers", "disagree")
    all_ranks(len(exc.per_rank) >= 1)


def test_many_to_many_disagreeing_counts(world, all_ranks):
    p, r = world.size, world.rank
    x = np.zeros(3, np.int64)
    raises_everywhere(all_ranks, lambda: C.many_to_many(
        x, [(r + 1) % p], recv_peers=[(r - 1) % p], recv_counts=[2]), "recv_counts")


def test_many_to_many_bad_peers(world, all_ranks):
    x = np.zeros(3, np.int64)
    raises_everywhere(all_ranks, lambda: C.many_to_many(x, [world.size]), "send_peers")
    raises_everywhere(all_ranks, lambda: C.many_to_many(x, [0], [2]), "send_counts")


def test_group_still_usable_after_errors(world, all_ranks):
    x = np.arange(4 * world.size, dtype=np.float32)
    want = np.empty_like(x)
    world.comm.Allreduce(x, want)
    all_ranks(np.array_equal(C.all_reduce(x, np.empty_like(x)), want))


def test_all_to_all_v_counts_that_cannot_be_read_raise_everywhere(world, all_ranks):
    p = world.size
    x = np.zeros(p, np.float32)
    counts = [[1]] * p if world.rank == 0 else [1] * p  # a list of lists on rank 0
    raises_everywhere(all_ranks, lambda: C.all_to_all_v(x, counts, np.zeros(p, np.float32),
                                                        [1] * p), field="send_counts")
