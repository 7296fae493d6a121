"""Table files for the planner: TOML and JSON, and the errors that name file and key."""
import json

import pytest

from embedding.planner.tables import TableFileError, load_tables, parse_tables
from embedding.types import OptimizerKind, Pooling, ShardingType

TOML = '''
[[tables]]
name = "user"
num_rows = 1000
dim = 64
ids_per_sample = 3.5
sharding = ["row_wise", "table_wise"]
[tables.optimizer]
kind = "rowwise_adagrad"
lr = 0.05

[[tables]]
name = "item"
num_rows = 50
dim = 32
dtype = "float16"
pooling = "mean"
features = ["item", "item_history"]
sharding = "column_wise"
column_slices = 2
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_toml_file(tmp_path):
    tables, cons = load_tables(write(tmp_path, "t.toml", TOML))
    assert [t.name for t in tables] == ["user", "item"]
    user, item = tables
    assert (user.num_rows, user.dim, user.optimizer.kind, user.optimizer.lr) == \
        (1000, 64, OptimizerKind.ROWWISE_ADAGRAD, 0.05)
    assert (item.dtype, item.pooling, item.features) == ("float16", Pooling.MEAN,
                                                          ("item", "item_history"))
    assert cons["user"].ids_per_sample == 3.5
    assert cons["user"].shardings == (ShardingType.ROW_WISE, ShardingType.TABLE_WISE)
    assert cons["item"].shardings == (ShardingType.COLUMN_WISE,)
    assert cons["item"].column_slices == 2


def test_json_file_matches_toml(tmp_path):
    import tomllib

    data = tomllib.loads(TOML)
    from_json = load_tables(write(tmp_path, "t.json", json.dumps(data)))
    from_toml = load_tables(write(tmp_path, "t.toml", TOML))
    assert from_json == from_toml


@pytest.mark.parametrize("entry,key,says", [
    ({"name": "a", "num_rows": 10, "dim": 8, "colour": "red"}, "tables[0].colour",
     "unknown key"),
    ({"name": "a", "num_rows": "10", "dim": 8}, "tables[0].num_rows", "expected an int, got str"),
    ({"name": "a", "num_rows": 10, "dim": 8.0}, "tables[0].dim", "expected an int, got float"),
    ({"name": "a", "num_rows": True, "dim": 8}, "tables[0].num_rows", "expected an int, got bool"),
    ({"name": "a", "dim": 8}, "tables[0].num_rows", "missing"),
    ({"name": 3, "num_rows": 10, "dim": 8}, "tables[0].name", "expected a string"),
    ({"name": "a", "num_rows": 10, "dim": 8, "dtype": "float8"}, "tables[0].dtype",
     "expected one of"),
    ({"name": "a", "num_rows": 10, "dim": 8, "sharding": ["diagonal"]}, "tables[0].sharding[0]",
     "expected one of"),
    ({"name": "a", "num_rows": 10, "dim": 8, "ids_per_sample": "2"},
     "tables[0].ids_per_sample", "expected a number"),
    ({"name": "a", "num_rows": 10, "dim": 8, "optimizer": {"kind": "sgd", "momentum": 0.9}},
     "tables[0].optimizer.momentum", "unknown key"),
    ({"name": "a", "num_rows": 10, "dim": 8, "optimizer": {"kind": "lamb"}},
     "tables[0].optimizer.kind", "expected one of"),
    ({"name": "a", "num_rows": 10, "dim": 8, "features": ["x", 2]}, "tables[0].features[1]",
     "expected a string"),
    ({"name": "a", "num_rows": -1, "dim": 8}, "tables[0]", "num_rows"),
])
def test_bad_entries_name_file_and_key(tmp_path, entry, key, says):
    path = write(tmp_path, "bad.json", json.dumps({"tables": [entry]}))
    with pytest.raises(TableFileError) as info:
        load_tables(path)
    err = info.value
    assert err.path == path and err.key == key
    assert str(err).startswith(f"{path}: {key}: ") and says in str(err)


def test_bad_documents(tmp_path):
    with pytest.raises(TableFileError, match="unknown key; expected 'tables'"):
        parse_tables({"tables": [], "defaults": {}}, "x.toml")
    with pytest.raises(TableFileError, match="tables: missing"):
        parse_tables({}, "x.toml")
    with pytest.raises(TableFileError, match="at least one table"):
        parse_tables({"tables": []}, "x.toml")
    with pytest.raises(TableFileError, match=r"tables\[1\].name: 'a' is repeated"):
        parse_tables({"tables": [{"name": "a", "num_rows": 1, "dim": 1}] * 2}, "x.toml")
    with pytest.raises(TableFileError, match="not valid TOML"):
        load_tables(write(tmp_path, "broken.toml", "[[tables]\nname="))
    with pytest.raises(TableFileError, match="not valid JSON"):
        load_tables(write(tmp_path, "broken.json", "{"))
    with pytest.raises(TableFileError, match="expected a .toml or .json file"):
        load_tables(write(tmp_path, "tables.yaml", "tables: []"))
    with pytest.raises(TableFileError, match="cannot read"):
        load_tables(str(tmp_path / "missing.toml"))
