"""Conversion to Parquet: Criteo text, CSV/TSV and neocomm binary, and ``neocomm data convert``."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from embedding.data import (BinaryDataset, BinaryWriter, DataFormatError,  # noqa: E402
                            SyntheticConfig, SyntheticDataset, write_batches)
from embedding.data.convert import (binary_to_parquet, criteo_to_parquet,  # noqa: E402
                                    delimited_to_parquet)


def neocomm_data(argv):
    from neocomm.cli import main

    return main(["data", *argv])


def criteo_line(rng, i):
    label = str(i % 2)
    ints = ["" if rng.random() < 0.25 else str(int(rng.integers(-3, 10 ** 6))) for _ in range(13)]
    cats = ["" if rng.random() < 0.25 else f"{int(rng.integers(0, 1 << 32)):08x}"
            for _ in range(26)]
    return [label] + ints + cats


def write_criteo(path, rows, gz=False):
    text = "".join("\t".join(r) + "\n" for r in rows).encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(text)
    else:
        path.write_bytes(text)


def only_files(directory):
    return sorted(os.listdir(directory))


# ---------------------------------------------------------------------------- Criteo text


def test_criteo_to_parquet_every_value(tmp_path):
    rng = np.random.default_rng(5)
    rows = [criteo_line(rng, i) for i in range(23)]
    rows[0][1:] = [""] * 39                    # every feature missing
    rows[1][14] = "00C0FFEE"                   # upper case hex is written in lower case
    rows[2][1] = "-1"
    write_criteo(tmp_path / "day_0", rows[:10])
    write_criteo(tmp_path / "day_1.gz", rows[10:], gz=True)
    out = tmp_path / "out.parquet"
    n = criteo_to_parquet([tmp_path / "day_0", tmp_path / "day_1.gz"], out, row_group_size=4)
    assert n == 23
    meta = pq.ParquetFile(out).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4] * 5 + [3]
    table = pq.read_table(out)
    assert table.schema.names == ["label"] + [f"I{j}" for j in range(1, 14)] + \
        [f"C{j}" for j in range(1, 27)]
    assert table.schema.field("label").type == pa.int8()
    assert all(table.schema.field(f"I{j}").type == pa.int64() for j in range(1, 14))
    assert all(table.schema.field(f"C{j}").type == pa.string() for j in range(1, 27))
    got = table.to_pylist()
    for r, rec in zip(rows, got):
        assert rec["label"] == int(r[0])
        for j in range(13):
            assert rec[f"I{j + 1}"] == (None if r[1 + j] == "" else int(r[1 + j]))
        for j in range(26):
            assert rec[f"C{j + 1}"] == (None if r[14 + j] == "" else r[14 + j].lower())
    assert got[1]["C1"] == "00c0ffee" and got[2]["I1"] == -1
    assert all(v is None for k, v in got[0].items() if k != "label")
    assert only_files(tmp_path) == ["day_0", "day_1.gz", "out.parquet"]


def test_criteo_bad_inputs_name_the_file_and_line(tmp_path):
    rng = np.random.default_rng(1)
    good = [criteo_line(rng, i) for i in range(3)]
    write_criteo(tmp_path / "good", good)
    out = tmp_path / "out.parquet"
    with pytest.raises(DataFormatError, match="missing_day: no such file") as e:
        criteo_to_parquet([tmp_path / "good", tmp_path / "missing_day"], out)
    assert e.value.path.endswith("missing_day")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty: the file is empty"):
        criteo_to_parquet([tmp_path / "good", tmp_path / "empty"], out)
    bad = [list(r) for r in good]
    bad[1][5] = "x7"
    write_criteo(tmp_path / "bad", bad)
    with pytest.raises(DataFormatError, match=r"bad, line 2: integer feature I5 b'x7'") as e:
        criteo_to_parquet([tmp_path / "good", tmp_path / "bad"], out, row_group_size=1)
    assert e.value.line == 2
    write_criteo(tmp_path / "short", good[:1] + [good[1][:30]])
    with pytest.raises(DataFormatError, match="short, line 2: expected 40 tab-separated fields"):
        criteo_to_parquet(tmp_path / "short", out)
    # nothing written and no temporary file left; an existing output is kept as it was
    assert not out.exists()
    assert only_files(tmp_path) == ["bad", "empty", "good", "short"]
    out.write_bytes(b"old")
    with pytest.raises(DataFormatError):
        criteo_to_parquet([tmp_path / "good", tmp_path / "bad"], out, row_group_size=1)
    assert out.read_bytes() == b"old"
    assert only_files(tmp_path) == ["bad", "empty", "good", "out.parquet", "short"]


def test_bad_arguments_are_value_errors(tmp_path):
    write_criteo(tmp_path / "good", [criteo_line(np.random.default_rng(0), 0)])
    with pytest.raises(ValueError, match="row_group_size"):
        criteo_to_parquet(tmp_path / "good", tmp_path / "o.parquet", row_group_size=0)
    with pytest.raises(ValueError, match="output: .*does not exist"):
        criteo_to_parquet(tmp_path / "good", tmp_path / "no" / "o.parquet")
    with pytest.raises(ValueError, match="output: expected a file other than the inputs"):
        criteo_to_parquet(tmp_path / "good", tmp_path / "good")
    with pytest.raises(ValueError, match="inputs: expected at least one"):
        criteo_to_parquet([], tmp_path / "o.parquet")
    with pytest.raises(ValueError, match="delimiter"):
        delimited_to_parquet(tmp_path / "good", tmp_path / "o.parquet", delimiter=",,")


# ---------------------------------------------------------------------------- CSV / TSV


def test_csv_with_header_and_list_columns(tmp_path):
    header = "user,name,score,tags,history"
    rows = [("1", "ann", "0.5", "a|b", "10|20|30"),
            ("2", "", "1.25", "", "7"),
            ("3", "cy", "", "c", ""),
            ("-4", "dee", "2", "d|e|f", "-1|0")]
    more = [("5", "eve", "3.5", "g", "40|50"), ("6", "fay", "4", "h|i", "60")]
    (tmp_path / "a.csv").write_text("\n".join([header] + [",".join(r) for r in rows]) + "\n")
    (tmp_path / "b.csv").write_text("\n".join([header] + [",".join(r) for r in more]) + "\n")
    out = tmp_path / "out.parquet"
    n = delimited_to_parquet([tmp_path / "a.csv", tmp_path / "b.csv"], out,
                             list_columns=["tags", "history"], block_size=32, row_group_size=4)
    assert n == 6
    table = pq.read_table(out)
    assert table.schema.names == ["user", "name", "score", "tags", "history"]
    types = [f.type for f in table.schema]
    assert types[:3] == [pa.int64(), pa.string(), pa.float64()]
    assert types[3].value_type == pa.string() and types[4].value_type == pa.int64()
    want = [
        {"user": 1, "name": "ann", "score": 0.5, "tags": ["a", "b"], "history": [10, 20, 30]},
        {"user": 2, "name": None, "score": 1.25, "tags": [], "history": [7]},
        {"user": 3, "name": "cy", "score": None, "tags": ["c"], "history": []},
        {"user": -4, "name": "dee", "score": 2.0, "tags": ["d", "e", "f"], "history": [-1, 0]},
        {"user": 5, "name": "eve", "score": 3.5, "tags": ["g"], "history": [40, 50]},
        {"user": 6, "name": "fay", "score": 4.0, "tags": ["h", "i"], "history": [60]},
    ]
    assert table.to_pylist() == want
    assert only_files(tmp_path) == ["a.csv", "b.csv", "out.parquet"]


def test_tsv_without_header_and_mixed_list(tmp_path):
    # one element of c2 in the second file is no int: the whole column is list<string>
    (tmp_path / "a.tsv").write_text("x\t1;2\t5\ny\t3\t6\n")
    (tmp_path / "b.tsv.gz").write_bytes(gzip.compress(b"z\t4;q\t7\n"))
    out = tmp_path / "out.parquet"
    n = delimited_to_parquet([tmp_path / "a.tsv", tmp_path / "b.tsv.gz"], out, delimiter="\t",
                             header=False, list_columns=["c1"], list_separator=";")
    assert n == 3
    table = pq.read_table(out)
    assert table.schema.names == ["c0", "c1", "c2"]
    assert table.to_pylist() == [{"c0": "x", "c1": ["1", "2"], "c2": 5},
                                 {"c0": "y", "c1": ["3"], "c2": 6},
                                 {"c0": "z", "c1": ["4", "q"], "c2": 7}]


def test_csv_errors_name_file_and_column(tmp_path):
    out = tmp_path / "out.parquet"
    (tmp_path / "a.csv").write_text("k,v\n1,2\n3,4\n")
    with pytest.raises(DataFormatError, match=r"a.csv: no column 'tags' to split"):
        delimited_to_parquet(tmp_path / "a.csv", out, list_columns=["tags"])
    (tmp_path / "b.csv").write_text("k,w\n5,6\n")
    with pytest.raises(DataFormatError, match=r"b.csv: the header differs .*column 2 is 'w'"):
        delimited_to_parquet([tmp_path / "a.csv", tmp_path / "b.csv"], out)
    (tmp_path / "c.csv").write_text("k,v\n1,2\n3\n")
    with pytest.raises(DataFormatError, match=r"c.csv, line 3: expected 2 comma-separated"):
        delimited_to_parquet(tmp_path / "c.csv", out)
    # v is int64 by the first block; a later block's text does not fit
    (tmp_path / "d.csv").write_text("k,v\n" + "1,2\n" * 20 + "3,oops\n")
    with pytest.raises(DataFormatError,
                       match=r"d.csv, line 22: column 'v': invalid value 'oops' for int64"):
        delimited_to_parquet(tmp_path / "d.csv", out, block_size=16)
    (tmp_path / "e.csv").write_text("k,v\n")
    with pytest.raises(DataFormatError, match=r"e.csv: holds no records"):
        delimited_to_parquet(tmp_path / "e.csv", out)
    assert not out.exists()
    assert only_files(tmp_path) == ["a.csv", "b.csv", "c.csv", "d.csv", "e.csv"]


# ---------------------------------------------------------------------------- binary


def test_binary_to_parquet_record_by_record(tmp_path):
    sizes = (50,) * 26
    ds = SyntheticDataset(SyntheticConfig(table_sizes=sizes, seed=2), 37)
    write_batches(tmp_path / "d.bin", [ds.read(0, 20), ds.read(20, 37)], sizes, chunk_records=8)
    out = tmp_path / "d.parquet"
    assert binary_to_parquet(tmp_path / "d.bin", out, row_group_size=10) == 37
    table = pq.read_table(out)
    assert table.schema.names == ["label"] + [f"I{j}" for j in range(1, 14)] + \
        [f"C{j}" for j in range(1, 27)]
    assert table.schema.field("label").type == pa.int8()
    assert table.schema.field("I1").type == pa.float32()
    assert table.schema.field("C1").type == pa.int64()
    ref = BinaryDataset(tmp_path / "d.bin").read(0, 37)
    got = table.to_pydict()
    np.testing.assert_array_equal(np.asarray(got["label"]), ref.labels.astype(np.int8))
    for j in range(13):
        np.testing.assert_array_equal(np.asarray(got[f"I{j + 1}"], np.float32), ref.dense[:, j])
    for f in range(26):
        assert got[f"C{f + 1}"] == ref.values[f].tolist()


def test_binary_empty_bags_become_list_columns(tmp_path):
    # 2 dense, 3 sparse: feature 1 has empty bags (-1), features 0 and 2 one id everywhere
    dense = np.arange(10, dtype=np.float32).reshape(5, 2) / 4
    labels = np.array([1, 0, 0, 1, 1])
    ids = np.array([[0, 3, 9], [1, -1, 8], [2, 4, 7], [3, -1, 6], [4, 5, 5]])
    with BinaryWriter(tmp_path / "e.bin", (10, 10, 10), num_dense=2, empty_bags=True) as w:
        w.write(dense[:3], labels[:3], ids[:3])
        w.write(dense[3:], labels[3:], ids[3:])
    with BinaryWriter(tmp_path / "f.bin", (10, 10, 10), num_dense=2, empty_bags=True) as w:
        w.write(dense[:1], labels[:1], ids[:1])
    out = tmp_path / "e.parquet"
    assert binary_to_parquet([tmp_path / "e.bin", tmp_path / "f.bin"], out) == 6
    table = pq.read_table(out)
    assert table.schema.names == ["label", "dense_0", "dense_1", "f0", "f1", "f2"]
    assert table.schema.field("f0").type == pa.int64()
    assert table.schema.field("f1").type == pa.list_(pa.field("element", pa.int64()))
    assert table.to_pylist() == [
        {"label": int(labels[i]), "dense_0": float(dense[i, 0]), "dense_1": float(dense[i, 1]),
         "f0": int(ids[i, 0]), "f1": [] if ids[i, 1] < 0 else [int(ids[i, 1])],
         "f2": int(ids[i, 2])} for i in [0, 1, 2, 3, 4, 0]]


def test_binary_bad_inputs(tmp_path):
    out = tmp_path / "o.parquet"
    with pytest.raises(DataFormatError, match="nope.bin: no such file"):
        binary_to_parquet(tmp_path / "nope.bin", out)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataFormatError, match="empty.bin: the file is empty"):
        binary_to_parquet(tmp_path / "empty.bin", out)
    (tmp_path / "text.bin").write_bytes(b"not binary at all" * 8)
    with pytest.raises(DataFormatError, match="text.bin: not a neocomm binary data file"):
        binary_to_parquet(tmp_path / "text.bin", out)
    assert only_files(tmp_path) == ["empty.bin", "text.bin"]


# ---------------------------------------------------------------------------- command line


def test_command_line_routes(tmp_path, capsys):
    rng = np.random.default_rng(3)
    rows = [criteo_line(rng, i) for i in range(4)]
    write_criteo(tmp_path / "day_0", rows)
    assert neocomm_data(["convert", str(tmp_path / "day_0"), "-o",
                         str(tmp_path / "c.parquet")]) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote 4 records to {tmp_path / 'c.parquet'} (parquet: label, 13 dense, 26 sparse "
        "columns)")
    assert pq.read_table(tmp_path / "c.parquet").column("C3").to_pylist() == \
        [None if r[16] == "" else r[16] for r in rows]

    (tmp_path / "u.csv").write_text("id,items\n1,4|5\n2,6\n")
    assert neocomm_data(["convert", str(tmp_path / "u.csv"), "-o", str(tmp_path / "u.parquet"),
                         "--list-column", "items"]) == 0
    assert "wrote 2 records" in capsys.readouterr().out
    assert pq.read_table(tmp_path / "u.parquet").column("items").to_pylist() == [[4, 5], [6]]

    (tmp_path / "u.txt").write_text("1;2,3\n")   # --from overrides the suffix
    assert neocomm_data(["convert", str(tmp_path / "u.txt"), "-o", str(tmp_path / "v.parquet"),
                         "--from", "csv", "--no-header", "--list-column", "c0",
                         "--list-separator", ";"]) == 0
    capsys.readouterr()
    assert pq.read_table(tmp_path / "v.parquet").to_pylist() == [{"c0": [1, 2], "c1": 3}]

    assert neocomm_data(["convert", str(tmp_path / "day_0"), "-o", str(tmp_path / "c.bin"),
                         "--preset", "tiny"]) == 0
    assert "wrote 4 records" in capsys.readouterr().out
    assert neocomm_data(["convert", str(tmp_path / "c.bin"), "-o",
                         str(tmp_path / "b.parquet")]) == 0
    assert "label, 13 dense, 26 sparse columns" in capsys.readouterr().out
    assert pq.read_table(tmp_path / "b.parquet").num_rows == 4


@pytest.mark.parametrize("argv, message", [
    (["in.bin", "-o", "out.bin"], "cannot convert binary -> binary; supported: criteo -> "
                                  "parquet, csv -> parquet"),
    (["in.csv", "-o", "out.bin"], "cannot convert csv -> binary"),
    (["in.csv", "-o", "out.dat", "--to", "binary"], "cannot convert csv -> binary"),
    (["day_0", "-o", "o.parquet", "--preset", "tiny"], "--preset: only for criteo -> binary"),
    (["day_0", "-o", "o.parquet", "--list-column", "x"], "--list-column: only for csv/tsv"),
    (["a.csv", "b.tsv", "-o", "o.parquet"], "look like different formats"),
])
def test_command_line_refuses_bad_routes(tmp_path, capsys, argv, message):
    assert neocomm_data(["convert", *argv]) == 2
    assert message in capsys.readouterr().err


def test_command_line_bad_input_exits_1_without_temp_files(tmp_path, capsys):
    rng = np.random.default_rng(4)
    rows = [criteo_line(rng, i) for i in range(3)]
    rows[2][0] = "2"
    write_criteo(tmp_path / "day_0", rows)
    assert neocomm_data(["convert", str(tmp_path / "day_0"), "-o",
                         str(tmp_path / "o.parquet")]) == 1
    assert "day_0, line 3: label b'2' is not 0 or 1" in capsys.readouterr().err
    assert neocomm_data(["convert", str(tmp_path / "gone.csv"), "-o",
                         str(tmp_path / "o.parquet")]) == 1
    assert "gone.csv: no such file" in capsys.readouterr().err
    assert neocomm_data(["convert", str(tmp_path / "gone"), "-o", str(tmp_path / "o.bin")]) == 1
    assert "gone" in capsys.readouterr().err
    assert only_files(tmp_path) == ["day_0"]
