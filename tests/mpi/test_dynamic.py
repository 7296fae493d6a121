"""Dynamic tables across ranks: table-wise and cyclic row-wise against a one-rank run of
the same global batches (every rank runs the reference on a group of itself)."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.train import Trainer
from embedding.types import (OptimizerConfig, OptimizerKind, Pooling, Shard, ShardingPlan,
                             ShardingType, TableConfig, TablePlan, cyclic_shards)

pytestmark = pytest.mark.training

ST = ShardingType
B = 4


def _tables(kind, **precision):
    """``precision``: table ``a``'s ``dtype``, ``rounding`` … (default float32)."""
    opt = OptimizerConfig(kind, lr=0.05)
    # one feature per table: a row's gradient terms then come in the same order (by sample)
    # in the sharded and the one-rank backward, so table-wise agrees bit for bit
    return [TableConfig("a", 128, 8, Pooling.SUM, optimizer=opt, dynamic=True, **precision),
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
    _match_one_rank(world, all_ranks, st, kind)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("st", [ST.TABLE_WISE, ST.CYCLIC_ROW_WISE], ids=lambda s: s.value)
@pytest.mark.parametrize("rounding", ["stochastic", "master"])
def test_half_dynamic_tables_match_one_rank(world, all_ranks, st, rounding):
    """Stochastic rounding hashes the id: table-wise, the owner rounds as one rank does."""
    _match_one_rank(world, all_ranks, st, OptimizerKind.ADAM, dtype="bfloat16",
                    rounding=rounding, rounding_seed=3)


def _match_one_rank(world, all_ranks, st, kind, **precision):
    group = world.world
    n = group.size
    tables = _tables(kind, **precision)
    half = bool(precision)
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
            elif half and name == "weight" and precision.get("rounding") != "master":
                # a float32 sum in another order may round to the neighbouring half value
                ok = np.allclose(got, want[name], rtol=2 ** -6, atol=1e-6)
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


def _entries_by_table(t, world) -> dict:
    """Every dynamic table's live entries on every rank of the job (``t`` None on a rank that
    holds no trainer), merged and ordered by id; the tick (per shard) left out."""
    mine = [] if t is None else [(s.table, s.tables.entries(s.index))
                                 for s in t.coll.local_shards()
                                 if hasattr(s.tables, "entries")]
    merged: dict = {}
    for part in world.comm.allgather(mine):
        for table, entries in part:
            merged.setdefault(table, []).append(entries)
    out = {}
    for table, parts in merged.items():
        ids = np.concatenate([p["ids"] for p in parts])
        order = np.argsort(ids, kind="stable")
        for key in parts[0]:
            if key != "tick":
                out[f"{table}/{key}"] = np.concatenate([p[key] for p in parts])[order]
    return out


@pytest.mark.parametrize("sharding", ["table_wise", "cyclic_row_wise"])
def test_dynamic_checkpoint_moves_to_half_the_ranks_and_back(world, tmp_path, all_ranks,
                                                             sharding):
    """Trained on every rank (table-wise, or cyclic row-wise from a plan file), resumed on half
    of them as the planner places the tables there (the entries move to the ranks that now own
    their ids), saved there and resumed on every rank under the first plan again: each table's
    ids, rows, optimizer state, counts and ages are the first run's at every hop."""
    from test_train import shared_dir, small_config

    base = shared_dir(world, tmp_path)

    def config(out, plan, **more):
        return small_config(out, plan=plan, tables={"dynamic": True, "eviction": "age"},
                            sparse_optimizer={"kind": "adam", "lr": 0.01}, **more)

    plan = {"shardings": ["table_wise"]}
    if sharding == "cyclic_row_wise" and world.size > 1:
        plan = {"file": f"{base}/cyclic.json"}
        if world.rank == 0:
            rows = (50, 70, 30, 200)  # test_train.small_config's tables f0..f3
            with open(plan["file"], "w") as fh:
                fh.write(ShardingPlan(world.size, len(world.world.nodes[0]), tuple(
                    TablePlan(f"f{i}", ST.CYCLIC_ROW_WISE, cyclic_shards(r, 8, world.size))
                    for i, r in enumerate(rows))).to_json())
        world.comm.Barrier()
    full = Trainer(config(f"{base}/full", plan), world.world)
    full.train()
    full.close()
    want = _entries_by_table(full, world)
    all_ranks({k.split("/")[0] for k in want} == {"f0", "f1", "f2", "f3"}
              and all(v.size for v in want.values()), f"dynamic entries of {sorted(want)}")
    half_size = max(1, world.size // 2)
    sub = world.world.split(list(range(half_size)), name="dyn-half")
    half = None
    if sub is not None:
        half = Trainer(config(f"{base}/half", {"shardings": ["table_wise", "cyclic_row_wise"]}),
                       sub)
        half.resume(f"{base}/full/checkpoints/step-{full.step:012d}")
    got = _entries_by_table(half, world)
    diff = sorted(k for k in want if k not in got or not np.array_equal(want[k], got[k]))
    all_ranks(not diff, f"on {half_size} of {world.size} ranks: differs in {diff}")
    if half is not None:
        half.save()
        half.close()
    back = Trainer(config(f"{base}/back", plan, checkpoint={"dir": f"{base}/half/checkpoints"}),
                   world.world)
    back.resume("latest")
    got = _entries_by_table(back, world)
    diff = sorted(k for k in want if k not in got or not np.array_equal(want[k], got[k]))
    all_ranks(not diff and back.step == full.step, f"back on {world.size}: differs in {diff}")
    all_ranks(np.array_equal(back.model.flat_params, full.model.flat_params),
              "the dense model differs after the round trip")
    back.close()
