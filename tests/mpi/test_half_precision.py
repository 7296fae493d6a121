"""float16 and bfloat16 reductions against the exact result, on every algorithm.

Every rank draws every rank's input from one seed, so each rank knows the
exact reduction (float64: exact for sums of a few 16-bit values is not
guaranteed, but its error, below 2^-50 relative, is far under the bound).
A result must lie within the bound of :mod:`neocomm.reduction` for the
algorithm's ``rounding_steps``; MAX and MIN must be exact. Crafted inputs
show the bound is attained (ring) and that accumulating in the 16-bit type
would break it (symmetric). Runs at any world size and node layout.
"""
from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives import symmetric
from collectives.algorithms import lookup, names
from collectives.algorithms.ring import block_bounds, even_counts
from collectives.fabric import fabric_for
from collectives.types import CollectiveOp, Request
from neocomm import CollectiveArgumentError
from neocomm.reduction import UNIT_ROUNDOFF, error_bound, relative_bound
from neocomm.types import ReduceOp, bfloat16

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("all", why=(
    "the rounding steps of a reduction follow the algorithm, which follows the layout"))]

DTYPES = ["float16"] + (["bfloat16"] if bfloat16 is not None else [])
OPS = [CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER]
CHUNKS = [None, 256]  # bytes: default, many small chunks
BLOCK = 1001  # elements per rank's block: odd, several chunks


