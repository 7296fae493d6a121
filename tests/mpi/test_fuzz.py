"""Differential fuzzer: random collective calls against native MPI on the same data.

Hypothesis draws the operation, the algorithm (or the default choice), the
dtype, the reduce op, the sizes (0, 1, odd, prime, counts that do not
divide evenly) and the group (the world or a subgroup of it) on rank 0
(derandomized), which sends each case to the others, and each rank draws its
own data from the case's seed. Results are compared bit for bit with native MPI (``mpi4py``) on the
same data: copies through byte views (every dtype), reductions through
MPI's own ops for the types MPI reduces exactly as neocomm defines
(float32/64, int32/64), else through NumPy on every rank's input (wrap-
around integers, float16, bfloat16). Values are small integers, so every
summation order gives the same floats.

    FUZZ_EXAMPLES=2000 neocomm run -n 4 --ranks-per-node 2 -- \\
        python -m pytest --with-mpi tests/mpi/test_fuzz.py     # a longer run

A failing case prints the one command that reproduces it
(``FUZZ_CASE=...``, run by :func:`test_replay`).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import collectives as C
from collectives.algorithms import registry
from collectives.types import CollectiveOp
from neocomm import CollectiveArgumentError
from neocomm.types import bfloat16

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("all", why=(
    "random calls against native MPI at every rank count and node layout the algorithms tell "
    "apart"))]

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
OPS = ["all_to_all", "all_to_all_v", "reduce_scatter", "all_reduce", "all_gather",
       "broadcast"]
DTYPES = ["float32", "float64", "int8", "uint8", "int16", "int32", "int64", "uint64",
          "float16"] + (["bfloat16"] if bfloat16 else [])
#: MPI reduces these as neocomm defines (Open MPI saturates 8- and 16-bit sums)
MPI_EXACT = {"float32", "float64", "int32", "int64"}
REFUSED: list = []  # forced algorithms that cannot run their case (refused on every member)
SIZES = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 13, 31, 97]), st.integers(0, 3000))


def _dtype(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


@st.composite
def cases(draw, world_size: int):
    op = draw(st.sampled_from(OPS))
    algos = [None] + [a.name for a in registry()[CollectiveOp(op)]]
    members = list(range(world_size))
    if world_size > 1 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, world_size - 1), min_size=1,
                                      max_size=world_size)))
    p = len(members)
    return {"op": op, "algo": draw(st.sampled_from(algos)),
            "dtype": draw(st.sampled_from(DTYPES)),
            "reduce": draw(st.sampled_from(["sum", "max", "min", "prod"])),
            "members": members,
            "block": draw(SIZES),
            "counts": draw(st.lists(st.lists(st.integers(0, 40), min_size=p, max_size=p),
                                    min_size=p, max_size=p)),
            "root": draw(st.integers(0, p - 1)),
            "seed": draw(st.integers(0, 2**31 - 1))}


def _data(case, rank: int, n: int):
    dt = _dtype(case["dtype"])
    rng = np.random.default_rng([case["seed"], rank])
    if dt.kind in "iu" and case["reduce"] == "sum":
        info = np.iinfo(dt)  # the whole range: sums overflow and must wrap
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    if case["reduce"] == "prod":
        return rng.integers(1, 4, n).astype(dt)
    lo = 0 if dt.kind == "u" else -4
    return rng.integers(lo, 5, n).astype(dt)


def _bits(a):
    return a.view(f"u{a.itemsize}")


def _reduce_ref(comm, x, op):
    """The element-wise reduction of every rank's ``x``: MPI where it is exact, NumPy else."""
    from mpi4py import MPI

    if x.dtype.name in MPI_EXACT:
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=getattr(MPI, op.upper()))
        return out
    parts = comm.allgather(x)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    acc = parts[0].copy()
    with np.errstate(over="ignore"):
        for other in parts[1:]:
            acc = ufunc(acc, other).astype(x.dtype)
    return acc


