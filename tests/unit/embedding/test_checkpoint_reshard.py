"""Checkpoints written by a 4-rank plan, read back for 2- and 3-rank plans: every element."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.checkpoint import (CheckpointError, CheckpointWriter, TensorSlice, load_checkpoint,
                                  read_box, read_for_plan, shard_slice)
from embedding.types import Shard, ShardingPlan, ShardingType, TablePlan, TableConfig

ST = ShardingType
TABLES = {"t0": (10, 8), "t1": (7, 6), "t2": (5, 4), "t3": (6, 3), "t4": (9, 4)}
CONFIGS = [TableConfig(n, r, d) for n, (r, d) in TABLES.items()]


def full(name):
    r, d = TABLES[name]
    return {"weight": np.arange(r * d, dtype=np.float32).reshape(r, d) + 1000 * int(name[1]),
            "rowwise": np.arange(r, dtype=np.float32) * 10 + 0.5 + int(name[1])}


def tp(name, kind, *shards):
    return TablePlan(name, kind, tuple(Shard(*s) for s in shards))


def plan4():
    return ShardingPlan(4, 2, (
        tp("t0", ST.ROW_WISE, (0, 0, 3, 0, 8), (1, 3, 3, 0, 8), (2, 6, 2, 0, 8), (3, 8, 2, 0, 8)),
        tp("t1", ST.COLUMN_WISE, (1, 0, 7, 0, 2), (2, 0, 7, 2, 4)),
        tp("t2", ST.TABLE_WISE, (3, 0, 5, 0, 4)),
        tp("t3", ST.DATA_PARALLEL, *[(r, 0, 6, 0, 3) for r in range(4)]),
        tp("t4", ST.TABLE_ROW_WISE, (2, 0, 5, 0, 4), (3, 5, 4, 0, 4)),
    ))


def plan2():
    return ShardingPlan(2, 2, (
        tp("t0", ST.ROW_WISE, (0, 0, 5, 0, 4), (1, 0, 5, 4, 4), (1, 5, 5, 0, 8)),  # a grid
        tp("t1", ST.ROW_WISE, (0, 0, 4, 0, 6), (1, 4, 3, 0, 6)),
        tp("t2", ST.TABLE_WISE, (0, 0, 5, 0, 4)),
        tp("t3", ST.DATA_PARALLEL, (0, 0, 6, 0, 3), (1, 0, 6, 0, 3)),
        tp("t4", ST.ROW_WISE, (0, 0, 1, 0, 4), (1, 1, 8, 0, 4)),
    ))


def plan3():
    return ShardingPlan(3, 3, (
        tp("t0", ST.ROW_WISE, (0, 0, 4, 0, 8), (1, 4, 3, 0, 8), (2, 7, 3, 0, 8)),
        tp("t1", ST.COLUMN_WISE, (0, 0, 7, 0, 3), (2, 0, 7, 3, 3)),
        tp("t2", ST.ROW_WISE, (0, 0, 2, 0, 4), (1, 2, 2, 0, 4), (2, 4, 1, 0, 4)),
        tp("t3", ST.TABLE_WISE, (1, 0, 6, 0, 3)),
        tp("t4", ST.COLUMN_WISE, (0, 0, 9, 0, 1), (1, 0, 9, 1, 1), (2, 0, 9, 2, 2)),
    ))


def rank_arrays(plan, rank):
    arrays, slices = {}, {}
    for t in plan.tables:
        g = full(t.table)
        for i, s in enumerate(t.shards):
            if s.rank != rank:
                continue
            w = g["weight"][s.row_offset:s.row_offset + s.num_rows,
                            s.col_offset:s.col_offset + s.num_cols]
            arrays[f"emb/{t.table}/{i}/weight"] = w
            slices[f"emb/{t.table}/{i}/weight"] = shard_slice(t.table, "weight", s,
                                                              g["weight"].shape)
            arrays[f"emb/{t.table}/{i}/rowwise"] = g["rowwise"][s.row_offset:s.row_offset
                                                                + s.num_rows]
            slices[f"emb/{t.table}/{i}/rowwise"] = TensorSlice(t.table, "rowwise",
                                                               (s.row_offset,),
                                                               g["rowwise"].shape)
    if rank == 0:
        arrays["dense/params"] = np.linspace(0, 1, 20, dtype=np.float32)
    arrays["rng/key"] = np.array([rank, 7], np.uint64)
    return arrays, slices


def write_plan(root, plan, step=100):
    for r in range(plan.world_size):
        CheckpointWriter(root, step, r, plan.world_size).write(*rank_arrays(plan, r))
    return CheckpointWriter(root, step, 0, plan.world_size).commit(
        plan=plan, tables=CONFIGS, state={"data": {"epoch": 1, "batch": 17}, "seed": 3})


@pytest.mark.parametrize("target", [plan2, plan3, plan4], ids=["2 ranks", "3 ranks", "same"])
def test_reshard_loses_no_element(tmp_path, target):
    write_plan(tmp_path, plan4())
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 100 and ckpt.manifest.plan == plan4()
    target = target()
    rebuilt = {t: {k: np.full(v.shape, np.nan, np.float32) for k, v in full(t).items()}
               for t in TABLES}
    for rank in range(target.world_size):
        got = read_for_plan(ckpt, target, rank)
        for (table, tensor, i), arr in got.items():
            s = target.table(table).shards[i]
            assert s.rank == rank
            g = full(table)[tensor]
            if tensor == "weight":
                expect = g[s.row_offset:s.row_offset + s.num_rows,
                           s.col_offset:s.col_offset + s.num_cols]
                rebuilt[table][tensor][s.row_offset:s.row_offset + s.num_rows,
                                       s.col_offset:s.col_offset + s.num_cols] = arr
            else:
                expect = g[s.row_offset:s.row_offset + s.num_rows]
                rebuilt[table][tensor][s.row_offset:s.row_offset + s.num_rows] = arr
            np.testing.assert_array_equal(arr, expect)
    for table in TABLES:  # the target plan covers every row and column, and each came back
        for tensor, g in full(table).items():
            np.testing.assert_array_equal(rebuilt[table][tensor], g)
    assert ckpt.read_array("dense/params").shape == (20,)
    assert ckpt.read_array("rng/key", rank=3).tolist() == [3, 7]
    assert ckpt.read_array("rng/key").tolist() == [0, 7]  # lowest rank by default


def test_read_box_spanning_files_and_limits(tmp_path):
    write_plan(tmp_path, plan4())
    ckpt = load_checkpoint(tmp_path)
    box = read_box(ckpt, "t0", "weight", (2, 1), (7, 5))  # rows 2..8 from ranks 0, 1, 2, 3
    np.testing.assert_array_equal(box, full("t0")["weight"][2:9, 1:6])
    np.testing.assert_array_equal(read_box(ckpt, "t1", "weight", (3, 1), (2, 3)),
                                  full("t1")["weight"][3:5, 1:4])
    assert read_box(ckpt, "t0", "weight", (0, 0), (0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match="outside"):
        read_box(ckpt, "t0", "weight", (8, 0), (3, 8))
    with pytest.raises(KeyError):
        read_box(ckpt, "t9", "weight", (0, 0), (1, 1))
    with pytest.raises(CheckpointError, match="tensors"):
        read_for_plan(ckpt, plan2(), 0, tensors=("weight", "exp_avg"))
    only_weights = read_for_plan(ckpt, plan2(), 1, tensors=("weight",))
    assert {k[1] for k in only_weights} == {"weight"}
    with pytest.raises(ValueError, match="rank"):
        read_for_plan(ckpt, plan2(), 2)


def test_a_region_no_file_holds_is_refused(tmp_path):
    plan = plan4()
    for r in range(4):
        arrays, slices = rank_arrays(plan, r)
        if r == 2:  # rank 2 lost its t0 rows [6, 8)
            for k in [k for k in arrays if k.startswith("emb/t0/")]:
                arrays.pop(k), slices.pop(k)
        CheckpointWriter(tmp_path, 5, r, 4).write(arrays, slices)
    CheckpointWriter(tmp_path, 5, 0, 4).commit(plan=plan, tables=CONFIGS)
    ckpt = load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"t0/weight: elements \[6, 7\) x \[0, 8\) are in "
                                              r"no file"):
        read_for_plan(ckpt, plan3(), 1)
    read_for_plan(ckpt, plan3(), 0)  # rows [0, 4) are all there
