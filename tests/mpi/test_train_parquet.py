"""A user's own Parquet data on every world size: train by config, evaluate several sets, predict.

    mpirun -n 2 python -m pytest --with-mpi tests/mpi/test_train_parquet.py

The data is the example set of ``neocomm data example`` (integer ids, a
string column, a list-valued column, floats with nulls, a key column),
written once by rank 0 into a directory every rank sees.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedding.train import ConfigError, Trainer, TrainingError, load_config, parse_config
from embedding.train.predict import predict

from test_train import own_group

pytestmark = pytest.mark.training

STEPS = 8


def config(base, out, **data):
    cfg = load_config(f"{base}/train.toml")
    doc = {"train": {"steps": STEPS, "batch_size": 96, "eval_every": 0, "log_every": 4,
                     "eval_batch_size": 96},
           "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "output": {"dir": out}}
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, **doc["train"]),
        model=dataclasses.replace(cfg.model, **doc["model"]),
        output=dataclasses.replace(cfg.output, dir=out),
        data=dataclasses.replace(cfg.data, **data))
    return cfg


def test_trains_evaluates_every_set_and_predicts_in_row_order(world, example, all_ranks):
    cfg = config(example, f"{example}/run")
    t = Trainer(cfg, world.world)
    t.train()
    t.close()
    ev = t.last_eval
    all_ranks(set(ev["sets"]) == {"valid", "test"}, f"sets {list(ev['sets'])}")
    for name, m in ev["sets"].items():
        all_ranks(m["records"] == 250 and 0.0 <= m["accuracy"] <= 1.0, f"{name}: {m}")
    # the features share nothing, so there is one table per feature, named after it
    all_ranks([x.name for x in t.tables] == ["user", "item", "city", "genres"],
              f"{[x.name for x in t.tables]}")
    out = f"{example}/scores.parquet"
    r = predict(f"{example}/run", f"{example}/test.parquet", out, group=world.world)
    got = pq.read_table(out) if world.rank == 0 else None
    ok, why = True, ""
    if world.rank == 0:
        src = pq.read_table(f"{example}/test.parquet")
        ok = (got.column_names == ["event_id", "clicked", "score", "logit"]
              and got.column("event_id").equals(src.column("event_id"))
              and got.column("clicked").equals(src.column("clicked")))
        why = f"columns {got.column_names}"
        s = got.column("score").to_numpy()
        ok = ok and bool(((s > 0) & (s < 1)).all())
    all_ranks(ok, why)
    # the scores are the model's: the same AUC and log-loss as the trainer's evaluation
    want = ev["sets"]["test"]
    all_ranks(abs(r["auc"] - want["auc"]) < 1e-9 and
              abs(r["log_loss"] - want["log_loss"]) < 1e-6 and r["rows"] == 250,
              f"predict {r} vs evaluation {want}")


@pytest.mark.parametrize("shuffle, pooling", [(False, "mean"), (True, "mean"),
                                             (False, "max")])
def test_the_loss_curve_is_the_one_of_one_rank(world, example, all_ranks, shuffle, pooling):
    """Records shuffled across files and row groups: the same order at every world size.
    The list-valued feature pooled by mean or by max."""
    sparse = load_config(f"{example}/train.toml").data.sparse
    sparse = tuple(dataclasses.replace(f, pooling=pooling) if f.name == "genres" else f
                   for f in sparse)
    opts = {"shuffle": shuffle, "shuffle_window": 1000, "sparse": sparse}
    many = Trainer(config(example, f"{example}/many", **opts), world.world)
    many.train()
    many.close()
    alone = Trainer(config(example, f"{example}/alone{world.rank}", **opts), own_group(world))
    alone.train()
    alone.close()
    a = np.array([x for _, x in many.losses])
    b = np.array([x for _, x in alone.losses])
    all_ranks(len(a) == STEPS and np.allclose(a, b, rtol=2e-5, atol=1e-6), f"{a} vs {b}")
    all_ranks(abs(many.last_eval["auc"] - alone.last_eval["auc"]) < 1e-4,
              f"{many.last_eval} vs {alone.last_eval}")


def test_a_bad_label_stops_every_rank_before_training(world, example, all_ranks):
    bad = f"{example}/bad.parquet"
    if world.rank == 0:
        t = pq.read_table(f"{example}/valid.parquet")
        labels = t.column("clicked").to_numpy().astype(np.int8)
        labels[7] = 3
        pq.write_table(t.set_column(t.column_names.index("clicked"), "clicked",
                                    pa.array(labels)), bad)
    world.comm.barrier()
    cfg = config(example, f"{example}/bad-run", eval_path=(f"{example}/valid.parquet", bad))
    with pytest.raises((ConfigError, TrainingError)) as info:
        Trainer(cfg, world.world)
    msg = str(info.value)
    all_ranks("bad.parquet" in msg and "3 at row 7" in msg, msg)


def test_the_shared_scan_equals_one_ranks_scan(world, example, all_ranks):
    """Each rank scans a part of the row groups; every rank gets the whole scan's result."""
    from embedding.data.parquet import ParquetSource, scan

    schema = load_config(f"{example}/train.toml").data.schema()
    src = ParquetSource(f"{example}/train.parquet", schema)
    shared = scan(src, schema, comm=world.comm)
    alone = scan(src, schema)
    all_ranks(shared.to_dict() == alone.to_dict(), f"{shared.to_dict()} vs {alone.to_dict()}")
    for table, v in alone.vocabularies.items():
        w = shared.vocabularies[table]
        all_ranks(w.values.equals(v.values) and np.array_equal(w.counts, v.counts), table)


