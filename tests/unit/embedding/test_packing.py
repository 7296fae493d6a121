"""Table packing in one process: the plan's packed tables and their JSON, their validation,
how a packed shard splits over its members, the planner's packing rule, member ids moved
into the packed table, and one-rank collections that train packed exactly as unpacked."""
from __future__ import annotations

import json

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.packing import choose_packs, packed_tables, row_offsets
from embedding.types import (IdPolicy, OptimizerConfig, OptimizerKind, PackedTable, PackMember,
                             Pooling, Shard, ShardingPlan, ShardingType, TableConfig, TablePlan,
                             cyclic_shards)

ST = ShardingType
OPT = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)


def _tables(n=5, dim=4, rows=(7, 3, 11, 1, 9)):
    return [TableConfig(f"t{i}", rows[i % len(rows)], dim, optimizer=OPT) for i in range(n)]


def _pack(tables, name="p"):
    return PackedTable(name, tuple(PackMember(t.name, o, t.num_rows) for t, o in
                                   zip(tables, row_offsets([t.num_rows for t in tables]))))


def _shards(st, rows, dim, size=1):
    if st is ST.CYCLIC_ROW_WISE:
        return cyclic_shards(rows, dim, size)
    return (Shard(0, 0, rows, 0, dim),)


def _plan(tables, st, packs=()):
    phys = packed_tables(tables, ShardingPlan(1, 1, tuple(
        TablePlan(t.name, st, _shards(st, t.num_rows, t.dim)) for t in tables
        if not any(t.name in p.tables for p in packs)) + tuple(
        TablePlan(p.name, st, _shards(st, p.num_rows, tables[0].dim)) for p in packs), packs))
    return ShardingPlan(1, 1, tuple(TablePlan(t.name, st, _shards(st, t.num_rows, t.dim))
                                    for t in phys), packs)


# -- the plan -----------------------------------------------------------------------
def test_plan_json_round_trip_and_old_plans():
    tables = _tables()
    plan = _plan(tables, ST.ROW_WISE, (_pack(tables[1:4]),))
    back = ShardingPlan.from_json(plan.to_json())
    assert back == plan
    d = json.loads(plan.to_json())
    assert d["packs"] == [{"name": "p", "members": [
        {"table": "t1", "row_offset": 0, "num_rows": 3},
        {"table": "t2", "row_offset": 3, "num_rows": 11},
        {"table": "t3", "row_offset": 14, "num_rows": 1}]}]
    assert plan.pack_of("t2").name == "p" and plan.pack_of("t0") is None
    assert sorted(plan.logical_tables()) == [t.name for t in tables]
    plain = _plan(tables, ST.TABLE_WISE)
    assert "packs" not in json.loads(plain.to_json())  # reads as before packing existed
    old = json.loads(plain.to_json())
    assert ShardingPlan.from_json(json.dumps(old)).packs == ()


@pytest.mark.parametrize("members, match", [
    ((PackMember("a", 0, 2), PackMember("a", 2, 2)), "table 'a' is listed twice"),
    ((PackMember("a", 0, 2), PackMember("b", 3, 2)), "row_offset of member 'b'.*expected 2"),
    ((PackMember("a", 1, 2),), "row_offset of member .a.*expected 0 .*got 1"),
    ((PackMember("a", 0, 0),), "num_rows of member 'a'.*got 0"),
    ((), "at least one table")])
def test_packed_table_validation(members, match):
    with pytest.raises(ValueError, match=match):
        PackedTable("p", members)


def test_plan_validation_names_table():
    tp = TablePlan("p", ST.TABLE_WISE, (Shard(0, 0, 4, 0, 4),))
    a = PackedTable("p", (PackMember("a", 0, 2), PackMember("b", 2, 2)))
    with pytest.raises(ValueError, match="packed table 'q' has no entry"):
        ShardingPlan(1, 1, (tp,), (PackedTable("q", a.members),))
    with pytest.raises(ValueError, match="table 'a' is a member of packed tables 'p' and 'q'"):
        ShardingPlan(1, 1, (tp, TablePlan("q", ST.TABLE_WISE, (Shard(0, 0, 2, 0, 4),))),
                     (a, PackedTable("q", (PackMember("a", 0, 2),))))
    with pytest.raises(ValueError, match="table 'a' is a member of packed table 'p' and has a "
                                         "plan entry of its own"):
        ShardingPlan(1, 1, (tp, TablePlan("a", ST.TABLE_WISE, (Shard(0, 0, 2, 0, 4),))), (a,))


