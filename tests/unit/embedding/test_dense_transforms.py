"""Dense column transforms: the settings and their errors, the formulas, the statistics the
checkpoint keeps, a wide column trained with the default, and checkpoints older than them."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401
import pyarrow.parquet as pq
import pytest

from embedding.data.parquet import ParquetDataset, ParquetSource, scan
from embedding.data.schema import DataSchema, SchemaError
from embedding.data.types import DataFormatError
from embedding.train import ConfigError, Trainer, parse_config
from embedding.train.data import open_data
from embedding.train.predict import find_checkpoint, predict

OLD = Path(__file__).parent / "data" / "old-dense-checkpoint"


def schema(dense, label="y"):
    return DataSchema.from_config(label, dense, [{"name": "item"}])


# ------------------------------------------------------------------------- settings
def test_settings_parse_with_standardize_as_the_default():
    s = schema(["a", {"column": "b", "transform": "log", "clip": [-5, 5.5]},
                {"column": "c", "transform": "minmax", "fill": 3},
                {"column": "d", "transform": "none", "indicator": True}])
    a, b, c, d = s.dense
    assert (a.transform, a.clip) == ("standardize", None)
    assert (b.transform, b.clip) == ("log", (-5.0, 5.5))
    assert (c.transform, c.fill) == ("minmax", 3.0)
    assert d.transform == "none" and s.dense_names == ("a", "b", "c", "d", "d_missing")
    # the config a checkpoint records reads back as the same columns
    again = schema([x.to_config() for x in s.dense])
    assert again.dense == s.dense
    assert a.to_config() == "a"


@pytest.mark.parametrize("entry, key, shown", [
    ({"column": "a", "transform": "zscore"}, "data.dense[0].transform", "'zscore'"),
    ({"column": "a", "transform": "Log"}, "data.dense[0].transform", "'Log'"),
    ({"column": "a", "clip": [5, 5]}, "data.dense[0].clip", "[5, 5]"),
    ({"column": "a", "clip": [9.0, -1.0]}, "data.dense[0].clip", "[9.0, -1.0]"),
    ({"column": "a", "clip": [1]}, "data.dense[0].clip", "[1]"),
    ({"column": "a", "clip": ["0", 1]}, "data.dense[0].clip", "['0', 1]"),
    ({"column": "a", "clip": 4}, "data.dense[0].clip", "4"),
    ({"column": "a", "scale": "log"}, "data.dense[0].scale", "unknown key"),
])
def test_bad_settings_name_the_key_and_the_value(entry, key, shown):
    with pytest.raises(SchemaError) as info:
        schema([entry])
    assert info.value.key == key and shown in str(info.value), str(info.value)
    doc = {"data": {"source": "parquet", "path": ["t.parquet"], "label": "y",
                    "dense": [entry], "sparse": [{"name": "item"}]}}
    with pytest.raises(ConfigError) as info:
        parse_config(doc, "my.toml")
    assert str(info.value).startswith(f"my.toml: {key}: ") and shown in str(info.value)


def write(path, cols, rg=4):
    pq.write_table(cols if isinstance(cols, pa.Table) else pa.table(cols), path,
                   row_group_size=rg)
    return str(path)


def config(train, test, dense, out, steps=0, **train_opts):
    return parse_config({
        "data": {"source": "parquet", "path": [str(train)], "eval_path": [str(test)],
                 "label": "y", "dense": dense, "sparse": [{"name": "item"}]},
        "model": {"embedding_dim": 8, "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
        "train": {"steps": max(steps, 1), "batch_size": 256, "eval_every": 0,
                  "log_every": 1000, **train_opts},
        "output": {"dir": str(out)}}, "test.toml")


def test_minmax_of_a_constant_column_is_refused_naming_the_key(tmp_path):
    n = 12
    f = write(tmp_path / "t.parquet", {"y": np.arange(n) % 2, "item": np.arange(n) % 3,
                                       "flat": [None if i == 4 else 7.0 for i in range(n)]})
    cfg = config(f, f, ["item", {"column": "flat", "transform": "minmax", "fill": 7.0}],
                 tmp_path)
    with pytest.raises(ConfigError) as info:
        open_data(cfg)
    msg = str(info.value)
    assert info.value.key == "data.dense[1].transform" and "'flat'" in msg and "7" in msg, msg
    assert "'minmax'" in msg
    # standardize takes a constant column: it becomes 0
    cfg = config(f, f, [{"column": "flat", "fill": 7.0}], tmp_path)
    assert not open_data(cfg).train.read(0, n).dense.any()


# ------------------------------------------------------------------------- formulas
def test_fill_clip_and_each_transform_follow_the_documented_formulas(tmp_path):
    raw = [None, -1000.0, -1.0, 0.0, 0.5, 3.0, float("nan"), 20.0, 1e4, 2.0]
    cols = {"y": np.arange(10) % 2, "item": np.arange(10) % 3}
    for c in "sdlmn":
        cols[c] = pa.array(raw, pa.float64())
    f = write(tmp_path / "t.parquet", cols, rg=3)  # statistics merged over 4 row groups
    s = schema([{"column": "s", "fill": 2.0},
                {"column": "d", "clip": [-10, 100]},
                {"column": "l", "transform": "log", "fill": -7.0},
                {"column": "m", "transform": "minmax", "clip": [-10, 100], "indicator": True},
                {"column": "n", "transform": "none", "fill": 1.5}])
    src = ParquetSource(f, s)
    stats = scan(src, s)
    got = ParquetDataset(src, s, stats.vocabularies, stats.table_rows,
                         dense=stats.dense).read(0, 10).dense
    x = np.array(raw, np.float64)
    null = np.isnan(x)

    def filled(v):
        return np.where(null, v, x)

    a = filled(2.0)  # fill is in raw units, before the transform
    assert np.array_equal(got[:, 0], ((a - a.mean()) / a.std()).astype(np.float32))
    b = np.clip(filled(0.0), -10, 100)  # the clip comes before the statistics
    np.testing.assert_allclose(got[:, 1], (b - b.mean()) / b.std(), rtol=1e-6, atol=1e-6)
    c = filled(-7.0)
    want = np.sign(c) * np.log1p(np.abs(c))  # negatives and zero included
    assert np.array_equal(got[:, 2], want.astype(np.float32))
    assert got[3, 2] == 0.0 and got[2, 2] == np.float32(-np.log(2.0))
    m = np.clip(filled(0.0), -10, 100)
    np.testing.assert_allclose(got[:, 3], (m + 10) / 110, rtol=1e-6)
    assert got[:, 3].min() == 0.0 and got[:, 3].max() == 1.0
    assert np.array_equal(got[:, 4], null.astype(np.float32))  # the indicator: raw nulls
    assert np.array_equal(got[:, 5], filled(1.5).astype(np.float32))  # none: as it is
    st = {c.column: c for c in stats.dense.columns}
    assert st["m"].minimum == -10 and st["m"].maximum == 100 and st["s"].count == 10
    assert abs(st["d"].std - b.std()) < 1e-9 and abs(st["s"].mean - a.mean()) < 1e-12


def test_statistics_do_not_depend_on_how_the_files_are_cut(tmp_path):
    """Per row group moments merged in row-group order: the same numbers for one file or
    for the same rows in two files with other row groups, to the last bit they share."""
    rng = np.random.default_rng(3)
    v = rng.lognormal(7, 1.5, 5000)
    cols = {"y": np.arange(5000) % 2, "item": np.arange(5000) % 7, "price": v}
    s = schema(["price"])
    one = scan(ParquetSource(write(tmp_path / "a.parquet", cols, rg=5000), s), s).dense
    cut = [write(tmp_path / f"b{i}.parquet", {k: x[i * 2500:(i + 1) * 2500]
                                              for k, x in cols.items()}, rg=300)
           for i in range(2)]
    many = scan(ParquetSource(cut, s), s).dense
    a, b = one.columns[0], many.columns[0]
    assert a.count == b.count == 5000 and (a.minimum, a.maximum) == (b.minimum, b.maximum)
    assert abs(a.mean - b.mean) <= 1e-12 * abs(a.mean) and abs(a.std - b.std) <= 1e-12 * a.std
    assert abs(a.mean - v.mean()) <= 1e-12 * v.mean() and abs(a.std - v.std()) <= 1e-9 * a.std


def test_an_infinite_dense_value_is_refused_unless_clipped(tmp_path):
    f = write(tmp_path / "t.parquet", {"y": np.arange(8) % 2, "item": np.arange(8) % 3,
                                       "p": [1.0, 2.0, 3.0, 4.0, 5.0, float("inf"), 1.0, 2.0]})
    s = schema(["p"])
    with pytest.raises(DataFormatError) as info:
        scan(ParquetSource(f, s), s)
    msg = str(info.value)
    assert "'p'" in msg and "inf at row 1" in msg and "row group 1" in msg, msg
    assert "data.dense[0].clip" in msg
    s = schema([{"column": "p", "clip": [0, 10]}])
    st = scan(ParquetSource(f, s), s).dense.columns[0]
    assert st.maximum == 10.0


# ---------------------------------------------------------------- training with them
def write_wide(path, n, seed):
    """Clicks from an item effect, a standard normal ``x`` and a release ``year``
    (1920-2000, some nulls): the year carries signal, in units far from the others'."""
    rng = np.random.default_rng(seed)
    item = rng.integers(0, 200, n)
    eff = np.random.default_rng(1).normal(0, 1.0, 200)
    x = rng.normal(0, 1, n)
    year = rng.integers(1920, 2001, n).astype(np.float64)
    logit = eff[item] + 0.6 * x - 0.02 * (year - 1960)
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    years = pa.array([None if i % 23 == 5 else v for i, v in enumerate(year)], pa.float64())
    return write(path, {"key": np.arange(n, dtype=np.int64), "y": y,
                        "item": item.astype(np.int64), "x": x, "year": years}, rg=2048)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide")
    return d, write_wide(d / "train.parquet", 16000, 0), write_wide(d / "test.parquet", 4000, 1)


