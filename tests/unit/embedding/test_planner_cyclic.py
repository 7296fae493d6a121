"""The planner and cyclic row-wise: priced as row-wise, offered beside it, chosen when asked
for, validated, and written by ``neocomm plan``."""
import json

import pytest

from embedding.planner import (Hardware, PlanMismatchError, TableConstraints, Workload,
                               evaluate_plan, plan_sharding, validate_plan)
from embedding.planner.enumerate import enumerate_candidates
from embedding.planner.estimate import CostModel
from embedding.planner.types import PlacementKind
from embedding.presets import preset
from embedding.types import (OptimizerConfig, OptimizerKind, Shard, ShardingPlan, ShardingType,
                             TableConfig, TablePlan, cyclic_shards)
from neocomm.cli import main

ST = ShardingType
GIB = 1 << 30
WL = Workload(batch_size=1024, ids_per_sample=2.0)


def cands(t, hw, **kw):
    out = enumerate_candidates(t, hw, WL, CostModel(hw), TableConstraints(**kw) if kw else None)
    return {c.describe(): c for c in out}


@pytest.mark.parametrize("rows, n, per_node", [(1001, 4, 4), (37, 8, 4), (10 ** 6, 16, 8)])
def test_cyclic_is_priced_as_row_wise_rank_by_rank(rows, n, per_node):
    t = TableConfig("t", rows, 64, optimizer=OptimizerConfig(OptimizerKind.ADAM))
    got = cands(t, Hardware(n, per_node, GIB))
    rw, cyc = got["row_wise"], got["cyclic_row_wise"]
    assert cyc.placement is PlacementKind.EVERY_RANK and cyc.sharding is ST.CYCLIC_ROW_WISE
    assert [(s.row_offset, s.num_rows, s.row_stride) for s in cyc.shards] == \
        [(c.row_offset, c.num_rows, c.row_stride) for c in cyclic_shards(rows, 64, n)]
    for a, b in zip(rw.shards, cyc.shards):
        assert a.row_stride == 1 and b.row_stride == n
        assert (a.num_rows, a.memory, a.lookup_seconds, a.comm_seconds, a.parts) == \
            (b.num_rows, b.memory, b.lookup_seconds, b.comm_seconds, b.parts)
    assert (rw.spread_seconds, rw.spread_memory, rw.collectives, rw.spread_parts) == \
        (cyc.spread_seconds, cyc.spread_memory, cyc.collectives, cyc.spread_parts)


def test_cyclic_is_offered_where_row_wise_is():
    assert "cyclic_row_wise" not in cands(TableConfig("t", 1000, 64), Hardware(1, 1, GIB))
    assert "cyclic_row_wise" not in cands(TableConfig("t", 3, 64), Hardware(4, 4, GIB))
    assert list(cands(TableConfig("t", 1000, 64), Hardware(4, 4, GIB),
                      shardings=("cyclic_row_wise",))) == ["cyclic_row_wise"]
    maxed = TableConfig("m", 1000, 64, pooling="max")
    assert not any("row_wise" in k for k in cands(maxed, Hardware(4, 4, GIB)))
    with pytest.raises(ValueError, match=r"sharding of table 'm': cyclic_row_wise adds partial "
                                         r"pools across ranks and cannot pool by max"):
        cands(maxed, Hardware(4, 4, GIB), shardings=(ST.CYCLIC_ROW_WISE,))


def test_at_equal_cost_the_planner_keeps_contiguous_row_wise():
    """Without a measure of skew both cost the same: the uncapped Criteo tables too large
    for one device stay contiguous row-wise, and so does a table that allows either."""
    tables = preset("criteo-1tb-uncapped")
    report = plan_sharding(tables, Hardware(8, 8, 80 * GIB, reserve=0.1))
    kinds = {t.sharding for t in report.plan.tables}
    assert ST.ROW_WISE in kinds and ST.CYCLIC_ROW_WISE not in kinds
    either = {"t": TableConstraints(shardings=("cyclic_row_wise", "row_wise"))}
    got = plan_sharding([TableConfig("t", 10 ** 6, 64)], Hardware(4, 4, GIB), WL,
                        constraints=either)
    assert got.plan.table("t").sharding is ST.ROW_WISE


