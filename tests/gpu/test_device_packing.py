"""Packed tables on device arrays: the packed collection on CuPy (the stand-in when no GPU
is here) against the same collection on NumPy, and against the unpacked one on CuPy.

The cases of ``tests/mpi/test_packing.py`` in float64: pooled outputs of every step
and every member table's weights after training match the NumPy run to a few ulps
(the device's warp-order sums), the kernel and collective calls per step are the
NumPy run's, and ``load_table`` writes one member's rows on the device.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import cupy as cp
from embedding.collection import ShardedEmbeddingCollection
from gpu_cases import load_mpi_tests

pytestmark = pytest.mark.mpi(min_size=1)
P = load_mpi_tests("test_packing")
RTOL = 1e-12
TABLES = [replace(t, dtype="float64") for t in P.TABLES]


def _train(coll, rank, steps=3):
    rng = np.random.default_rng(rank)
    outs = []
    for _ in range(steps):
        out = coll.forward(P._batch(rng))
        out = out.get() if isinstance(out, cp.ndarray) else out
        outs.append(out)
        coll.backward(coll.xp.asarray(np.cos(out * 3.0) + 0.1))
    return outs, coll.take_calls()


@pytest.mark.parametrize("whole", [False, True], ids=["row_wise", "table_wise"])
def test_device_packed_matches_numpy(world, all_ranks, whole):
    plan = P.packed_plan(world.size, whole=whole)
    host = ShardedEmbeddingCollection(TABLES, plan, world.world, seed=2)
    dev = ShardedEmbeddingCollection(TABLES, plan, world.world, seed=2, device="cuda")
    plain = ShardedEmbeddingCollection(TABLES, P.unpacked_plan(world.size), world.world,
                                       seed=2, device="cuda")
    (h_out, h_calls), (d_out, d_calls) = _train(host, world.rank), _train(dev, world.rank)
    p_out = _train(plain, world.rank)[0]
    close = all(np.allclose(d, h, rtol=RTOL, atol=RTOL) for d, h in zip(d_out, h_out))
    all_ranks(close, "device pooled outputs differ from NumPy")
    all_ranks(all(np.allclose(d, p, rtol=1e-9, atol=1e-12) for d, p in zip(d_out, p_out)),
              "packed device outputs differ from unpacked device outputs")
    all_ranks(d_calls == h_calls, f"device calls {d_calls}, NumPy calls {h_calls}")
    for t in TABLES:
        all_ranks(np.allclose(dev.gather_table(t.name), host.gather_table(t.name),
                              rtol=RTOL, atol=RTOL), f"table {t.name}")
    w = np.arange(TABLES[1].num_rows * 8, dtype=np.float64).reshape(-1, 8)
    before = dev.gather_table("e2")
    dev.load_table("e1", cp.asarray(w))
    all_ranks(np.array_equal(dev.gather_table("e1"), w)
              and np.array_equal(dev.gather_table("e2"), before), "load_table of a member")