def _dt(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


def _inputs(p, n, dtype, op, seed):
    """Every rank's input (rows), the same on every rank: wide magnitudes and both signs
    for SUM, values near 1 for PROD."""
    rng = np.random.default_rng(seed)
    if op is ReduceOp.PROD:
        x = 1 + 0.2 * rng.standard_normal((p, n))
    else:
        x = rng.standard_normal((p, n)) * 2.0 ** rng.integers(-8, 6, (p, n))
    return x.astype(dtype)


def _exact(rows, op):
    wide = rows.astype(np.float64)
    return {ReduceOp.SUM: wide.sum(0), ReduceOp.PROD: wide.prod(0),
            ReduceOp.MAX: wide.max(0), ReduceOp.MIN: wide.min(0)}[op]


def _steps(op, algo, world, nbytes, itemsize):
    request = Request(op, nbytes, itemsize, world.size)
    return lookup(op, algo).rounding_steps(request, fabric_for(world.world))


def _call(op, x, algo, chunk, rop):
    if op is CollectiveOp.ALL_REDUCE:
        return C.all_reduce(x, np.empty_like(x), op=rop.value, algo=algo, chunk_bytes=chunk)
    return C.reduce_scatter(x, op=rop.value, algo=algo, chunk_bytes=chunk)


def _mine(op, world, full):
    if op is CollectiveOp.ALL_REDUCE:
        return full
    return full[world.rank * BLOCK:(world.rank + 1) * BLOCK]


@pytest.mark.parametrize("rop", list(ReduceOp), ids=lambda o: o.value)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", DTYPES)
def test_within_bound_on_every_algorithm(world, all_ranks, dtype, op, rop):
    p, dt = world.size, _dt(dtype)
    rows = _inputs(p, BLOCK * p, dt, rop, seed=17 + p)
    x = rows[world.rank].copy()
    exact = _mine(op, world, _exact(rows, rop))
    ran = []
    for algo in names(op):
        if algo == "symmetric":  # needs symmetric buffers: test_symmetric_rounds_once
            continue
        steps = _steps(op, algo, world, x.nbytes, dt.itemsize)
        bound = _mine(op, world, error_bound(list(rows), rop, steps))
        for chunk in CHUNKS:
            try:
                got = _call(op, x, algo, chunk, rop).astype(np.float64)
            except CollectiveArgumentError as exc:
                if exc.field == "algo" and "cannot run" in str(exc):
                    break
                raise
            err = np.abs(got - exact)
            worst = int(np.argmax(err - bound)) if err.size else 0
            all_ranks(bool((err <= bound).all()),
                      f"{algo} chunk {chunk}: error {err[worst]} > bound {bound[worst]} "
                      f"({steps} steps)")
        else:
            ran.append(algo)
    all_ranks("ring" in ran and "native" in ran, f"ran only {ran}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_attains_its_bound(world, all_ranks, dtype):
    """One input of 1 and the others u (the unit roundoff), the 1 where the ring starts
    each block: every step rounds 1 + u down to 1 (ties to even), so the ring loses
    (p - 1) u, more than the bound allows for p - 2 steps, within p - 1."""
    p, dt = world.size, _dt(dtype)
    if p == 1:
        pytest.skip("no reduction step on one rank")
    u = UNIT_ROUNDOFF[dtype]
    n = 64 * p
    rows = np.full((p, n), u)
    for b, (lo, hi) in enumerate(block_bounds(even_counts(n, p))):
        rows[(b + 1) % p, lo:hi] = 1.0  # block b's ring starts at member b + 1
    rows = rows.astype(dt)
    got = C.all_reduce(rows[world.rank].copy(), algo="ring").astype(np.float64)
    err = np.abs(got - _exact(rows, ReduceOp.SUM))
    total = 1 + (p - 1) * u
    steps = _steps(CollectiveOp.ALL_REDUCE, "ring", world, n * dt.itemsize, dt.itemsize)
    all_ranks(steps == p - 1 and np.allclose(err, (p - 1) * u, rtol=0, atol=0)
              and bool((err > relative_bound(dt, p - 2, p) * total).all())
              and bool((err <= relative_bound(dt, p - 1, p) * total).all()),
              f"ring error {err.max()}, {steps} steps")


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", DTYPES)
def test_symmetric_rounds_once(world, all_ranks, dtype, op):
    """The symmetric algorithm reduces every input of a segment in float32 and rounds
    once: within the one-step bound, which a sum accumulated in the 16-bit type breaks
    on 1, u, u, ... (it stays at 1)."""
    if world.num_nodes != 1:
        pytest.skip("symmetric memory needs a group within one node")
    p, dt, u = world.size, _dt(dtype), UNIT_ROUNDOFF[dtype]
    n = BLOCK * p
    crafted = np.full((p, n), u)
    crafted[0] = 1.0
    for rows in (_inputs(p, n, dt, ReduceOp.SUM, seed=5), crafted.astype(dt)):
        buf = symmetric.empty(n, dt, group=world.world)
        buf[:] = rows[world.rank]
        if op is CollectiveOp.ALL_REDUCE:
            got = C.all_reduce(buf, algo="symmetric").astype(np.float64)
        else:
            got = C.reduce_scatter(buf, algo="symmetric").astype(np.float64)
        steps = _steps(op, "symmetric", world, n * dt.itemsize, dt.itemsize)
        bound = _mine(op, world, error_bound(list(rows), ReduceOp.SUM, steps))
        err = np.abs(got - _mine(op, world, _exact(rows, ReduceOp.SUM)))
        worst = int(np.argmax(err - bound))
        all_ranks(steps == min(1, p - 1) and bool((err <= bound).all()),
                  f"symmetric error {err[worst]} > bound {bound[worst]}")
        del buf
    naive = crafted.astype(dt)[0].copy()
    for r in range(1, p):
        naive += crafted.astype(dt)[r]  # accumulate in the 16-bit type
    naive_err = np.abs(naive.astype(np.float64) - _exact(crafted.astype(dt), ReduceOp.SUM))
    if p >= 3:
        all_ranks(bool((naive_err > error_bound(list(crafted.astype(dt)), ReduceOp.SUM,
                                                1)).all()), "the naive sum met the bound")


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_min_exact_and_async(world, all_ranks, dtype):
    """MAX and MIN are exact; an asynchronous call reduces as the blocking one does."""
    p, dt = world.size, _dt(dtype)
    rows = _inputs(p, 333, dt, ReduceOp.SUM, seed=3)
    x = rows[world.rank].copy()
    for rop in (ReduceOp.MAX, ReduceOp.MIN):
        h = C.all_reduce(x, np.empty_like(x), op=rop.value, async_op=True)
        got = h.wait()
        all_ranks(np.array_equal(got.astype(np.float64), _exact(rows, rop)), rop.value)
    blocking = C.all_reduce(x, np.empty_like(x), algo="ring")
    later = C.all_reduce(x, np.empty_like(x), algo="ring", async_op=True).wait()
    all_ranks(np.array_equal(blocking.view(np.uint16), later.view(np.uint16)), "async differs")