def test_dense_statistics_are_the_same_on_every_rank(world, example, all_ranks):
    """Each rank scans a part of the row groups: every rank gets the dense statistics of
    one rank's scan, bit for bit, its trainer reads with them and writes them into the
    checkpoint."""
    import json

    from embedding.data.parquet import ParquetSource, scan
    from embedding.data.schema import dense_columns
    from embedding.train.predict import find_checkpoint

    dense = dense_columns(["year", {"column": "age", "indicator": True},
                           {"column": "hour", "transform": "minmax", "clip": [2, 20]}])
    cfg = config(example, f"{example}/dense", dense=dense)
    schema = cfg.data.schema()
    shared = scan(ParquetSource(f"{example}/train.parquet", schema), schema,
                  comm=world.comm).dense.to_state()
    alone = scan(ParquetSource(f"{example}/train.parquet", schema), schema).dense.to_state()
    every = world.comm.allgather(shared)
    all_ranks(all(x == alone for x in every), f"{every} vs one rank's {alone}")
    t = Trainer(cfg, world.world)
    mine = t.data.dense_transforms.to_state()
    every = world.comm.allgather(mine)
    all_ranks(all(x == alone for x in every), f"{every} vs one rank's {alone}")
    # the trainer's records carry them: the standardised year, the min-max hour
    got = t.data.train.read(0, 50).dense
    raw = pq.read_table(f"{example}/train.parquet").slice(0, 50)
    year = raw.column("year").to_numpy().astype(np.float64)
    y = alone[0]
    ok_year = np.array_equal(got[:, 0], ((year - y["mean"]) / y["std"]).astype(np.float32))
    hour = np.clip(raw.column("hour").fill_null(0).to_numpy(), 2, 20)
    ok_hour = np.allclose(got[:, 3], (hour - 2) / 18, atol=1e-6)
    all_ranks(ok_year and ok_hour and 1900 < y["mean"] < 2000, f"{got[:3]}")
    t.train()
    t.close()
    if world.rank == 0:
        saved = json.loads((find_checkpoint(f"{example}/dense") / "manifest.json").read_text())
        ok = saved["state"]["dense_transforms"] == alone
    else:
        ok = True
    all_ranks(ok, "the checkpoint's statistics differ from the scan's")


