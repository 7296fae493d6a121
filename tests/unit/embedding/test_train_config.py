"""The trainer's TOML configuration: defaults, every section, and errors naming file and key."""
from __future__ import annotations

import tomllib

import pytest

from embedding.dense.types import DenseOptimizerKind
from embedding.train import ConfigError, TrainConfig, apply_overrides, load_config, to_toml
from embedding.train.config import parse_config
from embedding.train.types import DataSource
from embedding.types import OptimizerKind


def write(tmp_path, text: str):
    p = tmp_path / "train.toml"
    p.write_text(text)
    return p


def test_no_file_gives_the_defaults():
    cfg = load_config(None)
    assert cfg == TrainConfig()
    assert cfg.data.source is DataSource.SYNTHETIC
    assert cfg.model.bottom_mlp[-1] == cfg.model.embedding_dim
    assert cfg.sparse_optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD
    assert cfg.dense_optimizer.kind is DenseOptimizerKind.ADAM


def test_every_section_is_read(tmp_path):
    p = write(tmp_path, """
[data]
source = "binary"
path = "train.bin"
eval_records = 1000
broadcast = true
[tables]
rows = [10, 20, 30]
id_policy = "modulo"
[model]
embedding_dim = 4
bottom_mlp = [8, 4]
top_mlp = [16, 8, 1]
[sparse_optimizer]
kind = "adam"
lr = 0.01
[dense_optimizer]
kind = "sgd"
lr = 0.5
momentum = 0.9
[train]
steps = 7
batch_size = 12
overlap = false
[plan]
memory = "2GiB"
shardings = ["table_wise", "row_wise"]
[checkpoint]
every = 3
resume = "auto"
[output]
dir = "runs/x"
plot = true
""")
    cfg = load_config(p)
    assert cfg.source == str(p)
    assert cfg.data.source is DataSource.BINARY and cfg.data.path == ("train.bin",)
    assert cfg.data.broadcast and cfg.data.eval_records == 1000
    assert cfg.tables.rows == (10, 20, 30) and cfg.tables.id_policy == "modulo"
    assert cfg.model.top_mlp == (16, 8, 1)
    assert cfg.sparse_optimizer.kind is OptimizerKind.ADAM and cfg.sparse_optimizer.lr == 0.01
    assert cfg.dense_optimizer.kind is DenseOptimizerKind.SGD
    assert cfg.dense_optimizer.momentum == 0.9
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.overlap) == (7, 12, False)
    assert cfg.checkpoint.every == 3 and cfg.checkpoint.resume == "auto"
    assert cfg.output.dir == "runs/x" and cfg.output.plot
    assert cfg.plan.memory == "2GiB"
    assert cfg.plan.shardings == ("table_wise", "row_wise")


def test_printed_config_reads_back_the_same(tmp_path):
    cfg = apply_overrides(load_config(None), steps=9, seed=3)
    text = to_toml(cfg)
    again = parse_config(tomllib.loads(text), "printed")
    assert again.train.steps == 9 and again.train.seed == 3
    assert to_toml(again) == text