@pytest.mark.parametrize("change, match", [
    (dict(dim=8), "member 't2' of packed table 'p' has dim=8, member 't1' has 4"),
    (dict(dtype="float64"), "has dtype='float64'"),
    (dict(optimizer=OptimizerConfig(OptimizerKind.SGD)), "has optimizer="),
    (dict(pooling=Pooling.MEAN), "has pooling="),
    (dict(dynamic=True), "member 't2' of packed table 'p' is dynamic"),
    (dict(num_rows=12), "member 't2' of packed table 'p' has 12 rows, the plan records "
                        "num_rows=11")])
def test_members_must_agree(change, match):
    from dataclasses import replace

    tables = _tables()
    plan = _plan(tables, ST.TABLE_WISE, (_pack(tables[1:4]),))
    tables[2] = replace(tables[2], **change)
    with pytest.raises(ValueError, match=match):
        packed_tables(tables, plan)


def test_unknown_member_and_name_clash():
    tables = _tables()
    plan = _plan(tables, ST.TABLE_WISE, (_pack(tables[1:4]),))
    with pytest.raises(ValueError, match="member 't1' of packed table 'p' is not a table"):
        packed_tables([t for t in tables if t.name != "t1"], plan)
    clash = tables + [TableConfig("p", 3, 4)]
    with pytest.raises(ValueError, match="packed table 'p' has the name of a table"):
        packed_tables(clash, plan)


def test_packed_table_config():
    tables = [TableConfig("a", 3, 4, features=("a1", "a2"), optimizer=OPT),
              TableConfig("b", 5, 4, optimizer=OPT)]
    plan = _plan(tables, ST.ROW_WISE, (_pack(tables),))
    (p,) = packed_tables(tables, plan)
    assert (p.name, p.num_rows, p.dim, p.features, p.optimizer) == ("p", 8, 4,
                                                                     ("a1", "a2", "b"), OPT)


@pytest.mark.parametrize("rows, shards", [
    ((3, 4, 1, 9), [Shard(0, 0, 17, 0, 4)]),
    ((3, 4, 1, 9), [Shard(0, 0, 5, 0, 4), Shard(1, 5, 6, 0, 4), Shard(2, 11, 6, 0, 4)]),
    ((3, 4, 1, 9), list(cyclic_shards(17, 4, 3))),
    ((2, 2, 2), list(cyclic_shards(6, 4, 4))),
    ((5,), [Shard(0, 0, 5, 0, 2), Shard(1, 0, 5, 2, 2)])])
def test_parts_cover_every_member_row_once(rows, shards):
    """Each packed row of each shard lands in exactly one member part, at the member row
    the offsets give, and the local slices tile the shard."""
    p = PackedTable("p", tuple(PackMember(f"m{i}", o, r) for i, (o, r) in
                               enumerate(zip(row_offsets(rows), rows))))
    seen = {}
    for sh in shards:
        packed_rows = sh.rows()
        covered = []
        for m, local, sub in p.parts(sh):
            assert sub.row_stride == sh.row_stride and sub.col_slice == sh.col_slice
            np.testing.assert_array_equal(packed_rows[local] - m.row_offset, sub.rows())
            assert 0 <= sub.rows().min() and sub.rows().max() < m.num_rows
            covered += list(range(sh.num_rows))[local]
            for r in sub.rows():
                seen[(m.table, int(r), sh.col_offset)] = seen.get(
                    (m.table, int(r), sh.col_offset), 0) + 1
        assert covered == list(range(sh.num_rows))
    cols = {sh.col_offset for sh in shards}
    assert sorted(seen.values()) == [1] * (sum(rows) * len(cols))


# -- ids ------------------------------------------------------------------------------
def test_check_ids_moves_member_ids():
    kjt = KeyedJagged.from_lists({"a": [[0, 2], [1]], "b": [[4], []], "c": [[7, 1], [3]]})
    out = kjt.check_ids({"a": 3, "b": 5, "c": 5}, {"c": IdPolicy.MODULO}, {"a": 10, "c": 100})
    assert out.feature("a").bags() == [[10, 12], [11]]
    assert out.feature("b").bags() == [[4], []]
    assert out.feature("c").bags() == [[102, 101], [103]]
    assert kjt.feature("a").bags() == [[0, 2], [1]]  # the input is not changed
    with pytest.raises(ValueError, match="feature 'a': id 3 .* outside \\[0, 3\\)"):
        KeyedJagged.from_lists({"a": [[3]]}).check_ids({"a": 3}, None, {"a": 10})


