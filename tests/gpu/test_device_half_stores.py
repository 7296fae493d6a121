"""Half tables in the host-resident (tiered) and dynamic stores on the device.

A tiered half table's device cache holds the rows in their 16-bit storage and the copies
move the bits; stochastic rounding hashes a cached row's host row, so the device tiered
store trains bit for bit like the same half tables in device memory (the same kernels),
and, for SGD and Adam, like the NumPy in-memory store (``test_half_kernels``' contract).
A dynamic half table hashes the id a row holds, on the device as on the host: the two forms
train bit for bit alike.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from embedding.collection import dynamic_initializer
from embedding.kernels import Bags, FusedTables
from embedding.kernels.dynamic import DynamicTables
from embedding.kernels.tiered import TieredTables
from embedding.precision import storage_dtype
from embedding.types import (CachePolicy, Eviction, OptimizerConfig, OptimizerKind,
                             TableConfig, TableMemory, Tier)

cp = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "embedding"))
from test_half_stores import _assert_same, _bits, _contents  # noqa: E402
from test_tiered import DIMS, ROWS, zipf_bags  # noqa: E402

HALVES = ("float16", "bfloat16")
ROUNDINGS = ("nearest", "stochastic", "master")




def _store(kind, name, rounding, device, memory=None):
    opt = OptimizerConfig(kind, lr=0.05)
    kw = dict(dtype=name, rounding=rounding, seeds=[3, 4, 5], device=device)
    store = (FusedTables(ROWS, DIMS, opt, **kw) if memory is None
             else TieredTables(ROWS, DIMS, opt, memory, **kw))
    rng = np.random.default_rng(7)
    for t in range(len(ROWS)):
        w = rng.standard_normal((ROWS[t], DIMS[t])).astype(storage_dtype(name))
        view = store.weight(t)
        view[...] = cp.asarray(w) if isinstance(view, cp.ndarray) else w
    store.sync_master()
    return store


def _run(store, bags):
    """Lookups with the next batch prefetched, a forward-only batch dropped, the aggregate +
    update path on odd steps; the outputs (NumPy)."""
    xp = cp if store.device == "cuda" else np
    outs = []
    for i, b in enumerate(bags):
        out = store.lookup(b)
        outs.append(cp.asnumpy(out) if xp is cp else out.copy())
        if i + 1 < len(bags):
            store.prefetch(bags[i + 1])
        if i == 2:   # an evaluation batch after the prefetch, never updated
            probe = dataclasses.replace(bags[3])
            store.lookup(probe)
            if isinstance(store, TieredTables):
                store.drop_steps(keep=1)
        grad = xp.sin(out) + xp.float32(0.1)
        if i % 2:
            store.update(store.aggregate(b, grad))
        else:
            store.backward_update(b, grad)
    return outs


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", HALVES)
def test_device_tiered_half_tables_train_like_half_tables_in_device_memory(name, rounding,
                                                                          kind):
    rng = np.random.default_rng(3)
    bags = [zipf_bags(rng) for _ in range(6)]
    mem = [TableMemory(Tier.CACHED, 1, CachePolicy.LFU), TableMemory(Tier.HOST),
           TableMemory(Tier.CACHED, 3, admit_after=2)]
    ref = _store(kind, name, rounding, "cuda")
    tiered = _store(kind, name, rounding, "cuda", mem)
    want, got = _run(ref, bags), _run(tiered, bags)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    _assert_same(_contents(ref), _contents(tiered))
    assert tiered.work.weight(0).dtype == storage_dtype(name)
    assert tiered.stats.bytes_in > 0
    if kind is not OptimizerKind.ROWWISE_ADAGRAD:   # warp-order mean of squares aside
        host = _store(kind, name, rounding, "cpu")
        for a, b in zip(_run(host, bags), got):
            np.testing.assert_array_equal(a, b)
        _assert_same(_contents(host), _contents(tiered))


def _bags(bag_ids, dim):
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bag_ids])]).astype(np.int64)
    idx = np.concatenate([np.asarray(b, np.int64) for b in bag_ids])
    return Bags(idx, offsets, (0,), (0,), (False,), len(bag_ids), dim, 1, None)


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ADAM],
                         ids=lambda k: k.value)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", HALVES)
def test_device_dynamic_half_store_trains_like_the_host_store(name, rounding, kind):
    rng = np.random.default_rng(1)
    opt = OptimizerConfig(kind, lr=0.1)
    table = TableConfig("d", 12, 8, dynamic=True, optimizer=opt)
    stores = [DynamicTables([12], [8], opt, [Eviction.AGE], names=["d"], device=d, dtype=name,
                            rounding=rounding, seeds=[9], state_dtype=name)
              for d in ("cpu", "cuda")]
    for s in stores:
        s.set_initializer(0, dynamic_initializer(table, 2))
    pool = rng.integers(-2**40, 2**40, 25)
    for i in range(6):
        bags = _bags([rng.choice(pool, rng.integers(0, 4)).tolist() for _ in range(4)], 8)
        outs = [stores[0].lookup(bags), stores[1].lookup(bags).get()]
        np.testing.assert_array_equal(outs[0], outs[1])
        g = rng.standard_normal(outs[0].shape).astype(np.float32)
        if i % 2:
            stores[0].update(stores[0].aggregate(bags, g))
            stores[1].update(stores[1].aggregate(bags, cp.asarray(g)))
        else:
            stores[0].backward_update(bags, g)
            stores[1].backward_update(bags, cp.asarray(g))
    a, b = stores[0].entries(0), stores[1].entries(0)
    assert set(a) == set(b) and a["ids"].size == 12      # evictions happened
    assert stores[1].weight(0).dtype == storage_dtype(name)
    for part in a:
        np.testing.assert_array_equal(_bits(a[part]), _bits(b[part]), err_msg=part)
    if rounding == "master":
        assert a["weight"].dtype == np.float32
