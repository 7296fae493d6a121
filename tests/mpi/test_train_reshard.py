"""A trainer checkpoint loads onto half the ranks and another plan, and back, losing no row.

    mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_train_reshard.py

At 4 ranks: written by 4, loaded by 2 ranks under a plan that mixes
row-wise, column-wise, data-parallel and table-wise tables, written again
by those 2, loaded back by 4: every weight and optimizer state is bitwise
what the 4 ranks had. At any size: written cyclic row-wise, loaded under
contiguous row-wise and table-wise tables, written again and loaded back
cyclic, bitwise too. And written with every table packed into one, loaded
unpacked, written again and loaded packed under another sharding, bitwise.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from embedding.checkpoint import load_checkpoint, read_box
from embedding.train import Trainer, parse_config
from embedding.packing import row_offsets
from embedding.types import (PackedTable, PackMember, Shard, ShardingPlan, ShardingType,
                             TablePlan, cyclic_shards)

pytestmark = pytest.mark.training

ROWS = (50, 70, 30, 200)
DIM = 8


def small_config(out, **sections):
    doc = {"tables": {"rows": list(ROWS)},
           "model": {"embedding_dim": DIM, "bottom_mlp": [16, DIM], "top_mlp": [16, 1]},
           "data": {"records": 4800, "eval_records": 96},
           "train": {"steps": 5, "batch_size": 48, "eval_every": 0, "log_every": 5},
           "sparse_optimizer": {"kind": "adam", "lr": 0.01},
           "output": {"dir": str(out)}}
    for name, body in sections.items():
        doc.setdefault(name, {}).update(body)
    return parse_config(doc, "test")


def mixed_plan(size: int) -> ShardingPlan:
    """f0 row-wise over every rank, f1 in two column slices, f2 replicated, f3 on the last rank."""
    cuts = np.linspace(0, ROWS[0], size + 1).round().astype(int)
    rw = TablePlan("f0", ShardingType.ROW_WISE, tuple(
        Shard(r, int(cuts[r]), int(cuts[r + 1] - cuts[r]), 0, DIM) for r in range(size)))
    cw = TablePlan("f1", ShardingType.COLUMN_WISE, (
        Shard(0, 0, ROWS[1], 0, DIM // 2), Shard(size - 1, 0, ROWS[1], DIM // 2, DIM // 2)))
    dp = TablePlan("f2", ShardingType.DATA_PARALLEL,
                   tuple(Shard(r, 0, ROWS[2], 0, DIM) for r in range(size)))
    tw = TablePlan("f3", ShardingType.TABLE_WISE, (Shard(size - 1, 0, ROWS[3], 0, DIM),))
    return ShardingPlan(size, size, (rw, cw, dp, tw))


def state_of(t) -> dict:
    out = {"dense": t.model.flat_params.copy()}
    for k, v in t.optimizer.state_dict().items():
        out[f"dense_opt/{k}"] = np.asarray(v).copy()
    for s in t.coll.local_shards():
        key = f"{s.table}/{s.shard.row_offset}/{s.shard.col_offset}"
        out[key] = np.array(s.weight)
        for name in s.tables.state:
            out[f"{key}/{name}"] = np.array(s.tables.state_view(s.index, name))
    return out


def test_checkpoint_moves_to_half_the_ranks_and_back(world, tmp_path, all_ranks):
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    full = Trainer(small_config(f"{base}/full"), world.world)
    full.train()
    full.close()
    written = f"{base}/full/checkpoints/step-000000000005"
    half_size = max(1, world.size // 2)
    plan_file = f"{base}/half-plan.json"
    if world.rank == 0:
        with open(plan_file, "w") as fh:
            fh.write(mixed_plan(half_size).to_json())
    world.comm.Barrier()
    sub = world.world.split(list(range(half_size)), name="half")
    ok, checked = True, 0
    if sub is not None:
        half = Trainer(small_config(f"{base}/half", plan={"file": plan_file},
                                    checkpoint={"dir": f"{base}/half/checkpoints"}), sub)
        half.resume(written)
        ckpt = load_checkpoint(written)
        for s in half.coll.local_shards():
            sh = s.shard
            want = read_box(ckpt, s.table, "weight", (sh.row_offset, sh.col_offset),
                            (sh.num_rows, sh.num_cols))
            ok &= np.array_equal(np.asarray(s.weight), want)
            for name in s.tables.state:
                view = s.tables.state_view(s.index, name)
                off = (sh.row_offset,) if view.ndim == 1 else (sh.row_offset, sh.col_offset)
                ok &= np.array_equal(view, read_box(ckpt, s.table, name, off, view.shape))
            checked += int(s.weight.size)
        ok &= np.array_equal(half.model.flat_params, full.model.flat_params)
        ok &= half.step == 5
        half.save()
        half.close()
    all_ranks(ok, "the half-size trainer does not hold the checkpoint's values")
    total = world.comm.allreduce(checked)
    # Column slices and data-parallel replicas count once per holder.
    want = ROWS[0] * DIM + ROWS[1] * DIM + ROWS[2] * DIM * half_size + ROWS[3] * DIM
    all_ranks(total == want, f"checked {total} weights, expected {want}")
    with open(f"{base}/half/checkpoints/step-000000000005/manifest.json") as fh:
        manifest = json.load(fh)
    all_ranks(manifest["world_size"] == half_size, f"{manifest['world_size']}")
    back = Trainer(small_config(f"{base}/back", checkpoint={"dir": f"{base}/half/checkpoints"}),
                   world.world)
    back.resume("latest")
    a, b = state_of(full), state_of(back)
    diff = sorted(k for k in a if k not in b or not np.array_equal(a[k], b[k]))
    all_ranks(not diff, f"after 4 -> half -> back: differs in {diff}")
    back.close()


def cyclic_plan(size: int, per_node: int) -> ShardingPlan:
    return ShardingPlan(size, per_node, tuple(
        TablePlan(f"f{i}", ShardingType.CYCLIC_ROW_WISE, cyclic_shards(rows, DIM, size))
        for i, rows in enumerate(ROWS)))


def contiguous_plan(size: int, per_node: int) -> ShardingPlan:
    """f0 and f3 in contiguous row blocks (uneven), f1 and f2 whole on one rank each."""
    out = []
    for i, rows in enumerate(ROWS):
        if i in (1, 2):
            out.append(TablePlan(f"f{i}", ShardingType.TABLE_WISE,
                                 (Shard((i + 1) % size, 0, rows, 0, DIM),)))
            continue
        w = np.arange(1, size + 1)
        cuts = np.r_[0, np.cumsum(w) * rows // w.sum()]
        out.append(TablePlan(f"f{i}", ShardingType.ROW_WISE, tuple(
            Shard(r, int(cuts[r]), int(cuts[r + 1] - cuts[r]), 0, DIM) for r in range(size))))
    return ShardingPlan(size, per_node, tuple(out))


def _member_parts(plan, s):
    """``(table, local rows, table shard)`` of a local shard (a packed one's per member)."""
    pack = next((p for p in plan.packs if p.name == s.table), None)
    if pack is None:
        return [(s.table, slice(None), s.shard)]
    return [(m.table, local, sub) for m, local, sub in pack.parts(s.shard)]


def whole_state(t, world) -> dict:
    """Every table's weights and sparse optimizer state, whole, and the dense state;
    ``covered`` is False when the shards leave an element of a table out."""
    mine = [(table, sh, {"weight": np.array(s.weight[local]),
                         **{n: np.array(s.tables.state_view(s.index, n)[local])
                            for n in s.tables.state}})
            for s in t.coll.local_shards() for table, local, sh in _member_parts(t.coll.plan, s)]
    out = {"dense": t.model.flat_params.copy(), "step": np.array(t.step)}
    for k, v in t.optimizer.state_dict().items():
        out[f"dense_opt/{k}"] = np.asarray(v).copy()
    seen = {}
    for part in world.comm.allgather(mine):
        for table, sh, arrays in part:
            for name, a in arrays.items():
                key = f"{table}/{name}"
                if key not in out:
                    rows = dict(zip(("f0", "f1", "f2", "f3"), ROWS))[table]
                    out[key] = np.zeros((rows,) + a.shape[1:], a.dtype)
                    seen[key] = np.zeros(out[key].shape, bool)
                index = (sh.row_slice, sh.col_slice) if a.ndim == 2 else sh.row_slice
                out[key][index] = a
                seen[key][index] = True
    out["covered"] = np.array(all(m.all() for m in seen.values()) and len(seen) >= 4)
    return out


def _plan_file(world, path: str, plan: ShardingPlan) -> str:
    if world.rank == 0:
        with open(path, "w") as fh:
            fh.write(plan.to_json())
    world.comm.Barrier()
    return path


def test_cyclic_checkpoint_resumes_contiguous_and_back(world, tmp_path, all_ranks):
    """Trained and saved cyclic row-wise, resumed under contiguous row-wise and table-wise
    tables, saved again and resumed cyclic: the tables, their optimizer state and the
    dense model are bitwise the first run's at every hop."""
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    per_node = len(world.world.nodes[0])
    cyc = _plan_file(world, f"{base}/cyclic.json", cyclic_plan(world.size, per_node))
    rw = _plan_file(world, f"{base}/contiguous.json", contiguous_plan(world.size, per_node))
    first = Trainer(small_config(f"{base}/cyc", plan={"file": cyc}), world.world)
    first.train()
    first.close()
    all_ranks({p.sharding for p in first.coll.plan.tables} == {ShardingType.CYCLIC_ROW_WISE},
              "the first run is not cyclic")
    want = whole_state(first, world)
    all_ranks(bool(want["covered"]), "the cyclic shards do not cover the tables")
    with open(f"{base}/cyc/checkpoints/step-000000000005/manifest.json") as fh:
        manifest = json.load(fh)
    all_ranks(manifest["version"] == (2 if world.size > 1 else 1), f"{manifest['version']}")
    hops = [("contiguous", rw, f"{base}/cyc/checkpoints/step-000000000005"),
            ("cyclic again", cyc, None)]
    for i, (what, plan_file, source) in enumerate(hops):
        t = Trainer(small_config(f"{base}/hop{i}", plan={"file": plan_file},
                                 checkpoint={"dir": f"{base}/hop{i}/checkpoints"}),
                    world.world)
        t.resume(source or f"{base}/hop{i - 1}/checkpoints/step-000000000005")
        got = whole_state(t, world)
        diff = sorted(k for k in want if k not in got or not np.array_equal(want[k], got[k]))
        all_ranks(not diff and t.step == 5, f"resumed {what}: differs in {diff}")
        t.save()
        t.close()


def packed_plan(size: int, per_node: int, sharding: ShardingType) -> ShardingPlan:
    """Every table packed into ``all`` (350 rows), cyclic or in even row blocks."""
    pack = PackedTable("all", tuple(PackMember(f"f{i}", o, r) for i, (o, r) in
                                    enumerate(zip(row_offsets(ROWS), ROWS))))
    n = sum(ROWS)
    if sharding is ShardingType.CYCLIC_ROW_WISE:
        shards = cyclic_shards(n, DIM, size)
    else:
        cuts = np.linspace(0, n, size + 1).round().astype(int)
        shards = tuple(Shard(r, int(cuts[r]), int(cuts[r + 1] - cuts[r]), 0, DIM)
                       for r in range(size))
    return ShardingPlan(size, per_node, (TablePlan("all", sharding, shards),), (pack,))


def test_packed_checkpoint_resumes_unpacked_and_back(world, tmp_path, all_ranks):
    """Trained and saved with every table packed (cyclic row-wise), resumed unpacked
    (contiguous row-wise and table-wise), saved again and resumed packed in row blocks:
    the tables, their optimizer state and the dense model are bitwise the first run's at
    every hop, and the first checkpoint's manifest records the packing."""
    base = world.comm.bcast(str(tmp_path) if world.rank == 0 else None, root=0)
    per_node = len(world.world.nodes[0])
    packed = _plan_file(world, f"{base}/packed.json",
                        packed_plan(world.size, per_node, ShardingType.CYCLIC_ROW_WISE))
    plain = _plan_file(world, f"{base}/plain.json", contiguous_plan(world.size, per_node))
    blocks = _plan_file(world, f"{base}/blocks.json",
                        packed_plan(world.size, per_node, ShardingType.ROW_WISE))
    first = Trainer(small_config(f"{base}/packed", plan={"file": packed}), world.world)
    first.train()
    first.close()
    all_ranks([p.table for p in first.coll.plan.tables] == ["all"], "the first run is packed")
    want = whole_state(first, world)
    all_ranks(bool(want["covered"]), "the packed shards do not cover the tables")
    with open(f"{base}/packed/checkpoints/step-000000000005/manifest.json") as fh:
        manifest = json.load(fh)
    all_ranks([p["name"] for p in manifest["plan"]["packs"]] == ["all"]
              and sorted(t["name"] for t in manifest["tables"]) == ["f0", "f1", "f2", "f3"],
              "the manifest does not record the packing")
    hops = [("unpacked", plain, f"{base}/packed/checkpoints/step-000000000005"),
            ("packed again", blocks, None)]
    for i, (what, plan_file, source) in enumerate(hops):
        t = Trainer(small_config(f"{base}/phop{i}", plan={"file": plan_file},
                                 checkpoint={"dir": f"{base}/phop{i}/checkpoints"}),
                    world.world)
        t.resume(source or f"{base}/phop{i - 1}/checkpoints/step-000000000005")
        got = whole_state(t, world)
        diff = sorted(k for k in want if k not in got or not np.array_equal(want[k], got[k]))
        all_ranks(not diff and t.step == 5, f"resumed {what}: differs in {diff}")
        t.save()
        t.close()