# -- the planner's rule --------------------------------------------------------------------
def test_choose_packs():
    tables = [TableConfig("a", 10, 16), TableConfig("big", 1000, 16), TableConfig("b", 20, 16),
              TableConfig("c", 5, 8), TableConfig("d", 7, 8), TableConfig("e", 3, 32),
              TableConfig("f", 3, 16, optimizer=OPT), TableConfig("g", 4, 16, optimizer=OPT),
              TableConfig("h", 9, 16, dynamic=True), TableConfig("packed_d8", 2, 4)]
    packs = choose_packs(tables, 100)
    assert [(p.name, p.tables) for p in packs] == [
        ("packed_d16", ("a", "b")), ("packed_d8_", ("c", "d")), ("packed_d16_2", ("f", "g"))]
    assert packs[0].members[1] == PackMember("b", 10, 20)
    assert [(p.name, p.tables) for p in choose_packs(tables, 100, keep=["b"])] == [
        ("packed_d8_", ("c", "d")), ("packed_d16", ("f", "g"))]
    assert [p.tables for p in choose_packs(tables, 2000)][0] == ("a", "big", "b")
    with pytest.raises(ValueError, match="max_rows: expected a row count >= 1, got 0"):
        choose_packs(tables, 0)


# -- the collection ---------------------------------------------------------------------
def _batch(rng, tables, b=6):
    return KeyedJagged.from_lists({f: [rng.integers(0, t.num_rows, rng.integers(0, 4)).tolist()
                                       for _ in range(b)] for t in tables for f in t.features})


@pytest.mark.parametrize("st", [ST.TABLE_WISE, ST.ROW_WISE, ST.CYCLIC_ROW_WISE,
                                ST.DATA_PARALLEL, ST.COLUMN_WISE])
@pytest.mark.parametrize("kind", [OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM])
def test_packed_trains_like_unpacked(st, kind):
    """Same pooled output, same rows after every update, member by member, bit for bit."""
    opt = OptimizerConfig(kind, lr=0.05)
    tables = [TableConfig("a", 30, 8, features=("a", "a2"), optimizer=opt),
              TableConfig("b", 7, 8, optimizer=opt), TableConfig("c", 12, 4, optimizer=opt),
              TableConfig("d", 5, 8, optimizer=opt)]
    pack = _pack([tables[0], tables[1], tables[3]])
    colls = [ShardedEmbeddingCollection(tables, _plan(tables, st, packs), seed=5)
             for packs in ((), (pack,))]
    assert [t.name for t in colls[1].physical_tables] == ["p", "c"]
    for t in tables:
        np.testing.assert_array_equal(colls[0].gather_table(t.name),
                                      colls[1].gather_table(t.name))
    rng = np.random.default_rng(3)
    for _ in range(3):
        kjt = _batch(rng, tables)
        outs = [c.forward(kjt) for c in colls]
        np.testing.assert_array_equal(outs[0], outs[1])
        g = rng.standard_normal(outs[0].shape).astype(np.float32)
        for c in colls:
            c.backward(g)
    for t in tables:
        np.testing.assert_array_equal(colls[0].gather_table(t.name),
                                      colls[1].gather_table(t.name))
    w = rng.standard_normal((7, 8)).astype(np.float32)
    colls[1].load_table("b", w)
    np.testing.assert_array_equal(colls[1].gather_table("b"), w)
    for name in ("a", "d"):  # its neighbours in the packed table are untouched
        np.testing.assert_array_equal(colls[0].gather_table(name), colls[1].gather_table(name))


def test_counts_drop_to_one_store_per_dim():
    """Tables of one dim placed under three shardings take three kernel calls per lookup
    and per backward and a collective each; packed, they take what one table takes."""
    tables = _tables(6, dim=4)
    mixed = ShardingPlan(1, 1, tuple(TablePlan(t.name, st, _shards(st, t.num_rows, 4))
                                     for t, st in zip(tables, [ST.TABLE_WISE, ST.ROW_WISE,
                                                               ST.DATA_PARALLEL] * 2)))
    packed = _plan(tables, ST.ROW_WISE, (_pack(tables),))
    one = [TableConfig("one", 50, 4, features=tuple(t.name for t in tables), optimizer=OPT)]
    colls = {"mixed": ShardedEmbeddingCollection(tables, mixed),
             "packed": ShardedEmbeddingCollection(tables, packed),
             "one": ShardedEmbeddingCollection(one, _plan(one, ST.ROW_WISE))}
    rng = np.random.default_rng(0)
    counts = {}
    for key, c in colls.items():
        c.take_calls()
        for _ in range(2):
            out = c.forward(_batch(rng, tables))
            c.backward(np.ones_like(out))
        counts[key] = c.take_calls()
    assert counts["packed"] == counts["one"]
    assert counts["packed"]["kernels"] == 4  # a lookup and a fused backward per step
    assert counts["mixed"]["kernels"] > counts["packed"]["kernels"]
    assert counts["mixed"]["collectives"] > counts["packed"]["collectives"] > 0
    assert colls["packed"].take_calls() == {"kernels": 0, "collectives": 0}


