"""Data-parallel tables whose gradient AllReduce travels in 16 bits (``QComms.dense``).

Against the same collection in float32: after two SGD steps the replicas of
every data-parallel table stay within ``8 × ranks × u × step`` of the float32
run (``u`` the unit roundoff of the format, ``step`` the table's largest
float32 change; each rank's gradient is rounded once, each 16-bit partial sum
once more), every rank's replica is the same, the other tables are untouched
by the setting, and the ``"dense"`` bytes counted are half of float32's. The
touched-row flags that travel beside the gradients stay exact (never scaled,
summed exactly), and an fp16 sum that overflows stops every rank, before any
replica changes, naming the setting and the magnitude.

    mpirun -n 4 python scripts/mpi_pytest.py tests/mpi/test_qcomm_data_parallel.py
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.sharding.data_parallel import DataParallelSharding
from embedding.sharding.qcomm import QComms
from embedding.types import (OptimizerConfig, OptimizerKind, Pooling, Shard, ShardingPlan,
                             ShardingType, TableConfig, TablePlan)
from neocomm.errors import CollectiveArgumentError
from test_qcomm import EPS, _tables, run
from test_sharding import make_plan

pytestmark = pytest.mark.training

CASES = [QComms(dense="fp16"), QComms(dense="fp16", dense_loss_scale=1024.0),
         QComms(dense="bf16"), QComms("fp16", "bf16", dense="fp16", dense_loss_scale=256.0)]
IDS = ["fp16", "fp16-scaled", "bf16", "all-16-bit"]


def _dp_names(world, mix) -> set[str]:
    plan = make_plan(_tables(), mix, world.world)
    return {tp.table for tp in plan.tables if tp.sharding is ShardingType.DATA_PARALLEL}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("q", CASES, ids=IDS)
@pytest.mark.parametrize("mix", ["dp", "mixed"])
def test_data_parallel_within_the_codec_bound(world, all_ranks, mix, q):
    dp = _dp_names(world, mix)
    eps = EPS[q.dense.value]
    _, w0, _ = run(world, mix, steps=0)
    _, want, sent32 = run(world, mix, steps=2)
    _, got, sent = run(world, mix, q, steps=2)
    for name in want:
        err = float(np.abs(got[name] - want[name]).max())
        if name in dp:
            step = float(np.abs(want[name] - w0[name]).max())
            bound = 8 * world.size * eps * step + 1e-6
            all_ranks(0 < err <= bound, f"{mix}/{q.describe()}: table {name} differs by "
                      f"{err} (bound {bound})")
            replicas = world.comm.allgather(got[name])
            all_ranks(all(np.array_equal(r, replicas[0]) for r in replicas),
                      f"{mix}: the replicas of {name} differ")
        elif q.backward.value == "fp32":
            all_ranks(err == 0, f"{mix}: table {name} (not data-parallel) changed by {err}")
    all_ranks(sent32["dense"] > 0 and 2 * sent["dense"] == sent32["dense"],
              f"{mix}/{q.describe()}: sent {sent['dense']} data-parallel gradient bytes vs "
              f"{sent32['dense']} in fp32")
    all_ranks(sent["forward"] * (2 if q.forward.value == "fp16" else 1) == sent32["forward"],
              f"{mix}: forward bytes {sent['forward']} vs {sent32['forward']}")


def _dp_collection(world, qcomms, rows):
    sgd = OptimizerConfig(OptimizerKind.SGD, lr=1.0)
    table = TableConfig("t0", rows, 4, Pooling.SUM, ("f0",), "float32", sgd)
    plan = ShardingPlan(world.size, len(world.world.nodes[0]), (TablePlan(
        "t0", ShardingType.DATA_PARALLEL,
        tuple(Shard(r, 0, rows, 0, 4) for r in range(world.size))),))
    return ShardedEmbeddingCollection([table], plan, world.world, qcomms=qcomms)


def _step(coll, ids, grad):
    kjt = KeyedJagged.from_lists({"f0": [[i] for i in ids]})
    coll.forward(kjt)
    coll.backward(np.asarray(grad, np.float32).reshape(len(ids), 4))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("q", [QComms(dense="fp16", dense_loss_scale=32768.0),
                               QComms(dense="bf16")], ids=["fp16-scaled", "bf16"])
def test_flags_stay_exact(world, all_ranks, q):
    """Row 0 is touched by every rank with a gradient that fp16 rounds to zero, row 1 + r by
    rank r alone, row 1 + size + r // 2 by pairs of ranks: the AllReduced flags count the
    ranks exactly (unscaled: 32768 × 4 ranks would overflow fp16), and every touched row,
    the zero-valued one too, reaches the optimizer."""
    size, rank = world.size, world.rank
    rows = 2 * size + 3
    coll = _dp_collection(world, q, rows)
    strat = next(s for s in coll.strategies if isinstance(s, DataParallelSharding))
    sent, updated = [], []
    real_send, real_update = strat.send, strat.fused.update

    def send(direction, op, buf, *args, **kwargs):
        sent.append(buf)
        return real_send(direction, op, buf, *args, **kwargs)

    def update(out):
        updated.extend(np.asarray(r).tolist() for r, _ in out)
        return real_update(out)

    strat.send, strat.fused.update = send, update
    ids = [0, 1 + rank, 1 + size + rank // 2]
    grad = np.full((3, 4), 0.25)
    grad[0] = 1e-12  # below fp16's smallest subnormal even when scaled
    _step(coll, ids, grad)
    counts = np.zeros(rows)
    counts[0] = size
    counts[1:1 + size] = 1
    for r in range(size):
        counts[1 + size + r // 2] += 1
    flags = sent[0][4 * rows:].astype(np.float64)
    all_ranks(sent[0].itemsize == 2 and np.array_equal(flags, counts),
              f"{q.describe()}: AllReduced flags {flags.tolist()}, expected {counts.tolist()}")
    all_ranks(updated == [np.flatnonzero(counts).tolist()],
              f"{q.describe()}: rows updated {updated}, touched {np.flatnonzero(counts)}")
    w = coll.gather_table("t0")
    w0 = _dp_collection(world, None, rows).gather_table("t0")
    all_ranks(np.allclose(w[1:] - w0[1:], -0.25 * counts[1:, None], atol=1e-3),
              f"{q.describe()}: updates {(w - w0)[:, 0].tolist()}")


@pytest.mark.mpi(min_size=1)
def test_loss_scaled_overflow_fails_every_rank(world, all_ranks):
    q = QComms(dense="fp16", dense_loss_scale=4096.0)
    grad_scale = 100.0 if world.rank == 0 else 1.0  # only rank 0's gradients overflow
    with pytest.raises(CollectiveArgumentError) as info:
        run(world, "dp", q, grad_scale=grad_scale)
    msg = str(info.value)
    all_ranks("qcomms.dense_loss_scale" in msg and "scaled by 4096" in msg
              and "on this rank, beyond fp16's largest value 65504" in msg
              and "data-parallel tables" in msg and "(on rank" in msg, msg)


@pytest.mark.mpi(min_size=2)
def test_overflowing_sum_fails_every_rank_before_any_update(world, all_ranks):
    """Every rank's gradient fits fp16 (40000), their sum over the ranks does not."""
    coll = _dp_collection(world, QComms(dense="fp16"), 5)
    before = coll.gather_table("t0")
    with pytest.raises(CollectiveArgumentError) as info:
        _step(coll, [2], np.full(4, 40000.0))
    msg = str(info.value)
    all_ranks("qcomms.dense:" in msg and "reach 40000" in msg and "65504" in msg
              and f"sum over {world.size} rank(s) overflows" in msg, msg)
    all_ranks(np.array_equal(coll.gather_table("t0"), before), "a replica changed")
    _step(coll, [2], np.full(4, 1.0))  # the next step goes on
    after = coll.gather_table("t0")
    all_ranks(np.allclose(after[2] - before[2], -world.size), f"{after[2] - before[2]}")