def train(cfg, outputs=False):
    t = Trainer(cfg, outputs=outputs)
    t.train()
    t.close()
    return t


def test_a_wide_year_column_trains_as_well_as_without_it_by_default(wide):
    """No transform setting: the year is standardised and helps. (Fed as it is, the same
    run loses to the run without the column.)"""
    d, tr, te = wide
    without = train(config(tr, te, ["x"], d / "a", steps=200)).last_eval["auc"]
    with_year = train(config(tr, te, ["x", {"column": "year", "fill": 1960.0}], d / "b",
                             steps=200)).last_eval["auc"]
    assert with_year >= without - 0.005, (with_year, without)


def test_predict_applies_the_statistics_the_checkpoint_keeps(wide, tmp_path):
    d, tr, te = wide
    cfg = config(tr, te, ["x", {"column": "year", "indicator": True}], tmp_path / "run",
                 steps=20)
    t = train(cfg, outputs=True)
    ckpt = find_checkpoint(tmp_path / "run")
    saved = json.loads((ckpt / "manifest.json").read_text())["state"]["dense_transforms"]
    st = scan(ParquetSource(tr, cfg.data.schema()), cfg.data.schema()).dense
    assert saved == st.to_state() and [c["transform"] for c in saved] == ["standardize"] * 2
    year = pq.read_table(tr).column("year").to_numpy(zero_copy_only=False)
    year = np.where(np.isnan(year), 0.0, year)  # the nulls' fill (0) is part of them
    assert abs(saved[1]["mean"] - year.mean()) < 1e-9 and abs(saved[1]["std"] - year.std()) < 1e-9
    r = predict(tmp_path / "run", te, tmp_path / "scores.parquet")
    want = t.last_eval["sets"]["test"]
    assert abs(r["auc"] - want["auc"]) < 1e-12 and abs(r["log_loss"] - want["log_loss"]) < 1e-9
    # the scores are the model's on the standardised inputs, row by row
    scores = pq.read_table(tmp_path / "scores.parquet").column("logit").to_numpy()
    ds = t.data.eval
    assert ds.dense is t.data.dense_transforms and abs(ds.read(0, 50).dense[:, 1]).max() < 5
    from embedding.train.evaluate import score

    again = Trainer(cfg, outputs=False)
    again.resume(str(ckpt))
    logits, _ = score(again, again.data.eval, "check")
    again.close()
    assert np.array_equal(logits.astype(np.float32), scores)


