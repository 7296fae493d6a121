"""Half tables in the host-resident (tiered) and dynamic stores: they train bit for bit like
the in-memory half store (the same rounding bits), their checkpoints round-trip across
precisions, and the planner counts their half bytes."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection, dynamic_initializer
from embedding.kernels import Bags, FusedTables
from embedding.kernels.dynamic import DynamicTables
from embedding.kernels.tiered import TieredTables
from embedding.optim import state_specs
from embedding.precision import storage_dtype
from embedding.types import (CachePolicy, Eviction, OptimizerConfig, OptimizerKind, Pooling,
                             Shard, ShardingPlan, ShardingType, TableConfig, TableMemory,
                             TablePlan, Tier)
from test_half_tables import _train
from test_tiered import DIMS, ROWS, train

HALVES = ("float16", "bfloat16")
ROUNDINGS = ("nearest", "stochastic", "master")
KINDS = (OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM)


def _bits(arr) -> np.ndarray:
    """The bits of ``arr`` (NumPy, or a device array: copied to the host)."""
    arr = arr.get() if hasattr(arr, "get") else np.asarray(arr)
    return arr.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[arr.dtype.itemsize])


def _contents(store) -> list:
    """Every table's weights, optimizer state and master rows, as bits."""
    out = []
    for t in range(store.num_tables):
        out.append(_bits(store.weight(t)))
        for spec in state_specs(store.optimizers[t].kind):
            out.append(_bits(store.state_view(t, spec.name)))
        master = store.master_weight(t)
        out.append(None if master is None else _bits(master))
    return out


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, i
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"array {i}")


# -- the tiered store -----------------------------------------------------------------------
def _tiered(kind, name, rounding, memory=None, state_dtype=None):
    """Three tables of ``name`` rows (seeds 3, 4, 5): in memory, or tiered by ``memory``."""
    opt = OptimizerConfig(kind, lr=0.05)
    kw = dict(dtype=name, rounding=rounding, seeds=[3, 4, 5], state_dtype=state_dtype)
    store = (FusedTables(ROWS, DIMS, opt, **kw) if memory is None
             else TieredTables(ROWS, DIMS, opt, memory, **kw))
    rng = np.random.default_rng(7)
    for t in range(len(ROWS)):
        store.weight(t)[...] = rng.standard_normal((ROWS[t], DIMS[t])).astype(np.float32)
    store.sync_master()
    return store


