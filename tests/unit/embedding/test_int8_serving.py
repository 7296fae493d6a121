"""Serving with int8 tables: train a small model on the example data, export its tables,
score the held-out file with the float32 and the int8 tables, compare the AUCs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest

from embedding.checkpoint import Checkpoint, Int8Export, read_box
from embedding.data.example import write_example
from embedding.train import Trainer, load_config
from embedding.train.export import export_int8
from embedding.train.predict import find_checkpoint, predict
from embedding.train.types import ConfigError, TrainingError
from neocomm.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """20 steps of 128 on 3000 example records, checkpoints at steps 10 and 20."""
    d = tmp_path_factory.mktemp("serving")
    paths = write_example(d, records=3000, eval_records=1000, row_group_size=1000)
    cfg = load_config(paths["config"])
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, steps=20, batch_size=128, eval_every=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=10),
        output=dataclasses.replace(cfg.output, dir=str(d / "run")))
    t = Trainer(cfg)
    t.train()
    t.close()
    return d, find_checkpoint(d / "run")


def test_int8_tables_score_within_0002_auc_of_float32(trained):
    d, ckpt = trained
    export = export_int8(d / "run", d / "int8")
    f32 = predict(d / "run", d / "test.parquet", d / "f32.parquet")
    i8 = predict(d / "run", d / "test.parquet", d / "i8.parquet", tables=d / "int8")
    assert i8["tables"] == str(export) and i8["int8_tables"] == ["city", "genres", "item",
                                                                   "user"]
    assert f32["rows"] == i8["rows"] == 1000
    assert f32["auc"] > 0.6, f"the model learned too little to compare: {f32}"
    assert abs(f32["auc"] - i8["auc"]) <= 0.002, (f32, i8)
    # the int8 tables were used: the scores moved, a little
    a = pq.read_table(d / "f32.parquet").column("logit").to_numpy()
    b = pq.read_table(d / "i8.parquet").column("logit").to_numpy()
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.05
    # every dequantized row is within half a quantization step of the float32 row
    ex, source = Int8Export(export), Checkpoint(ckpt)
    for name, t in ex.tables.items():
        x = read_box(source, name, "weight", (0, 0), (t.num_rows, t.dim))
        step = (x.max(axis=1) - x.min(axis=1)) / 255
        err = np.abs(ex.rows(name) - x)
        assert (err <= step[:, None] / 2 + 1e-6).all(), name


def test_the_command_line_scores_with_the_export(trained, capsys):
    d, ckpt = trained
    assert main(["checkpoint", "export", str(ckpt), "--out", str(d / "cli-int8")]) == 0
    text = capsys.readouterr().out
    assert f"of {ckpt.resolve()} (step 20)" in text and "fused8bit_rowwise" in text
    export = d / "cli-int8" / ckpt.name
    rc = main(["predict", "--checkpoint", str(ckpt), "--data", str(d / "test.parquet"),
               "--out", str(d / "cli.parquet"), "--tables", str(export)])
    text = capsys.readouterr().out
    assert rc == 0 and f"with the int8 tables of {export} (city, genres, item, user)" in text
    assert "on the input's labels: AUC" in text


def test_an_export_of_another_checkpoint_or_in_its_place_is_refused(trained):
    d, ckpt = trained
    older = ckpt.parent / "step-000000000010"
    export = export_int8(older, d / "old-int8", tables=["user"])
    with pytest.raises(TrainingError, match=r"the export was made from .*step-000000000010 "
                                            r"\(step 10\), not from this checkpoint"):
        predict(ckpt, d / "test.parquet", d / "x.parquet", tables=export)
    with pytest.raises(ConfigError, match=r"--checkpoint: .* is an int8 export of tables, not "
                                          r"a training checkpoint; pass it as --tables"):
        predict(export, d / "test.parquet", d / "x.parquet")
    # only the exported table is int8; the others keep their float32 rows
    r = predict(older, d / "test.parquet", d / "x.parquet", tables=export)
    assert r["int8_tables"] == ["user"]
