"""Memory estimates against hand-computed values, and the candidate enumeration rules."""
import pytest

from collectives.types import CollectiveOp
from embedding.planner.enumerate import column_splits, enumerate_candidates, row_blocks
from embedding.planner.estimate import (CostModel, Scope, optimizer_bytes, shard_memory,
                                        touch_bytes_per_id)
from embedding.planner.types import (Hardware, PlacementKind, PlanDoesNotFitError,
                                     TableConstraints, Workload)
from embedding.types import OptimizerConfig, OptimizerKind, ShardingType, TableConfig

GIB = 1 << 30
WL = Workload(batch_size=1024, ids_per_sample=2.0)  # 8-byte ids


def table(rows=1000, dim=64, kind=OptimizerKind.SGD, dtype="float32", name="t"):
    return TableConfig(name, rows, dim, dtype=dtype, optimizer=OptimizerConfig(kind=kind))


def cands(t, hw, wl=WL, **kw):
    out = enumerate_candidates(t, hw, wl, CostModel(hw), TableConstraints(**kw) if kw else None)
    return {c.describe(): c for c in out}


def test_weights_and_optimizer_state_by_hand():
    # 1000 x 64 float32 = 256000 bytes of weights
    assert shard_memory(table(), 1000, 64).weights == 256000
    assert shard_memory(table(), 1000, 64).optimizer == 0                       # SGD: none
    assert optimizer_bytes(OptimizerKind.ROWWISE_ADAGRAD, 1000, 64) == 4000      # 1 float/row
    assert optimizer_bytes(OptimizerKind.ADAM, 1000, 64) == 512000               # 2 per element
    adam = shard_memory(table(kind=OptimizerKind.ADAM), 250, 32, buffers=7)
    assert (adam.weights, adam.optimizer, adam.buffers, adam.total) == (32000, 64000, 7, 96007)
    half = shard_memory(table(dtype="float16"), 1000, 64)
    assert half.weights == 128000


def test_touch_bytes_per_id():
    assert touch_bytes_per_id(table(), 64) == 3 * 64 * 4
    assert touch_bytes_per_id(table(kind=OptimizerKind.ROWWISE_ADAGRAD), 64) == 3 * 256 + 8
    assert touch_bytes_per_id(table(kind=OptimizerKind.ADAM), 64) == 3 * 256 + 2 * 512


def test_candidate_memory_by_hand():
    hw = Hardware(4, 4, GIB)
    c = cands(table(kind=OptimizerKind.ROWWISE_ADAGRAD), hw)
    # table-wise: ids in B*L*8 = 16384, pooled rows out and grads in 2*B*64*4 = 524288
    tw = c["table_wise"].shards[0]
    assert (tw.memory.weights, tw.memory.optimizer, tw.memory.buffers) == (256000, 4000, 540672)
    # every rank sends its B/W samples' ids and gets their rows: 256 * (16 + 512)
    assert c["table_wise"].spread_memory == 135168
    # row-wise over 4: 250 rows each; a quarter of the ids, partial sums of the whole batch
    rw = c["row_wise"]
    assert rw.placement is PlacementKind.EVERY_RANK and len(rw.shards) == 4
    assert {s.num_rows for s in rw.shards} == {250}
    assert (rw.shards[0].memory.weights, rw.shards[0].memory.optimizer,
            rw.shards[0].memory.buffers) == (64000, 1000, 4096 + 524288)
    # column-wise x2: 32 columns each, every slice keeps one float per row
    cw = c["column_wise x2"]
    assert [(s.col_offset, s.num_cols) for s in cw.shards] == [(0, 32), (32, 32)]
    assert (cw.shards[0].memory.weights, cw.shards[0].memory.optimizer,
            cw.shards[0].memory.buffers) == (128000, 4000, 16384 + 262144)
    # data-parallel: a full replica, its local batch's buffers and the dense gradient
    dp = c["data_parallel"].shards[0]
    assert (dp.memory.weights, dp.memory.buffers) == (256000, 256 * 2 * 8 + 2 * 256 * 256 + 256000)


