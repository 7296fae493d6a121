"""Int8 exports of checkpoints written by several ranks under any plan: every row exported
once, read back fused or dequantized, looked up by row or id; bad input named."""
from __future__ import annotations

import json

import numpy as np
import pytest

from embedding.checkpoint import CheckpointError, CheckpointWriter, Int8Export, quantize_rows
from embedding.checkpoint.reshard import shard_slice
from embedding.types import Shard, TableConfig
from embedding.train.export import export_int8
from neocomm.cli import main

ROWS, DIM = 11, 6


def _tables():
    return (TableConfig("rw", ROWS, DIM), TableConfig("cyc", ROWS, DIM),
            TableConfig("cw", ROWS, DIM), TableConfig("dyn", 8, DIM, dynamic=True))


def _write(root, full: dict, dyn_ids) -> str:
    """A 2-rank checkpoint as the trainer lays it out: ``rw`` row-wise (rows [0, 4) and
    [4, 11)), ``cyc`` cyclic (even rows, odd rows), ``cw`` column-wise (columns [0, 2) and
    [2, 6)), ``dyn`` dynamic with ids split between the ranks."""
    shards = {
        # Shard(rank, row_offset, num_rows, col_offset, num_cols, row_stride)
        "rw": [Shard(0, 0, 4, 0, DIM), Shard(1, 4, ROWS - 4, 0, DIM)],
        "cyc": [Shard(0, 0, 6, 0, DIM, 2), Shard(1, 1, 5, 0, DIM, 2)],
        "cw": [Shard(0, 0, ROWS, 0, 2), Shard(1, 0, ROWS, 2, DIM - 2)],
    }
    writers = [CheckpointWriter(root, 7, r, 2) for r in range(2)]
    for rank, w in enumerate(writers):
        arrays, slices = {}, {}
        for name, table_shards in shards.items():
            for i, s in enumerate(table_shards):
                if s.rank == rank:
                    key = f"emb/{name}/{i}/weight"
                    arrays[key] = np.ascontiguousarray(full[name][s.row_slice, s.col_slice])
                    slices[key] = shard_slice(name, "weight", s, (ROWS, DIM))
        mine = dyn_ids[rank::2]
        arrays.update({f"dyn/dyn/{rank}/ids": mine,
                       f"dyn/dyn/{rank}/weight": full["dyn"][mine],
                       f"dyn/dyn/{rank}/count": np.ones(len(mine), np.int64),
                       f"dyn/dyn/{rank}/last": np.ones(len(mine), np.int64),
                       f"dyn/dyn/{rank}/tick": np.array([3 + rank], np.int64)})
        w.write(arrays, slices)
    return str(writers[0].commit(tables=_tables(), state={"step": 7}))


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(5)
    full = {t.name: rng.standard_normal((ROWS, DIM)).astype(np.float32) for t in _tables()}
    full["dyn"] = rng.standard_normal((1000, DIM)).astype(np.float32)  # row = id
    dyn_ids = np.array([3, 17, 42, 99, 512, 900], np.int64)
    return _write(tmp_path / "ckpt", full, dyn_ids), full, dyn_ids


def test_every_table_of_any_plan_is_exported_whole(checkpoint, tmp_path):
    path, full, dyn_ids = checkpoint
    out = export_int8(path, tmp_path / "int8")
    assert out.name == "step-000000000007"
    ex = Int8Export(tmp_path / "int8")  # the root: its newest export
    assert ex.path == out and ex.step == 7 and ex.format == "fused8bit_rowwise"
    assert sorted(ex.tables) == ["cw", "cyc", "dyn", "rw"]
    for name in ("rw", "cyc", "cw"):
        assert ex.ids(name) is None and ex.tables[name].rows == ROWS
        assert np.array_equal(ex.fused(name), quantize_rows(full[name]))
        assert ex.rows(name).shape == (ROWS, DIM)
    assert ex.tables["dyn"].dynamic and ex.tables["dyn"].rows == len(dyn_ids)
    assert np.array_equal(ex.ids("dyn"), dyn_ids)
    assert np.array_equal(ex.fused("dyn"), quantize_rows(full["dyn"][dyn_ids]))
    assert ex.source["step"] == 7 and ex.source["world_size"] == 2
    # the export is a checkpoint: `neocomm checkpoint inspect` verifies every file
    assert main(["checkpoint", "inspect", str(out)]) == 0


