"""Cyclic row-wise sharding in one process: the id -> (rank, local row) route, strided
shards in plans and their JSON, plan validation, and a one-rank collection."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.sharding import STRATEGIES, ShardingEnv
from embedding.sharding.cyclic_row_wise import (CyclicRows, CyclicRowWiseSharding,
                                                check_cyclic_partition)
from embedding.sharding.row_wise import RowBlocks, bucketize
from embedding.types import (OptimizerConfig, OptimizerKind, Pooling, Shard, ShardingPlan,
                             ShardingType, TableConfig, TablePlan, cyclic_shards)

ST = ShardingType


@pytest.mark.parametrize("rows, size", [(10, 4), (3, 4), (1, 1), (17, 5), (8, 8), (100, 3)])
def test_route_is_the_inverse_of_the_shards(rows, size):
    """Every row r goes to rank r % N as local row r // N, and that local row of that
    rank's shard is r again: each row on exactly one rank, the ranks' rows in order."""
    shards = cyclic_shards(rows, 6, size)
    assert [s.rank for s in shards] == list(range(size))
    assert sum(s.num_rows for s in shards) == rows
    ids = np.arange(rows, dtype=np.int64)
    dest, local = CyclicRows(size)(ids)
    np.testing.assert_array_equal(dest, ids % size)
    np.testing.assert_array_equal(local, ids // size)
    for k, s in enumerate(shards):
        assert (s.row_offset, s.row_stride, s.col_offset, s.num_cols) == (k, size, 0, 6)
        assert s.num_rows == max(0, -(-(rows - k) // size))  # ceil((R - k) / N)
        mine = local[dest == k]
        np.testing.assert_array_equal(mine, np.arange(s.num_rows))
        np.testing.assert_array_equal(s.rows(), ids[dest == k])
        np.testing.assert_array_equal(ids[s.row_slice], s.rows())


def test_shard_sizes_differ_by_at_most_one_and_match_row_blocks():
    """The cyclic shards have the sizes of the planner's even row blocks, rank by rank."""
    from embedding.planner.enumerate import row_blocks

    for rows, size in [(10, 4), (37, 4), (11, 3), (1000, 7)]:
        sizes = [s.num_rows for s in cyclic_shards(rows, 2, size)]
        assert sizes == [n for _, n in row_blocks(rows, size)]
        assert max(sizes) - min(sizes) <= 1


def test_route_and_blocks_bucketize_alike():
    """bucketize takes either route: ids grouped by destination with local rows."""
    kjt = KeyedJagged.from_lists({"f": [[0, 5, 6], [], [9, 2]]})
    feats = [kjt.feature("f")]
    lengths, ids, _, counts = bucketize(feats, [CyclicRows(2)], 2, 3)
    assert counts.tolist() == [3, 2]
    assert ids.tolist() == [0, 3, 1, 2, 4]  # rank 0: rows 0, 6, 2; rank 1: rows 5, 9
    assert lengths[:, 0].tolist() == [[2, 0, 1], [1, 0, 1]]
    lengths, ids, _, counts = bucketize(feats, [RowBlocks(np.array([0, 5]),
                                                          np.array([0, 1]))], 2, 3)
    assert counts.tolist() == [2, 3] and ids.tolist() == [0, 2, 0, 1, 4]


def test_route_refuses_a_bad_size():
    with pytest.raises(ValueError, match="size: expected a number of ranks >= 1, got 0"):
        CyclicRows(0)
    with pytest.raises(ValueError, match="size"):
        cyclic_shards(10, 4, 0)


def test_shard_stride_is_checked_and_only_cyclic_is_strided():
    with pytest.raises(ValueError, match="row_stride: expected an int >= 1, got 0"):
        Shard(0, 0, 1, 0, 1, 0)
    assert Shard(1, 2, 3, 0, 4).row_stride == 1
    with pytest.raises(ValueError, match=r"row_stride of a shard of table 'emb': only "
                                         r"cyclic_row_wise shards are strided, got "
                                         r"row_stride=2 on rank 1 \(row_wise\)"):
        TablePlan("emb", ST.ROW_WISE, (Shard(0, 0, 5, 0, 4), Shard(1, 1, 5, 0, 4, 2)))


def test_plan_json_keeps_strides_and_reads_plans_without_them():
    plan = ShardingPlan(2, 2, (
        TablePlan("a", ST.CYCLIC_ROW_WISE, cyclic_shards(5, 4, 2)),
        TablePlan("b", ST.ROW_WISE, (Shard(0, 0, 3, 0, 4), Shard(1, 3, 2, 0, 4)))))
    text = plan.to_json()
    doc = json.loads(text)
    assert [s.get("row_stride") for s in doc["tables"][0]["shards"]] == [2, 2]
    assert all("row_stride" not in s for s in doc["tables"][1]["shards"])
    assert ShardingPlan.from_json(text) == plan
    # a plan written before strides existed (no row_stride anywhere) reads as contiguous
    assert ShardingPlan.from_json(json.dumps({"world_size": 2, "ranks_per_node": 2,
                                              "tables": [doc["tables"][1]]})).tables[0] \
        == plan.tables[1]


