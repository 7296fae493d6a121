"""float16 and bfloat16 reductions on device buffers, over NCCL and the staged backend.

Each result is compared with the exact reduction of the same inputs (every
rank draws every rank's input from one seed) within the bound of
:mod:`neocomm.reduction` for the algorithm's ``rounding_steps``. NCCL cannot
reduce bfloat16 before 2.10: such a call is refused on every rank, even when
only one rank's NCCL is older. Runs under mpirun at 2 and 4 ranks, on one and
on two emulated nodes.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp
import collectives
from collectives.algorithms import lookup, names
from collectives.fabric import fabric_for
from collectives.types import CollectiveOp, Request
from neocomm import CollectiveArgumentError
from neocomm.reduction import UNIT_ROUNDOFF, error_bound
from neocomm.types import ReduceOp, bfloat16

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = ["float16"] + (["bfloat16"] if bfloat16 is not None else [])
OPS = [CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER]
BLOCK = 3000  # elements per rank's block: several staging pieces of the 64 KiB pool


def _dt(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


def _rows(p, n, dt, rop, seed):
    rng = np.random.default_rng(seed)
    if rop is ReduceOp.PROD:
        return (1 + 0.2 * rng.standard_normal((p, n))).astype(dt)
    return (rng.standard_normal((p, n)) * 2.0 ** rng.integers(-8, 6, (p, n))).astype(dt)


def _exact(rows, rop):
    wide = rows.astype(np.float64)
    return {ReduceOp.SUM: wide.sum(0), ReduceOp.PROD: wide.prod(0),
            ReduceOp.MAX: wide.max(0), ReduceOp.MIN: wide.min(0)}[rop]


@pytest.mark.parametrize("rop", list(ReduceOp), ids=lambda o: o.value)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", DTYPES)
def test_within_bound_on_every_algorithm(dtype, op, rop, device_backend, world, all_ranks):
    p, r, dt = world.size, world.rank, _dt(dtype)
    rows = _rows(p, BLOCK * p, dt, rop, seed=29 + p)
    lo, hi = (0, BLOCK * p) if op is CollectiveOp.ALL_REDUCE else (r * BLOCK, (r + 1) * BLOCK)
    exact = _exact(rows, rop)[lo:hi]
    fabric = fabric_for(world.world, device=True)
    ran = []
    for algo in names(op):
        request = Request(op, rows[r].nbytes, dt.itemsize, p, device=True)
        if algo == "symmetric" or lookup(op, algo).supports(request, fabric) is not None:
            continue
        steps = lookup(op, algo).rounding_steps(request, fabric)
        d = cp.asarray(rows[r])
        if op is CollectiveOp.ALL_REDUCE:
            got = collectives.all_reduce(d, op=rop.value, algo=algo)
        else:
            got = collectives.reduce_scatter(d, op=rop.value, algo=algo)
        err = np.abs(got.get().astype(np.float64) - exact)
        bound = error_bound(list(rows), rop, steps)[lo:hi]
        worst = int(np.argmax(err - bound))
        all_ranks(bool((err <= bound).all()), f"{device_backend}/{algo}: error {err[worst]} > "
                                              f"{bound[worst]} ({steps} steps)")
        ran.append(algo)
    all_ranks("native" in ran and "ring" in ran, f"ran only {ran}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_standin_nccl_rounds_once_per_step(dtype, world, all_ranks, monkeypatch):
    """NCCL's ring rounds every partial sum to the type: 1, u, u, ... stays at 1."""
    if not getattr(cp, "STANDIN", False):
        pytest.skip("checks the device stand-in itself; a real GPU is in use")
    monkeypatch.setenv("NEOCOMM_BACKEND", "nccl")
    dt, u = _dt(dtype), UNIT_ROUNDOFF[dtype]
    mine = np.full(37, 1.0 if world.rank == 0 else u).astype(dt)
    got = collectives.all_reduce(cp.asarray(mine), algo="native").get().astype(np.float64)
    all_ranks(np.array_equal(got, np.ones(37)), f"stand-in NCCL gave {got[:3]}, want 1")


def test_bfloat16_on_old_nccl_is_refused_everywhere(world, all_ranks, monkeypatch):
    """Only rank 0's NCCL is 2.9.6: every rank raises, naming the dtype, the op, the
    version and what NCCL reduces; float16 still reduces."""
    if bfloat16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    from cupy.cuda import nccl

    monkeypatch.setenv("NEOCOMM_BACKEND", "nccl")
    if world.rank == 0:
        monkeypatch.setattr(nccl, "get_version", lambda: 20906)
    x = cp.asarray(np.ones(41, bfloat16))
    for call in (lambda: collectives.all_reduce(x, op="max"),
                 lambda: collectives.reduce_scatter(cp.asarray(np.ones(41 * world.size,
                                                                       bfloat16)))):
        try:
            call()
            all_ranks(False, "bfloat16 reduced on NCCL 2.9.6")
        except CollectiveArgumentError as exc:
            msg = str(exc)
            all_ranks(exc.field == "sendbuf" and "cannot reduce bfloat16" in msg
                      and "NCCL 2.9.6" in msg and "NCCL >= 2.10" in msg
                      and "float16" in msg, msg)
    h = collectives.all_reduce(cp.asarray(np.ones(41, np.float16)))
    all_ranks(np.array_equal(h.get(), np.full(41, world.size, np.float16)), "float16")