def test_collection_refuses_bad_packs():
    tables = _tables(3)
    plan = _plan(tables, ST.TABLE_WISE, (_pack(tables[:2]),))
    with pytest.raises(ValueError, match=r"plan: expected one entry per table \['p'\], got "
                                         r"\['p', 't2'\]"):
        ShardedEmbeddingCollection(tables[:2], plan)
    from embedding.sharding.qcomm import QComms

    with pytest.raises(ValueError, match="qcomms: the members \\['t0', 't1'\\] of packed "
                                         "table 'p' have different settings"):
        ShardedEmbeddingCollection(tables, plan, qcomms={"t0": QComms(forward="fp16")})


# -- checkpoints ----------------------------------------------------------------------
def _save(coll, plan, path):
    from embedding.checkpoint import CheckpointWriter, load_checkpoint
    from embedding.train.state import shard_arrays

    arrays, slices = shard_arrays(coll, plan, 0)
    w = CheckpointWriter(path, step=1)
    w.write(arrays, slices)
    return load_checkpoint(w.commit(plan=plan, tables=coll.tables))


def _whole(ckpt, tables):
    from embedding.checkpoint import read_box

    out = {}
    for (table, tensor), (shape, _) in ckpt.tensors().items():
        out[(table, tensor)] = read_box(ckpt, table, tensor, (0,) * len(shape), shape)
    assert {t for t, _ in out} == {t.name for t in tables}
    return out


def test_checkpoint_packed_to_unpacked_and_back(tmp_path):
    """Written packed (cyclic row-wise), loaded unpacked (table-wise), written again and
    loaded packed (row-wise): every member's weights and optimizer state bitwise at every
    hop, and the loaded collections train on exactly as the first one."""
    from embedding.train.state import load_shards

    opt = OptimizerConfig(OptimizerKind.ADAM, lr=0.05)
    tables = [TableConfig("a", 30, 8, features=("a", "a2"), optimizer=opt),
              TableConfig("b", 7, 8, optimizer=opt), TableConfig("c", 12, 4, optimizer=opt)]
    pack = _pack([tables[0], tables[1]])
    plans = [_plan(tables, ST.CYCLIC_ROW_WISE, (pack,)), _plan(tables, ST.TABLE_WISE),
             _plan(tables, ST.ROW_WISE, (pack,))]
    first = ShardedEmbeddingCollection(tables, plans[0], seed=1)
    rng = np.random.default_rng(7)
    for _ in range(2):
        out = first.forward(_batch(rng, tables))
        first.backward(rng.standard_normal(out.shape).astype(np.float32))
    ckpt = _save(first, plans[0], tmp_path / "packed")
    assert [p.name for p in ckpt.manifest.plan.packs] == ["p"]  # the manifest records it
    assert {n.split("/")[2] for n in ckpt.names() if n.startswith("emb/a/")} == {"p.0"}
    want = _whole(ckpt, tables)
    colls = [first]
    for i, plan in enumerate(plans[1:]):
        coll = ShardedEmbeddingCollection(tables, plan, seed=99)
        ckpt.check_compatible(coll.tables)
        load_shards(ckpt, coll, plan, 0)
        ckpt = _save(coll, plan, tmp_path / f"hop{i}")
        got = _whole(ckpt, tables)
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
        colls.append(coll)
    kjt = _batch(rng, tables)
    outs = [c.forward(kjt) for c in colls]
    g = rng.standard_normal(outs[0].shape).astype(np.float32)
    for c, o in zip(colls, outs):
        np.testing.assert_array_equal(o, outs[0])
        c.backward(g)
    for t in tables:
        for c in colls[1:]:
            np.testing.assert_array_equal(c.gather_table(t.name), first.gather_table(t.name))


