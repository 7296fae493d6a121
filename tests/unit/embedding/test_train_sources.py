"""The trainer's data sources: one registered per data.source name, each checking and opening."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from embedding.train import ConfigError, DataSource, parse_config
from embedding.train.data import open_data
from embedding.train.sources import SOURCES, Source, source_of


def test_every_source_name_has_a_registered_source():
    assert list(SOURCES) == list(DataSource)
    for kind, source in SOURCES.items():
        assert source.kind is kind and source.name == kind.value
        assert source_of(kind) is source


def test_a_registered_source_is_checked_and_opened_through_the_table(monkeypatch):
    """What a new source needs: its entry; the config's check and open_data use it."""
    calls = []

    def check(cfg, path):
        calls.append(("check", path))
        if cfg.data.records < 100:
            raise ConfigError(path, "data.records", "this source wants at least 100")

    def opened(cfg, group=None):
        calls.append(("open", group))
        return "data"

    monkeypatch.setitem(SOURCES, DataSource.SYNTHETIC, Source(DataSource.SYNTHETIC, check, opened))
    cfg = parse_config({"data": {"records": 200}}, "t.toml")
    assert open_data(cfg, group="g") == "data"
    assert calls == [("check", "t.toml"), ("open", "g")]
    with pytest.raises(ConfigError, match=r"data.records.*at least 100"):
        parse_config({"data": {"records": 50}}, "t.toml")


def test_a_name_without_a_source_is_refused(monkeypatch):
    monkeypatch.delitem(SOURCES, DataSource.CRITEO)
    with pytest.raises(ConfigError, match=r"data.source.*expected one of \['synthetic', "
                                          r"'binary', 'parquet'\], got 'criteo'"):
        parse_config({"data": {"source": "criteo", "path": ["a.txt"]}}, "t.toml")
    with pytest.raises(ValueError, match="data.source: expected one of"):
        source_of(DataSource.CRITEO)


@pytest.mark.parametrize("data,key,match", [
    ({"source": "synthetic", "path": ["a.bin"]}, "data.path",
     "set, but data.source is 'synthetic'"),
    ({"source": "criteo"}, "data.path", "required when data.source is 'criteo'"),
    ({"source": "criteo", "path": ["a.txt"], "label": "y"}, "data.label", "names Parquet columns"),
    ({"source": "binary", "path": ["a.parquet"]}, "data.path", "is a Parquet file"),
    ({"source": "binary", "path": ["a.bin", "b.bin"]}, "data.path", "reads one file"),
    ({"source": "parquet", "path": ["a.parquet"]}, "data.label", "required with source"),
])
def test_each_source_checks_its_data_table(data, key, match):
    with pytest.raises(ConfigError, match=match) as caught:
        parse_config({"data": data}, "t.toml")
    assert caught.value.key == key


def test_open_data_of_synthetic_records():
    cfg = parse_config({"data": {"records": 64, "eval_records": 16},
                        "tables": {"rows": [10, 20, 30]}}, "t.toml")
    data = open_data(cfg)
    assert (data.train.num_records, data.eval.num_records) == (64, 16)
    assert data.table_sizes == (10, 20, 30) and data.planted is not None
    assert dataclasses.is_dataclass(data)


def test_memory_dataset_holds_multi_hot_bags():
    from embedding.train.datasets import MemoryDataset

    ids = np.arange(5 * 2 * 3).reshape(5, 2, 3)
    data = MemoryDataset(np.zeros((5, 1)), np.ones(5), ids, ("a", "b"))
    batch = data.read(1, 4)
    assert batch.feature_names == ("a", "b")
    assert [list(n) for n in batch.lengths] == [[3, 3, 3], [3, 3, 3]]
    assert list(batch.values[0]) == [6, 7, 8, 12, 13, 14, 18, 19, 20]
    assert list(batch.values[1]) == [9, 10, 11, 15, 16, 17, 21, 22, 23]
    one = MemoryDataset(np.zeros((5, 1)), np.ones(5), ids[:, :, 0], ("a", "b")).read(0, 2)
    assert [list(v) for v in one.values] == [[0, 6], [3, 9]]