def test_resume_keeps_the_checkpoints_statistics_and_refuses_another_transform(wide,
                                                                               tmp_path):
    d, tr, te = wide
    cfg = config(tr, te, ["x", "year"], tmp_path / "run", steps=10)
    train(cfg, outputs=True)
    t0 = pq.read_table(tr)
    later = pa.compute.add(t0.column("year"), 5.0)
    moved = write(tmp_path / "moved.parquet",
                  t0.set_column(t0.column_names.index("year"), "year", later), rg=2048)
    # other training files (the same ids, other years): the checkpoint's numbers are used
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=(moved,)))
    t = Trainer(other, outputs=False)
    scanned = t.data.dense_transforms.to_state()
    t.resume(str(find_checkpoint(tmp_path / "run")))
    kept = t.data.dense_transforms.to_state()
    t.close()
    saved = json.loads((find_checkpoint(tmp_path / "run") / "manifest.json").read_text())
    assert kept == saved["state"]["dense_transforms"] and kept != scanned
    log = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dense=schema(
        ["x", {"column": "year", "transform": "log"}]).dense))
    t = Trainer(log, outputs=False)
    with pytest.raises(Exception) as info:
        t.resume(str(find_checkpoint(tmp_path / "run")))
    t.close()
    msg = str(info.value)
    assert "data.dense[1].transform" in msg and "'log'" in msg and "'standardize'" in msg, msg


