"""Bad input to a sharded collection raises on every rank, never hangs.

    mpirun -n 2 python -m pytest --with-mpi tests/mpi/test_sharding_errors.py
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.kernels.reference import pool_bags
from embedding.types import (IdPolicy, OptimizerConfig, Shard, ShardingPlan, ShardingType,
                             TableConfig, TablePlan)
from neocomm.errors import CollectiveArgumentError

pytestmark = pytest.mark.layouts("1x2", "1x3", why=(
    "bad input is refused before any shard moves: a power of two and three ranks"))

TABLES = [TableConfig("users", 20, 4, features=("user",), dtype="float64",
                      optimizer=OptimizerConfig(lr=0.1)),
          TableConfig("items", 30, 3, features=("item",), dtype="float64",
                      optimizer=OptimizerConfig(lr=0.1))]


def _plan(size: int) -> ShardingPlan:
    cuts = np.linspace(0, 30, size + 1).astype(int)
    return ShardingPlan(size, size, (
        TablePlan("users", ShardingType.TABLE_WISE, (Shard(size - 1, 0, 20, 0, 4),)),
        TablePlan("items", ShardingType.ROW_WISE,
                  tuple(Shard(r, int(cuts[r]), int(cuts[r + 1] - cuts[r]), 0, 3)
                        for r in range(size)))))


@pytest.fixture
def coll(world):
    return ShardedEmbeddingCollection(TABLES, _plan(world.size), world.world)


def _kjt(user, item, batch=2):
    return KeyedJagged.from_dict({"user": (np.asarray(user), np.ones(batch, np.int64)),
                                  "item": (np.asarray(item), np.ones(batch, np.int64))})


def _raises_everywhere(all_ranks, fn, *needles):
    try:
        fn()
        ok, msg = False, "no error"
    except CollectiveArgumentError as exc:
        msg = str(exc)
        ok = isinstance(exc, ValueError) and all(n in msg for n in needles)
    all_ranks(ok, f"expected an error naming {needles} on every rank, got: {msg}")


@pytest.mark.mpi(min_size=1)
def test_out_of_range_id_on_one_rank_raises_on_all(world, all_ranks, coll):
    bad = world.size - 1
    item = [1, 99] if world.rank == bad else [1, 2]
    _raises_everywhere(all_ranks, lambda: coll.forward(_kjt([0, 1], item)), "'item'", "99",
                       f"rank {bad}")
    # The collection still works afterwards: nobody was left inside a collective. The ids
    # differ by rank and reach rows held by other ranks (users lives on the last rank,
    # items is cut in row blocks over every rank).
    rng = np.random.default_rng(11)
    full = {t.name: rng.standard_normal((t.num_rows, t.dim)) for t in TABLES}
    for name, w in full.items():
        coll.load_table(name, w)
    user = [world.rank % 20, (7 * world.rank + 19) % 20]
    item = [(11 * world.rank) % 30, 29 - world.rank % 30]
    out = coll.forward(_kjt(user, item))
    want = np.concatenate([full["users"][user], full["items"][item]], axis=1)
    all_ranks(out.shape == (2, 7) and np.allclose(out, want, rtol=0, atol=1e-12),
              f"rank {world.rank}: pooled rows after the error differ from the tables' rows")
    coll.backward(np.zeros_like(out))


@pytest.mark.mpi(min_size=1)
def test_negative_id_raises_on_all(world, all_ranks, coll):
    user = [-3, 1] if world.rank == 0 else [0, 1]
    _raises_everywhere(all_ranks, lambda: coll.forward(_kjt(user, [1, 2])), "'user'", "-3")


@pytest.mark.mpi(min_size=1)
def test_unknown_and_missing_features_raise_on_all(world, all_ranks, coll):
    if world.rank == 0:
        kjt = KeyedJagged.from_dict({"user": ([0, 1], [1, 1]), "other": ([0, 1], [1, 1])})
    else:
        kjt = _kjt([0, 1], [1, 2])
    _raises_everywhere(all_ranks, lambda: coll.forward(kjt), "missing features ['item']",
                       "unknown features ['other']")


@pytest.mark.mpi(min_size=2)
def test_batch_size_mismatch_raises_on_all(world, all_ranks, coll):
    b = 3 if world.rank == 1 else 2
    kjt = _kjt(list(range(b)), list(range(b)), batch=b)
    _raises_everywhere(all_ranks, lambda: coll.forward(kjt), "batch_size")


@pytest.mark.mpi(min_size=2)
def test_weighted_on_some_ranks_only_raises_on_all(world, all_ranks, coll):
    kjt = _kjt([0, 1], [1, 2])
    if world.rank == 0:
        kjt = KeyedJagged(kjt.keys, kjt.values, kjt.lengths, np.ones(4))
    _raises_everywhere(all_ranks, lambda: coll.forward(kjt), "weighted")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("policy", [IdPolicy.MODULO, IdPolicy.HASH])
def test_id_policy_maps_ids_into_range(world, all_ranks, policy):
    coll = ShardedEmbeddingCollection(TABLES, _plan(world.size), world.world,
                                      id_policy={"items": policy})
    rng = np.random.default_rng(3)
    full = {t.name: rng.standard_normal((t.num_rows, t.dim)) for t in TABLES}
    for name, w in full.items():
        coll.load_table(name, w)
    raw = np.array([10 ** 12 + world.rank, -7])
    out = coll.forward(_kjt([0, 1], raw))
    from embedding.jagged import apply_id_policy

    mapped = apply_id_policy(raw, 30, policy)
    expect = pool_bags(full["items"], [[int(mapped[0])], [int(mapped[1])]])
    all_ranks(bool(np.all((mapped >= 0) & (mapped < 30)))
              and np.allclose(out[:, 4:], expect, rtol=0, atol=1e-12),
              f"{policy.value}: pooled rows differ from the mapped ids' rows")
    # users keeps the ERROR policy
    _raises_everywhere(all_ranks, lambda: coll.forward(_kjt([0, 20], [1, 2])), "'user'", "20")