def _memory(cache: int):
    return [TableMemory(Tier.CACHED, cache, CachePolicy.LFU), TableMemory(Tier.HOST),
            TableMemory(Tier.CACHED, min(cache, 25), admit_after=2)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("cache", [1, 40])
def test_tiered_half_tables_train_bit_for_bit_like_tables_in_memory(cache, name, rounding,
                                                                    kind):
    """A one-row cache rounds each row in every slot it passes through: a cached row
    hashes its host row, not its slot, or stochastic rounding would differ."""
    ref = _tiered(kind, name, rounding)
    want = train(ref)
    tiered = _tiered(kind, name, rounding, _memory(cache))
    got = train(tiered)
    for a, b in zip(want, got):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert tiered.step == ref.step == 6
    _assert_same(_contents(ref), _contents(tiered))
    assert tiered.weight(0).dtype == storage_dtype(name)


@pytest.mark.parametrize("name", HALVES)
def test_tiered_aggregate_update_and_half_state_are_exact(name):
    kind = OptimizerKind.ADAM
    for rounding in ("stochastic", "master"):
        ref = _tiered(kind, name, rounding, state_dtype=name)
        want = train(ref, fused=False, weighted=True, mean=True)
        tiered = _tiered(kind, name, rounding, [TableMemory(Tier.CACHED, 2)] * 3,
                         state_dtype=name)
        got = train(tiered, fused=False, weighted=True, mean=True)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
        assert tiered.state_view(0, "exp_avg").dtype == storage_dtype(name)
        _assert_same(_contents(ref), _contents(tiered))


def test_tiered_copies_move_half_the_bytes_and_master_rows_with_them():
    """Same cache decisions, so the bytes scale with the row: float32 rows 4 bytes an
    element, float16 2, float16 with a float32 master copy 6 (SGD keeps no state)."""
    mem = [TableMemory(Tier.CACHED, 3)] * 3
    stats = {}
    for key, name, rounding in (("f32", "float32", "nearest"), ("f16", "float16", "nearest"),
                                ("master", "float16", "master")):
        store = _tiered(OptimizerKind.SGD, name, rounding, mem)
        train(store)
        store.flush()
        stats[key] = store.take_stats()
    f32, f16, master = stats["f32"], stats["f16"], stats["master"]
    assert f16.bytes_in > 0 and f16.bytes_out > 0
    assert (2 * f16.bytes_in, 2 * f16.bytes_out) == (f32.bytes_in, f32.bytes_out)
    assert (master.bytes_in, master.bytes_out) == (3 * f16.bytes_in, 3 * f16.bytes_out)
    # with half optimizer state the state moves in half too (row-wise AdaGrad: one float)
    both = []
    for name in ("float32", "bfloat16"):
        store = _tiered(OptimizerKind.ROWWISE_ADAGRAD, name, "nearest", mem,
                        state_dtype=name)
        train(store)
        both.append(store.take_stats().bytes_in)
    assert both[0] == 2 * both[1]


# -- the dynamic store ----------------------------------------------------------------------
def _bags(ids_per_bag, dim):
    lengths = [len(b) for b in ids_per_bag]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    idx = np.concatenate([np.asarray(b, np.int64) for b in ids_per_bag])
    return Bags(idx, offsets, (0,), (0,), (False,), len(ids_per_bag), dim, 1, None)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("fused", [True, False], ids=["backward_update", "aggregate+update"])
def test_dynamic_half_table_trains_like_the_fixed_table_whose_row_i_holds_id_i(
        fused, name, rounding, kind):
    """Stochastic rounding hashes the id: the map puts ids in other rows than a fixed
    table's, and the bits are the same."""
    rng = np.random.default_rng(1)
    cap, dim = 30, 8
    opt = OptimizerConfig(kind, lr=0.05)
    kw = dict(dtype=name, rounding=rounding, seeds=[11], names=["d"])
    init = dynamic_initializer(TableConfig("d", cap, dim, dynamic=True), seed=3)
    dyn = DynamicTables([cap], [dim], opt, [Eviction.COUNT], **kw)
    dyn.set_initializer(0, init)
    fixed = FusedTables([cap], [dim], opt, **kw)
    fixed.weight(0)[...] = init(np.arange(cap)).astype(storage_dtype(name))
    fixed.sync_master()
    for _ in range(5):
        bags = _bags([rng.integers(0, cap, rng.integers(0, 5)).tolist() for _ in range(6)], dim)
        out = [dyn.lookup(bags), fixed.lookup(bags)]
        np.testing.assert_array_equal(out[0], out[1])
        g = rng.standard_normal(out[0].shape).astype(np.float32)
        for store in (dyn, fixed):
            if fused:
                store.backward_update(bags, g)
            else:
                store.update(store.aggregate(bags, g))
    ids, rows = dyn.export(0)
    assert not np.array_equal(ids, rows)           # the ids sit in other rows
    np.testing.assert_array_equal(_bits(dyn.weight(0)[rows]), _bits(fixed.weight(0)[ids]))
    assert dyn.weight(0).dtype == storage_dtype(name)
    for spec in state_specs(kind):
        np.testing.assert_array_equal(dyn.state_view(0, spec.name)[rows],
                                      fixed.state_view(0, spec.name)[ids])
    if rounding == "master":
        np.testing.assert_array_equal(dyn.master_weight(0)[rows], fixed.master_weight(0)[ids])
        np.testing.assert_array_equal(dyn.entries(0)["weight"], fixed.master_weight(0)[ids])
    else:
        assert dyn.master_weight(0) is None


def test_an_evaluation_lookup_of_a_half_dynamic_table_reads_unseen_ids_as_zeros():
    dyn = DynamicTables([4], [4], OptimizerConfig(OptimizerKind.SGD), [Eviction.AGE],
                        dtype="bfloat16")
    dyn.set_initializer(0, lambda ids: np.ones((len(ids), 4)))
    dyn.lookup(_bags([[5]], 4))
    with dyn.reading():
        out = dyn.lookup(_bags([[5, 9], [9]], 4))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[1, 1, 1, 1], [0, 0, 0, 0]])


