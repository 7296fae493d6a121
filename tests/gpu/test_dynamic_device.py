"""Dynamic tables on the device (a GPU, or the stand-in running the probe kernel on PoCL):
the CuPy id map and the device store against the NumPy ones."""
from __future__ import annotations

import cupy as cp
import numpy as np
import pytest

from embedding.collection import dynamic_initializer
from embedding.kernels import Bags
from embedding.kernels.dynamic import DynamicTables
from embedding.kernels.idmap import IdMap
from embedding.optim import state_specs
from embedding.types import Eviction, OptimizerConfig, OptimizerKind, TableConfig


@pytest.mark.parametrize("eviction", list(Eviction), ids=lambda e: e.value)
def test_device_map_makes_the_same_rows_and_slots(eviction):
    rng = np.random.default_rng(0)
    host, dev = IdMap(30, eviction), IdMap(30, eviction, xp=cp)
    pool = rng.integers(-2**62, 2**62, 80)
    for _ in range(30):
        ids = rng.choice(pool, rng.integers(1, 12))
        a, b = host.acquire(ids), dev.acquire(cp.asarray(ids))
        np.testing.assert_array_equal(a.rows, b.rows.get())
        np.testing.assert_array_equal(a.evicted_ids, b.evicted_ids.get())
    for name in ("keys", "slot_row", "row_id", "count", "last"):
        np.testing.assert_array_equal(getattr(host, name), getattr(dev, name).get())
    np.testing.assert_array_equal(host.find(pool), dev.find(cp.asarray(pool)).get())


def _bags(bag_ids, dim):
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bag_ids])]).astype(np.int64)
    idx = np.concatenate([np.asarray(b, np.int64) for b in bag_ids])
    return Bags(idx, offsets, (0,), (0,), (False,), len(bag_ids), dim, 1, None)


def test_device_store_trains_like_the_host_store():
    rng = np.random.default_rng(1)
    opt = OptimizerConfig(OptimizerKind.SGD, lr=0.1)
    table = TableConfig("d", 12, 8, dynamic=True, optimizer=opt)
    stores = [DynamicTables([12], [8], opt, [Eviction.AGE], names=["d"], device=d)
              for d in ("cpu", "cuda")]
    for s in stores:
        s.set_initializer(0, dynamic_initializer(table, 2))
    pool = rng.integers(-2**40, 2**40, 25)
    for _ in range(6):
        bags = _bags([rng.choice(pool, rng.integers(0, 4)).tolist() for _ in range(4)], 8)
        outs = [stores[0].lookup(bags), stores[1].lookup(bags).get()]
        np.testing.assert_array_equal(outs[0], outs[1])
        g = rng.standard_normal(outs[0].shape).astype(np.float32)
        stores[0].backward_update(bags, g)
        stores[1].backward_update(bags, cp.asarray(g))
    a, b = stores[0].entries(0), stores[1].entries(0)
    assert set(a) == set(b) and a["ids"].size == 12
    # evaluation: known and unseen ids read alike on both, and nothing moves
    bags = _bags([[int(a["ids"][0]), 2**41], [2**41 + 1], [int(a["ids"][3])]], 8)
    with stores[0].reading(), stores[1].reading():
        outs = [stores[0].lookup(bags), stores[1].lookup(bags).get()]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not outs[0][1].any() and outs[0][0].any()
    for s in stores:
        np.testing.assert_array_equal(s.entries(0)["count"], a["count"])
    for part in a:
        np.testing.assert_array_equal(a[part], b[part], err_msg=part)
    assert not state_specs(OptimizerKind.SGD)