# -- the planner and its switches -------------------------------------------------------------
def _small_tables():
    return ([TableConfig(f"s{i}", 100 + 10 * i, 16) for i in range(12)]
            + [TableConfig(f"m{i}", 50 + i, 8) for i in range(4)]
            + [TableConfig("big", 500_000, 16)])


def test_planner_packs_small_tables():
    from embedding.planner import Hardware, Workload, plan_sharding, validate_plan

    tables = _small_tables()
    hw, wl = Hardware(2, 2, 1 << 30), Workload(batch_size=512)
    report = plan_sharding(tables, hw, wl, pack_rows=1000)
    plan = report.plan
    assert [(p.name, len(p.members)) for p in plan.packs] == [("packed_d16", 12),
                                                               ("packed_d8", 4)]
    assert sorted(t.table for t in plan.tables) == ["big", "packed_d16", "packed_d8"]
    validate_plan(plan, 2, ranks_per_node=2, tables=tables)
    assert sorted(plan.logical_tables()) == sorted(t.name for t in tables)
    assert plan_sharding(tables, hw, wl).plan.packs == ()  # off unless asked for
    from embedding.planner import PlanMismatchError

    with pytest.raises(PlanMismatchError, match="packed tables do not fit the model: packs: "
                                                "member 's0' of packed table 'packed_d16' has "
                                                "101 rows"):
        from dataclasses import replace

        validate_plan(plan, 2, tables=[replace(t, num_rows=101) if t.name == "s0" else t
                                       for t in tables])


def test_plan_command_pack_switch(capsys, tmp_path):
    from neocomm.cli import main

    path = tmp_path / "tables.toml"
    path.write_text("".join(f'[[tables]]\nname = "t{i}"\nnum_rows = {100 + i}\ndim = 16\n'
                            for i in range(8)))
    out_json = tmp_path / "plan.json"
    rc = main(["plan", str(path), "-n", "2", "--memory", "1GiB", "--batch-size", "256",
               "--pack", "--pack-rows", "200", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "packed 8 tables into 1: packed_d16 (8 tables, 828 rows)" in out
    plan = ShardingPlan.from_json(out_json.read_text())
    assert plan.packs[0].tables == tuple(f"t{i}" for i in range(8))
    rc = main(["plan", str(path), "-n", "2", "--memory", "1GiB", "--no-pack"])
    out, err = capsys.readouterr()
    assert rc == 0 and "packed" not in out
    with pytest.raises(SystemExit) as info:
        main(["plan", str(path), "-n", "2", "--pack-rows", "0"])
    assert info.value.code == 2
    assert "--pack-rows: expected a positive int, got '0'" in capsys.readouterr().err


def test_train_config_pack_keys(tmp_path):
    from embedding.train import ConfigError, parse_config

    cfg = parse_config({"plan": {"pack": True, "pack_rows": 5000}}, "t")
    assert (cfg.plan.pack, cfg.plan.pack_rows) == (True, 5000)
    assert parse_config({}, "t").plan.pack is False
    for doc, key in (({"plan": {"pack": "yes"}}, "plan.pack"),
                     ({"plan": {"pack_rows": 0}}, "plan.pack_rows")):
        with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
            parse_config(doc, "t")


def test_int8_export_loads_into_packed_tables(tmp_path):
    """An int8 export of a packed checkpoint sets the same rows in a packed and an unpacked
    collection: every member's dequantized rows."""
    from embedding.checkpoint.fused8bit import dequantize_rows
    from embedding.train.export import export_int8, load_export_weights

    tables = _tables(4, dim=8)
    pack = _pack(tables[:3])
    plans = [_plan(tables, ST.ROW_WISE, (pack,)), _plan(tables, ST.TABLE_WISE),
             _plan(tables, ST.CYCLIC_ROW_WISE, (pack,))]
    first = ShardedEmbeddingCollection(tables, plans[0], seed=3)
    ckpt = _save(first, plans[0], tmp_path / "ck")
    ex = export_int8(ckpt.path, tmp_path / "int8")
    from embedding.checkpoint.int8 import Int8Export

    rows = {t.name: dequantize_rows(Int8Export(ex).fused(t.name)) for t in tables}
    for plan in plans[1:]:
        coll = ShardedEmbeddingCollection(tables, plan, seed=8)
        assert sorted(load_export_weights(ex, ckpt, coll, plan)) == [t.name for t in tables]
        for t in tables:
            np.testing.assert_array_equal(coll.gather_table(t.name), rows[t.name])
