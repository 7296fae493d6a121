"""The planner end to end: Criteo sets fitting, large tables split, plan validation."""
import pytest

from embedding.planner import (Hardware, PartitionMethod, PlanDoesNotFitError,
                               PlanMismatchError, TableConstraints, Workload, baseline_plan,
                               plan_sharding, validate_plan)
from embedding.presets import (CRITEO_1TB_ROWS, CRITEO_1TB_UNCAPPED_ROWS, preset, preset_names,
                               synthetic)
from embedding.types import (OptimizerConfig, OptimizerKind, Shard, ShardingPlan, ShardingType,
                             TableConfig, TablePlan)

GIB = 1 << 30
SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)


def hw(n=8, per_node=8, memory=80 * GIB, reserve=0.1):
    return Hardware(n, per_node, memory, reserve=reserve)


def check_report(report, tables, hardware):
    validate_plan(report.plan, hardware.world_size, ranks_per_node=hardware.ranks_per_node,
                  tables=tables)
    assert report.max_memory <= hardware.usable_memory
    assert len(report.ranks) == hardware.world_size
    assert report.imbalance >= 1.0
    assert ShardingPlan.from_json(report.plan.to_json()) == report.plan


def test_presets():
    assert len(CRITEO_1TB_ROWS) == 26 and CRITEO_1TB_ROWS[5] == 3
    uncapped = preset("criteo-1tb-uncapped")
    assert sum(t.num_rows for t in uncapped) == 882_000_000
    assert max(t.num_rows for t in uncapped) == 292_775_614
    assert 420 < sum(t.weight_bytes for t in uncapped) / GIB < 422
    for capped, full in zip(CRITEO_1TB_ROWS, CRITEO_1TB_UNCAPPED_ROWS):
        assert full >= capped
    assert len(preset("synthetic-7")) == 7 and preset("synthetic-7") == synthetic(7)
    for bad in ("criteo", "synthetic-0", "synthetic-x", ""):
        with pytest.raises(ValueError, match="preset: expected one of"):
            preset(bad)
    assert "criteo-1tb" in preset_names()


def test_criteo_1tb_fits_on_8_ranks():
    tables, hardware = preset("criteo-1tb"), hw()
    report = plan_sharding(tables, hardware)
    check_report(report, tables, hardware)
    base = baseline_plan(tables, hardware)
    check_report(base, tables, hardware)
    assert all(t.sharding is ShardingType.TABLE_WISE for t in base.plan.tables)
    assert report.step_seconds <= base.step_seconds


@pytest.mark.parametrize("n,per_node", [(8, 8), (16, 8)])
def test_uncapped_fits_and_the_largest_table_is_split(n, per_node):
    tables, hardware = preset("criteo-1tb-uncapped"), hw(n, per_node)
    report = plan_sharding(tables, hardware)
    check_report(report, tables, hardware)
    largest = report.plan.table("C20")  # 292,775,614 rows, ~140 GiB
    assert largest.sharding in SPLIT and len(largest.ranks) > 1
    for t in tables:  # every table too large for one device is split by rows
        if t.weight_bytes > hardware.usable_memory:
            assert report.plan.table(t.name).sharding in SPLIT, t.name


def test_uncapped_baseline_cannot_place_the_large_tables_whole():
    with pytest.raises(PlanDoesNotFitError) as info:
        baseline_plan(preset("criteo-1tb-uncapped"), hw())
    err = info.value
    assert err.table in ("C1", "C10", "C20", "C22")
    assert err.short > 0 and "short by" in str(err)


def test_too_much_in_all_names_a_table_and_the_shortfall():
    # 8 tables of 48 MiB on 2 ranks of 128 MiB: each fits, all of them cannot
    tables = [TableConfig(f"t{i}", 196608, 64) for i in range(8)]
    with pytest.raises(PlanDoesNotFitError) as info:
        plan_sharding(tables, Hardware(2, 2, 128 << 20), Workload(batch_size=64))
    err = info.value
    assert err.table.startswith("t") and err.short > 0
    assert "short by" in str(err) and "in all the tables need" in str(err)


def test_memory_pressure_spreads_tables():
    # three 100 MiB tables on 2 ranks of 160 MiB: two whole tables never share
    # a rank, so one table must be split across both
    tables = [TableConfig(f"t{i}", 409600, 64) for i in range(3)]
    hardware = Hardware(2, 2, 160 << 20)
    report = plan_sharding(tables, hardware, Workload(batch_size=64))
    check_report(report, tables, hardware)
    kinds = sorted(t.sharding.value for t in report.plan.tables)
    assert kinds.count("table_wise") <= 2


@pytest.mark.parametrize("method", ["greedy", "kk"])
def test_each_partitioner_alone(method):
    tables, hardware = synthetic(60, seed=3), hw(16, 8)
    report = plan_sharding(tables, hardware, methods=[method], search=False)
    check_report(report, tables, hardware)
    labels = dict(report.alternatives)
    assert PartitionMethod.parse(method).value in labels