def run_case(world, case, xp=np) -> str:
    """Run ``case`` on ``xp`` arrays (NumPy here, CuPy in tests/gpu); '' when it matches
    MPI on the host (or was refused on every member alike)."""
    put = xp.asarray
    sub = world.world if len(case["members"]) == world.size else \
        world.world.split(case["members"], name="fuzz")
    if sub is None:
        return ""
    comm, p, r = sub.comm, sub.size, sub.rank
    op, algo, reduce_op = case["op"], case["algo"], case["reduce"]
    reducing = op in ("all_reduce", "reduce_scatter")
    if reducing and case["dtype"] == "bool":
        return ""
    try:
        if op == "all_to_all":
            x = _data(case, r, case["block"] * p)
            want = np.empty_like(_bits(x))
            comm.Alltoall(_bits(x), want)
            got = C.all_to_all(put(x), group=sub, algo=algo)
        elif op == "all_to_all_v":
            send = [case["counts"][r][j] for j in range(p)]
            recv = [case["counts"][j][r] for j in range(p)]
            x = _data(case, r, sum(send))
            want = np.empty(sum(recv), _bits(x).dtype)
            sd = [int(v) for v in np.concatenate([[0], np.cumsum(send)[:-1]])]
            rd = [int(v) for v in np.concatenate([[0], np.cumsum(recv)[:-1]])]
            comm.Alltoallv([_bits(x), (send, sd)], [want, (recv, rd)])
            given_recv = recv if case["seed"] % 2 else None  # with and without recv counts
            got, counts = C.all_to_all_v(put(x), send, recv_counts=given_recv, group=sub,
                                         algo=algo)
            if list(counts) != recv:
                return f"recv_counts {list(counts)}, expected {recv}"
        elif op == "reduce_scatter":
            uneven = case["seed"] % 3 == 0
            counts = [case["counts"][0][j] for j in range(p)] if uneven else [case["block"]] * p
            x = _data(case, r, sum(counts))
            full = _reduce_ref(comm, x, reduce_op)
            lo = sum(counts[:r])
            want = full[lo:lo + counts[r]]
            got = C.reduce_scatter(put(x), recv_counts=counts if uneven else None,
                                   op=reduce_op, group=sub, algo=algo)
        elif op == "all_reduce":
            x = _data(case, r, case["block"])
            want = _reduce_ref(comm, x, reduce_op)
            got = C.all_reduce(put(x), op=reduce_op, group=sub, algo=algo)
        elif op == "all_gather":
            x = _data(case, r, case["block"])
            want = np.empty(x.size * p, _bits(x).dtype)
            comm.Allgather(_bits(x), want)
            got = C.all_gather(put(x), group=sub, algo=algo)
        else:
            x = _data(case, r, case["block"])
            want = _bits(x).copy()
            comm.Bcast(want, root=case["root"])
            got = C.broadcast(put(x), root=case["root"], group=sub, algo=algo)
    except CollectiveArgumentError as exc:
        if exc.field == "algo":  # this algorithm cannot run this case: said on every member
            REFUSED.append(case["algo"])
            return ""
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported on every rank together, not raised
        import traceback

        return f"rank {world.rank}: " + "".join(traceback.format_exception(exc))
    got = (got.get() if xp is not np else np.asarray(got)).reshape(-1)
    want = want.reshape(-1)
    if not reducing:
        got = _bits(got)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)[:4] if got.shape == want.shape else "shape"
        return f"rank {world.rank}: differs from MPI at {bad}"
    return ""


def _command(world, case) -> str:
    rpn = os.environ.get("NEOCOMM_RANKS_PER_NODE")
    layout = f" --ranks-per-node {rpn}" if rpn else ""
    return (f"FUZZ_CASE='{json.dumps(case)}' neocomm run -n {world.size}{layout} -- "
            f"python -m pytest --with-mpi tests/mpi/test_fuzz.py -k test_replay")


def check(world, all_ranks, case, xp=np):
    problem = run_case(world, case, xp)
    all_ranks(not problem, f"{problem or 'another rank failed'}\nreproduce with:\n"
                           f"  {_command(world, case)}")


