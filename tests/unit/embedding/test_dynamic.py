"""Dynamic tables in one process: the id → row hash map, the store against a fixed table,
the config checks, a one-rank collection and a checkpoint resume across shardings."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection, dynamic_initializer
from embedding.jagged import KeyedJagged
from embedding.kernels import Bags, FusedTables
from embedding.kernels.dynamic import DynamicTables
from embedding.kernels.idmap import EMPTY, TOMB, IdMap, probe_numpy
from embedding.optim import state_specs
from embedding.types import (Eviction, OptimizerConfig, OptimizerKind, Pooling, Shard,
                             ShardingPlan, ShardingType, TableConfig, TableMemory, TablePlan,
                             Tier, cyclic_shards)

ST = ShardingType


# -- the hash map ---------------------------------------------------------------------
def test_map_matches_a_dict_under_random_inserts():
    rng = np.random.default_rng(0)
    m = IdMap(400)
    ref: dict[int, int] = {}
    pool = rng.integers(-2**63 + 2, 2**63 - 1, 300)
    for _ in range(60):
        ids = rng.choice(pool, rng.integers(1, 20))
        got = m.acquire(ids)
        for i, r in zip(ids.tolist(), got.rows.tolist()):
            assert ref.setdefault(i, r) == r
        assert len(set(ref.values())) == len(ref) == m.size
    ids, rows = m.entries()
    assert ids.tolist() == sorted(ref) and rows.tolist() == [ref[i] for i in sorted(ref)]
    np.testing.assert_array_equal(m.find(ids), rows)
    absent = np.array([1, 2, 3], np.int64)
    absent = absent[~np.isin(absent, ids)]
    assert (m.find(absent) == -1).all()
    # the slots hold each live id once, on its probe path
    live = m.keys[(m.keys != EMPTY) & (m.keys != TOMB)]
    assert sorted(live.tolist()) == sorted(ref)
    found, _ = probe_numpy(m.keys, ids, m.mask)
    np.testing.assert_array_equal(m.slot_row[found], rows)


def test_map_grows_to_capacity_in_id_order_then_refuses_a_too_wide_batch():
    m = IdMap(5)
    got = m.acquire(np.array([30, 10, 20, 10]))
    assert got.rows.tolist() == [2, 0, 1, 0] and m.size == 3
    assert got.new_ids.tolist() == [10, 20, 30] and got.evicted_ids.size == 0
    m.acquire(np.array([50, 40]))
    assert m.size == 5 and m.row_id.tolist() == [10, 20, 30, 40, 50]
    with pytest.raises(ValueError, match="6 distinct ids of a table of capacity 5 rows"):
        m.acquire(np.arange(100, 106))
    with pytest.raises(ValueError, match="reserved"):
        m.acquire(np.array([int(EMPTY)]))


def test_eviction_by_count_drops_the_least_used_ties_to_the_smaller_id():
    m = IdMap(3, Eviction.COUNT)
    m.acquire(np.array([1, 1, 1, 2, 3, 3]))  # counts 1:3, 2:1, 3:2
    got = m.acquire(np.array([4]))
    assert got.evicted_ids.tolist() == [2] and got.rows.tolist() == [1]
    got = m.acquire(np.array([5, 1]))       # 4 (1 use) goes, 1 is read by the batch
    assert got.evicted_ids.tolist() == [4]
    m2 = IdMap(2, "count")
    m2.acquire(np.array([9, 7]))
    assert m2.acquire(np.array([8])).evicted_ids.tolist() == [7]  # tie: smaller id


def test_eviction_by_age_drops_the_least_recently_used():
    m = IdMap(3, Eviction.AGE)
    for ids in ([1, 2, 3], [1], [3], [1, 1, 1]):
        m.acquire(np.array(ids))
    got = m.acquire(np.array([4, 5]))        # 2 (tick 1), then 3 (tick 3)
    assert got.evicted_ids.tolist() == [2, 3]
    assert sorted(m.entries()[0].tolist()) == [1, 4, 5]
    # many evictions leave tombstones; the slots are rebuilt and lookups stay right
    for k in range(200):
        m.acquire(np.array([100 + k]))
    ids, rows = m.entries()
    assert ids.tolist() == [1, 298, 299] or len(ids) == 3
    np.testing.assert_array_equal(m.find(ids), rows)


# -- the store against a fixed table ------------------------------------------------------
def _bags(ids_per_bag, dims, batch):
    lengths = [len(b) for b in ids_per_bag]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    idx = np.concatenate([np.asarray(b, np.int64) for b in ids_per_bag])
    return Bags(idx, offsets, (0,), (0,), (False,), batch, dims[0], 1, None)


@pytest.mark.parametrize("kind", list(OptimizerKind))
@pytest.mark.parametrize("fused", [True, False], ids=["backward_update", "aggregate+update"])
def test_store_trains_like_a_fixed_table_holding_the_same_ids(kind, fused):
    rng = np.random.default_rng(1)
    cap, dim, batch = 40, 8, 6
    opt = OptimizerConfig(kind, lr=0.05)
    table = TableConfig("d", cap, dim, dynamic=True, optimizer=opt)
    init = dynamic_initializer(table, seed=3)
    dyn = DynamicTables([cap], [dim], opt, [Eviction.COUNT], names=["d"])
    dyn.set_initializer(0, init)
    vocab = rng.integers(-2**40, 2**40, 30)
    # the fixed table: row r holds vocab id r, with the weights the dynamic table gives it
    fixed = FusedTables([cap], [dim], opt, names=["d"])
    fixed.weight(0)[:30] = init(vocab).astype(np.float32)
    row_of = {int(v): r for r, v in enumerate(vocab)}
    for _ in range(5):
        bag_ids = [rng.choice(vocab, rng.integers(0, 5)).tolist() for _ in range(batch)]
        d_bags = _bags(bag_ids, [dim], batch)
        f_bags = _bags([[row_of[i] for i in b] for b in bag_ids], [dim], batch)
        out = [dyn.lookup(d_bags), fixed.lookup(f_bags)]
        np.testing.assert_array_equal(out[0], out[1])
        g = rng.standard_normal(out[0].shape).astype(np.float32)
        if fused:
            dyn.backward_update(d_bags, g)
            fixed.backward_update(f_bags, g)
        else:
            (ids, gd), = dyn.aggregate(d_bags, g)
            (rows, gf), = fixed.aggregate(f_bags, g)
            assert np.all(np.diff(ids) > 0)
            order = np.argsort(vocab[rows], kind="stable")
            np.testing.assert_array_equal(ids, vocab[rows][order])
            np.testing.assert_array_equal(gd, gf[order])
            dyn.update([(ids, gd)])
            fixed.update([(rows, gf)])
    ids, rows = dyn.export(0)
    frows = np.array([row_of[i] for i in ids.tolist()])
    np.testing.assert_array_equal(dyn.weight(0)[rows], fixed.weight(0)[frows])
    for spec in state_specs(kind):
        np.testing.assert_array_equal(dyn.state_view(0, spec.name)[rows],
                                      fixed.state_view(0, spec.name)[frows])


def test_an_evicted_row_restarts_for_its_new_id():
    opt = OptimizerConfig(OptimizerKind.ADAM, lr=0.1)
    table = TableConfig("d", 2, 4, dynamic=True, optimizer=opt)
    dyn = DynamicTables([2], [4], opt, [Eviction.AGE], names=["d"])
    dyn.set_initializer(0, dynamic_initializer(table))
    for ids in ([5, 6], [6]):
        bags = _bags([ids], [4], 1)
        dyn.lookup(bags)
        dyn.backward_update(bags, np.ones((1, 4), np.float32))
    dyn.lookup(_bags([[7]], [4], 1))               # evicts 5 (oldest)
    ids, rows = dyn.export(0)
    assert ids.tolist() == [6, 7]
    r7 = rows[1]
    np.testing.assert_array_equal(dyn.weight(0)[r7],
                                  dynamic_initializer(table)(np.array([7]))[0]
                                  .astype(np.float32))
    for spec in state_specs(OptimizerKind.ADAM):
        assert not np.any(dyn.state_view(0, spec.name)[r7])
    with pytest.raises(ValueError, match=r"ids of d: \[5\] are not in the table"):
        dyn.backward_update(_bags([[5]], [4], 1), np.ones((1, 4), np.float32))


# -- config and plan checks -----------------------------------------------------------------
def test_bad_dynamic_settings_name_the_table_and_the_value():
    with pytest.raises(ValueError, match=r"eviction of table 'd': .* got 'lru'"):
        TableConfig("d", 10, 4, dynamic=True, eviction="lru")
    with pytest.raises(ValueError, match=r"num_rows of dynamic table 'd': .*capacity >= 1 "
                                         r"rows, got 0"):
        TableConfig("d", 0, 4, dynamic=True)
    t = TableConfig("d", 10, 4, dynamic=True)
    assert TableConfig.from_dict(t.to_dict()) == t
    assert "dynamic" not in TableConfig("f", 10, 4).to_dict()
    full = (Shard(0, 0, 10, 0, 4),)
    cases = [(TablePlan("d", ST.ROW_WISE, full), r"sharding of table 'd': .* got 'row_wise'"),
             (TablePlan("d", ST.TABLE_WISE, full, TableMemory(Tier.HOST)),
              r"tier of table 'd': .* got 'host'")]
    for tp, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ShardedEmbeddingCollection([t], ShardingPlan(1, 1, (tp,)))


# -- the collection and checkpoints --------------------------------------------------------
def _tables(dynamic: bool, kind=OptimizerKind.ROWWISE_ADAGRAD):
    opt = OptimizerConfig(kind, lr=0.05)
    return [TableConfig("a", 30, 8, Pooling.SUM, ("a", "a2"), optimizer=opt, dynamic=dynamic),
            TableConfig("b", 7, 4, Pooling.MEAN, optimizer=opt)]


def _plan(tables, st, size=1):
    return ShardingPlan(size, size, tuple(
        TablePlan(t.name, st if t.dynamic else ST.TABLE_WISE,
                  cyclic_shards(t.num_rows, t.dim, size) if st is ST.CYCLIC_ROW_WISE
                  and t.dynamic else (Shard(0, 0, t.num_rows, 0, t.dim),))
        for t in tables))


def _kjts(seed, n, big=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = [rng.integers(0, 30, rng.integers(0, 4)).tolist() for _ in range(6)]
        if big:
            a = [[x * 7919 - 2**50 for x in b] for b in a]
        out.append(KeyedJagged.from_lists({
            "a": a, "a2": [rng.integers(0, 30, 1 if big else 2).tolist() for _ in range(6)],
            "b": [rng.integers(0, 7, rng.integers(0, 3)).tolist() for _ in range(6)]}))
    return out


@pytest.mark.parametrize("st", [ST.TABLE_WISE, ST.CYCLIC_ROW_WISE])
def test_one_rank_dynamic_collection_equals_a_fixed_table(st):
    """Ids in [0, 30) read by a dynamic table of capacity 30 train as rows of a fixed one:
    a new id starts with the weights a fixed table gives that row."""
    colls = [ShardedEmbeddingCollection(t, _plan(t, st), seed=5)
             for t in (_tables(True), _tables(False))]
    rng = np.random.default_rng(2)
    for kjt in _kjts(4, 4):
        outs = [c.forward(kjt) for c in colls]
        np.testing.assert_array_equal(outs[0], outs[1])
        g = rng.standard_normal(outs[0].shape).astype(np.float32)
        for c in colls:
            c.backward(g)
    store, = colls[0].dynamic_stores()
    ids, rows = store.export(0)
    np.testing.assert_array_equal(store.weight(0)[rows], colls[1].gather_table("a")[ids])
    with pytest.raises(ValueError, match="table 'a' is dynamic"):
        colls[0].gather_table("a")


@pytest.mark.parametrize("first, second", [(ST.TABLE_WISE, ST.TABLE_WISE),
                                           (ST.TABLE_WISE, ST.CYCLIC_ROW_WISE),
                                           (ST.CYCLIC_ROW_WISE, ST.TABLE_WISE)])
def test_checkpoint_resume_is_bitwise_across_shardings(tmp_path, first, second):
    from embedding.checkpoint import load_checkpoint, save_checkpoint
    from embedding.train.state import load_shards, shard_arrays

    tables = [dataclasses.replace(_tables(True, OptimizerKind.ADAM)[0], num_rows=24,
                                  eviction=Eviction.AGE), _tables(False, OptimizerKind.ADAM)[1]]
    kjts = _kjts(9, 6, big=True)
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal((6, 20)).astype(np.float32) for _ in kjts]

    def train(coll, steps):
        for i in steps:
            coll.forward(kjts[i])
            coll.backward(grads[i])

    whole = ShardedEmbeddingCollection(tables, _plan(tables, first), seed=5)
    train(whole, range(6))
    before = ShardedEmbeddingCollection(tables, _plan(tables, first), seed=5)
    train(before, range(3))
    arrays, slices = shard_arrays(before, before.plan, 0)
    assert "dyn/a/0/ids" in arrays and not any(k.startswith("emb/a/") for k in arrays)
    path = save_checkpoint(tmp_path, 3, arrays, slices, plan=before.plan, tables=tables)
    # new ids after the resume draw their first rows from the seed: the run keeps it
    after = ShardedEmbeddingCollection(tables, _plan(tables, second), seed=5)
    ckpt = load_checkpoint(path)
    ckpt.check_compatible(tables)
    load_shards(ckpt, after, after.plan, 0)
    train(after, range(3, 6))
    a, b = whole.dynamic_stores()[0].entries(0), after.dynamic_stores()[0].entries(0)
    assert a["ids"].size == 24 and set(a) == set(b)
    for part in a:
        if part != "tick":
            np.testing.assert_array_equal(a[part], b[part], err_msg=part)
    np.testing.assert_array_equal(whole.gather_table("b"), after.gather_table("b"))


@pytest.mark.parametrize("pooling", [Pooling.SUM, Pooling.MEAN, Pooling.MAX])
def test_evaluation_reads_unseen_ids_as_zeros_and_leaves_the_table_as_it_was(pooling):
    """A forward with grad=False finds ids only: an unseen id pools as a zero row (counted in
    a mean's length), nothing is inserted, and no entry's count or age moves."""
    opt = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    tables = [TableConfig("a", 8, 4, pooling, optimizer=opt, dynamic=True,
                          eviction=Eviction.AGE)]
    coll = ShardedEmbeddingCollection(tables, _plan(tables, ST.TABLE_WISE), seed=1)
    store, = coll.dynamic_stores()
    train = KeyedJagged.from_lists({"a": [[10, 11], [12]]})
    coll.backward(np.ones_like(coll.forward(train)))
    before = store.entries(0)
    evaluate = KeyedJagged.from_lists({"a": [[10, 99], [98], [], [12, 11]]})
    pooled, _ = coll.forward_with_context(evaluate, grad=False)
    after = store.entries(0)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    ids, rows = store.export(0)
    row = {int(i): store.weight(0)[r] for i, r in zip(ids, rows)}
    zero = np.zeros(4, np.float32)
    pool = {Pooling.SUM: lambda rs: np.sum(rs, axis=0),
            Pooling.MEAN: lambda rs: np.mean(rs, axis=0),
            Pooling.MAX: lambda rs: np.max(rs, axis=0)}[pooling]
    want = [pool([row[10], zero]), pool([zero]), zero, pool([row[12], row[11]])]
    np.testing.assert_allclose(pooled, np.stack(want), rtol=1e-6, atol=0)
    # the same batch in training inserts the unseen ids
    coll.forward(evaluate)
    assert store.export(0)[0].tolist() == [10, 11, 12, 98, 99]
