"""Plan -> train: ``neocomm plan --config`` plans the tables a config implies, and
``neocomm train --plan`` trains with that plan; a plan for another job is refused."""
from __future__ import annotations

import dataclasses
import json

import pytest

from embedding.data.example import write_example
from embedding.train import ConfigError, Trainer, apply_overrides, load_config
from embedding.train.config import parse_config
from embedding.train.data import open_data
from embedding.train.setup import build_tables, plan_for
from embedding.types import ShardingPlan, ShardingType, TablePlan, cyclic_shards
from neocomm.cli import main


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    d = tmp_path_factory.mktemp("example")
    paths = write_example(d, records=2000, eval_records=200, row_group_size=500)
    cfg = load_config(paths["config"])
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=3, batch_size=64, eval_every=0),
        output=dataclasses.replace(cfg.output, dir=str(d / "out")))
    return d, paths, cfg


def test_the_plan_is_the_one_the_trainer_makes(example, tmp_path, capsys):
    d, paths, cfg = example
    out = tmp_path / "plan.json"
    rc = main(["plan", "--config", paths["config"], "-n", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    plan = ShardingPlan.from_json(out.read_text())
    data = open_data(cfg)
    tables = build_tables(cfg, data.table_sizes, data.feature_names, data.feature_tables,
                          data.feature_pooling)
    # the planner's tables are the trainer's: the feature names, the vocabulary sizes
    assert sorted(t.table for t in plan.tables) == ["city", "genres", "item", "user"]
    sizes = {t.name: t.num_rows for t in tables}
    assert sizes["city"] == len(data.vocabularies["city"].values) + 1
    # the data's pooling factor (genres holds 1-3 values) reaches the planner
    assert data.ids_per_sample["genres"] > 1.5 and "genres 1." in text
    full = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=2048))
    report = plan_for(full, tables, 2, 2, data.ids_per_sample)[0]
    written = json.loads(out.read_text())
    assert set(written.pop("estimate")) >= {"ranks", "tables", "step_seconds"}
    assert json.loads(report.plan.to_json()) == written
    assert "neocomm train --config" in text and "--plan" in text


def test_train_with_the_plan_and_refuse_one_for_another_job(example, tmp_path, capsys):
    d, paths, cfg = example
    one = tmp_path / "one.json"
    assert main(["plan", "--config", paths["config"], "-n", "1", "--json", str(one)]) == 0
    t = Trainer(apply_overrides(cfg, plan=str(one)))
    t.train()
    t.close()
    assert t.plan.to_json() == ShardingPlan.from_json(one.read_text()).to_json()
    two = tmp_path / "two.json"
    assert main(["plan", "--config", paths["config"], "-n", "2", "--json", str(two)]) == 0
    with pytest.raises(ConfigError, match="the plan is for 2 ranks, the world has 1"):
        Trainer(apply_overrides(cfg, plan=str(two)))
    # another table set: the difference is named
    renamed = json.loads(one.read_text())
    renamed["tables"][0]["table"] = "cities"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(renamed))
    gone = json.loads(one.read_text())["tables"][0]["table"]
    with pytest.raises(ConfigError, match=rf"it has \['cities'\] that the model does not; it "
                                          rf"lacks the model's \['{gone}'\]"):
        Trainer(apply_overrides(cfg, plan=str(bad)))


def test_config_mode_refuses_table_options(example, capsys):
    _, paths, _ = example
    assert main(["plan", "criteo-1tb", "--config", paths["config"], "-n", "2"]) == 2
    assert "TABLES: not with --config" in capsys.readouterr().err
    assert main(["plan", "-n", "2"]) == 2
    assert "--config" in capsys.readouterr().err


def test_cyclic_row_wise_from_the_config_to_training(example, tmp_path):
    """``[plan] shardings = ["cyclic_row_wise"]`` is read and planned (every table cyclic
    on 2 ranks); a one-rank cyclic plan file trains as table-wise does, loss for loss."""
    d, paths, cfg = example
    doc = {"plan": {"shardings": ["cyclic_row_wise"]}}
    assert parse_config(doc, "test").plan.shardings == ("cyclic_row_wise",)
    cyc = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan,
                                                            shardings=("cyclic_row_wise",)))
    data = open_data(cfg)
    tables = build_tables(cfg, data.table_sizes, data.feature_names, data.feature_tables,
                          data.feature_pooling)
    plan = plan_for(cyc, tables, 2, 2, data.ids_per_sample)[0].plan
    assert {t.sharding for t in plan.tables} == {ShardingType.CYCLIC_ROW_WISE}
    for t in tables:
        assert plan.table(t.name).shards == cyclic_shards(t.num_rows, t.dim, 2)
    losses = {}
    for st in (ShardingType.CYCLIC_ROW_WISE, ShardingType.TABLE_WISE):
        one = ShardingPlan(1, 1, tuple(TablePlan(t.name, st, cyclic_shards(t.num_rows, t.dim, 1))
                                       for t in tables))
        path = tmp_path / f"{st.value}.json"
        path.write_text(one.to_json())
        out = dataclasses.replace(cfg.output, dir=str(tmp_path / st.value))
        trainer = Trainer(dataclasses.replace(apply_overrides(cfg, plan=str(path)), output=out))
        trainer.train()
        trainer.close()
        assert trainer.plan == one
        losses[st] = [loss for _, loss in trainer.losses]
    assert len(losses[ShardingType.TABLE_WISE]) == 3
    assert losses[ShardingType.CYCLIC_ROW_WISE] == losses[ShardingType.TABLE_WISE]


def test_a_tiered_plan_trains(example, tmp_path, capsys):
    """``--host-memory`` with too little device memory puts tables in host memory behind a
    cache; the plan file carries each table's memory and the trainer keeps it."""
    _, paths, cfg = example
    out = tmp_path / "tiered.json"
    rc = main(["plan", "--config", paths["config"], "-n", "1", "--batch-size", "16",
               "--memory", "60KiB", "--host-memory", "1GiB", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    plan = ShardingPlan.from_json(out.read_text())
    cached = [tp for tp in plan.tables if tp.memory.cache_rows]
    assert cached and "cached" in text
    t = Trainer(apply_overrides(cfg, plan=str(out)))
    t.train()
    t.close()
    assert t.plan.to_json() == plan.to_json()
    # [plan] host_memory of the config reaches the planner the trainer runs
    data = open_data(cfg)
    tables = build_tables(cfg, data.table_sizes, data.feature_names, data.feature_tables,
                          data.feature_pooling)
    small = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, host_memory="1GiB"),
                                train=dataclasses.replace(cfg.train, batch_size=16))
    report, hardware, _ = plan_for(small, tables, 1, 1, data.ids_per_sample, memory=60 << 10)
    assert hardware.host_memory == 1 << 30
    assert any(tp.memory.tiered for tp in report.plan.tables)
