"""Symmetric memory and the ``symmetric`` algorithm, against native MPI."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import collectives as C
from collectives import symmetric
from collectives.select import select
from collectives.fabric import fabric_for
from collectives.types import CollectiveOp, Request
from neocomm import CollectiveArgumentError

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("all", why=(
    "symmetric memory within one node at 1 to 4 ranks, and the refusal across nodes"))]

SYM = "symmetric"


def one_node(world) -> bool:
    return world.num_nodes == 1


def raises_everywhere(all_ranks, fn, match):
    try:
        fn()
    except CollectiveArgumentError as exc:
        all_ranks(match in str(exc), f"wrong error: {exc}")
        return exc
    all_ranks(False, "no error raised")


@pytest.fixture
def group(world):
    """The world group when it lies in one node, else this node's group."""
    return world.world if one_node(world) else world.intra_node


def test_empty_is_symmetric_zeroed_and_shaped(world, group, all_ranks):
    buf = symmetric.empty((3, 5), np.float64, group=group)
    plain = np.zeros((3, 5))
    ok = (buf.shape == (3, 5) and buf.dtype == np.float64 and not buf.any()
          and symmetric.is_symmetric(buf, group) and symmetric.is_symmetric(buf[1], group)
          and not symmetric.is_symmetric(plain, group))
    all_ranks(ok, "shape, dtype, zeros or symmetry wrong")
    z = symmetric.zeros(7, "int32", group=group)
    all_ranks(z.shape == (7,) and z.dtype == np.int32 and not z.any())


def test_no_file_is_left_in_dev_shm(world, group, all_ranks):
    symmetric.empty(1024, np.float32, group=group)
    group.comm.Barrier()
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"neocomm-{os.getpid()}-")]
    all_ranks(not left, f"left behind: {left}")


def test_peers_see_each_others_writes(world, group, all_ranks):
    buf = symmetric.empty(4, np.int64, group=group)
    buf[:] = group.rank + 10
    group.comm.Barrier()
    views, _, _ = symmetric.peers(group, buf)
    all_ranks(all(int(v[0]) == q + 10 for q, v in enumerate(views)))
    group.comm.Barrier()


def test_memory_is_released_with_its_last_view(world, group, all_ranks):
    import weakref

    buf = symmetric.empty(1 << 16, np.float32, group=group)
    whole = buf.base
    while whole.base is not None and isinstance(whole.base, np.ndarray):
        whole = whole.base
    ref = weakref.ref(whole)
    del buf, whole
    gc.collect()
    all_ranks(ref() is None, "the region outlived its arrays")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
@pytest.mark.parametrize("count", [0, 1, 13, 4099])
def test_all_reduce_matches_mpi(world, group, all_ranks, rng, dtype, count):
    from mpi4py import MPI

    p = group.size
    src = symmetric.empty(count, dtype, group=group)
    src[:] = (rng.random(count) * 100).astype(dtype)
    ref = np.empty(count, dtype)
    group.comm.Allreduce(np.array(src), ref, op=MPI.SUM)
    ref_max = np.empty(count, dtype)
    group.comm.Allreduce(np.array(src), ref_max, op=MPI.MAX)
    two_shot = symmetric.empty(count, dtype, group=group)
    C.all_reduce(src, two_shot, group=group, algo=SYM)
    one_shot = np.empty(count, dtype)
    C.all_reduce(src, one_shot, group=group, algo=SYM)
    one_shot_max = np.empty(count, dtype)
    C.all_reduce(src, one_shot_max, op="max", group=group, algo=SYM)
    C.all_reduce(src, group=group, algo=SYM)  # in place, last
    tol = dict(rtol=1e-5 * p) if dtype == "float32" else dict(rtol=1e-12)
    all_ranks(np.allclose(two_shot, ref, **tol) and np.allclose(one_shot, ref, **tol)
              and np.allclose(src, ref, **tol) and np.array_equal(one_shot_max, ref_max),
              "all_reduce differs from MPI")
    # every rank holds the same bits (the reduction order is the same everywhere)
    digest = np.frombuffer(np.ascontiguousarray(one_shot).tobytes(), np.uint8).sum()
    all_ranks(len(set(group.comm.allgather(int(digest)))) == 1, "ranks disagree bitwise")


@pytest.mark.parametrize("uneven", [False, True])
def test_reduce_scatter_matches_mpi(world, group, all_ranks, rng, uneven):
    from mpi4py import MPI

    p = group.size
    counts = [3 + 2 * q for q in range(p)] if uneven else [6] * p
    n = sum(counts)
    src = symmetric.empty(n, np.float64, group=group)
    src[:] = rng.random(n)
    ref = np.empty(counts[group.rank])
    group.comm.Reduce_scatter(np.array(src), ref, counts, op=MPI.SUM)
    out = C.reduce_scatter(src, recv_counts=counts if uneven else None, group=group, algo=SYM)
    all_ranks(np.allclose(out, ref, rtol=1e-12), "reduce_scatter differs from MPI")


