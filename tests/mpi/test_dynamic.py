"""Dynamic tables across ranks: table-wise and cyclic row-wise against a one-rank run of
the same global batches (every rank runs the reference on a group of itself)."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.types import (OptimizerConfig, OptimizerKind, Pooling, Shard, ShardingPlan,
                             ShardingType, TableConfig, TablePlan, cyclic_shards)

ST = ShardingType
B = 4


def _tables(kind):
    opt = OptimizerConfig(kind, lr=0.05)
    # one feature per table: a row's gradient terms then come in the same order (by sample)
    # in the sharded and the one-rank backward, so table-wise agrees bit for bit
    return [TableConfig("a", 128, 8, Pooling.SUM, optimizer=opt, dynamic=True),
            TableConfig("b", 9, 4, Pooling.MEAN, optimizer=opt)]


def _plan(tables, st, size):
    plans = []
    for i, t in enumerate(tables):
        if st is ST.CYCLIC_ROW_WISE and t.dynamic:
            plans.append(TablePlan(t.name, st, cyclic_shards(t.num_rows, t.dim, size)))
        else:
            plans.append(TablePlan(t.name, ST.TABLE_WISE,
                                   (Shard((i + 1) % size, 0, t.num_rows, 0, t.dim),)))
    return ShardingPlan(size, size, tuple(plans))


def _self_group(world):
    mine = None
    for r in range(world.size):  # collective: every rank splits every singleton
        sub = world.world.split([r], name=f"dynamic-self{r}")
        if sub is not None:
            mine = sub
    return mine


def _batch(rng, pool, n):
    lists = {"a": [rng.choice(pool, rng.integers(0, 4)).tolist() for _ in range(n)],
             "b": [rng.integers(0, 9, rng.integers(0, 3)).tolist() for _ in range(n)]}
    return lists


def _kjt(lists, lo, hi):
    return KeyedJagged.from_lists({k: v[lo:hi] for k, v in lists.items()})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("st", [ST.TABLE_WISE, ST.CYCLIC_ROW_WISE], ids=lambda s: s.value)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
def test_dynamic_tables_match_one_rank(world, all_ranks, st, kind):
    group = world.world
    n = group.size
    tables = _tables(kind)
    coll = ShardedEmbeddingCollection(tables, _plan(tables, st, n), group, seed=7)
    ref = ShardedEmbeddingCollection(tables, _plan(tables, ST.TABLE_WISE, 1),
                                     _self_group(world), seed=7)
    rng = np.random.default_rng(11)  # the same on every rank: the global batches
    pool = rng.integers(-2**62, 2**62, 40)
    lo, hi = group.rank * B, (group.rank + 1) * B
    for step in range(4):
        lists = _batch(rng, pool, B * n)
        grad = rng.standard_normal((B * n, coll.out_dim)).astype(np.float32)
        out = coll.forward(_kjt(lists, lo, hi))
        expect = ref.forward(_kjt(lists, 0, B * n))[lo:hi]
        if st is ST.TABLE_WISE:
            ok, msg = np.array_equal(out, expect), "differs"
        else:  # partial pools are added across ranks: the order of a sum differs
            gap = float(np.max(np.abs(out - expect), initial=0))
            ok, msg = gap < 1e-5, f"off by {gap}"
        all_ranks(ok, f"{st.value}/{kind.value} step {step}: forward {msg}")
        coll.backward(grad[lo:hi])
        ref.backward(grad)
    mine = [s.tables.entries(s.index) for s in coll.local_shards() if s.table == "a"]
    parts = [p for got in group.comm.allgather(mine) for p in got]
    ids = np.concatenate([p["ids"] for p in parts])
    order = np.argsort(ids)
    want = ref.dynamic_stores()[0].entries(0)
    ok = np.array_equal(ids[order], want["ids"])
    for name in want:
        if ok and name not in ("tick", "ids"):
            got = np.concatenate([p[name] for p in parts])[order]
            if st is ST.TABLE_WISE:
                ok = np.array_equal(got, want[name])
            else:
                ok = np.allclose(got, want[name], rtol=1e-4, atol=1e-6)
    all_ranks(ok, f"{st.value}/{kind.value}: entries of table a differ from one rank's")


# -- the trainer ------------------------------------------------------------------------
def test_trainer_with_dynamic_tables_trains_like_fixed_tables(world, tmp_path, all_ranks):
    """``[tables] dynamic = true``: a table's rows go to ids as they come, each starting from
    the id-keyed first row, so with room for every id the run equals the fixed tables'; a
    resume continues it exactly."""
    from test_train import shared_dir, small_config, train

    base = shared_dir(world, tmp_path)
    plan = {"shardings": ["table_wise"]}
    fixed = train(small_config(f"{base}/fixed", plan=plan), world.world)
    dyn = train(small_config(f"{base}/dyn", plan=plan, tables={"dynamic": True,
                                                                "eviction": "age"}),
                world.world)
    all_ranks(all(t.dynamic for t in dyn.tables), "the tables are not dynamic")
    all_ranks(dyn.losses == fixed.losses, f"{dyn.losses} vs {fixed.losses}")
    # stop after 3 steps, resume, finish: the same losses as the run straight through
    half = small_config(f"{base}/half", plan=plan, tables={"dynamic": True, "eviction": "age"},
                        train={"steps": 3}, checkpoint={"every": 3})
    first = train(half, world.world)
    rest = train(small_config(f"{base}/half", plan=plan,
                              tables={"dynamic": True, "eviction": "age"}),
                 world.world, resume="latest")
    all_ranks(first.losses + rest.losses == dyn.losses,
              f"{first.losses} + {rest.losses} vs {dyn.losses}")


@pytest.mark.parametrize("section, key", [("tables", "tables.dynamic"),
                                          ("plan", "plan.shardings")])
def test_dynamic_settings_that_cannot_work_fail_on_every_rank(world, tmp_path, all_ranks,
                                                               section, key):
    from embedding.train import ConfigError
    from test_train import shared_dir, small_config, train

    base = shared_dir(world, tmp_path)
    extra = ({"tables": {"dynamic": True, "tier": "host"}} if section == "tables" else
             {"tables": {"dynamic": True}, "plan": {"shardings": ["row_wise"]}})
    try:
        train(small_config(f"{base}/bad", **extra), world.world)
        msg = ""
    except ConfigError as exc:
        msg = str(exc)
    all_ranks(key in msg and "dynamic" in msg, f"expected {key}, got {msg!r}")