def test_lookup_by_row_and_by_id(checkpoint, tmp_path):
    path, full, dyn_ids = checkpoint
    ex = Int8Export(export_int8(path, tmp_path / "int8", tables=["cyc", "dyn"]))
    assert sorted(ex.tables) == ["cyc", "dyn"]
    got = ex.lookup("cyc", np.array([[10, 0], [3, 3]]))
    assert got.shape == (2, 2, DIM) and got.dtype == np.float32
    assert np.array_equal(got[0, 0], ex.rows("cyc")[10])
    assert np.array_equal(ex.lookup("cyc", [1, 2], fused=True), ex.fused("cyc")[[1, 2]])
    step = (full["cyc"].max(axis=1) - full["cyc"].min(axis=1)) / 255
    assert (np.abs(ex.rows("cyc") - full["cyc"]) <= step[:, None] / 2 + 1e-6).all()
    # a dynamic table by id; an id without an entry reads as zeros
    got = ex.lookup("dyn", np.array([900, 5, 3]))
    assert np.array_equal(got[0], ex.rows("dyn")[-1]) and np.array_equal(got[2],
                                                                          ex.rows("dyn")[0])
    assert not got[1].any() and not ex.lookup("dyn", [5], fused=True).any()


def test_bad_input_names_the_value(checkpoint, tmp_path, capsys):
    path, _, _ = checkpoint
    with pytest.raises(ValueError, match=r"tables: no table 'nope' in checkpoint .*; it has "
                                         r"\['cw', 'cyc', 'dyn', 'rw'\]"):
        export_int8(path, tmp_path / "x", tables=["rw", "nope"])
    with pytest.raises(ValueError, match="format: unsupported row format 'int4'; supported: "
                                         "fused8bit_rowwise"):
        export_int8(path, tmp_path / "x", fmt="int4")
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        export_int8(tmp_path / "empty", tmp_path / "x")
    ex = Int8Export(export_int8(path, tmp_path / "int8", tables=["rw"]))
    with pytest.raises(ValueError, match=r"table: no table 'cw' in the export .*; it has "
                                         r"\['rw'\]"):
        ex.rows("cw")
    with pytest.raises(ValueError, match=r"ids: id 11 is not a row of table 'rw' \(rows 0 "
                                         r"to 10\)"):
        ex.lookup("rw", [0, 11])
    with pytest.raises(CheckpointError, match="is an int8 export already, not a training "
                                              "checkpoint"):
        export_int8(ex.path, tmp_path / "again")
    with pytest.raises(CheckpointError, match="not an int8 export"):
        Int8Export(path)
    # the command: 2 for bad arguments, 1 for a path that is no checkpoint, 0 written
    assert main(["checkpoint", "export", path, "--out", str(tmp_path / "c"),
                 "--tables", "nope"]) == 2
    assert "no table 'nope'" in capsys.readouterr().err
    assert main(["checkpoint", "export", path, "--out", str(tmp_path / "c"),
                 "--format", "fused4bit"]) == 2
    assert "unsupported row format 'fused4bit'" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "c")]) == 1
    assert "no checkpoint there" in capsys.readouterr().err
    assert main(["checkpoint", "export", path, "--out", str(tmp_path / "c"),
                 "--tables", "rw,dyn"]) == 0
    text = capsys.readouterr().out
    assert "rw" in text and f"6 x {DIM} (dynamic, float32" in text


def test_a_damaged_export_is_refused(checkpoint, tmp_path):
    path, _, _ = checkpoint
    out = export_int8(path, tmp_path / "int8", tables=["rw"])
    rec = next(f for f in json.loads((out / "manifest.json").read_text())["files"]
               if f["name"] == "int8/rw/rows")
    with open(out / rec["path"], "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CheckpointError, match="int8/rw/rows.*has checksum"):
        Int8Export(out).rows("rw")