def test_the_scan_benchmark_reports_the_same_result(world, example, all_ranks, capsys,
                                                     monkeypatch):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_scan.py"
    monkeypatch.setattr("sys.argv", [str(script), example, "--repeat", "1"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    all_ranks(world.rank != 0 or ("3,000 records" in out and "same result: True" in out), out)


def test_bad_training_labels_in_two_shares_name_the_first(world, example, all_ranks):
    """Row groups 1 and 4 hold bad labels (read by different ranks): every rank names row
    group 1's, as one rank scanning in file order would."""
    bad = f"{example}/bad-train.parquet"
    if world.rank == 0:
        t = pq.read_table(f"{example}/train.parquet")
        labels = t.column("clicked").to_numpy().astype(np.int8)
        labels[700 + 5], labels[4 * 700 + 9] = 2, 7
        pq.write_table(t.set_column(t.column_names.index("clicked"), "clicked",
                                    pa.array(labels)), bad, row_group_size=700)
    world.comm.barrier()
    cfg = config(example, f"{example}/bad-train-run", path=(bad,))
    with pytest.raises((ConfigError, TrainingError)) as info:
        Trainer(cfg, world.world)
    msg = str(info.value)
    all_ranks("bad-train.parquet" in msg and "2 at row 5" in msg and "7 at" not in msg, msg)


def test_a_file_one_rank_cannot_see_fails_every_rank(world, example, all_ranks):
    """Opening fails on one rank only: the others do not wait for it in the shared scan."""
    path = f"{example}/train.parquet" if world.rank != world.size - 1 else \
        f"{example}/missing-on-this-node.parquet"
    cfg = config(example, f"{example}/missing-run", path=(path,))
    with pytest.raises((ConfigError, TrainingError)) as info:
        Trainer(cfg, world.world)
    msg = str(info.value)
    all_ranks("missing-on-this-node.parquet" in msg and f"rank {world.size - 1}" in msg, msg)


def test_resume_refuses_a_changed_vocabulary(world, example, all_ranks):
    cfg = config(example, f"{example}/v1")
    t = Trainer(cfg, world.world)
    t.train()
    t.close()
    # the same run on fewer training records: the vocabularies differ
    short = f"{example}/short.parquet"
    if world.rank == 0:
        pq.write_table(pq.read_table(f"{example}/train.parquet").slice(0, 1500), short)
    world.comm.barrier()
    cfg2 = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=(short,)))
    t2 = Trainer(cfg2, world.world)
    with pytest.raises(TrainingError) as info:
        t2.resume("latest")
    t2.close()
    msg = str(info.value)
    all_ranks("vocabulary" in msg and "is not the one of the training data" in msg, msg)


def test_the_documented_config_shape_parses_as_is(tmp_path):
    """The exact [data] example of the own-data docs: nothing more is needed."""
    doc = {"data": {"source": "parquet", "path": ["train.parquet"],
                    "eval_path": ["valid.parquet", "test.parquet"], "label": "clicked",
                    "dense": ["age", "hour", "weekday", "year"],
                    "sparse": [{"name": "genres", "column": "genres", "table": "genres",
                                "pooling": "mean"}]}}
    cfg = parse_config(doc, "doc")
    schema = cfg.data.schema()
    assert schema.feature_names == ("genres",) and schema.num_dense == 4
    assert schema.sparse[0].pooling == "mean" and schema.sparse[0].encoding == "vocabulary"


def test_a_trainer_without_outputs_writes_nothing(world, example, all_ranks):
    """outputs=False (scoring, or training to compare): no log, no checkpoint, no directory."""
    import os

    out = f"{example}/nothing-here"
    t = Trainer(config(example, out), world.world, outputs=False)
    t.train()
    t.close()
    all_ranks(t.last_eval is not None and not os.path.exists(out), f"{out} exists")
