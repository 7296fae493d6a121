"""Prepared (persistent) collectives: same results as the plain calls, fail together, free."""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from neocomm import CollectiveArgumentError

pytestmark = pytest.mark.layouts("1x1", "1x2", "1x3", "2x2", why=(
    "prepared calls at one rank, a power of two, three ranks and across nodes"))


def _cases(world, rng, xp=np):
    """(name, input, output, prepare(algo), plain(algo)) per dense op, on ``xp`` arrays (NumPy
    here, CuPy in tests/gpu); inputs differ per rank."""
    p, r = world.size, world.rank
    x = xp.asarray(rng.integers(-8, 8, 6 * p).astype(np.float32))
    y = xp.empty_like(x)
    counts = [(r + q) % 3 + 1 for q in range(p)]  # what this rank sends to q
    recv = [(q + r) % 3 + 1 for q in range(p)]  # what q sends to this rank
    xv = xp.asarray(rng.integers(-8, 8, sum(counts)).astype(np.int64))
    yv = xp.empty(sum(recv), np.int64)
    rs_out = xp.empty(x.size // p, np.float32)
    ag_out = xp.empty(x.size * p, np.float32)
    bc = xp.full(5, float(r), np.float64)
    inplace = x.copy()
    return [
        ("all_to_all", x, y, lambda a: C.prepare_all_to_all(x, y, algo=a),
         lambda a: C.all_to_all(x, xp.empty_like(x), algo=a)),
        ("all_to_all_v", xv, yv, lambda a: C.prepare_all_to_all_v(xv, counts, yv, recv, algo=a),
         lambda a: C.all_to_all_v(xv, counts, xp.empty_like(yv), recv, algo=a)[0]),
        ("all_reduce", x, y, lambda a: C.prepare_all_reduce(x, y, algo=a),
         lambda a: C.all_reduce(x, xp.empty_like(x), algo=a)),
        ("all_reduce_in_place", inplace, inplace,
         lambda a: C.prepare_all_reduce(inplace, op="max", algo=a),
         lambda a: C.all_reduce(inplace.copy(), op="max", algo=a)),
        ("reduce_scatter", x, rs_out, lambda a: C.prepare_reduce_scatter(x, rs_out, algo=a),
         lambda a: C.reduce_scatter(x, xp.empty_like(rs_out), algo=a)),
        ("all_gather", x, ag_out, lambda a: C.prepare_all_gather(x, ag_out, algo=a),
         lambda a: C.all_gather(x, xp.empty_like(ag_out), algo=a)),
        ("broadcast", bc, bc, lambda a: C.prepare_broadcast(bc, root=p - 1, algo=a),
         lambda a: C.broadcast(bc.copy(), root=p - 1, algo=a)),
    ]


def prepared_mismatches(world, rng, algo, xp=np) -> list[str]:
    """Run every case prepared, four times as its input changes in place (the last run
    through start/wait), against the plain call; the runs that differ."""
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    bad = []
    for name, inp, out, prepare, plain in _cases(world, rng, xp):
        with prepare(algo) as prep:
            for step in range(4):
                inp += 1  # new contents, same buffers
                want = host(plain(algo)).copy()  # the plain call first: in place ops change inp
                if step < 3:
                    got = prep()
                else:
                    prep.start()
                    got = prep.wait()
                got = got[0] if name == "all_to_all_v" else got
                if got is not out or not np.array_equal(host(got).reshape(-1),
                                                         want.reshape(-1)):
                    bad.append(f"{name} step {step}")
    return bad


@pytest.mark.parametrize("algo", [None, "native"])
def test_prepared_runs_match_plain_calls_as_contents_change(world, rng, all_ranks, algo):
    bad = prepared_mismatches(world, rng, algo)
    all_ranks(not bad, f"rank {world.rank}: {bad}")


def test_native_host_calls_run_as_one_mpi_call(world, all_ranks):
    """Native host calls are persistent MPI requests (all_reduce: the blocking call), and
    each run moves this run's data between the ranks."""
    p, r = world.size, world.rank
    xa = np.arange(4 * p, dtype=np.float32) + 100 * r
    ya = np.empty_like(xa)
    xb = np.arange(4 * p, dtype=np.float32) + 100 * r  # broadcast in place from the root 0
    xc = np.arange(4 * p, dtype=np.float32) * (r + 1)
    yc = np.empty_like(xc)
    with C.prepare_all_to_all(xa, ya, algo="native") as a, \
            C.prepare_broadcast(xb, algo="native") as b, \
            C.prepare_all_reduce(xc, yc, algo="native") as c:
        ok = a.persistent and b.persistent and a.algo == "native"
        ok = ok and not c.persistent and "direct" in repr(c)  # the blocking mpi4py call
        for step in range(2):  # a persistent request rerun sees the new contents
            xa += 1
            xc += 1
            xb[:] = np.arange(4 * p) + 100 * r + step
            want_a, want_c = np.empty_like(xa), np.empty_like(xc)
            world.comm.Alltoall(xa, want_a)
            world.comm.Allreduce(xc, want_c)
            got_a, got_b, got_c = a(), b(), c()  # every rank runs all three, whatever ok is
            ok &= got_a is ya and np.array_equal(ya, want_a)
            ok &= np.array_equal(got_b, np.arange(4 * p) + step)  # rank 0's contents
            ok &= got_c is yc and np.array_equal(yc, want_c)
    h = np.full(3, world.rank + 1, np.float16)
    with C.prepare_all_reduce(h) as d:  # no predefined MPI type here
        got_d = d()
        ok &= "rerun" in repr(d) and np.array_equal(got_d, np.full(3, p * (p + 1) / 2))
    all_ranks(ok, f"rank {r}: a prepared native run differs from MPI")


def test_a_non_native_algorithm_is_rerun(world, all_ranks):
    x = np.arange(8 * world.size, dtype=np.float64) + world.rank
    want = np.empty_like(x)
    with C.prepare_all_to_all(x, np.empty_like(x), algo="pairwise") as prep:
        ok = prep.algo == "pairwise" and not prep.persistent
        for _ in range(2):
            x *= 2
            world.comm.Alltoall(x, want)
            ok = ok and np.array_equal(prep(), want)
    all_ranks(ok)


def test_an_outstanding_async_call_is_driven_while_a_prepared_run_waits(world, all_ranks):
    p, r = world.size, world.rank
    x = np.arange(4 * p, dtype=np.float32) + 100 * r
    y = np.empty_like(x)
    z = np.arange(16, dtype=np.float64) * (r + 1)
    want_x, want_z = np.empty_like(x), np.empty_like(z)
    world.comm.Alltoall(x, want_x)
    world.comm.Allreduce(z, want_z)
    with C.prepare_all_to_all(x, y) as prep:
        handle = C.all_reduce(z, async_op=True)
        got = prep()
        ok = got is y and np.array_equal(y, want_x)
        ok &= np.array_equal(handle.wait(), want_z)
    all_ranks(ok)


def test_preparing_leaves_implicit_plans_alone(world, all_ranks):
    x = np.ones(4 * world.size, np.float32)
    y = np.empty_like(x)
    C.all_to_all(x, y)
    plans = C.state_of(None).plans
    before = dict(plans._plans)
    with C.prepare_all_to_all(x, y):
        pass
    all_ranks(plans._plans == before)


def test_use_after_free_raises(world, all_ranks):
    x = np.ones(4 * world.size, np.float32)
    prep = C.prepare_all_to_all(x, np.empty_like(x))
    prep()
    prep.free()
    prep.free()  # idempotent
    raised = 0
    for use in (prep, prep.start, prep.wait):
        try:
            use()
        except ValueError as exc:
            raised += "after free()" in str(exc)
    with C.prepare_all_reduce(x) as ctx:
        pass
    try:
        ctx()
    except ValueError:
        raised += 1
    all_ranks(raised == 4 and "freed" in repr(prep))


def test_wait_without_start_and_start_twice_raise(world, all_ranks):
    x = np.ones(4 * world.size, np.float32)
    raised = 0
    with C.prepare_all_to_all(x, np.empty_like(x)) as prep:
        try:
            prep.wait()
        except ValueError as exc:
            raised += "without start()" in str(exc)
        prep.start()
        try:
            prep()
        except ValueError as exc:
            raised += "not waited for" in str(exc)
        prep.wait()
    all_ranks(raised == 2)


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_on_every_rank(world):
    n = world.size
    x = np.ones(4 * n, np.float32)
    y = np.empty(4 * n if world.rank != 1 else 4 * n + 1, np.float32)
    with pytest.raises(CollectiveArgumentError, match="recvbuf"):
        C.prepare_all_to_all(x, y)
    with pytest.raises(CollectiveArgumentError, match="dtype differs"):
        C.prepare_all_reduce(np.ones(4, np.float32 if world.rank else np.float64))


@pytest.mark.mpi(min_size=2)
def test_a_missing_prepared_only_argument_on_one_rank_raises_everywhere(world):
    n = world.size
    x = np.ones(n, np.int64)
    recv = [1] * n if world.rank != 0 else None
    with pytest.raises(CollectiveArgumentError, match="recv_counts"):
        C.prepare_all_to_all_v(x, [1] * n, np.empty(n, np.int64), recv)
    with pytest.raises(CollectiveArgumentError, match="root"):
        C.prepare_broadcast(x, root=0 if world.rank else "zero")


def test_bad_input_with_checks_off_raises_locally(world, all_ranks):
    backend = C.state_of(world.world)
    saved = backend.check
    backend.check = False
    try:
        with pytest.raises(CollectiveArgumentError, match="recvbuf"):
            C.prepare_all_to_all(np.ones(4 * world.size), np.empty(4 * world.size + 1))
    finally:
        backend.check = saved
    all_ranks(True)


@pytest.mark.parametrize("op", ["all_to_all", "all_to_all_v", "all_reduce", "reduce_scatter",
                                "all_gather", "broadcast", "many_to_many"])
def test_the_benchmark_runs_prepared_collectives(world, all_ranks, op):
    from collectives.bench import PEER, BenchConfig, run_bench
    from collectives.types import CollectiveOp

    cfg = BenchConfig(CollectiveOp.parse(op), min_bytes=4096, max_bytes=16384, factor=4,
                      iters=2, warmup=1, check=2, repeat=1, algos=("auto", "all"),
                      prepared=True)
    rows = run_bench(cfg, world.world)
    ok = {PEER, "auto", "native"} <= {r.algo for r in rows} and all(r.wrong == 0 for r in rows)
    ok = ok and all(r.chosen for r in rows if r.algo == "auto")
    all_ranks(ok, str([(r.size, r.algo, r.chosen, r.wrong) for r in rows]))


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_prepared_run_on_buffers_that_changed_is_refused(world, all_ranks, change):
    """The same arrays, their dtype or shape changed in place since preparing: the run
    raises naming both layouts (it would run with the prepared layout otherwise); an
    implicit plan of the same arrays is not replayed either (a fresh call runs)."""
    p = world.size
    x = np.arange(4 * p, dtype=np.float32)
    y = np.empty_like(x)
    prep = C.prepare_all_to_all(x, y)
    C.all_to_all(x, y)  # leaves an implicit plan of (x, y)
    if change == "dtype":
        x.dtype, y.dtype = np.int32, np.int32  # same bytes, read as int32
    else:
        x.shape, y.shape = (p, 4), (p, 4)
    msgs = []
    for run in (prep, prep.start):
        try:
            run()
            msgs.append("")
        except ValueError as exc:
            msgs.append(str(exc))
    want = "int32 (" if change == "dtype" else f"float32 ({p}, 4)"
    all_ranks(all(want in m and "prepared as float32" in m for m in msgs), f"{msgs}")
    expect = np.empty_like(x)
    world.comm.Alltoall(x, expect)
    all_ranks(np.array_equal(C.all_to_all(x, y), expect), "the implicit plan replayed")
    prep.free()