# ---------------------------------------------------------- checkpoints older than them
@pytest.fixture
def old(tmp_path):
    """The checkpoint, data and predictions written by the code before dense transforms."""
    d = tmp_path / "old"
    shutil.copytree(OLD, d)
    return d


def test_a_checkpoint_without_statistics_predicts_as_before(old):
    ckpt = old / "step-000000000016"
    state = json.loads((ckpt / "manifest.json").read_text())["state"]
    assert "dense_transforms" not in state  # written before them
    r = predict(ckpt, old / "test.parquet", old / "now.parquet")
    before = pq.read_table(old / "scores.parquet")
    now = pq.read_table(old / "now.parquet")
    assert now.column_names == before.column_names
    # the same inputs and weights; the dense layers' matrix products round as this CPU's BLAS
    # kernels do, so scores written on another CPU agree to float32 rounding, not bit for bit
    np.testing.assert_allclose(now.column("logit").to_numpy(), before.column("logit").to_numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(now.column("score").to_numpy(), before.column("score").to_numpy(),
                               rtol=1e-5, atol=1e-6)
    assert r["auc"] == pytest.approx(state["eval"]["auc"], abs=1e-4)
    # told that it was trained on standardised inputs, the same checkpoint scores otherwise:
    # the missing statistics are what keep its inputs raw
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    cfg = parse_config(manifest["state"]["config"], "old")
    sch = cfg.data.schema()
    manifest["state"]["dense_transforms"] = scan(ParquetSource(old / "train.parquet", sch),
                                                 sch).dense.to_state()
    text = json.dumps(manifest).encode()
    (ckpt / "manifest.json").write_bytes(text)
    (ckpt / "COMPLETE").write_text(json.dumps({"manifest_sha256":
                                               hashlib.sha256(text).hexdigest()}))
    predict(ckpt, old / "test.parquet", old / "told.parquet")
    told = pq.read_table(old / "told.parquet").column("logit").to_numpy()
    assert not np.allclose(told, before.column("logit").to_numpy(), atol=1e-3)


def test_resuming_a_checkpoint_without_statistics_keeps_raw_inputs(old, tmp_path):
    """Evaluation after the resumption gives the recorded figures; training on writes
    checkpoints that still record no statistics (they stay untransformed)."""
    ckpt = old / "step-000000000016"
    state = json.loads((ckpt / "manifest.json").read_text())["state"]
    raw = dict(state["config"])
    raw["data"] = dict(raw["data"], path=[str(old / "train.parquet")],
                       eval_path=[str(old / "test.parquet")])
    raw["output"] = dict(raw["output"], dir=str(tmp_path / "on"))
    raw["train"] = dict(raw["train"], steps=20)
    raw["checkpoint"] = dict(raw.get("checkpoint", {}), resume=str(ckpt))
    cfg = parse_config(raw, "resumed")
    t = Trainer(cfg)
    t.resume(str(ckpt))
    assert t.data.dense_transforms.identity
    got, want = t.evaluate()["sets"]["test"], state["eval"]["sets"]["test"]
    assert got.keys() == want.keys()   # figures as recorded, to the BLAS rounding of this CPU
    assert all(got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6) for k in want), (got, want)
    t.train()
    t.close()
    on = json.loads((find_checkpoint(tmp_path / "on") / "manifest.json").read_text())
    assert on["state"]["step"] == 20 and "dense_transforms" not in on["state"]
    r = predict(tmp_path / "on", old / "test.parquet", tmp_path / "on.parquet")
    assert r["auc"] == on["state"]["eval"]["auc"]


