"""Host-resident tables with a device cache train bitwise like tables in device memory.

Every sharding that can hold them (all but data-parallel), every optimizer,
caches of 1 row, a few rows and the whole table, LRU and LFU, the host tier,
deduplication, the pipelined input dist with prefetch, and forward-only
(evaluation) steps between training steps: the pooled output of each step
and every shard's weights and optimizer state must equal, bit for bit, the
same collection with every table in device memory.

    mpirun -n 4 python -m pytest --with-mpi tests/mpi/test_tiers.py
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.optim import state_specs
from embedding.types import CachePolicy, OptimizerKind, TableMemory, Tier
from test_sharding import (BATCH, assert_every_pair, global_batch, latin_cases, local_kjt,
                           make_plan, make_tables, skip_if_uneven, tiered_plan)

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.training]
MIXES = ["tw", "rw", "cw", "twrw", "twcw", "cyc", "mixed", "mixed_hier", "mixed_cyc"]


def shard_state(coll) -> list[np.ndarray]:
    """Weights and optimizer state of every local shard, in (table, shard) order (host and
    device tables of one sharding type live in different stores, in another order)."""
    out = []
    for s in sorted(coll.local_shards(), key=lambda s: (s.table, s.shard.row_offset,
                                                          s.shard.col_offset)):
        out.append(np.array(s.weight))
        table = next(t for t in coll.tables if t.name == s.table)
        for spec in state_specs(table.optimizer.kind):
            out.append(np.array(s.tables.state_view(s.index, spec.name)))
    return out


def run_both(world, all_ranks, mix, kind, cache, *, policy=CachePolicy.LRU, dedup=False,
             pipelined=False, evaluate=False, steps=3):
    group = world.world
    tables = make_tables(kind)
    plan = make_plan(tables, mix, group)
    colls = [ShardedEmbeddingCollection(tables, p, group, dedup=dedup) for p in
             (plan, tiered_plan(plan, tables, cache, policy))]
    rng = np.random.default_rng(4321)
    for t in tables:
        w = rng.standard_normal((t.num_rows, t.dim))
        for c in colls:
            c.load_table(t.name, w)
    batches = [global_batch(rng, tables, group.size, weighted=True) for _ in range(steps)]
    grads = [rng.standard_normal((BATCH, colls[0].out_dim)) for _ in range(steps)]
    kjts = [local_kjt(b, w, group.rank) for b, w in batches]
    outs = [[], []]
    for k, coll in enumerate(colls):
        nxt = coll.input_dist(kjts[0]) if pipelined else None
        for i in range(steps):
            if pipelined:
                out, ctx = coll.forward_with_context(nxt)
                if i + 1 < steps:
                    nxt = coll.input_dist(kjts[i + 1])
                    coll.prefetch(nxt)  # rows of batch i + 1 come in before i's update
            else:
                out, ctx = coll.forward_with_context(coll.input_dist(kjts[i]))
            outs[k].append(np.array(out))
            if evaluate:  # a forward-only batch between training steps
                ev, _ = coll.forward_with_context(coll.input_dist(kjts[-1 - i]), grad=False)
                outs[k].append(np.array(ev))
            coll.backward(grads[i], ctx)
    stores = colls[1].tiered_stores()
    all_ranks(all(s.open_steps() == 0 for s in stores), f"{mix}: steps left open")
    same = all(np.array_equal(a, b) for a, b in zip(outs[0], outs[1]))
    all_ranks(same, f"{mix}/{kind.value}/cache {cache}: tiered forward differs")
    states = [shard_state(c) for c in colls]
    same = len(states[0]) == len(states[1]) and all(
        np.array_equal(a, b) for a, b in zip(*states))
    all_ranks(same, f"{mix}/{kind.value}/cache {cache}: tiered shards differ after training")
    return colls


KINDS = list(OptimizerKind)
CACHES = [1, 4, "all"]
#: every pair of (sharding mix, cache rows, optimizer) meets in a case: each mix runs each
#: cache size once with the optimizers rotated (a Latin square), so each mix also runs each
#: optimizer, and each cache size each optimizer, in a third of the full product's cases
BITWISE = latin_cases(MIXES, CACHES, KINDS)


def test_the_bitwise_cases_meet_every_pair():
    assert_every_pair(BITWISE, MIXES, CACHES, KINDS)


@pytest.mark.parametrize("mix, cache, kind", BITWISE,
                         ids=[f"{m}-{c}-{k.value}" for m, c, k in BITWISE])
def test_tiered_training_is_bitwise_equal(world, all_ranks, mix, cache, kind):
    skip_if_uneven(mix, world)
    run_both(world, all_ranks, mix, kind, cache)


@pytest.mark.parametrize("mix", ["tw", "rw", "mixed"])
def test_lfu_policy_is_exact(world, all_ranks, mix):
    run_both(world, all_ranks, mix, OptimizerKind.ADAM, 3, policy=CachePolicy.LFU)


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix", ["tw", "cw", "twcw", "mixed"])
def test_tiered_dedup_is_exact(world, all_ranks, mix, kind):
    run_both(world, all_ranks, mix, kind, 2, dedup=True)


@pytest.mark.parametrize("mix", ["mixed", "mixed_hier"])
def test_prefetch_and_evaluation_steps_are_exact(world, all_ranks, mix):
    skip_if_uneven(mix, world)
    colls = run_both(world, all_ranks, mix, OptimizerKind.ROWWISE_ADAGRAD, 2, pipelined=True,
                     evaluate=True, steps=4)
    stats = colls[1].take_cache_stats()
    total = world.comm.allreduce(stats.lookups)
    all_ranks(total > 0 and stats.bytes_in >= 0, f"cache counters: {stats}")


def test_cache_larger_than_the_table_is_refused_on_every_rank(world, all_ranks):
    group = world.world
    tables = make_tables(OptimizerKind.SGD)
    plan = make_plan(tables, "tw", group)
    big = dataclasses.replace(plan.tables[1], memory=TableMemory(Tier.CACHED, 24))
    plan = dataclasses.replace(plan, tables=(plan.tables[0], big) + plan.tables[2:])
    try:
        ShardedEmbeddingCollection(tables, plan, group)
        msg = ""
    except ValueError as exc:
        msg = str(exc)
    all_ranks("table 't1'" in msg and "24 rows" in msg and "23 rows" in msg, msg)


@pytest.mark.parametrize("saved_tiered", [False, True], ids=["device-to-cached",
                                                              "cached-to-device"])
def test_checkpoint_moves_tables_across_tiers(world, all_ranks, tmp_path_factory, saved_tiered):
    """Train, save, resume under the other tier, train on: equal to never stopping."""
    from embedding.checkpoint import load_checkpoint, save_checkpoint
    from embedding.train.state import load_shards, shard_arrays

    group = world.world
    tables = make_tables(OptimizerKind.ADAM)
    plan = make_plan(tables, "mixed", group)
    tiered = tiered_plan(plan, tables, 2)
    first, second = (tiered, plan) if saved_tiered else (plan, tiered)
    rng = np.random.default_rng(77)
    batches = [global_batch(rng, tables, group.size, weighted=False) for _ in range(4)]
    kjts = [local_kjt(b, w, group.rank) for b, w in batches]
    whole = ShardedEmbeddingCollection(tables, plan, group, seed=5)
    before = ShardedEmbeddingCollection(tables, first, group, seed=5)

    def train(coll, steps):
        for i in steps:
            out = coll.forward(kjts[i])
            coll.backward(np.tanh(out) + 0.01 * i)

    train(whole, range(4))
    train(before, range(2))
    root = group.comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if group.rank == 0 else None)
    arrays, slices = shard_arrays(before, first, group.rank)
    path = save_checkpoint(root, 2, arrays, slices, rank=group.rank, world_size=group.size,
                           barrier=group.comm.Barrier, plan=first, tables=tables)
    after = ShardedEmbeddingCollection(tables, second, group, seed=99)
    load_shards(load_checkpoint(path), after, second, group.rank)
    train(after, range(2, 4))
    states = [shard_state(whole), shard_state(after)]
    same = all(np.array_equal(a, b) for a, b in zip(*states))
    all_ranks(same, "a resumed run across tiers differs from the uninterrupted one")


# -- the trainer ----------------------------------------------------------------------
@pytest.mark.parametrize("tier, cache", [("cached", "5%"), ("cached", "3"), ("host", ""),
                                         ("cached", "2KiB")])
def test_trainer_with_host_resident_tables_trains_the_same(world, tmp_path, all_ranks, tier,
                                                            cache):
    """Same losses and tables, bit for bit, as device memory; the log reports the cache."""
    from embedding.train.metrics import read_metrics
    from test_train import STEPS, shared_dir, small_config, train

    base = shared_dir(world, tmp_path)
    sparse = {"kind": "adam", "lr": 0.05}
    dev = train(small_config(f"{base}/dev", sparse_optimizer=sparse), world.world)
    tables = {"tier": tier, "cache": cache, "tier_min_rows": 60, "cache_policy": "lfu"}
    tiered = train(small_config(f"{base}/tiered", tables=tables, sparse_optimizer=sparse),
                   world.world)
    kinds = {tp.table: tp.memory.tier.value for tp in tiered.plan.tables}
    all_ranks(sorted(kinds.values()).count(tier) == 2, f"tiers per table: {kinds}")
    all_ranks(tiered.losses == dev.losses, f"{tiered.losses} vs {dev.losses}")
    a = shard_state(dev.coll) + [dev.model.flat_params]
    b = shard_state(tiered.coll) + [tiered.model.flat_params]
    all_ranks(len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)),
              "tables or dense model differ after training")
    if world.rank == 0:
        recs = [r for r in read_metrics(f"{base}/tiered/metrics.jsonl") if r["event"] == "train"]
        # (a step's rows come in while the step before it runs: counted in that record)
        ok = len(recs) == STEPS and all(r["cache"]["lookups_per_step"] > 0 and
                                        r["cache"]["h2d_bytes_per_step"] > 0
                                        for r in recs[:-1])
        ok = ok and all(0 <= r["cache"]["step_share"] <= 1 for r in recs)
        hits = [r["cache"]["hit_rate"] for r in recs]
        ok = ok and (max(hits) > 0) == (tier == "cached")
        msg = f"cache records: {[r.get('cache') for r in recs]}"
    else:
        ok, msg = True, ""
    all_ranks(ok, msg)


@pytest.mark.parametrize("tables, key, words", [
    ({"tier": "cached"}, "tables.cache", "needs a cache size"),
    ({"tier": "host", "cache": "5%"}, "tables.cache", "only tier"),
    ({"tier": "cached", "cache": "500"}, "tables.cache", "more than table"),
    ({"tier": "cached", "cache": "150%"}, "tables.cache", "(0%, 100%]"),
    ({"tier": "cached", "cache": "12B"}, "tables.cache", "holds no row"),
    ({"tier": "disk"}, "tables.tier", "'disk'"),
    ({"cache_policy": "fifo"}, "tables.cache_policy", "'fifo'"),
    ({"tier": "host", "host_memory": "8KiB"}, "plan.host_memory", "more than the 8 KiB there"),
])
def test_bad_tier_settings_fail_on_every_rank_before_training(world, tmp_path, all_ranks,
                                                               tables, key, words):
    from embedding.train import ConfigError
    from test_train import shared_dir, small_config, train

    base = shared_dir(world, tmp_path)
    tables = dict(tables)
    plan = {"host_memory": tables.pop("host_memory")} if "host_memory" in tables else {}
    try:
        train(small_config(f"{base}/bad", tables=tables, plan=plan), world.world)
        msg = ""
    except ConfigError as exc:
        msg = str(exc)
    all_ranks(key in msg and words in msg, f"expected {key} / {words!r}, got {msg!r}")