def test_all_to_all_all_gather_broadcast_match_mpi(world, group, all_ranks, rng):
    p, r = group.size, group.rank
    src = symmetric.empty(5 * p, np.int32, group=group)
    src[:] = rng.integers(-1000, 1000, 5 * p)
    ref = np.empty_like(src)
    group.comm.Alltoall(np.array(src), ref)
    out = C.all_to_all(src, group=group, algo=SYM)
    small = symmetric.empty(4, np.float32, group=group)
    small[:] = r + 0.5
    gathered = C.all_gather(small, group=group, algo=SYM)
    root = p - 1
    bcast = symmetric.empty(6, np.int64, group=group)
    bcast[:] = 100 + r
    C.broadcast(bcast, root=root, group=group, algo=SYM)
    ok = (np.array_equal(out, ref)
          and np.array_equal(gathered, np.repeat(np.arange(p) + 0.5, 4).reshape(p, 4))
          and (bcast == 100 + root).all())
    all_ranks(ok, "all_to_all, all_gather or broadcast differs")


def test_async_handle(world, group, all_ranks):
    p = group.size
    src = symmetric.empty(1000, np.float64, group=group)
    src[:] = group.rank + 1
    out = symmetric.empty(1000, np.float64, group=group)
    handle = C.all_reduce(src, out, group=group, algo=SYM, async_op=True)
    got = handle.wait()
    all_ranks(got is out and np.allclose(out, p * (p + 1) / 2))


def test_selector_prefers_symmetric_for_large_reductions(world, group, all_ranks):
    fabric = fabric_for(group)
    big = Request(CollectiveOp.ALL_REDUCE, 64 << 20, 4, group.size, symmetric=3)
    plain = Request(CollectiveOp.ALL_REDUCE, 64 << 20, 4, group.size)
    want = SYM if group.size > 1 else None
    chosen = select(big, fabric).name
    all_ranks((want is None or chosen == want) and select(plain, fabric).name != SYM,
              f"chose {chosen}")


def test_slices_that_differ_across_ranks_raise_everywhere(world, group, all_ranks):
    if group.size < 2:
        pytest.skip("needs 2 ranks in a node")
    buf = symmetric.empty(64, np.float32, group=group)
    lo = 0 if group.rank == 0 else 16  # same size, different offsets
    backend = C.state_of(group)
    saved = backend.check
    backend.check = False  # the algorithm's own check, not the argument agreement
    try:
        raises_everywhere(all_ranks, lambda: C.all_reduce(buf[lo:lo + 16], group=group,
                                                          algo=SYM), "differ across ranks")
    finally:
        backend.check = saved


def test_forced_on_plain_buffers_names_the_reason(world, group, all_ranks):
    x = np.ones(8 * group.size, np.float32)
    raises_everywhere(all_ranks, lambda: C.all_reduce(x, group=group, algo=SYM),
                      "not symmetric memory")


def test_allocation_arguments_that_differ_raise_everywhere(world, group, all_ranks):
    if group.size < 2:
        pytest.skip("needs 2 ranks")
    shape = (4, 4) if group.rank == 0 else (2, 8)
    raises_everywhere(all_ranks, lambda: symmetric.empty(shape, np.float32, group=group),
                      "shape")


@pytest.mark.parametrize("shape, dtype, match", [((-1,), "float32", "shape"),
                                                 (("x",), "float32", "shape"),
                                                 ((4,), object, "dtype"),
                                                 ((4,), "complex64", "dtype")])
def test_bad_allocation_raises_everywhere(world, group, all_ranks, shape, dtype, match):
    raises_everywhere(all_ranks, lambda: symmetric.empty(shape, dtype, group=group), match)


def test_group_across_nodes_declines(world, all_ranks):
    if one_node(world):
        pytest.skip("needs an (emulated) multi-node layout")
    buf = symmetric.empty(8 * world.size, np.float32, group=world.world)
    # symmetric within each node: the node's group runs it, the world group cannot
    all_ranks(symmetric.is_symmetric(buf, world.intra_node)
              and not symmetric.is_symmetric(buf, world.world))
    raises_everywhere(all_ranks, lambda: C.all_reduce(buf, group=world.world, algo=SYM),
                      "within one node")
    C.all_reduce(buf[:8 * world.intra_node.size], group=world.intra_node, algo=SYM)


