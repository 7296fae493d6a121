"""Checkpoints written by a 4-rank plan, read back for 2- and 3-rank plans: every element.

Also between contiguous and cyclic row-wise plans (strided slices), both ways.
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.checkpoint import (CheckpointError, CheckpointWriter, TensorSlice, load_checkpoint,
                                  read_box, read_for_plan, shard_slice)
from embedding.types import (Shard, ShardingPlan, ShardingType, TablePlan, TableConfig,
                             cyclic_shards)

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


def plan_cyclic(size):
    """Every table cyclic row-wise over ``size`` ranks."""
    return ShardingPlan(size, size, tuple(
        TablePlan(n, ST.CYCLIC_ROW_WISE, cyclic_shards(r, d, size))
        for n, (r, d) in TABLES.items()))


def plan_cyclic_mixed():
    """Three ranks: t0 and t4 cyclic, the others contiguous."""
    return ShardingPlan(3, 3, (
        TablePlan("t0", ST.CYCLIC_ROW_WISE, cyclic_shards(10, 8, 3)),
        tp("t1", ST.COLUMN_WISE, (0, 0, 7, 0, 3), (2, 0, 7, 3, 3)),
        tp("t2", ST.ROW_WISE, (0, 0, 2, 0, 4), (1, 2, 2, 0, 4), (2, 4, 1, 0, 4)),
        tp("t3", ST.TABLE_WISE, (1, 0, 6, 0, 3)),
        TablePlan("t4", ST.CYCLIC_ROW_WISE, cyclic_shards(9, 4, 3)),
    ))


def rank_arrays(plan, rank):
    arrays, slices = {}, {}
    for t in plan.tables:
        g = full(t.table)
        for i, s in enumerate(t.shards):
            if s.rank != rank or s.num_rows == 0:
                continue
            arrays[f"emb/{t.table}/{i}/weight"] = g["weight"][s.row_slice, s.col_slice]
            slices[f"emb/{t.table}/{i}/weight"] = shard_slice(t.table, "weight", s,
                                                              g["weight"].shape)
            arrays[f"emb/{t.table}/{i}/rowwise"] = g["rowwise"][s.row_slice]
            slices[f"emb/{t.table}/{i}/rowwise"] = shard_slice(t.table, "rowwise", s,
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


PAIRS = [(plan4, plan2), (plan4, plan3), (plan4, plan4),
         (plan4, lambda: plan_cyclic(2)), (plan4, lambda: plan_cyclic(3)),
         (lambda: plan_cyclic(4), plan4), (lambda: plan_cyclic(4), plan2),
         (lambda: plan_cyclic(4), plan3), (lambda: plan_cyclic(4), lambda: plan_cyclic(3)),
         (lambda: plan_cyclic(4), lambda: plan_cyclic(4)),
         (plan_cyclic_mixed, plan2), (plan2, plan_cyclic_mixed)]
PAIR_IDS = ["4 to 2 ranks", "4 to 3 ranks", "same", "to cyclic 2", "to cyclic 3",
            "cyclic 4 to 4", "cyclic 4 to 2", "cyclic 4 to 3", "cyclic 4 to cyclic 3",
            "cyclic same", "mixed cyclic to 2", "2 to mixed cyclic"]


@pytest.mark.parametrize("source, target", PAIRS, ids=PAIR_IDS)
def test_reshard_loses_no_element(tmp_path, source, target):
    write_plan(tmp_path, source())
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 100 and ckpt.manifest.plan == source()
    target = target()
    rebuilt = {t: {k: np.full(v.shape, np.nan, np.float32) for k, v in full(t).items()}
               for t in TABLES}
    for rank in range(target.world_size):
        got = read_for_plan(ckpt, target, rank)
        for (table, tensor, i), arr in got.items():
            s = target.table(table).shards[i]
            assert s.rank == rank
            g = full(table)[tensor]
            box = (s.row_slice, s.col_slice) if tensor == "weight" else (s.row_slice,)
            np.testing.assert_array_equal(arr, g[box])
            rebuilt[table][tensor][box] = arr
    for table in TABLES:  # the target plan covers every row and column, and each came back
        for tensor, g in full(table).items():
            np.testing.assert_array_equal(rebuilt[table][tensor], g)
    assert ckpt.read_array("dense/params").shape == (20,)
    last = ckpt.manifest.world_size - 1
    assert ckpt.read_array("rng/key", rank=last).tolist() == [last, 7]
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


def write_losing_t0(path, plan, lost: int = 2):
    """A checkpoint of ``plan`` on 4 ranks whose rank ``lost`` wrote none of table t0."""
    for r in range(4):
        arrays, slices = rank_arrays(plan, r)
        if r == lost:
            for k in [k for k in arrays if k.startswith("emb/t0/")]:
                arrays.pop(k), slices.pop(k)
        CheckpointWriter(path, 5, r, 4).write(arrays, slices)
    CheckpointWriter(path, 5, 0, 4).commit(plan=plan, tables=CONFIGS)
    return load_checkpoint(path)


def test_a_region_no_file_holds_is_refused(tmp_path):
    ckpt = write_losing_t0(tmp_path, plan4())  # rank 2's t0 rows are [6, 8)
    with pytest.raises(CheckpointError, match=r"t0/weight: elements \[6, 7\) x \[0, 8\) are in "
                                              r"no file"):
        read_for_plan(ckpt, plan3(), 1)
    read_for_plan(ckpt, plan3(), 0)  # rows [0, 4) are all there


def test_strided_slices_and_manifest_versions(tmp_path):
    """A strided slice round-trips through the manifest, which is version 2 then; a
    checkpoint without strides stays version 1 (readable by readers before strides)."""
    sl = shard_slice("t0", "weight", cyclic_shards(10, 8, 4)[1], (10, 8))
    assert sl.offset == (1, 0) and sl.stride == (4, 1) and sl.strided
    assert TensorSlice.from_dict(sl.to_dict()) == sl
    assert "stride" not in TensorSlice("t0", "weight", (3, 0), (10, 8)).to_dict()
    sl.check_shape((3, 8), "a")          # rows 1, 5, 9
    with pytest.raises(ValueError, match="stride"):
        sl.check_shape((4, 8), "a")      # row 13 is outside
    with pytest.raises(ValueError, match="stride"):
        TensorSlice("t0", "weight", (0, 0), (10, 8), (0, 1))
    write_plan(tmp_path / "cyc", plan_cyclic(4))
    write_plan(tmp_path / "box", plan4())
    assert load_checkpoint(tmp_path / "cyc").manifest.version == 2
    assert load_checkpoint(tmp_path / "box").manifest.version == 1


def test_strided_read_box(tmp_path):
    """read_box with a row stride, from contiguous and from cyclic files."""
    write_plan(tmp_path / "box", plan4())
    write_plan(tmp_path / "cyc", plan_cyclic(3))
    g = full("t0")["weight"]
    for where in ("box", "cyc"):
        ckpt = load_checkpoint(tmp_path / where)
        np.testing.assert_array_equal(read_box(ckpt, "t0", "weight", (1, 2), (3, 5), (4, 1)),
                                      g[1:10:4, 2:7])
        np.testing.assert_array_equal(read_box(ckpt, "t0", "weight", (0, 1), (4, 3), (3, 2)),
                                      g[0:10:3, 1:7:2])
        np.testing.assert_array_equal(read_box(ckpt, "t0", "rowwise", (2,), (4,), (2,)),
                                      full("t0")["rowwise"][2:10:2])
        with pytest.raises(ValueError, match="outside"):
            read_box(ckpt, "t0", "weight", (1, 0), (4, 8), (3, 1))   # row 10
        with pytest.raises(ValueError, match="stride"):
            read_box(ckpt, "t0", "weight", (1, 0), (1, 8), (0, 1))


def test_a_lost_cyclic_shard_is_refused(tmp_path):
    """Rank 2 of a cyclic checkpoint lost its t0 rows 2 and 6: a contiguous shard and a
    cyclic one that need them are refused with the rows named; the others load."""
    ckpt = write_losing_t0(tmp_path, plan_cyclic(4))
    with pytest.raises(CheckpointError, match=r"t0/weight: elements \[6, 7\) x \[0, 8\) are in "
                                              r"no file"):
        read_for_plan(ckpt, plan3(), 1)     # rows [4, 7)
    with pytest.raises(CheckpointError, match=r"t0/weight: elements \[2, 7\) step 4 x "
                                              r"\[0, 8\) are in no file"):
        read_for_plan(ckpt, plan_cyclic(2), 0)    # rows 0, 2, 4, 6, 8
    read_for_plan(ckpt, plan_cyclic(2), 1)  # odd rows are all there