def fuzz(world, all_ranks, xp=np, examples: int = EXAMPLES):
    """Run ``examples`` drawn cases on ``xp`` arrays against native MPI.

    Rank 0 alone runs Hypothesis and sends each case it draws (and, while it shrinks a
    failure, each smaller one) to the others, which run what they receive until it says
    it is done: Hypothesis's engine is not bound to take the same path on every rank
    (derandomized or not), and one extra case on one rank would hang the job."""
    comm = world.world.comm
    tried = []
    REFUSED.clear()
    if world.rank != 0:
        failed = False
        while True:
            case = comm.bcast(None, root=0)
            if case is None:
                break
            tried.append(case["op"])
            try:
                check(world, all_ranks, case, xp)
            except AssertionError:
                failed = True  # rank 0 shrinks it and reports the smallest case
        outcome = comm.bcast(None, root=0)
        assert not (failed or outcome), outcome or "rank 0 found a failing case"
        return

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=cases(world.size))
    def one(case):
        comm.bcast(case, root=0)
        tried.append(case["op"])
        check(world, all_ranks, case, xp)

    outcome = None
    try:
        one()
    except BaseException as exc:
        outcome = f"rank 0 found a failing case: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        raise
    finally:
        comm.bcast(None, root=0)
        comm.bcast(outcome, root=0)
    ops = {op: tried.count(op) for op in OPS}  # the figures docs/reliability.md reports
    figures = (f"fuzz ({xp.__name__}): {len(tried)} cases at {world.size} rank(s): {ops}; "
               f"{len(REFUSED)} forced an algorithm that cannot run them (refused alike)")
    print("\n" + figures)
    if os.environ.get("FUZZ_REPORT"):  # a file that collects them (tests/cluster)
        with open(os.environ["FUZZ_REPORT"], "a") as fh:
            fh.write(figures + "\n")
    assert len(tried) >= min(examples, 10), f"only {len(tried)} cases were tried"


def test_fuzz_against_native_mpi(world, all_ranks):
    fuzz(world, all_ranks)


def test_replay(world, all_ranks):
    """Run the case of ``FUZZ_CASE`` (printed by a failing fuzz run)."""
    text = os.environ.get("FUZZ_CASE")
    if not text:
        pytest.skip("FUZZ_CASE is not set (a failing fuzz case prints it)")
    check(world, all_ranks, json.loads(text))


def test_a_wrong_result_is_reported_with_its_command(world, all_ranks, monkeypatch):
    """The fuzzer's own check fails on a wrong answer, and says how to reproduce it."""
    case = {"op": "all_reduce", "algo": None, "dtype": "int32", "reduce": "sum",
            "members": list(range(world.size)), "block": 5, "counts": [[0] * world.size],
            "root": 0, "seed": 7}
    real = C.all_reduce
    monkeypatch.setattr(C, "all_reduce", lambda x, **kw: real(x, **kw) + 1)
    with pytest.raises(AssertionError) as err:
        check(world, all_ranks, case)
    all_ranks("differs from MPI" in str(err.value) and "FUZZ_CASE=" in str(err.value),
              str(err.value))


def test_the_fuzzer_fails_on_every_rank_when_one_case_is_wrong(world, all_ranks, monkeypatch):
    """A wrong answer for some drawn cases fails the fuzzer on every rank together, after
    rank 0 has shrunk it (the other ranks follow every case it sends), without a hang."""
    for name in ("all_gather", "broadcast"):
        real = getattr(C, name)
        monkeypatch.setattr(C, name, lambda x, real=real, **kw: real(x, **kw) + 1)
    with pytest.raises(AssertionError) as err:
        fuzz(world, all_ranks, examples=60)
    text = str(err.value)
    all_ranks(("differs from MPI" in text and "FUZZ_CASE=" in text) if world.rank == 0
              else "rank 0 found a failing case" in text, text)
