"""Bad input to the collectives raises CollectiveArgumentError on every rank, never hangs."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import settings
from neocomm import CollectiveArgumentError

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x1", "1x2", "1x3", "2x2", why=(
    "bad input is refused on one rank, on groups of two and three, and by the algorithms "
    "between nodes"))]


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
    """After calls refused on every rank (a count that differs across ranks, an unknown
    algorithm), the next collectives of the same group move every rank's data."""
    p, r = world.size, world.rank
    if p > 1:
        raises_everywhere(all_ranks, lambda: C.all_reduce(np.zeros(4 + r)), "count")
    raises_everywhere(all_ranks, lambda: C.all_to_all(np.zeros(4 * p), algo="fastest"), "algo")
    x = np.arange(4 * p, dtype=np.float32) + 100 * r
    want_ar, want_a2a = np.empty_like(x), np.empty_like(x)
    world.comm.Allreduce(x, want_ar)
    world.comm.Alltoall(x, want_a2a)
    all_ranks(np.array_equal(C.all_reduce(x, np.empty_like(x)), want_ar)
              and np.array_equal(C.all_to_all(x), want_a2a))


def test_all_to_all_v_counts_that_cannot_be_read_raise_everywhere(world, all_ranks):
    p = world.size
    x = np.zeros(p, np.float32)
    counts = [[1]] * p if world.rank == 0 else [1] * p  # a list of lists on rank 0
    raises_everywhere(all_ranks, lambda: C.all_to_all_v(x, counts, np.zeros(p, np.float32),
                                                        [1] * p), field="send_counts")


def test_doubling_on_a_group_that_is_not_a_power_of_two(world, all_ranks):
    """A 3-rank group (split from 4 over 2 nodes: nodes of 2 and 1) cannot run recursive
    doubling: every member is told which algorithm, the group size and the rule, before
    any message moves; the default algorithm still gathers correctly."""
    if world.size < 3:
        pytest.skip("needs a group of 3 ranks")
    sub = world.world.split([0, 1, 2])
    ok = True
    if sub is not None:
        x = np.full(4, sub.rank, np.float32)
        try:
            C.all_gather(x, group=sub, algo="doubling")
            ok = False
        except CollectiveArgumentError as exc:
            msg = str(exc)
            ok = ("'doubling'" in msg and "power of two" in msg and "got 3 ranks" in msg
                  and exc.field == "algo")
        got = C.all_gather(x, group=sub)
        ok = ok and np.array_equal(got.reshape(-1), np.repeat(np.arange(3.0), 4))
    all_ranks(ok, "doubling on 3 ranks")