def test_constrained_shardings_are_honoured():
    tables = [TableConfig("rw", 100000, 64), TableConfig("trw", 100000, 64),
              TableConfig("tcw", 100000, 64), TableConfig("cw", 100000, 128),
              TableConfig("dp", 10, 64)]
    cons = {"rw": TableConstraints(shardings=("row_wise",)),
            "trw": TableConstraints(shardings=("table_row_wise",)),
            "tcw": TableConstraints(shardings=("table_column_wise",), column_slices=4),
            "cw": TableConstraints(shardings=("column_wise",), column_slices=4),
            "dp": TableConstraints(shardings=("data_parallel",))}
    hardware = Hardware(16, 8, GIB)
    report = plan_sharding(tables, hardware, Workload(batch_size=512), constraints=cons)
    check_report(report, tables, hardware)
    p = report.plan
    assert p.table("rw").ranks == tuple(range(16))
    assert p.table("dp").ranks == tuple(range(16))
    nodes = {r // 8 for r in p.table("trw").ranks}
    assert len(nodes) == 1 and len(p.table("trw").ranks) == 8
    tcw = p.table("tcw")
    assert len({r // 8 for r in tcw.ranks}) == 1 and len(tcw.ranks) == 4
    cw = p.table("cw")
    assert len(cw.ranks) == 4 and sorted(s.col_offset for s in cw.shards) == [0, 32, 64, 96]


def test_optimizer_state_counts_on_the_ranks():
    sgd = [TableConfig("a", 1_000_000, 64)]
    adam = [TableConfig("a", 1_000_000, 64, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM))]
    hardware = Hardware(1, 1, GIB)
    r_sgd = plan_sharding(sgd, hardware, Workload(batch_size=128)).ranks[0].memory
    r_adam = plan_sharding(adam, hardware, Workload(batch_size=128)).ranks[0].memory
    assert r_sgd.optimizer == 0 and r_adam.optimizer == 2 * r_adam.weights
    assert r_adam.weights == r_sgd.weights == 256_000_000


def test_validate_plan_against_the_world():
    tables, hardware = preset("criteo-1tb"), hw()
    plan = plan_sharding(tables, hardware).plan
    with pytest.raises(PlanMismatchError) as info:
        validate_plan(plan, 4)
    assert "8 ranks" in str(info.value) and "4" in str(info.value)
    assert info.value.field == "world_size"
    assert (info.value.expected, info.value.got) == (4, 8)
    with pytest.raises(PlanMismatchError, match="nodes of 8 ranks, the world has nodes of 4"):
        validate_plan(plan, 8, ranks_per_node=4)
    with pytest.raises(PlanMismatchError, match="are not the model's"):
        validate_plan(plan, 8, tables=tables[:-1])
    bigger = [TableConfig(t.name, t.num_rows + 1, t.dim) for t in tables]
    with pytest.raises(PlanMismatchError, match="do not cover"):
        validate_plan(plan, 8, tables=bigger)
    with pytest.raises(ValueError, match="world_size"):
        validate_plan(plan, 0)


def test_validate_plan_finds_overlaps_and_holes():
    t = TableConfig("t", 100, 64)
    ok = [Shard(0, 0, 50, 0, 32), Shard(1, 50, 50, 0, 32), Shard(2, 0, 100, 32, 32)]
    validate_plan(ShardingPlan(4, 4, (TablePlan("t", "column_wise", tuple(ok)),)), 4,
                  tables=[t])
    overlap = [Shard(0, 0, 60, 0, 32), Shard(1, 40, 60, 0, 32), Shard(2, 0, 100, 32, 32)]
    with pytest.raises(PlanMismatchError, match="missing or overlap"):
        validate_plan(ShardingPlan(4, 4, (TablePlan("t", "row_wise", tuple(overlap)),)), 4,
                      tables=[t])
    short = [Shard(0, 0, 100, 0, 32)]
    with pytest.raises(PlanMismatchError, match="columns end at 32, not 64"):
        validate_plan(ShardingPlan(4, 4, (TablePlan("t", "column_wise", tuple(short)),)), 4,
                      tables=[t])
    dp = [Shard(r, 0, 100, 0, 64) for r in (0, 1, 2, 2)]
    with pytest.raises(PlanMismatchError, match="every rank once"):
        validate_plan(ShardingPlan(4, 4, (TablePlan("t", "data_parallel", tuple(dp)),)), 4,
                      tables=[t])


def test_bad_table_lists():
    with pytest.raises(ValueError, match="at least one table"):
        plan_sharding([], hw())
    with pytest.raises(ValueError, match="unique"):
        plan_sharding([TableConfig("a", 10, 8), TableConfig("a", 20, 8)], hw())
    with pytest.raises(ValueError, match="not in the table list"):
        plan_sharding([TableConfig("a", 10, 8)], hw(),
                      constraints={"b": TableConstraints(column_slices=2)})
    with pytest.raises(ValueError, match="method"):
        plan_sharding([TableConfig("a", 10, 8)], hw(), methods=["random"])