def _table(rows=10, dim=4, pooling=Pooling.SUM):
    return TableConfig("emb", rows, dim, pooling)


@pytest.mark.parametrize("shards, message", [
    (cyclic_shards(10, 4, 3), r"expected one shard on each of the 4 ranks of the group, got "
                              r"shards on ranks \[0, 1, 2\]"),
    (cyclic_shards(10, 4, 4)[:3] + (Shard(2, 3, 2, 0, 4, 4),),
     r"got shards on ranks \[0, 1, 2, 2\]"),
    (cyclic_shards(10, 4, 4)[:3] + (Shard(3, 2, 2, 0, 4, 4),),
     r"the shard on rank 3 must hold rows 3, 3 \+ 4, … \(row_offset=3, num_rows=2, "
     r"row_stride=4\) at full width \(col_offset=0, num_cols=4\); got row_offset=2"),
    (cyclic_shards(10, 4, 4)[:3] + (Shard(3, 3, 2, 0, 4, 3),), r"got .*row_stride=3"),
    (cyclic_shards(10, 4, 4)[:3] + (Shard(3, 3, 3, 0, 4, 4),), r"got .*num_rows=3"),
    (cyclic_shards(10, 4, 4)[:3] + (Shard(3, 3, 2, 0, 2, 4),), r"got .*num_cols=2"),
])
def test_a_plan_that_is_not_cyclic_is_refused(shards, message):
    plan = TablePlan("emb", ST.CYCLIC_ROW_WISE, shards)
    with pytest.raises(ValueError, match=r"plan of table 'emb' \(cyclic_row_wise\): .*" + message):
        check_cyclic_partition(_table(), plan, 4)


def _env(rank, size):
    group = SimpleNamespace(rank=rank, size=size, nodes=[tuple(range(size))])
    return ShardingEnv(group)


def test_strategy_holds_the_rank_shard_and_refuses_bad_plans():
    tables = [_table(10, 4), TableConfig("small", 2, 3)]
    plans = [TablePlan(t.name, ST.CYCLIC_ROW_WISE, cyclic_shards(t.num_rows, t.dim, 4))
             for t in tables]
    assert STRATEGIES[ST.CYCLIC_ROW_WISE] is CyclicRowWiseSharding
    strat = CyclicRowWiseSharding(tables, plans, _env(3, 4))
    held = strat.local_shards()
    assert [(s.table, s.shard) for s in held] == [("emb", Shard(3, 3, 2, 0, 4, 4))]
    assert held[0].weight.shape == (2, 4)  # rank 3 holds no row of the 2-row table
    with pytest.raises(ValueError, match="plan of table 'emb' .cyclic_row_wise."):
        CyclicRowWiseSharding(tables, [plans[0], plans[1]], _env(0, 3))
    with pytest.raises(ValueError, match=r"sharding of table 'emb': cyclic_row_wise adds "
                                         r"partial pools across ranks and cannot pool by max"):
        CyclicRowWiseSharding([_table(pooling=Pooling.MAX)], plans[:1], _env(0, 4))


def test_one_rank_collection_equals_table_wise():
    """On one rank the cyclic collection trains like the table-wise one (same kernels,
    same initial weights), bit for bit."""
    opt = OptimizerConfig(OptimizerKind.ADAM, lr=0.05)
    tables = [TableConfig("a", 30, 8, Pooling.SUM, ("a", "a2"), optimizer=opt),
              TableConfig("b", 7, 4, Pooling.MEAN, optimizer=opt)]
    colls = [ShardedEmbeddingCollection(tables, ShardingPlan(1, 1, tuple(
        TablePlan(t.name, st, cyclic_shards(t.num_rows, t.dim, 1)) for t in tables)), seed=5)
        for st in (ST.CYCLIC_ROW_WISE, ST.TABLE_WISE)]
    rng = np.random.default_rng(3)
    for _ in range(3):
        kjt = KeyedJagged.from_lists({f: [rng.integers(0, t.num_rows, rng.integers(0, 4))
                                          .tolist() for _ in range(6)]
                                      for t in tables for f in t.features})
        outs = [c.forward(kjt) for c in colls]
        np.testing.assert_array_equal(outs[0], outs[1])
        g = rng.standard_normal(outs[0].shape).astype(np.float32)
        for c in colls:
            c.backward(g)
    for t in tables:
        np.testing.assert_array_equal(colls[0].gather_table(t.name),
                                      colls[1].gather_table(t.name))
