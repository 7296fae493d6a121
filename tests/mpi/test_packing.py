"""Packed tables across ranks: the same model as unpacked, one store per dim group.

    mpirun -n 2 python scripts/mpi_pytest.py tests/mpi/test_packing.py

Ten small tables of two dims. Unpacked, they are spread table-wise, row-wise and
data-parallel; packed, each dim's tables are one table (row-wise over every rank, or
whole on one rank). The pooled outputs and the tables after training agree (bitwise
where the shardings sum in the same order, to float32 rounding where row-wise partial
pools are added across ranks in another grouping), and the kernel and collective calls
per step are those of one table per dim. A trainer with ``[plan] pack = true`` plans one
packed table and logs fewer calls per step than without.
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.packing import row_offsets
from embedding.types import (OptimizerConfig, OptimizerKind, PackedTable, PackMember, Shard,
                             ShardingPlan, ShardingType, TableConfig, TablePlan)

pytestmark = pytest.mark.training

ST = ShardingType
OPT = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
TABLES = ([TableConfig(f"e{i}", 20 + 3 * i, 8, optimizer=OPT) for i in range(6)]
          + [TableConfig(f"q{i}", 9 + i, 4, optimizer=OPT) for i in range(4)])


def _pack(name, tables):
    return PackedTable(name, tuple(PackMember(t.name, o, t.num_rows) for t, o in
                                   zip(tables, row_offsets([t.num_rows for t in tables]))))


def _blocks(rows, dim, size):
    cuts = np.linspace(0, rows, size + 1).round().astype(int)
    return tuple(Shard(r, int(cuts[r]), int(cuts[r + 1] - cuts[r]), 0, dim) for r in range(size))


def unpacked_plan(size):
    out = []
    for i, t in enumerate(TABLES):
        kind = (ST.TABLE_WISE, ST.ROW_WISE, ST.DATA_PARALLEL)[i % 3]
        shards = (_blocks(t.num_rows, t.dim, size) if kind is ST.ROW_WISE else
                  tuple(Shard(r, 0, t.num_rows, 0, t.dim) for r in range(size))
                  if kind is ST.DATA_PARALLEL else (Shard(i % size, 0, t.num_rows, 0, t.dim),))
        out.append(TablePlan(t.name, kind, shards))
    return ShardingPlan(size, size, tuple(out))


def packed_plan(size, whole=False):
    e, q = _pack("e", TABLES[:6]), _pack("q", TABLES[6:])
    return ShardingPlan(size, size, (
        TablePlan("e", ST.TABLE_WISE, (Shard(size - 1, 0, e.num_rows, 0, 8),)) if whole else
        TablePlan("e", ST.ROW_WISE, _blocks(e.num_rows, 8, size)),
        TablePlan("q", ST.TABLE_WISE, (Shard(0, 0, q.num_rows, 0, 4),))), (e, q))


def _batch(rng):
    return KeyedJagged.from_lists({t.name: [rng.integers(0, t.num_rows, rng.integers(0, 4))
                                            .tolist() for _ in range(5)] for t in TABLES})


def _train(coll, rng, steps=3):
    outs = []
    for _ in range(steps):
        out = coll.forward(_batch(rng))
        outs.append(np.array(out))
        coll.backward(np.cos(out * 3.0) + 0.1)
    return outs, coll.take_calls()


def test_packed_matches_unpacked(world, all_ranks):
    colls = {k: ShardedEmbeddingCollection(TABLES, plan, world.world, seed=4) for k, plan in
             (("plain", unpacked_plan(world.size)), ("packed", packed_plan(world.size)),
              ("whole", packed_plan(world.size, whole=True)))}
    res = {k: _train(c, np.random.default_rng(world.rank)) for k, c in colls.items()}
    for k in ("packed", "whole"):
        close = all(np.allclose(a, b, rtol=1e-5, atol=1e-6)
                    for a, b in zip(res["plain"][0], res[k][0]))
        all_ranks(close, f"{k}: pooled outputs differ from unpacked")
    exact = all(np.array_equal(a, b) for a, b in zip(res["packed"][0], res["whole"][0])) \
        if world.size == 1 else True
    all_ranks(exact, "one rank: row-wise and whole packed tables differ")
    for t in TABLES:
        want = colls["plain"].gather_table(t.name)
        for k in ("packed", "whole"):
            got = colls[k].gather_table(t.name)
            all_ranks(np.allclose(got, want, rtol=1e-5, atol=1e-6), f"{k}: table {t.name}")
    # one table per dim, sharded as the packed ones: the calls packing should come down to
    ones = [TableConfig("E", 135, 8, features=tuple(t.name for t in TABLES[:6]),
                        optimizer=OPT),
            TableConfig("Q", 42, 4, features=tuple(t.name for t in TABLES[6:]), optimizer=OPT)]
    ref_plan = ShardingPlan(world.size, world.size, (
        TablePlan("E", ST.ROW_WISE, _blocks(135, 8, world.size)),
        TablePlan("Q", ST.TABLE_WISE, (Shard(0, 0, 42, 0, 4),))))
    ref = _train(ShardedEmbeddingCollection(ones, ref_plan, world.world),
                 np.random.default_rng(world.rank))[1]
    packed, plain = res["packed"][1], res["plain"][1]
    all_ranks(packed == ref, f"packed calls {packed}, one table per dim {ref}")
    all_ranks(packed["kernels"] < plain["kernels"]
              and packed["collectives"] < plain["collectives"],
              f"packed calls {packed} are not fewer than unpacked {plain}")


def test_trainer_packs_and_logs_calls(world, tmp_path, all_ranks):
    from embedding.train import Trainer, parse_config
    from embedding.train.metrics import read_metrics

    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    calls = {}
    for pack in (False, True):
        cfg = parse_config({
            "tables": {"rows": [40 + 7 * i for i in range(12)]},
            "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
            "data": {"records": 2400, "eval_records": 96},
            "train": {"steps": 4, "batch_size": 48, "eval_every": 0, "log_every": 4},
            "plan": {"pack": pack, "shardings": ["table_wise", "row_wise", "data_parallel"]},
            "output": {"dir": f"{base}/pack{int(pack)}"}}, "test")
        t = Trainer(cfg, world.world)
        t.train()
        t.close()
        all_ranks(bool(t.plan.packs) == pack, f"pack={pack}: packs {t.plan.packs}")
        if pack:
            all_ranks(len(t.plan.tables) == 1 and len(t.plan.packs[0].members) == 12,
                      f"{t.plan}")
        if world.rank == 0:
            recs = [r for r in read_metrics(f"{base}/pack{int(pack)}/metrics.jsonl")
                    if r["event"] == "train"]
            calls[pack] = recs[-1]["emb_calls"]
    ok = world.rank != 0 or (calls[True]["kernels"] <= calls[False]["kernels"]
                             and calls[True]["collectives"] <= calls[False]["collectives"]
                             and calls[True]["kernels"] <= 2)
    all_ranks(ok, f"calls per step packed {calls.get(True)} unpacked {calls.get(False)}")
