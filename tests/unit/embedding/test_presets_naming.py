"""One registry of table sets: a plan of a preset fits the trainer's tables of that preset."""
import json
from dataclasses import replace

import pytest

from embedding.data import TABLE_PRESETS, table_size_preset
from embedding.data.types import CRITEO_1TB_TABLE_SIZES, SPARSE_NAMES
from embedding.planner import Hardware, PlanMismatchError, plan_sharding, validate_plan
from embedding.planner.tables import preset_tables
from embedding.presets import (CRITEO_1TB_ROWS, CRITEO_FEATURES, NEO_SETS, TABLE_SETS, preset,
                               preset_names, table_rows, trainer_preset_names)
from embedding.train.config import parse_config
from embedding.train.data import table_sizes_of
from embedding.train.setup import build_tables
from embedding.types import ShardingPlan
from neocomm.cli import main

WORLD, PER_NODE = 4, 2


def trainer_tables(name: str, dim: int = 16):
    """The tables ``neocomm train`` builds for ``[tables] preset = name``."""
    cfg = parse_config({"tables": {"preset": name},
                        "model": {"embedding_dim": dim, "bottom_mlp": [64, dim]}})
    return build_tables(cfg, table_sizes_of(cfg), SPARSE_NAMES)


def check(plan, tables):
    validate_plan(plan, WORLD, ranks_per_node=PER_NODE, tables=tables)


def test_one_registry_for_both():
    assert list(TABLE_SETS) == ["criteo-1tb", "criteo-1tb-uncapped", "criteo-1tb-100x",
                                "criteo-1tb-1000x", "tiny"]
    assert preset_names() == list(TABLE_SETS) + list(NEO_SETS) + ["synthetic-N"]
    assert trainer_preset_names() == list(TABLE_SETS) == list(TABLE_PRESETS)
    assert SPARSE_NAMES == CRITEO_FEATURES == tuple(f"C{i}" for i in range(1, 27))
    assert CRITEO_1TB_TABLE_SIZES == CRITEO_1TB_ROWS
    for name in TABLE_SETS:
        assert [t.name for t in preset(name)] == list(SPARSE_NAMES)
        assert tuple(t.num_rows for t in preset(name)) == TABLE_PRESETS[name] == table_rows(name)
        assert {t.dim for t in preset(name)} == {128}
        assert {t.dim for t in preset(name, dim=24)} == {24}


@pytest.mark.parametrize("name", trainer_preset_names())
def test_a_plan_of_a_preset_at_the_trainers_dim_fits_the_trainers_tables(name):
    dim = 16
    planned, pooling = preset_tables(name, dim=dim)
    assert pooling == {}
    report = plan_sharding(planned, Hardware(WORLD, PER_NODE, 1 << 40))
    plan = ShardingPlan.from_json(report.plan.to_json())  # as neocomm train reads plan.file
    check(plan, trainer_tables(name, dim))
    with pytest.raises(PlanMismatchError, match="do not cover"):  # other dims
        check(plan, trainer_tables(name, 32))


def test_names_rows_and_dims_must_all_agree():
    hardware = Hardware(WORLD, PER_NODE, 1 << 40)
    plan = plan_sharding(preset("criteo-1tb-1000x", dim=16), hardware).plan
    with pytest.raises(PlanMismatchError, match="do not cover"):  # other rows
        check(plan, trainer_tables("criteo-1tb-100x"))
    renamed = [replace(t, name=t.name.lower()) for t in trainer_tables("criteo-1tb-1000x")]
    with pytest.raises(PlanMismatchError, match="are not the model's"):  # other names
        check(plan, renamed)


def test_the_command_plans_for_the_trainer(capsys, tmp_path):
    path = tmp_path / "p.json"
    argv = ["plan", "criteo-1tb-1000x", "-n", str(WORLD), "--ranks-per-node", str(PER_NODE),
            "--fabric", "cpu-host", "--memory", "1GiB", "--summary", "--json", str(path)]
    assert main(argv + ["--dim", "16"]) == 0, capsys.readouterr().err
    plan = ShardingPlan.from_json(path.read_text())
    assert sorted(t.table for t in plan.tables) == sorted(SPARSE_NAMES)
    check(plan, trainer_tables("criteo-1tb-1000x", 16))
    assert main(argv) == 0  # the planner's default dim, 128: not the trainer's 16
    with pytest.raises(PlanMismatchError):
        check(ShardingPlan.from_json(path.read_text()), trainer_tables("criteo-1tb-1000x", 16))
    table_file = tmp_path / "t.json"
    table_file.write_text(json.dumps({"tables": [{"name": "a", "num_rows": 10, "dim": 8}]}))
    capsys.readouterr()
    assert main(["plan", str(table_file), "-n", "2", "--dim", "16", "--memory", "1GiB"]) == 2
    assert "--dim" in capsys.readouterr().err


def test_the_trainer_refuses_synthetic_sets_saying_why():
    with pytest.raises(ValueError, match="planner-only table set"):
        table_size_preset("synthetic-8")
    with pytest.raises(ValueError, match=r"expected one of \['criteo-1tb'"):
        table_rows("criteo-2tb")
    with pytest.raises(ValueError, match="synthetic-8"):
        parse_config({"tables": {"preset": "synthetic-8"}})
    assert len(preset("synthetic-8")) == 8  # the planner takes it