def test_dense_arguments_are_checked():
    with pytest.raises(ValueError, match=r"dense: 'int8' codes pooled rows only.*data-parallel"
                                         r".*fp32, fp16, bf16"):
        QComms(dense="int8")
    with pytest.raises(ValueError, match=r"dense: expected one of .*got 'fp8'"):
        QComms(dense="fp8")
    with pytest.raises(ValueError, match=r"dense_loss_scale: 512 scales an fp16 exchange "
                                         r"only; dense is 'bf16'"):
        QComms(dense="bf16", dense_loss_scale=512)
    with pytest.raises(ValueError, match=r"dense_loss_scale: expected a finite number > 0, "
                                         r"got 0"):
        QComms(dense="fp16", dense_loss_scale=0)
    q = QComms(dense="fp16", dense_loss_scale=64)
    assert q.quantized and q.describe().endswith("dense=fp16, dense_loss_scale=64")


@pytest.mark.mpi(min_size=1)
def test_each_sharding_takes_only_the_settings_it_uses(world, all_ranks):
    """A data-parallel table of dim 2 beside an int8 forward is not refused (it has no output
    dist); table-wise tables whose settings differ only in ``dense`` share one strategy."""
    sgd = OptimizerConfig(OptimizerKind.SGD, lr=1.0)
    tables = [TableConfig("narrow", 8, 2, Pooling.SUM, ("f0",), "float32", sgd),
              TableConfig("a", 8, 4, Pooling.SUM, ("f1",), "float32", sgd),
              TableConfig("b", 8, 4, Pooling.SUM, ("f2",), "float32", sgd)]
    every = tuple(range(world.size))
    plan = ShardingPlan(world.size, len(world.world.nodes[0]), (
        TablePlan("narrow", ShardingType.DATA_PARALLEL,
                  tuple(Shard(r, 0, 8, 0, 2) for r in every)),
        TablePlan("a", ShardingType.TABLE_WISE, (Shard(0, 0, 8, 0, 4),)),
        TablePlan("b", ShardingType.TABLE_WISE, (Shard(world.size - 1, 0, 8, 0, 4),))))
    q = {"narrow": QComms(forward="int8", dense="bf16"),
         "a": QComms(forward="int8", backward="bf16", dense="fp16"),
         "b": QComms(forward="int8", backward="bf16")}
    coll = ShardedEmbeddingCollection(tables, plan, world.world, qcomms=q)
    kinds = sorted((s.plans[0].sharding.value, s.qcomms.describe()) for s in coll.strategies)
    all_ranks(kinds == [("data_parallel", "forward=fp32, backward=fp32, dense=bf16"),
                        ("table_wise", "forward=int8, backward=bf16")], f"{kinds}")
    kjt = KeyedJagged.from_lists({"f0": [[1]], "f1": [[2]], "f2": [[3]]})
    out = coll.forward(kjt)
    all_ranks(out.shape == (1, 10), f"{out.shape}")