@pytest.mark.parametrize("text, key, words", [
    ("[trian]\nsteps = 3\n", "trian", "unknown section"),
    ("steps = 3\n", "steps", "unknown key"),
    ("[train]\nstep = 3\n", "train.step", "unknown key"),
    ("[train]\nsteps = \"many\"\n", "train.steps", "expected an int"),
    ("[train]\nsteps = 2.5\n", "train.steps", "expected an int"),
    ("[train]\nsteps = true\n", "train.steps", "expected an int"),
    ("[train]\nsteps = 0\n", "train.steps", ">= 1"),
    ("[train]\noverlap = 1\n", "train.overlap", "true or false"),
    ("[data]\nsource = \"csv\"\n", "data.source", "neocomm data convert FILE -o FILE.parquet"),
    ("[data]\nsource = \"parquet\"\n", "data.path", "required when data.source is"),
    ("[data]\nsource = \"criteo\"\npath = \"a.parquet\"\n", "data.path", "is a Parquet file; set source"),
    ("[data]\nsource = \"parquet\"\npath = \"a.parquet\"\n", "data.label", "required with source"),
    ("[data]\nsource = \"parquet\"\npath = \"a.parquet\"\nlabel = \"y\"\n[[data.sparse]]\nname = \"g\"\npooling = \"maximum\"\n", "data.sparse[0].pooling", "expected one of"),
    ("[data]\nsource = \"binary\"\npath = \"a.bin\"\nlabel = \"y\"\n", "data.label", "names Parquet columns"),
    ("[data]\nsource = \"binary\"\n", "data.path", "required"),
    ("[data]\npath = \"x.bin\"\n", "data.path", "synthetic"),
    ("[tables]\npreset = \"huge\"\n", "tables.preset", "expected one of"),
    ("[tables]\nrows = [10, -1]\n", "tables.rows", "positive"),
    ("[model]\nbottom_mlp = [64, 32]\n", "model.bottom_mlp", "embedding_dim"),
    ("[model]\ntop_mlp = [64, 2]\n", "model.top_mlp", "must be 1"),
    ("[sparse_optimizer]\nkind = \"lamb\"\n", "sparse_optimizer.kind", "expected one of"),
    ("[dense_optimizer]\nlr = -1.0\n", "dense_optimizer.lr", "> 0"),
    ("[dense_optimizer]\nbeta1 = 1.0\n", "dense_optimizer.beta1", "< 1"),
    ("[checkpoint]\nkeep = 0\n", "checkpoint.keep", ">= 1"),
    ("[plan]\nmemory = \"lots\"\n", "plan.memory", "size"),
    ("[plan]\nshardings = [\"diagonal\"]\n", "plan.shardings", "sharding types"),
    ("[train]\neval_batch_size = 100000\n", "train.eval_batch_size", "larger"),
    ("train = 3\n", "train", "section"),
])
def test_bad_values_name_the_file_and_key(tmp_path, text, key, words):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    err = info.value
    assert err.path == str(p) and err.key == key, str(err)
    assert str(err).startswith(f"{p}: {key}: ")
    assert words in str(err)


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_config(tmp_path / "missing.toml")
    assert info.value.path.endswith("missing.toml")
    p = write(tmp_path, "[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)


def test_command_line_overrides():
    cfg = apply_overrides(load_config(None), steps=10, batch_size=64, out="o", resume="latest",
                          seed=7, plot=True, overlap=False)
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.seed) == (10, 64, 7)
    assert cfg.output.dir == "o" and cfg.output.plot and not cfg.train.overlap
    assert cfg.checkpoint.resume == "latest"
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, steps=0)
    assert info.value.key == "--steps" and info.value.path == "command line"
    with pytest.raises(ConfigError, match="--batch-size"):
        apply_overrides(cfg, batch_size=-4)
    with pytest.raises(ConfigError, match="--out"):
        apply_overrides(cfg, out="")


def test_config_errors_survive_pickling():
    import pickle

    err = ConfigError("a.toml", "train.steps", "expected an int")
    again = pickle.loads(pickle.dumps(err))
    assert (again.path, again.key, str(again)) == (err.path, err.key, str(err))


def test_print_config_needs_no_mpi(tmp_path, capsys):
    from neocomm.cli import main

    assert main(["train", "--print-config", "--steps", "42"]) == 0
    printed = capsys.readouterr().out
    assert parse_config(tomllib.loads(printed), "printed").train.steps == 42
    p = write(tmp_path, "[train]\nsteps = -1\n")
    assert main(["train", "--print-config", "--config", str(p)]) == 2
    assert f"{p}: train.steps: expected an int >= 1" in capsys.readouterr().err


def test_the_default_batch_fits_any_number_of_ranks_and_a_given_one_must_split():
    from embedding.train.batching import global_batch, resolve_batches

    assert [global_batch(0, n) for n in (1, 2, 3, 4, 5, 6, 4096)] == \
        [2048, 2048, 2046, 2048, 2045, 2046, 4096]
    assert global_batch(1536, 3) == 1536
    with pytest.raises(ConfigError) as err:
        global_batch(1024, 3, source="t.toml")
    assert str(err.value) == ("t.toml: train.batch_size: 1024 samples do not split evenly over "
                              "3 ranks; use a multiple of 3 (1023 or 1026), or 0 for the "
                              "default (2048 rounded down to a multiple of the ranks)")
    assert "use a multiple of 8 (8)" in str(pytest.raises(ConfigError, global_batch, 5, 8).value)
    cfg = parse_config({"train": {"eval_batch_size": 100}}, "t.toml")
    assert load_config(None).train.batch_size == 0
    with pytest.raises(ConfigError, match=r"train.eval_batch_size: 100 samples .* \(99 or "
                       r"102\), or 0 for the training batch"):
        resolve_batches(cfg, 3)
    tr = resolve_batches(parse_config({}, "t.toml"), 5).train
    assert (tr.batch_size, tr.eval_batch_size) == (2045, 2045)