# -- collections and checkpoints --------------------------------------------------------------
def _collection(store, dtype, rounding="nearest", seed=5):
    """Half table ``a`` (30 × 8, in ``store``: device, tiered or dynamic) and float32 table
    ``b``, table-wise on one rank."""
    opt = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
    tables = [TableConfig("a", 30, 8, Pooling.SUM, optimizer=opt, dtype=dtype,
                          rounding=rounding, rounding_seed=2, dynamic=store == "dynamic"),
              TableConfig("b", 7, 4, Pooling.MEAN, optimizer=opt)]
    memory = {"tiered": TableMemory(Tier.CACHED, 4)}.get(store, TableMemory())
    plan = ShardingPlan(1, 1, (
        TablePlan("a", ShardingType.TABLE_WISE, (Shard(0, 0, 30, 0, 8),), memory),
        TablePlan("b", ShardingType.TABLE_WISE, (Shard(0, 0, 7, 0, 4),))))
    return ShardedEmbeddingCollection(tables, plan, seed=seed), plan


def _table_a(coll) -> np.ndarray:
    """Table ``a``'s rows by id, as float32 (NaN rows: ids a dynamic table has not seen)."""
    dyn = coll.dynamic_stores()
    if not dyn:
        return coll.gather_table("a")
    ids, rows = dyn[0].export(0)
    out = np.full((30, 8), np.nan, np.float32)
    out[ids] = dyn[0].weight(0)[rows].astype(np.float32)
    return out


def _store_a(coll):
    """The store holding table ``a``."""
    return next(s.fused for s in coll.strategies if s.tables[0].name == "a")


def _master_a(coll) -> np.ndarray:
    store = _store_a(coll)
    if isinstance(store, DynamicTables):
        ids, rows = store.export(0)
        out = np.full((30, 8), np.nan, np.float32)
        out[ids] = store.master_weight(0)[rows]
        return out
    return np.array(store.master_weight(0))


@pytest.mark.parametrize("rounding", ["stochastic", "master"])
@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("store", ["tiered", "dynamic"])
def test_half_collections_train_like_the_device_store(store, name, rounding):
    ref, _ = _collection("device", name, rounding)
    coll, _ = _collection(store, name, rounding)
    assert type(_store_a(coll)).__name__ == {"tiered": "TieredTables",
                                                       "dynamic": "DynamicTables"}[store]
    _train(ref, steps=4)
    _train(coll, steps=4)
    got = _table_a(coll)
    live = ~np.isnan(got[:, 0])           # a dynamic table holds the ids it has seen
    assert live.sum() > 10
    np.testing.assert_array_equal(_bits(got[live]), _bits(ref.gather_table("a")[live]))
    np.testing.assert_array_equal(ref.gather_table("b"), coll.gather_table("b"))
    if rounding == "master":
        np.testing.assert_array_equal(_master_a(coll)[live], _master_a(ref)[live])


def _save(coll, plan, path, step=2):
    from embedding.checkpoint.reader import load_checkpoint
    from embedding.checkpoint.writer import CheckpointWriter
    from embedding.train.state import shard_arrays

    arrays, slices = shard_arrays(coll, plan, 0)
    w = CheckpointWriter(path, step=step)
    w.write(arrays, slices)
    ckpt = load_checkpoint(w.commit(plan=plan, tables=coll.tables))
    ckpt.check_compatible(coll.tables)
    return ckpt, arrays


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("store", ["tiered", "dynamic"])
def test_half_checkpoints_load_into_any_precision_and_back(tmp_path, store, name):
    from embedding.train.state import load_shards

    coll, plan = _collection(store, name, "stochastic")
    _train(coll)
    ckpt, arrays = _save(coll, plan, tmp_path / "half")
    assert all(a.dtype.name != "bfloat16" for a in arrays.values())   # portable
    want = _table_a(coll)
    for target in (name, "float32", "float16" if name == "bfloat16" else "bfloat16"):
        other, _ = _collection(store, target, seed=9)
        load_shards(ckpt, other, plan, 0)
        got = _table_a(other)
        if target in ("float32", name):                 # exact
            np.testing.assert_array_equal(got, want)
        else:                                           # rounded to nearest
            np.testing.assert_array_equal(got, want.astype(storage_dtype(target))
                                          .astype(np.float32))
        np.testing.assert_array_equal(other.gather_table("b"), coll.gather_table("b"))
    # a float32 checkpoint into a master half table: the rows round to nearest, the master
    # copy takes the float32 rows; and back out into float32, the master rows come back
    f32, _ = _collection(store, "float32")
    _train(f32)
    ckpt, _ = _save(f32, plan, tmp_path / "f32")
    half, _ = _collection(store, name, "master")
    load_shards(ckpt, half, plan, 0)
    np.testing.assert_array_equal(_table_a(half), _table_a(f32).astype(storage_dtype(name))
                                  .astype(np.float32))
    np.testing.assert_array_equal(_master_a(half), _table_a(f32))
    ckpt, _ = _save(half, plan, tmp_path / "back")
    again, _ = _collection(store, "float32", seed=9)
    load_shards(ckpt, again, plan, 0)
    np.testing.assert_array_equal(_table_a(again), _table_a(f32))