def test_subgroup(world, all_ranks):
    if world.size < 3 or not one_node(world):
        pytest.skip("needs 3 ranks in one node")
    sub = world.world.split([0, 2])
    if sub is not None:
        buf = symmetric.empty(10, np.float64, group=sub)
        buf[:] = sub.rank + 1
        C.all_reduce(buf, group=sub, algo=SYM)
        ok = (buf == 3).all()
    else:
        ok = True
    all_ranks(ok)


def test_async_operations_waited_in_different_orders(world, group, all_ranks):
    p = group.size
    bufs = [symmetric.empty(3000, np.float64, group=group) for _ in range(3)]
    for i, b in enumerate(bufs):
        b[:] = (i + 1) * (group.rank + 1)
    handles = [C.all_reduce(b, group=group, algo=SYM, async_op=True) for b in bufs[:2]]
    C.all_reduce(bufs[2], group=group, algo=SYM)  # blocking, while two are in flight
    for h in (handles if group.rank % 2 else handles[::-1]):
        h.wait()
    total = p * (p + 1) / 2
    all_ranks(all(np.allclose(b, (i + 1) * total) for i, b in enumerate(bufs)))


def test_mismatch_is_caught_asynchronously_too(world, group, all_ranks):
    if group.size < 2:
        pytest.skip("needs 2 ranks in a node")
    buf = symmetric.empty(64, np.float32, group=group)
    lo = 0 if group.rank == 0 else 16
    backend = C.state_of(group)
    saved = backend.check
    backend.check = False
    try:
        raises_everywhere(all_ranks, lambda: C.all_reduce(buf[lo:lo + 16], group=group,
                                                          algo=SYM, async_op=True).wait(),
                          "differ across ranks")
    finally:
        backend.check = saved


@pytest.mark.parametrize("overlap", [True, False])
def test_trainer_gradients_live_in_symmetric_memory(world, all_ranks, rng, overlap):
    from embedding.dense import DenseConfig, DenseModel
    from embedding.train.step import GradSync, PhaseTimer, symmetric_grads

    group = world.world
    alloc = symmetric_grads(group, np)
    if group.size < 2 or not one_node(world):
        all_ranks(alloc is None, "symmetric gradients on a group that cannot use them")
        return
    cfg = DenseConfig(num_dense=3, num_sparse=2, bottom_mlp=(8, 4), top_mlp=(8, 1))
    model = DenseModel(cfg, seed=1, grad_alloc=alloc)
    sync = GradSync(model, group, overlap=overlap)
    dense = rng.random((5, 3)).astype(np.float32)
    pooled = rng.random((5, 2, 4)).astype(np.float32)
    labels = (rng.random(5) > 0.5).astype(np.float32)
    plain = DenseModel(cfg, seed=1)  # the same step, gradients kept local
    plain.forward_backward(dense, pooled, labels)
    local = np.array(plain.flat_grads)
    model.forward_backward(dense, pooled, labels, hook=sync.hook())
    sync.finish(PhaseTimer())
    expected = np.empty_like(local)
    group.comm.Allreduce(local, expected)
    expected /= group.size
    all_ranks(symmetric.is_symmetric(model.flat_grads, group)
              and np.allclose(model.flat_grads, expected, rtol=1e-5, atol=1e-7),
              "gradients not symmetric or not the mean")


def _whole(buf):
    while isinstance(buf.base, np.ndarray):
        buf = buf.base
    return buf


