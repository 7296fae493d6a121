"""Host-resident tables on the device: a CuPy cache in front of NumPy rows.

The missed rows travel through a pinned buffer and a side stream
(:mod:`embedding.kernels.staging`); these tests drive the store directly, so
that on the device stand-in a missing event wait or a pinned buffer refilled
too early fails deterministically. Device tiered tables must train bitwise
like the same tables in device memory (the same kernels run on both).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from embedding.kernels import FusedTables
from embedding.kernels.staging import Part, RowFetcher
from embedding.kernels.tiered import TieredTables
from embedding.optim import state_specs
from embedding.types import CachePolicy, OptimizerConfig, OptimizerKind, TableMemory, Tier

cp = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "embedding"))
from test_tiered import DIMS, ROWS, zipf_bags  # noqa: E402


def _store(kind, memory=None):
    opt = OptimizerConfig(kind, lr=0.05)
    if memory is None:
        store = FusedTables(ROWS, DIMS, opt, dtype="float64", device="cuda")
    else:
        store = TieredTables(ROWS, DIMS, opt, memory, dtype="float64", device="cuda")
    rng = np.random.default_rng(7)
    for t in range(len(ROWS)):
        w = rng.standard_normal((ROWS[t], DIMS[t]))
        if memory is None:
            store.weight(t)[...] = cp.asarray(w)
        else:
            store.weight(t)[...] = w
    return store


def _state(store):
    out = []
    for t in range(len(ROWS)):
        for arr in [store.weight(t)] + [store.state_view(t, s.name)
                                        for s in state_specs(store.optimizers[t].kind)]:
            out.append(cp.asnumpy(arr) if isinstance(arr, cp.ndarray) else np.array(arr))
    return out


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("cache", [1, 3, 40])
def test_prefetched_device_cache_trains_like_device_tables(kind, cache):
    """Batch i+1 prefetched before batch i's update, a forward-only batch dropped between
    steps, the aggregate + update path on odd steps: outputs and tables bitwise equal."""
    ref = _store(kind)
    mem = [TableMemory(Tier.CACHED, cache, CachePolicy.LFU), TableMemory(Tier.HOST),
           TableMemory(Tier.CACHED, min(cache, 25), admit_after=2)]
    tiered = _store(kind, mem)
    rng = np.random.default_rng(3)
    bags = [zipf_bags(rng) for _ in range(6)]
    probe = dataclasses.replace(bags[3])  # batch 3's rows, looked up before they land
    for store in (ref, tiered):
        outs = []
        for i, b in enumerate(bags):
            out = store.lookup(b)
            outs.append(cp.asnumpy(out))
            if i + 1 < len(bags):
                store.prefetch(bags[i + 1])
            if i == 2:   # an evaluation batch after the prefetch, never updated
                outs.append(cp.asnumpy(store.lookup(probe)))
                if store is tiered:
                    store.drop_steps(keep=1)
            grad = cp.sin(out) + 0.1
            if i % 2:
                store.update(store.aggregate(b, grad))
            else:
                store.backward_update(b, grad)
        store.outs = outs
    for a, b in zip(ref.outs, tiered.outs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_state(ref), _state(tiered)):
        np.testing.assert_array_equal(a, b)
    assert tiered.stats.bytes_in > 0


def test_fetched_rows_land_after_the_copy_and_the_pinned_buffer_waits():
    """Two fetches back to back through one pinned buffer, landed out of order."""
    f = RowFetcher(cp)
    src = np.arange(120, dtype=np.float32).reshape(30, 4)
    state = np.arange(30, dtype=np.int64)
    a = cp.zeros((6, 4), np.float32)
    s = cp.zeros(6, np.int64)
    first = f.start([Part("w", src, np.array([3, 7]), np.array([0, 4])),
                     Part("s", state, np.array([3, 7]), np.array([0, 4]))])
    second = f.start([Part("w", src, np.array([29]), np.array([5]))])
    target = {"w": a, "s": s}.__getitem__
    f.land(second, target)
    f.land(first, target)
    np.testing.assert_array_equal(cp.asnumpy(a)[[0, 4, 5]], src[[3, 7, 29]])
    np.testing.assert_array_equal(cp.asnumpy(s)[[0, 4]], [3, 7])
    assert f.start([Part("w", src, np.zeros(0, np.int64), np.zeros(0, np.int64))]) is None


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD],
                         ids=lambda k: k.value)
def test_fetch_buffers_outlive_the_scatters_that_read_them(kind):
    """Training steps with the next batch prefetched at once, nothing read back to the host
    in between: every step fetches rows and evicts none, so each step's fetch buffer goes
    back to CuPy's pool (the side stream's arena) while the scatter out of it may still be
    queued on the compute stream. The next fetch must not get that block before the scatter
    ran (the stand-in's pool reports such a reuse); training stays bitwise equal."""
    ref = _store(kind)
    tiered = _store(kind, [TableMemory(Tier.CACHED, r) for r in ROWS])  # room for every row
    rng = np.random.default_rng(11)
    bags = [zipf_bags(rng) for _ in range(8)]
    for store in (ref, tiered):
        outs = []
        for i, b in enumerate(bags):
            out = store.lookup(b)
            if i + 1 < len(bags):
                store.prefetch(bags[i + 1])
            store.backward_update(b, cp.sin(out) + 0.1)
            outs.append(out)
        store.outs = [cp.asnumpy(o) for o in outs]
    stats = tiered.take_stats()
    assert stats.bytes_in > 0 and stats.bytes_out == 0  # rows fetched, none evicted
    for a, b in zip(ref.outs, tiered.outs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_state(ref), _state(tiered)):
        np.testing.assert_array_equal(a, b)
