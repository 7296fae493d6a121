"""The broadcast reader (one reader rank, OneToMany to the others) equals rank-local reading."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.data import BroadcastReader, ShardedReader, SyntheticConfig, SyntheticDataset

pytestmark = pytest.mark.layouts("1x2", "1x3", "2x2", why=(
    "one reader and its receivers at a power of two, three ranks and across nodes"))


def test_broadcast_reader_matches_sharded_reader_for_every_root(world, all_ranks):
    ds = SyntheticDataset(SyntheticConfig(table_sizes=(500,) * 26, seed=2), 4096)
    ok = True
    for root in range(world.size):
        reader = BroadcastReader(ds if world.rank == root else None, 96, world.rank, world.size,
                                 root=root, shuffle=True, seed=5)
        ref = ShardedReader(ds, 96, world.rank, world.size, shuffle=True, seed=5)
        for _ in range(3):
            a, b = reader.next(), ref.next()
            ok &= np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
            ok &= all(np.array_equal(x, y) for x, y in zip(a.values, b.values))
            ok &= all(np.array_equal(x, y) for x, y in zip(a.lengths, b.lengths))
    all_ranks(ok, "broadcast reader differs from the sharded reader")