# ---------------------------------------------------------------- the data commands
def test_data_stats_and_inspect_show_each_columns_transform(tmp_path, capsys):
    from neocomm.cli import main

    tr = write_wide(tmp_path / "train.parquet", 600, 0)
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'''[data]
source = "parquet"
path = ["{tr}"]
label = "y"
dense = ["year", {{column = "x", transform = "log", clip = [-2.0, 2.0]}}]

[[data.sparse]]
name = "item"
''')
    assert main(["data", "stats", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    year = pq.read_table(tr).column("year").to_numpy(zero_copy_only=False)
    year = np.where(np.isnan(year), 0.0, year)
    shown = out[out.index("dense features as the model gets them"):].splitlines()
    line = next(x for x in shown if x.strip().startswith("year "))
    assert "standardize" in line and f"(x - {year.mean():.6g}) / {year.std():.6g}" in line, out
    line = next(x for x in shown if x.strip().startswith("x "))
    assert "log" in line and "sign(clip(x, -2, 2)) * log1p(|clip(x, -2, 2)|)" in line, out
    lo, hi = np.sign([-2.0, 2.0]) * np.log1p(2.0)
    assert f"-> {lo:.4g} .. {hi:.4g}" in line, out
    assert main(["data", "inspect", "--config", str(cfg), "--rows", "1"]) == 0
    out = capsys.readouterr().out
    first = pq.read_table(tr).slice(0, 1).to_pylist()[0]
    want = np.float32((first["year"] - year.mean()) / year.std())
    assert f"year={first['year']!r} -> {want:g}" in out, out
    # a setting the data cannot take (every id clipped to -0.5): the key, exit status 2
    cfg.write_text(cfg.read_text().replace('dense = ["year"', 'dense = [{column = "item", '
                                           'transform = "minmax", clip = [-1.0, -0.5]}, "year"'))
    assert main(["data", "stats", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "data.dense[0].transform" in err and "'item'" in err and "-0.5" in err, err