def test_repeated_calls_replay_and_release_the_region(world, group, all_ranks):
    import weakref

    p = group.size
    src = symmetric.empty(5000, np.float32, group=group)
    out = symmetric.empty(5000, np.float32, group=group)
    results = []
    for step in range(3):  # the second and third calls replay the first one's plan
        src[:] = step + group.rank
        C.all_reduce(src, out, group=group, algo=SYM)
        results.append(float(out[0]))
    expected = [p * step + p * (p - 1) / 2 for step in range(3)]
    refs = [weakref.ref(_whole(src)), weakref.ref(_whole(out))]
    del src, out
    gc.collect()
    all_ranks(results == expected and all(r() is None for r in refs),
              f"{results} vs {expected}, regions alive: {[r() is not None for r in refs]}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_reductions(world, group, all_ranks, dtype):
    from neocomm.types import bfloat16

    dt = bfloat16 if dtype == "bfloat16" else np.float16
    p, n = group.size, 1000
    src = symmetric.empty(n, dt, group=group)
    src[:] = (np.arange(n) % 7 + group.rank).astype(dt)  # small integers: sums are exact
    out = C.all_reduce(src, symmetric.empty(n, dt, group=group), group=group, algo=SYM)
    block = C.reduce_scatter(src, group=group, algo=SYM) if n % p == 0 else None
    expected = (np.arange(n) % 7) * p + p * (p - 1) // 2
    ok = np.array_equal(out.astype(np.int64), expected)
    if block is not None:
        lo = group.rank * (n // p)
        ok = ok and np.array_equal(block.astype(np.int64), expected[lo:lo + n // p])
    all_ranks(ok, f"{dtype} reduction differs")


def _checks(group, buf, on: bool):
    backend = C.state_of(group)
    saved = backend.check
    backend.check = on
    return backend, saved


@pytest.mark.parametrize("mixed", ["plain on rank 0", "other slice on rank 0"])
def test_auto_selection_names_buffers_that_are_not_symmetric_everywhere(world, group,
                                                                         all_ranks, mixed):
    """Checks on, no algorithm forced: the agreement names the symmetric buffers."""
    if group.size < 2:
        pytest.skip("needs 2 ranks in a node")
    n = 1 << 18  # large enough for the cost model to pick symmetric
    pool = symmetric.empty(2 * n, np.float32, group=group)
    buf = pool[:n]
    if group.rank == 0:
        buf = np.zeros(n, np.float32) if mixed.startswith("plain") else pool[n:]
    backend, saved = _checks(group, pool, True)
    try:
        raises_everywhere(all_ranks, lambda: C.all_reduce(buf, group=group),
                          "symmetric buffers differs across ranks")
    finally:
        backend.check = saved


def test_dtype_that_differs_is_caught_with_checks_off(world, group, all_ranks):
    if group.size < 2:
        pytest.skip("needs 2 ranks in a node")
    pool = symmetric.empty(64, np.float32, group=group)
    buf = pool if group.rank else pool.view(np.int32)  # same bytes, another dtype
    backend, saved = _checks(group, pool, False)
    try:
        raises_everywhere(all_ranks, lambda: C.all_gather(buf, group=group, algo=SYM), "dtype")
    finally:
        backend.check = saved


def test_empty_buffers_run_anywhere_and_are_not_kept(world, all_ranks):
    import weakref

    if world.num_nodes != 1:
        pytest.skip("needs one node")
    sub = world.world.split([0]) if world.size > 1 else world.world
    if sub is not None and world.size > 1:
        symmetric.empty(4, np.float32, group=sub)  # only rank 0 has a region
    group = world.world
    empty_in, empty_out = np.zeros(0, np.float32), np.zeros(0, np.float32)
    C.all_reduce(empty_in, empty_out, group=group, algo=SYM)
    C.all_reduce(empty_in, empty_out, group=group)  # plain, planned
    refs = [weakref.ref(empty_in), weakref.ref(empty_out)]
    del empty_in, empty_out
    gc.collect()
    all_ranks(all(r() is None for r in refs), "a plan kept an empty buffer alive")


@pytest.mark.parametrize("which", ["every node", "node 0 only", "in place", "not rank 0"])
def test_hierarchical_all_reduce_loads_within_symmetric_nodes(world, all_ranks, rng,
                                                              monkeypatch, which):
    """Across (emulated) nodes: the intra-node steps of a node whose buffers are
    symmetric are loads; any mix of nodes gives MPI's result."""
    from mpi4py import MPI

    from collectives.algorithms import hier_allreduce

    layout = world.world.nodes
    if len(layout) < 2 or len({len(n) for n in layout}) != 1 or len(layout[0]) < 2:
        pytest.skip("needs 2 or more equal nodes of 2 or more ranks")
    seen = []
    ring = hier_allreduce.ring_reduce_scatter

    def spy(call, members, *args, **kw):
        seen.append(tuple(members))
        return ring(call, members, *args, **kw)

    monkeypatch.setattr(hier_allreduce, "ring_reduce_scatter", spy)
    group = world.world
    sym = {"node 0 only": world.node == 0, "not rank 0": world.rank != 0}.get(which, True)
    # a node loads when all its ranks' buffers are symmetric (empty ones always are)
    node_sym = sym if which != "not rank 0" else world.node != world.node_of(0)
    mine = tuple(layout[world.node])
    for count in (0, 5, 3001):
        seen.clear()
        src = symmetric.empty(count, np.float64, group=group)
        src[:] = rng.random(count)
        ref = np.empty(count)
        group.comm.Allreduce(np.array(src), ref, op=MPI.SUM)
        if which == "in place":
            C.all_reduce(src, group=group, algo="hierarchical")
            out = src
        else:
            out = symmetric.empty(count, np.float64, group=group)  # collective: everyone
            if not sym:
                out = np.empty(count)
            C.all_reduce(src, out, group=group, algo="hierarchical")
        loads, expected = mine not in seen, node_sym or count == 0
        all_ranks(np.allclose(out, ref, rtol=1e-12), f"{count}: differs from MPI")
        all_ranks(loads == expected, f"{count}: loads={loads}, expected {expected}")