@pytest.mark.parametrize("rounding", ["stochastic", "master"])
@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("store", ["tiered", "dynamic"])
def test_a_resume_continues_a_half_tiered_or_dynamic_table_bit_for_bit(tmp_path, store, name,
                                                                       rounding):
    """The update counter resumes at the checkpoint's step; a reloaded dynamic table puts
    its ids in other rows than the run straight through, and rounds as it did (by id)."""
    from embedding.train.state import load_shards

    straight, plan = _collection(store, name, rounding)
    _train(straight, steps=2, seed=3)
    _train(straight, steps=3, seed=4)
    first, _ = _collection(store, name, rounding)
    _train(first, steps=2, seed=3)
    ckpt, _ = _save(first, plan, tmp_path)
    # a dynamic table's new ids draw their first rows from the seed: the run keeps it
    resumed, _ = _collection(store, name, rounding, seed=9 if store == "tiered" else 5)
    load_shards(ckpt, resumed, plan, 0)
    if store == "dynamic":
        ids, rows = resumed.dynamic_stores()[0].export(0)
        assert not np.array_equal(rows, first.dynamic_stores()[0].export(0)[1])
    _train(resumed, steps=3, seed=4)
    np.testing.assert_array_equal(_bits(_table_a(resumed)), _bits(_table_a(straight)))
    np.testing.assert_array_equal(resumed.gather_table("b"), straight.gather_table("b"))
    if rounding == "master":
        np.testing.assert_array_equal(_master_a(resumed), _master_a(straight))


# -- the planner and refusals -----------------------------------------------------------------
def test_planner_counts_half_bytes_of_host_cached_and_dynamic_tables():
    from embedding.planner import Hardware, Workload, evaluate_plan

    hw = Hardware(2, 2, 512 << 20, host_memory=8 << 30, host_bandwidth=20e9)
    opt = OptimizerConfig(OptimizerKind.ADAM)
    plan = ShardingPlan(2, 2, (
        TablePlan("big", ShardingType.TABLE_WISE, (Shard(0, 0, 100_000, 0, 64),),
                  TableMemory(Tier.CACHED, 1000)),
        TablePlan("dyn", ShardingType.TABLE_WISE, (Shard(1, 0, 50_000, 0, 64),))))
    mem = {}
    for dt, rounding in (("float32", "nearest"), ("bfloat16", "nearest"),
                         ("float16", "master")):
        tables = [TableConfig("big", 100_000, 64, dtype=dt, optimizer=opt, rounding=rounding),
                  TableConfig("dyn", 50_000, 64, dtype=dt, dynamic=True, optimizer=opt,
                              rounding=rounding)]
        mem[dt] = [r.memory for r in evaluate_plan(plan, tables, hw, Workload(4096)).ranks]
    state = 2 * 64 * 4                                  # Adam's two float32 values
    for dt, item, extra in (("float32", 4, 0), ("bfloat16", 2, 0), ("float16", 2, 4 * 64)):
        host, dyn = mem[dt]
        assert host.host == 100_000 * (64 * item + state + extra)    # the host rows
        assert host.weights == 1000 * 64 * item                      # the device cache
        assert dyn.weights == 50_000 * 64 * item
        assert dyn.optimizer == 50_000 * (state + extra)


def test_the_stores_refuse_what_the_in_memory_store_refuses():
    opt = OptimizerConfig(OptimizerKind.ADAM)
    host = [TableMemory(Tier.HOST)]
    for make in (lambda **kw: TieredTables([10], [4], opt, host, **kw),
                 lambda **kw: DynamicTables([10], [4], opt, [Eviction.AGE], **kw)):
        with pytest.raises(ValueError, match=r"rounding.*stochastic.*float16 or bfloat16"):
            make(dtype="float32", rounding="stochastic")
        with pytest.raises(ValueError, match=r"state_dtype: .*bfloat16 optimizer state.*"
                                             r"float64"):
            make(dtype="float64", state_dtype="bfloat16", device="cuda")
        with pytest.raises(ValueError, match=r"dtype: expected one of .*'int8'"):
            make(dtype="int8")
