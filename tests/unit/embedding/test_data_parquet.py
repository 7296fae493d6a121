"""Parquet input: checks before training, the encodings, reads across row groups and files."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedding.data.parquet import (ParquetDataset, ParquetSource, check_label_column, scan,
                                    stable_hash)
from embedding.data.reader import ShardedReader
from embedding.data.schema import DataSchema, SchemaError
from embedding.data.types import DataFormatError


def table(n=10, **over):
    rng = np.random.default_rng(0)
    cols = {
        "key": pa.array(np.arange(n, dtype=np.int64)),
        "y": pa.array((np.arange(n) % 3 == 0).astype(np.int8)),
        "age": pa.array([None if i % 4 == 1 else float(20 + i) for i in range(n)]),
        "city": pa.array([None if i % 5 == 4 else "abc"[i % 3] for i in range(n)]),
        "tags": pa.array([None if i == 2 else [f"t{(i + j) % 4}" for j in range(i % 3)]
                          + ([None] if i == 5 else []) for i in range(n)],
                         pa.list_(pa.string())),
        "item": pa.array(rng.integers(0, 5, n).astype(np.int32)),
    }
    cols.update(over)
    return pa.table(cols)


def write(path, t, rg=4):
    pq.write_table(t, path, row_group_size=rg)
    return str(path)


SCHEMA = DataSchema.from_config(
    "y", ["age", {"column": "age", "fill": -1.0, "indicator": True}][1:],
    [{"name": "city"}, {"name": "tags", "pooling": "mean"},
     {"name": "item", "encoding": "hash", "rows": 7}])


def fnv1a_splitmix(data: bytes) -> int:
    """The documented hash, written out independently."""
    m = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & m
    return splitmix(h)


def splitmix(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_stable_hash_is_the_documented_one():
    words = ["", "a", "ab", "Zürich", "x" * 70, "genre:sci-fi"]
    assert stable_hash(words).tolist() == [fnv1a_splitmix(w.encode()) for w in words]
    ints = [0, 1, -1, 2**62, -(2**40)]
    assert stable_hash(ints).tolist() == [splitmix(v) for v in ints]
    # any integer width gives the same hash as its int64 value
    assert (stable_hash(pa.array([3, 9], pa.int8())) == stable_hash([3, 9])).all()


def test_encoding_of_every_column_kind(tmp_path):
    t = table()
    path = write(tmp_path / "a.parquet", t)
    src = ParquetSource(path, SCHEMA)
    stats = scan(src, SCHEMA)
    city = stats.vocabularies["city"]
    # most frequent first, ties by value; row 0 is for unknown values
    counts = {}
    for v in t.column("city").to_pylist():
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    order = sorted(counts, key=lambda v: (-counts[v], v))
    assert city.values.to_pylist() == order and city.num_rows == len(order) + 1
    assert stats.table_rows == {"city": len(order) + 1, "tags": 5, "item": 7}
    batch = ParquetDataset(src, SCHEMA, stats.vocabularies, stats.table_rows).read(0, 10)
    # labels and dense (fill -1 where null, then the missing flag)
    assert batch.labels.tolist() == [float(i % 3 == 0) for i in range(10)]
    ages = t.column("age").to_pylist()
    assert batch.dense[:, 0].tolist() == [-1.0 if a is None else a for a in ages]
    assert batch.dense[:, 1].tolist() == [float(a is None) for a in ages]
    # a scalar string column: a null is an empty bag
    cities = t.column("city").to_pylist()
    assert batch.lengths[0].tolist() == [int(c is not None) for c in cities]
    assert batch.values[0].tolist() == [order.index(c) + 1 for c in cities if c is not None]
    # a list column: null lists are empty, null elements skipped
    tags = stats.vocabularies["tags"].values.to_pylist()
    want = [[x for x in (row or []) if x is not None] for row in t.column("tags").to_pylist()]
    assert batch.lengths[1].tolist() == [len(w) for w in want]
    assert batch.values[1].tolist() == [tags.index(x) + 1 for w in want for x in w]
    # a hashed integer column
    items = t.column("item").to_pylist()
    assert batch.values[2].tolist() == [splitmix(v) % 7 for v in items]


def test_unknown_values_at_evaluation_go_to_row_zero(tmp_path):
    train = write(tmp_path / "train.parquet", table())
    other = table(city=pa.array(["a", "zzz", None, "b", "c", "new", "a", "a", "b", "q"]))
    held = write(tmp_path / "held.parquet", other)
    src = ParquetSource(train, SCHEMA)
    stats = scan(src, SCHEMA)
    ds = ParquetDataset(ParquetSource(held, SCHEMA), SCHEMA, stats.vocabularies,
                        stats.table_rows)
    got = ds.read(0, 10).values[0].tolist()
    known = stats.vocabularies["city"].values.to_pylist()
    want = [known.index(c) + 1 if c in known else 0
            for c in other.column("city").to_pylist() if c is not None]
    assert got == want and 0 in got


def test_reads_across_row_groups_and_files_match_one_read(tmp_path):
    a = write(tmp_path / "p1.parquet", table(11), rg=3)
    b = write(tmp_path / "p2.parquet", table(7), rg=5)
    src = ParquetSource([a, b], SCHEMA)
    assert src.num_records == 18 and len(src.row_groups) == 4 + 2
    stats = scan(src, SCHEMA)
    ds = ParquetDataset(src, SCHEMA, stats.vocabularies, stats.table_rows, cache_row_groups=2)
    whole = ds.read(0, 18)
    for start, stop in [(0, 5), (2, 3), (5, 13), (10, 12), (11, 18), (17, 18), (4, 4)]:
        part = ds.read(start, stop)
        ref = whole.slice(start, stop)
        assert np.array_equal(part.dense, ref.dense) and np.array_equal(part.labels, ref.labels)
        for f in range(3):
            assert np.array_equal(part.values[f], ref.values[f])
            assert np.array_equal(part.lengths[f], ref.lengths[f])
        assert len(ds._cache) <= 2  # memory stays at a few decoded row groups


def test_a_directory_is_its_parquet_files_in_name_order(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    write(d / "b.parquet", table(3))
    write(d / "a.parquet", table(5))
    (d / "notes.txt").write_text("not data")
    src = ParquetSource(d, SCHEMA)
    assert [p.name for p in src.paths] == ["a.parquet", "b.parquet"] and src.num_records == 8


def test_ranks_split_the_records_without_overlap_or_loss(tmp_path):
    src = ParquetSource(write(tmp_path / "a.parquet", table(40), rg=7), SCHEMA)
    stats = scan(src, SCHEMA)
    ds = ParquetDataset(src, SCHEMA, stats.vocabularies, stats.table_rows)
    seen = []
    for rank in range(4):
        reader = ShardedReader(ds, 8, rank, 4)
        for batch in reader:
            seen.extend(batch.dense[:, 0].tolist())
    whole = ds.read(0, 40).dense[:, 0].tolist()
    assert sorted(seen) == sorted(whole) and len(seen) == 40


@pytest.mark.parametrize("make, words", [
    (lambda d: str(d / "missing.parquet"), "no such file"),
    (lambda d: str(d / "train.csv"), "neocomm data convert"),
    (lambda d: write(d / "e.parquet", table(0)), "no records"),
    (lambda d: write(d / "m.parquet", table().drop_columns(["age"])), "no column 'age'"),
    (lambda d: write(d / "s.parquet", table(age=pa.array(["x"] * 10))), "dense column 'age'"),
    (lambda d: write(d / "f.parquet", table(city=pa.array([1.5] * 10))),
     "expected integers or strings"),
    (lambda d: write(d / "l.parquet", table(y=pa.array(["yes"] * 10))), "label column 'y'"),
])
def test_bad_files_are_named_before_training(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(DataFormatError) as info:
        ParquetSource(path, SCHEMA)
    assert words in str(info.value)
    assert str(info.value).startswith(path) or path in str(info.value)


def test_a_file_whose_schema_differs_from_the_first_is_named(tmp_path):
    a = write(tmp_path / "a.parquet", table())
    b = write(tmp_path / "b.parquet", table(item=pa.array([f"i{i}" for i in range(10)])))
    with pytest.raises(DataFormatError) as info:
        ParquetSource([a, b], SCHEMA)
    msg = str(info.value)
    assert msg.startswith(b) and "'item'" in msg and "int32" in msg and "string" in msg


def test_a_list_column_declared_single_valued_is_refused(tmp_path):
    path = write(tmp_path / "a.parquet", table())
    schema = DataSchema.from_config("y", [], [{"name": "tags", "multi_valued": False}])
    with pytest.raises(DataFormatError, match="list column .* multi_valued = false"):
        ParquetSource(path, schema)


@pytest.mark.parametrize("labels, words", [
    (pa.array([0, 1, 2, 0, 1, 0, 0, 1, 0, 0], pa.int64()), "2 at row 2"),
    (pa.array([0.0, 1.0, 0.5] + [0.0] * 7), "0.5 at row 2"),
    (pa.array([0, None] + [1] * 8, pa.int64()), "null label at row 1"),
])
def test_labels_other_than_zero_and_one_are_named(tmp_path, labels, words):
    path = write(tmp_path / "a.parquet", table(y=labels), rg=10)
    src = ParquetSource(path, SCHEMA)
    for run in (lambda: scan(src, SCHEMA), lambda: check_label_column(src, "y")):
        with pytest.raises(DataFormatError) as info:
            run()
        assert words in str(info.value) and path in str(info.value)


def test_boolean_labels_and_features_sharing_a_table(tmp_path):
    t = table(y=pa.array([True, False] * 5), other_city=pa.array(list("bbbbbddddd")))
    path = write(tmp_path / "a.parquet", t)
    schema = DataSchema.from_config("y", [], [
        {"name": "home", "column": "city", "table": "cities"},
        {"name": "work", "column": "other_city", "table": "cities"}])
    src = ParquetSource(path, schema)
    stats = scan(src, schema)
    assert stats.positives == 5
    vocab = stats.vocabularies["cities"].values.to_pylist()
    assert sorted(vocab) == ["a", "b", "c", "d"] and stats.table_rows == {"cities": 5}
    batch = ParquetDataset(src, schema, stats.vocabularies, stats.table_rows).read(0, 10)
    assert batch.values[1].tolist() == [vocab.index(c) + 1 for c in "bbbbbddddd"]


@pytest.mark.parametrize("sparse, key", [
    ([{"name": "a", "pooling": "min"}], "data.sparse[0].pooling"),
    ([{"name": "a", "encoding": "hash"}], "data.sparse[0].rows"),
    ([{"name": "a"}, {"name": "a", "column": "b"}], "data.sparse[1].name"),
    ([{"name": "a", "table": "t"}, {"name": "b", "table": "t", "pooling": "mean"}],
     "data.sparse[1].pooling"),
    ([{"name": "a", "colum": "b"}], "data.sparse[0].colum"),
    ([], "data.sparse"),
])
def test_schema_errors_name_the_key(sparse, key):
    with pytest.raises(SchemaError) as info:
        DataSchema.from_config("y", [], sparse)
    assert info.value.key == key


def test_batch_take_gathers_jagged_rows(tmp_path):
    src = ParquetSource(write(tmp_path / "a.parquet", table(12)), SCHEMA)
    stats = scan(src, SCHEMA)
    ds = ParquetDataset(src, SCHEMA, stats.vocabularies, stats.table_rows)
    whole = ds.read(0, 12)
    rows = [5, 0, 11, 5, 2]
    got = whole.take(rows)
    for k, r in enumerate(rows):
        one, ref = got.slice(k, k + 1), whole.slice(r, r + 1)
        assert np.array_equal(one.dense, ref.dense) and one.labels[0] == ref.labels[0]
        for f in range(3):
            assert np.array_equal(one.values[f], ref.values[f])
    # the data set's own gather (row group by row group) is the same
    same = ds.read_records(rows)
    for f in range(3):
        assert np.array_equal(same.values[f], got.values[f])
        assert np.array_equal(same.lengths[f], got.lengths[f])


@pytest.mark.parametrize("window", [5, 16, 1000])
def test_record_shuffle_mixes_row_groups_and_files_and_resumes(tmp_path, window):
    a = write(tmp_path / "p1.parquet", table(23), rg=4)
    b = write(tmp_path / "p2.parquet", table(17, key=pa.array(np.arange(100, 117))), rg=6)
    schema = DataSchema.from_config("y", ["key"], [{"name": "city"}])
    src = ParquetSource([a, b], schema)
    stats = scan(src, schema)
    ds = ParquetDataset(src, schema, stats.vocabularies, stats.table_rows)
    keys = ds.read(0, 40).dense[:, 0]

    def epochs(reader, n):
        out = []
        for _ in range(n):
            out.append(np.concatenate([bt.dense[:, 0] for bt in reader]))
        return out

    readers = [ShardedReader(ds, 8, r, 2, shuffle=True, seed=5, shuffle_window=window)
               for r in range(2)]
    per_rank = [epochs(rd, 2) for rd in readers]
    for e in range(2):
        seen = np.concatenate([per_rank[0][e], per_rank[1][e]])
        assert sorted(seen) == sorted(keys)  # every record once per epoch, none twice
    one = epochs(ShardedReader(ds, 8, 0, 1, shuffle=True, seed=5, shuffle_window=window), 2)
    # one rank reads the global batches the two ranks split
    first = np.concatenate([np.concatenate([per_rank[0][0][i:i + 4], per_rank[1][0][i:i + 4]])
                            for i in range(0, 40 // 2, 4)])
    assert np.array_equal(first, one[0])
    assert not np.array_equal(one[0], one[1])  # another epoch, another order
    assert not np.array_equal(one[0], np.sort(one[0]))  # records are shuffled
    if window >= 40:  # one window: records of both files meet within a batch
        batches = one[0].reshape(-1, 8)
        assert any((bt < 100).any() and (bt >= 100).any() for bt in batches)
    # resuming at a position reads the same records as going on
    r = ShardedReader(ds, 8, 0, 1, shuffle=True, seed=5, shuffle_window=window)
    r.next(), r.next()
    state = r.state_dict()
    rest = [r.next().dense[:, 0] for _ in range(4)]
    s = ShardedReader(ds, 8, 0, 1, shuffle=True, seed=5, shuffle_window=window)
    s.load_state_dict(state)
    assert all(np.array_equal(x, s.next().dense[:, 0]) for x in rest)


def test_batches_read_a_config_as_the_trainer_does(tmp_path):
    from embedding.data.example import write_example
    from embedding.train import batches, load_config
    from embedding.train.data import open_data

    paths = write_example(tmp_path, records=600, eval_records=50, row_group_size=128)
    cfg = load_config(paths["config"])
    import dataclasses

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=64,
                                                             eval_batch_size=16),
                              data=dataclasses.replace(cfg.data, shuffle=True))
    data = open_data(cfg)
    one = list(batches(cfg, data=data))
    two = [list(batches(cfg, rank=r, world_size=2, data=data)) for r in range(2)]
    assert len(one) == 600 // 64 and all(b.batch_size == 64 for b in one)
    for k, whole in enumerate(one):  # rank r holds half r of each global batch
        for r in range(2):
            half = two[r][k]
            assert np.array_equal(half.dense, whole.dense[r * 32:(r + 1) * 32])
    kjt = one[0].to_jagged()
    assert tuple(kjt.keys) == ("user", "item", "city", "genres")
    # an evaluation set: every record once over the ranks, the last batch smaller
    got = [list(batches(cfg, "test", rank=r, world_size=3, data=data)) for r in range(3)]
    test = data.evaluation_sets[1][1].read(0, 50)
    rows = np.concatenate([np.concatenate([got[r][k].dense for r in range(3)])
                           for k in range(len(got[0]))])
    assert np.array_equal(rows, test.dense)
    with pytest.raises(ValueError, match="'valid', 'test'"):
        next(batches(cfg, "tset", data=data))