def test_a_table_asked_to_be_cyclic_is_planned_cyclic_and_evaluates_alike():
    tables = [TableConfig("big", 10 ** 6, 64), TableConfig("small", 1000, 64),
              TableConfig("other", 10 ** 6, 64)]
    hardware = Hardware(4, 4, GIB)
    cons = {"big": TableConstraints(shardings=("cyclic_row_wise",)),
            "other": TableConstraints(shardings=("row_wise",))}
    report = plan_sharding(tables, hardware, WL, constraints=cons)
    big = report.plan.table("big")
    assert big.sharding is ST.CYCLIC_ROW_WISE
    assert sorted(big.shards, key=lambda s: s.rank) == list(cyclic_shards(10 ** 6, 64, 4))
    validate_plan(report.plan, 4, ranks_per_node=4, tables=tables)
    assert ShardingPlan.from_json(report.plan.to_json()) == report.plan
    again = evaluate_plan(report.plan, tables, hardware, WL)
    assert again.step_seconds == pytest.approx(report.step_seconds)
    label = {t.table: t.label for t in report.tables}
    assert label["big"] == "cyclic_row_wise" and label["other"] == "row_wise"
    # the same table row-wise costs the same
    as_rw = {**cons, "big": TableConstraints(shardings=("row_wise",))}
    rw = plan_sharding(tables, hardware, WL, constraints=as_rw)
    assert rw.step_seconds == pytest.approx(report.step_seconds)


def test_validate_plan_checks_cyclic_shards():
    t = TableConfig("t", 10, 8)

    def check(shards):
        plan = ShardingPlan(4, 4, (TablePlan("t", ST.CYCLIC_ROW_WISE, tuple(shards)),))
        validate_plan(plan, 4, tables=[t])

    check(cyclic_shards(10, 8, 4))
    check(reversed(cyclic_shards(10, 8, 4)))       # any order of the shards
    with pytest.raises(PlanMismatchError, match=r"table 't' .*one shard on each of the 4 "
                                                r"ranks, got shards on ranks \[0, 1, 2\]"):
        check(cyclic_shards(10, 8, 3))
    bad = cyclic_shards(10, 8, 4)[:3] + (Shard(3, 3, 2, 0, 4, 4),)
    with pytest.raises(PlanMismatchError, match=r"table 't' .*the cyclic row-wise shard on "
                                                r"rank 3 must be rows 3, 3 \+ 4, … .2 rows"):
        check(bad)
    tiny = TableConfig("t", 3, 8)                  # rank 3 holds no row, and that is fine
    validate_plan(ShardingPlan(4, 4, (TablePlan("t", ST.CYCLIC_ROW_WISE,
                                                cyclic_shards(3, 8, 4)),)), 4, tables=[tiny])


def test_neocomm_plan_prints_writes_and_checks_cyclic(capsys, tmp_path):
    tables = tmp_path / "tables.toml"
    tables.write_text('[[tables]]\nname = "user"\nnum_rows = 4000000\ndim = 64\n'
                      'sharding = "cyclic_row_wise"\n\n'
                      '[[tables]]\nname = "item"\nnum_rows = 1000\ndim = 64\n')
    path = tmp_path / "plan.json"
    rc = main(["plan", str(tables), "-n", "4", "--json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("user "))
    assert "cyclic_row_wise" in line and "0-3" in line
    doc = json.loads(path.read_text())
    user = next(t for t in doc["tables"] if t["table"] == "user")
    assert user["sharding"] == "cyclic_row_wise"
    assert [(s["rank"], s["row_offset"], s["row_stride"]) for s in user["shards"]] == \
        [(k, k, 4) for k in range(4)]
    assert main(["plan", str(tables), "-n", "4", "--check", str(path)]) == 0
    assert "matches" in capsys.readouterr()[0]
    assert main(["plan", str(tables), "-n", "2", "--check", str(path)]) == 1