def test_costs_come_from_the_collectives_model():
    hw = Hardware(8, 8, GIB)
    model = CostModel(hw)
    a2a = model.seconds(CollectiveOp.ALL_TO_ALL, Scope.WORLD, 1 << 20)
    assert a2a > 0
    assert model.seconds(CollectiveOp.ALL_TO_ALL, Scope.WORLD, 2 << 20) == pytest.approx(2 * a2a)
    one = CostModel(Hardware(1, 1, GIB))
    assert one.seconds(CollectiveOp.ALL_TO_ALL, Scope.WORLD, 1 << 20) == 0.0
    # faster links, cheaper table-wise shard
    slow = cands(table(), Hardware(8, 4, GIB))["table_wise"].shards[0].comm_seconds
    from dataclasses import replace
    fab = Hardware(8, 4, GIB).fabric
    fast_fab = replace(fab, inter=replace(fab.inter, bandwidth=fab.inter.bandwidth * 10),
                       intra=replace(fab.intra, bandwidth=fab.intra.bandwidth * 10))
    fast = cands(table(), Hardware(8, 4, GIB, fabric=fast_fab))["table_wise"]
    assert fast.shards[0].comm_seconds < slow


def test_row_blocks_and_column_splits():
    assert row_blocks(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert sum(r for _, r in row_blocks(39979771, 64)) == 39979771
    assert column_splits(128, 8, 32) == [2, 4]
    assert column_splits(128, 8, 16) == [2, 4, 8]
    assert column_splits(96, 8, 16) == [2, 3, 4, 6]
    assert column_splits(33, 8, 16) == []


def test_hierarchical_only_with_several_nodes():
    one = cands(table(), Hardware(8, 8, GIB))
    assert not any(k.startswith("table_row") or k.startswith("table_col") for k in one)
    two = cands(table(), Hardware(16, 8, GIB))
    assert "table_row_wise" in two and "table_column_wise x2" in two
    trw = two["table_row_wise"]
    assert trw.placement is PlacementKind.ONE_NODE and len(trw.shards) == 8


def test_too_large_table_is_only_split_by_rows():
    # 2**20 rows x 64 float32 = 256 MiB: more than the 200 MiB a device has
    hw = Hardware(16, 8, 200 << 20)
    big = cands(table(rows=1 << 20), hw)
    assert set(big) == {"row_wise", "cyclic_row_wise", "table_row_wise"}
    assert all(c.max_shard_memory <= hw.usable_memory for c in big.values())


def test_table_that_fits_nowhere_names_itself_and_the_shortfall():
    hw = Hardware(2, 2, 64 << 20)
    with pytest.raises(PlanDoesNotFitError) as info:
        cands(table(rows=1 << 20, name="huge"), hw)      # 128 MiB per rank row-wise
    err = info.value
    assert err.table == "huge" and err.short > 0
    assert "huge" in str(err) and "short by" in str(err)


def test_column_slices_must_divide_the_dimension():
    hw = Hardware(8, 8, GIB)
    with pytest.raises(ValueError, match="dim 64 is not divisible into 3 column slices"):
        cands(table(), hw, column_slices=3)
    with pytest.raises(ValueError, match="16 slices need 16 ranks"):
        cands(table(), hw, column_slices=16)
    only = cands(table(), hw, shardings=(ShardingType.COLUMN_WISE,), column_slices=4)
    assert list(only) == ["column_wise x4"]
    with pytest.raises(ValueError, match="not divisible into column slices"):
        cands(table(dim=33), hw, shardings=(ShardingType.COLUMN_WISE,))


def test_constraints_limit_the_shardings_and_pooling():
    hw = Hardware(4, 4, GIB)
    only_rw = cands(table(), hw, shardings=(ShardingType.ROW_WISE,))
    assert list(only_rw) == ["row_wise"]
    heavy = cands(table(), hw, ids_per_sample=20.0)["table_wise"].shards[0]
    light = cands(table(), hw)["table_wise"].shards[0]
    assert heavy.lookup_seconds == pytest.approx(10 * light.lookup_seconds)
    assert heavy.memory.buffers - light.memory.buffers == 1024 * 18 * 8


def test_max_pooled_tables_are_never_split_by_rows():
    hw = Hardware(16, 8, 200 << 20)
    maxed = TableConfig("m", 1 << 20, 64, pooling="max")
    big = cands(maxed, hw)  # too large for one device: column slices instead of row blocks
    assert big and all(k.startswith(("column_wise", "table_column_wise")) for k in big)
    assert all(c.max_shard_memory <= hw.usable_memory for c in big.values())
    small = cands(TableConfig("m", 1000, 64, pooling="max"), hw)
    assert "table_wise" in small and not any("row_wise" in k for k in small)
    with pytest.raises(ValueError, match=r"sharding of table 'm': row_wise adds partial pools "
                                         r"across ranks and cannot pool by max; a max-pooled "
                                         r"table is sharded table_wise, column_wise"):
        cands(maxed, hw, shardings=(ShardingType.ROW_WISE,))


def test_bad_hardware_and_workload():
    with pytest.raises(ValueError, match="world_size"):
        Hardware(0, 1, GIB)
    with pytest.raises(ValueError, match="device_memory"):
        Hardware(4, 4, 0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Hardware(6, 4, GIB)
    with pytest.raises(ValueError, match="reserve"):
        Hardware(4, 4, GIB, reserve=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        Workload(batch_size=0)
    with pytest.raises(ValueError, match="ids_per_sample"):
        Workload(ids_per_sample=-1)
    with pytest.raises(ValueError, match="column_slices"):
        TableConstraints(column_slices=-2)
    with pytest.raises(ValueError, match="dtype"):
        shard_memory(table(dtype="complex64"), 1, 1)


@pytest.mark.parametrize("sharding, hw", [(ShardingType.ROW_WISE, Hardware(8, 8, GIB)),
                                          (ShardingType.CYCLIC_ROW_WISE, Hardware(8, 8, GIB)),
                                          (ShardingType.TABLE_ROW_WISE, Hardware(16, 8, GIB))])
def test_row_blocks_of_one_size_are_priced_once_and_alike(monkeypatch, sharding, hw):
    """A table's row blocks differ by a row at most; each size is priced once (the planner
    enumerates every table over up to 128 ranks) and every block of it carries that price,
    with its own offset and stride."""
    from embedding.planner import enumerate as en

    priced = []
    real = en._Builder._shard

    def counted(self, rows, *args, **kw):
        est = real(self, rows, *args, **kw)
        priced.append(est)
        return est

    monkeypatch.setattr(en._Builder, "_shard", counted)
    t = table(rows=1003, dim=16, kind=OptimizerKind.ADAM)
    c = en._Builder(t, hw, WL, CostModel(hw), WL.ids_per_sample).rows(sharding)
    blocks = [(s.row_offset, s.num_rows, s.row_stride) for s in c.shards]
    parts = 8
    if sharding is ShardingType.CYCLIC_ROW_WISE:
        assert blocks == [(b.row_offset, b.num_rows, b.row_stride)
                          for b in en.cyclic_shards(1003, 16, parts)]
    else:
        assert blocks == [(o, r, 1) for o, r in row_blocks(1003, parts)]
    sizes = {s.num_rows for s in c.shards}
    assert len(sizes) == 2 and sorted(p.num_rows for p in priced) == sorted(sizes)
    by_size = {p.num_rows: p for p in priced}
    for s in c.shards:
        p = by_size[s.num_rows]
        assert (s.memory, s.lookup_seconds, s.comm_seconds, s.parts, s.col_offset,
                s.num_cols) == (p.memory, p.lookup_seconds, p.comm_seconds, p.parts, 0, 16)
    small, large = sorted(by_size.values(), key=lambda p: p.num_rows)
    assert small.memory.weights < large.memory.weights
    assert small.lookup_seconds < large.lookup_seconds