def test_different_collectives_on_different_ranks_are_named(world, all_ranks):
    """Rank 0 in all_to_all_v while the others are in all_to_all: every rank raises at
    once (no watchdog), showing each rank's call as written."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    p = world.size
    x = np.ones(8 * p, np.float32)
    if world.rank == 0:
        fn = lambda: C.all_to_all_v(x, [8] * p, recv_counts=[8] * p)  # noqa: E731
    else:
        fn = lambda: C.all_to_all(x)  # noqa: E731
    exc = raises_everywhere(all_ranks, fn, "call")
    msg = str(exc)
    all_ranks(f"rank 0: all_to_all_v(float32, counts {[8] * p})" in msg
              and f"rank 1: all_to_all(float32, {8 * p})" in msg, msg)


@pytest.mark.parametrize("async_rank", [0, -1])
def test_blocking_and_async_calls_do_not_match(world, all_ranks, async_rank):
    if world.size < 2:
        pytest.skip("needs two ranks")
    mine = world.rank == async_rank % world.size
    x = np.ones(16, np.float32)

    def call():
        h = C.all_reduce(x, async_op=mine)
        if mine:
            h.wait()
    exc = raises_everywhere(all_ranks, call, "call")
    all_ranks(f"rank {async_rank % world.size}: all_reduce(float32, 16, op='sum', "
              f"async_op=True)" in str(exc), str(exc))


@pytest.mark.parametrize("fn", ["all_reduce", "reduce_scatter"])
def test_an_invalid_op_on_one_rank_is_refused_everywhere(world, all_ranks, fn):
    x = np.ones(4 * world.size, np.float32)
    op = "average" if world.rank == world.size - 1 else "sum"
    exc = raises_everywhere(all_ranks, lambda: getattr(C, fn)(x, op=op), "op", "'average'")
    all_ranks(exc.ranks == (world.size - 1,), f"{exc.ranks}")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32"])
def test_integer_overflow_wraps_on_every_algorithm(world, all_ranks, dtype):
    """C's two's-complement wrap-around (as MPI and NCCL define it) on every path."""
    from collectives.algorithms import registry
    from collectives.types import CollectiveOp

    info = np.iinfo(dtype)
    x = np.full(64 * world.size, info.max - 3, dtype)
    want = np.full_like(x, info.max - 3)
    with np.errstate(over="ignore"):
        for _ in range(world.size - 1):
            want = want + np.full_like(x, info.max - 3)
    bad = []
    for algo in registry()[CollectiveOp.ALL_REDUCE]:
        y = x.copy()
        for rep in range(2):  # the second call replays the first one's plan
            y[...] = x
            try:
                C.all_reduce(y, algo=algo.name)
            except CollectiveArgumentError as exc:
                if exc.field == "algo":  # cannot run on this group: said on every rank
                    break
                raise
            if not np.array_equal(y, want):
                bad.append(f"{algo.name} call {rep + 1}: {y[:2]}")
    all_ranks(not bad, f"{dtype} sums that did not wrap to {want[:2]}: {bad}")


@pytest.mark.parametrize("shift", [4, -4], ids=["recv_after_send", "recv_before_send"])
@pytest.mark.parametrize("fn", ["all_to_all", "all_to_all_v", "all_reduce", "reduce_scatter",
                                "all_gather"])
def test_partly_overlapping_buffers_are_refused(world, all_ranks, fn, shift):
    """Views of one array at different offsets are refused on every rank, naming both
    buffers; the very same array (in place) still works."""
    p = world.size
    n = 8 * p
    base = np.arange(n * p + 16, dtype=np.float32)
    out_n = {"reduce_scatter": n // p, "all_gather": n * p}.get(fn, n)
    s0 = 8
    send = base[s0:s0 + n]
    recv = base[s0 + shift:s0 + shift + out_n]
    call = {"all_to_all": lambda: C.all_to_all(send, recv),
            "all_to_all_v": lambda: C.all_to_all_v(send, [8] * p, recv, [8] * p),
            "all_reduce": lambda: C.all_reduce(send, recv),
            "reduce_scatter": lambda: C.reduce_scatter(send, recv),
            "all_gather": lambda: C.all_gather(send, recv)}[fn]
    raises_everywhere(all_ranks, call, "recvbuf", "overlaps sendbuf in part")


@pytest.mark.parametrize("fn", ["all_to_all", "all_to_all_v", "all_reduce"])
def test_the_same_array_as_send_and_receive_buffer_works_on_every_algorithm(world, all_ranks,
                                                                            fn):
    from collectives.algorithms import registry
    from collectives.types import CollectiveOp

    p = world.size
    bad = []
    for algo in registry()[CollectiveOp(fn)]:
        x = np.arange(8 * p, dtype=np.float32) + 100 * world.rank
        want = np.empty_like(x)
        (world.comm.Allreduce if fn == "all_reduce" else world.comm.Alltoall)(x.copy(), want)
        try:
            if fn == "all_to_all_v":
                got = C.all_to_all_v(x, [8] * p, x, [8] * p, algo=algo.name)[0]
            else:
                got = getattr(C, fn)(x, x, algo=algo.name)
        except CollectiveArgumentError as exc:
            if exc.field == "algo":  # cannot run on this group (said on every rank)
                continue
            raise
        if not np.array_equal(got, want):
            bad.append(algo.name)
    all_ranks(not bad, f"{fn} in place wrong with {bad}")


@pytest.mark.parametrize("bad", ["world", 3, "comm"])
def test_something_that_is_not_a_group_is_named(world, all_ranks, bad):
    """An mpi4py communicator, a number or a name where a group goes: a TypeError that
    names what was given and what a group is, on every rank that passed it."""
    from mpi4py import MPI

    given = MPI.COMM_WORLD if bad == "comm" else bad
    x = np.ones(4, np.float32)
    try:
        C.all_reduce(x, group=given)
        msg = ""
    except TypeError as exc:
        msg = str(exc)
    want = {"comm": "got Intracomm", 3: "got int 3", "world": "got str 'world'"}[bad]
    all_ranks("group: expected a neocomm ProcessGroup" in msg and want in msg, msg)


def test_the_world_itself_stands_for_its_world_group(world, all_ranks):
    """``group=world`` (the World that neocomm.init returned) reduces over every rank."""
    x = np.full(4, world.rank + 1.0)
    got = C.all_reduce(x, np.empty_like(x), group=world)
    all_ranks(np.array_equal(got, np.full(4, world.size * (world.size + 1) / 2)))
