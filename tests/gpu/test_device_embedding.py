"""The sharded embedding collection on device arrays, against the same collection on NumPy.

Every sharding type and the mixes of ``tests/mpi/test_sharding.py``, every
optimizer, per-id weights, dedup and the pipelined input dist: the pooled
output of each step and every local shard's weights and optimizer state
after the steps must equal the NumPy run's (float64 tables; the device's
warp-order sums and ``pow`` differ by a few ulps at most). The device run
goes through CuPy and NCCL (or the staged backend): the stand-in when no
GPU is here.

Half tables (float16, bfloat16 with stochastic, master and nearest rounding,
narrow optimizer state) run the same steps on sharding types whose
collectives only move data, and must match the NumPy run bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import cupy as cp
from embedding.collection import ShardedEmbeddingCollection
from embedding.optim import state_specs
from embedding.types import OptimizerKind
from gpu_cases import load_mpi_tests

pytestmark = pytest.mark.mpi(min_size=1)
RTOL = 1e-12


S = load_mpi_tests("test_sharding")


#: Precision of each table of ``S.make_tables`` in the half-table runs (float32 compute).
HALF = {"t0": dict(dtype="bfloat16", rounding="stochastic", rounding_seed=3),
        "t1": dict(dtype="float16", rounding="master"),
        "t2": dict(dtype="float16", state_dtype="float16", rounding="stochastic"),
        "t3": dict(dtype="float32")}


def _close(got, want) -> float:
    got = cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    got, want = got.astype(np.float64), np.asarray(want, np.float64)
    if np.array_equal(got, want, equal_nan=True):
        return 0.0
    return float(np.max(np.abs(got - want) / (1 + np.abs(want)), initial=0))


def _run(world, all_ranks, mix, kind, *, dedup=False, pipelined=False, steps=2, pools=S.POOLS,
         cache=None, half=False):
    """``half``: the tables of :data:`HALF`, compared bit for bit."""
    group = world.world
    tables = S.make_tables(kind, pools)
    rtol = RTOL
    if half:
        tables = [replace(t, **HALF[t.name]) for t in tables]
        rtol = 0.0
    plan = S.make_plan(tables, mix, group)
    if cache is not None:  # host-resident tables: NumPy on the host, a CuPy cache in front
        plan = S.tiered_plan(plan, tables, cache)
    host = ShardedEmbeddingCollection(tables, plan, group, dedup=dedup)
    dev = ShardedEmbeddingCollection(tables, plan, group, dedup=dedup, device="cuda")
    rng = np.random.default_rng(99)
    for t in tables:
        w = rng.standard_normal((t.num_rows, t.dim))
        host.load_table(t.name, w)
        dev.load_table(t.name, cp.asarray(w))
    batches = [S.global_batch(rng, tables, group.size, weighted=True) for _ in range(steps)]
    grads = [rng.standard_normal((S.BATCH, host.out_dim)).astype(host.env.dtype)
             for _ in range(steps)]
    kjts = [S.local_kjt(bags, weights, group.rank) for bags, weights in batches]
    nxt = (host.input_dist(kjts[0]), dev.input_dist(kjts[0])) if pipelined else None
    for i in range(steps):
        if pipelined:
            (out_h, ctx_h), (out_d, ctx_d) = (host.forward_with_context(nxt[0]),
                                              dev.forward_with_context(nxt[1]))
            if i + 1 < steps:
                nxt = (host.input_dist(kjts[i + 1]), dev.input_dist(kjts[i + 1]))
                if cache is not None:
                    host.prefetch(nxt[0])
                    dev.prefetch(nxt[1])
        else:
            out_h, ctx_h = host.forward(kjts[i]), None
            out_d, ctx_d = dev.forward(kjts[i]), None
        all_ranks(isinstance(out_d, cp.ndarray), f"{mix}: forward gave {type(out_d).__name__}")
        err = _close(out_d, out_h)
        all_ranks(err <= rtol, f"{mix}/{kind.value} step {i}: device forward differs by {err}")
        host.backward(grads[i], ctx_h)
        dev.backward(cp.asarray(grads[i]), ctx_d)
    worst = 0.0
    for sh, sd in zip(host.local_shards(), dev.local_shards()):
        worst = max(worst, _close(sd.weight, sh.weight))
        table = next(t for t in tables if t.name == sh.table)
        for spec in state_specs(table.optimizer.kind):
            worst = max(worst, _close(sd.tables.state_view(sd.index, spec.name),
                                      sh.tables.state_view(sh.index, spec.name)))
    if half:
        for sh, sd in zip(host.local_shards(), dev.local_shards()):
            master = sh.tables.master
            if master is not None:
                worst = max(worst, _close(sd.tables.master, master))
    all_ranks(worst <= rtol, f"{mix}/{kind.value}: device shards differ by {worst}")


#: every pair of (sharding mix, optimizer, device backend) meets in a case: each mix runs
#: each optimizer, the backend alternating (so each mix and each optimizer runs on both), in
#: half the full product's cases
_KINDS, _BACKENDS = list(OptimizerKind), ("nccl", "staged")
MATCH_CASES = S.latin_cases(list(S.MIXES), _KINDS, _BACKENDS)


def test_the_match_cases_meet_every_pair():
    S.assert_every_pair(MATCH_CASES, list(S.MIXES), _KINDS, _BACKENDS)


@pytest.mark.parametrize("mix, kind, device_backend", MATCH_CASES, indirect=["device_backend"],
                         ids=[f"{m}-{k.value}-{b}" for m, k, b in MATCH_CASES])
def test_device_collection_matches_numpy(world, all_ranks, device_backend, mix, kind):
    S.skip_if_uneven(mix, world)
    _run(world, all_ranks, mix, kind)


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ADAM], ids=lambda k: k.value)
@pytest.mark.parametrize("mix", ["tw", "cw", "twcw"])
def test_device_half_tables_match_numpy_bitwise(world, all_ranks, mix, kind):
    """Sharding types whose collectives only move data (AlltoAll): no float reduction
    order between the NCCL and the MPI run, so every output and shard is bit-identical."""
    _run(world, all_ranks, mix, kind, half=True, steps=3)


@pytest.mark.parametrize("mix", ["tw", "cw", "twcw", "mixed"])
def test_device_dedup_matches_numpy(world, all_ranks, mix):
    _run(world, all_ranks, mix, OptimizerKind.ROWWISE_ADAGRAD, dedup=True)


@pytest.mark.parametrize("mix, dedup", [("tw", False), ("cw", False), ("dp", False),
                                        ("twcw", False), ("mixed", True)])
def test_device_max_pooling_matches_numpy(world, all_ranks, mix, dedup):
    """The device kernels route a max column's gradient to the same row as NumPy."""
    _run(world, all_ranks, mix, OptimizerKind.ADAM, dedup=dedup, pools=S.MAX_POOLS, steps=3)


@pytest.mark.parametrize("mix", ["mixed", "mixed_hier", "mixed_cyc"])
def test_device_pipelined_input_dist_matches_numpy(world, all_ranks, mix):
    S.skip_if_uneven(mix, world)
    _run(world, all_ranks, mix, OptimizerKind.ADAM, pipelined=True, steps=3)


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix, cache, dedup, pipelined", [
    ("tw", 1, False, False), ("rw", 4, False, True), ("cw", 2, True, False),
    ("twrw", "all", False, False), ("twcw", 1, True, False), ("mixed", 3, False, True),
    ("mixed_hier", 2, False, True)])
def test_device_tiered_tables_match_numpy(world, all_ranks, mix, cache, dedup, pipelined,
                                          kind):
    """Host rows with a device cache: the CuPy cache, its copies and the kernels on slots."""
    S.skip_if_uneven(mix, world)
    _run(world, all_ranks, mix, kind, dedup=dedup, pipelined=pipelined, steps=3, cache=cache)
