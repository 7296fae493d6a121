"""Host-resident tables with a device cache: bitwise equal to tables in device memory."""
import dataclasses

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables
from embedding.kernels.cache import RowCache
from embedding.kernels.tiered import TieredTables
from embedding.types import CachePolicy, OptimizerConfig, OptimizerKind, TableMemory, Tier

ROWS = (40, 7, 25)
DIMS = (4, 4, 8)
OPTS = [OptimizerConfig(k, lr=0.05) for k in OptimizerKind]


def zipf_bags(rng, batch=6, groups=2, max_len=4, weighted=False, mean=False):
    """Bags over the three tables (two slots read table 0), skewed ids."""
    slot_table = (0, 1, 2, 0)
    slot_col, col = [], 0
    for t in slot_table:
        slot_col.append(col)
        col += DIMS[t]
    lens, vals = [], []
    for _ in range(groups):
        for t in slot_table:
            for _ in range(batch):
                n = int(rng.integers(0, max_len + 1))
                lens.append(n)
                vals.extend(np.minimum(rng.zipf(1.3, n) - 1, ROWS[t] - 1))
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    ids = np.asarray(vals, np.int64)
    w = rng.random(ids.size) if weighted else None
    return Bags(ids, offsets, slot_table, tuple(slot_col), (mean,) * 4, batch, col, groups, w)


def make(kind, memory=None, dtype="float64"):
    opt = OptimizerConfig(kind, lr=0.05)
    if memory is None:
        store = FusedTables(ROWS, DIMS, opt, dtype=dtype)
    else:
        store = TieredTables(ROWS, DIMS, opt, memory, dtype=dtype)
    rng = np.random.default_rng(7)
    for t in range(len(ROWS)):
        store.weight(t)[...] = rng.standard_normal((ROWS[t], DIMS[t]))
    return store


def train(store, steps=6, seed=3, fused=True, weighted=False, mean=False):
    rng = np.random.default_rng(seed)
    outs = []
    for _ in range(steps):
        bags = zipf_bags(rng, weighted=weighted, mean=mean)
        store.prefetch(bags)
        out = store.lookup(bags)
        outs.append(out.copy())
        grad = np.sin(out) + 0.1
        if fused:
            store.backward_update(bags, grad)
        else:
            store.update(store.aggregate(bags, grad))
    return outs


def state_of(store):
    out = []
    for t in range(len(ROWS)):
        out.append(np.array(store.weight(t)))
        from embedding.optim import state_specs

        for spec in state_specs(store.optimizers[t].kind):
            out.append(np.array(store.state_view(t, spec.name)))
    return out


@pytest.mark.parametrize("kind", list(OptimizerKind))
@pytest.mark.parametrize("cache", [1, 3, 10, 40])
@pytest.mark.parametrize("policy", list(CachePolicy))
def test_cached_training_is_bitwise_equal_to_device_tables(kind, cache, policy):
    ref = make(kind)
    want = train(ref)
    mem = [TableMemory(Tier.CACHED, cache, policy), TableMemory(Tier.HOST),
           TableMemory(Tier.CACHED, min(cache, 25), policy, admit_after=2)]
    tiered = make(kind, mem)
    got = train(tiered)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(state_of(ref), state_of(tiered)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", list(OptimizerKind))
def test_aggregate_then_update_and_weighted_mean_bags_are_exact(kind):
    ref = make(kind, dtype="float32")
    want = train(ref, fused=False, weighted=True, mean=True)
    tiered = make(kind, [TableMemory(Tier.CACHED, 2)] * 3, dtype="float32")
    got = train(tiered, fused=False, weighted=True, mean=True)
    for a, b in zip(want + state_of(ref), got + state_of(tiered)):
        np.testing.assert_array_equal(a, b)


def test_aggregate_returns_table_rows_ascending():
    tiered = make(OptimizerKind.SGD, [TableMemory(Tier.CACHED, 5)] * 3)
    ref = make(OptimizerKind.SGD)
    bags = zipf_bags(np.random.default_rng(1))
    g = np.ones((bags.out_rows, bags.out_dim))
    ref.lookup(bags)
    tiered.lookup(bags)
    for (r1, g1), (r2, g2) in zip(ref.aggregate(bags, g), tiered.aggregate(bags, g)):
        order = np.argsort(r1)
        np.testing.assert_array_equal(r1[order], r2)
        np.testing.assert_array_equal(g1[order], g2)


def test_a_lookup_between_a_prefetch_and_its_batch_sees_the_fetched_rows():
    ref, tiered = make(OptimizerKind.SGD), make(OptimizerKind.SGD,
                                                [TableMemory(Tier.CACHED, 4)] * 3)
    rng = np.random.default_rng(8)
    a, b = zipf_bags(rng), zipf_bags(rng)
    for store in (ref, tiered):
        store.lookup(a)
        store.prefetch(b)
        # b's rows looked up (as another batch) before b lands
        store.outs = [store.lookup(dataclasses.replace(b)).copy()]
    np.testing.assert_array_equal(ref.outs[0], tiered.outs[0])


def test_two_steps_in_flight_and_forward_only_steps():
    """Lookup b before a's update (rows shared across steps stay put); a dropped step."""
    kind = OptimizerKind.ADAM
    ref, tiered = make(kind), make(kind, [TableMemory(Tier.CACHED, 1)] * 3)
    rng = np.random.default_rng(5)
    a, b, c = (zipf_bags(rng) for _ in range(3))
    for store in (ref, tiered):
        oa = store.lookup(a)
        ob = store.lookup(b)
        store.backward_update(a, np.cos(oa))
        store.backward_update(b, np.cos(ob))
        store.lookup(c)  # evaluation: no backward
    assert tiered.open_steps() == 1
    tiered.drop_steps()
    assert tiered.open_steps() == 0
    for x, y in zip(state_of(ref), state_of(tiered)):
        np.testing.assert_array_equal(x, y)


def test_a_skipped_backward_is_dropped_and_cannot_come_later():
    kind = OptimizerKind.ADAM
    ref, tiered = make(kind), make(kind, [TableMemory(Tier.CACHED, 2)] * 3)
    rng = np.random.default_rng(0)
    a, b = zipf_bags(rng), zipf_bags(rng)
    for store in (ref, tiered):
        oa = store.lookup(a)
        ob = store.lookup(b)
    for store in (ref, tiered):
        store.backward_update(b, np.cos(ob))     # a's backward never comes
    assert tiered.open_steps() == 0
    with pytest.raises(ValueError, match="not an open step"):
        tiered.backward_update(a, oa)
    for x, y in zip(state_of(ref), state_of(tiered)):
        np.testing.assert_array_equal(x, y)


def test_gather_then_update_dedup_path():
    kind = OptimizerKind.ROWWISE_ADAGRAD
    ref, tiered = make(kind), make(kind, [TableMemory(Tier.CACHED, 2)] * 3)
    pairs = [(0, np.array([3, 1, 3])), (2, np.array([24, 0]))]
    g0 = np.arange(8.0).reshape(2, 4)
    for store in (ref, tiered):
        rows = store.gather(pairs)
        np.testing.assert_array_equal(np.asarray(rows[0])[0], np.asarray(store.host.weight(0)[3])
                                      if store is tiered else ref.weight(0)[3])
        store.update([(np.array([1, 3]), g0), (np.zeros(0, np.int64), np.zeros((0, 4))),
                      (np.array([0]), np.ones((1, 8)))])
    for x, y in zip(state_of(ref), state_of(tiered)):
        np.testing.assert_array_equal(x, y)


def test_stats_count_hits_and_bytes():
    tiered = make(OptimizerKind.ROWWISE_ADAGRAD, [TableMemory(Tier.CACHED, 40)] +
                  [TableMemory(Tier.HOST)] * 2)
    bags = Bags(np.array([1, 2, 1, 3]), np.array([0, 2, 3, 4]), (0, 1, 2), (0, 4, 8), (False,) * 3,
                1, 16)
    out = tiered.lookup(bags)
    tiered.backward_update(bags, np.ones_like(out))
    first = tiered.take_stats()
    assert (first.lookups, first.hits) == (4, 0)
    row0 = 4 * 8 + 8           # dim 4 float64 + one float64 accumulator
    row2 = 8 * 8 + 8
    assert first.bytes_in == 2 * row0 + row0 + row2       # table 1 has dim 4 too
    # staging rows (host tier) go back at once; cached rows stay
    assert first.bytes_out == row0 + row2
    tiered.lookup(bags)
    second = tiered.take_stats()
    assert (second.lookups, second.hits) == (4, 2)
    assert second.hit_rate == 0.5


@pytest.mark.parametrize("policy,victim", [(CachePolicy.LRU, 1), (CachePolicy.LFU, 2)])
def test_eviction_order(policy, victim):
    cache = RowCache(10, 2, policy)
    for rows in ([1], [1], [1], [2], [2]):
        got, _ = cache.acquire(np.array(rows))
        cache.release(got.slots)
    # rows 1 (used 3 times, long ago) and 2 (used twice, just now) fill the cache
    got, _ = cache.acquire(np.array([5]))
    cache.release(got.slots)
    assert victim not in cache.resident() and 5 in cache.resident()


def test_admission_threshold_stages_until_the_nth_access():
    cache = RowCache(10, 4, CachePolicy.LRU, admit_after=3)
    for n in range(1, 4):
        got, _ = cache.acquire(np.array([7]))
        assert got.fetch_rows.tolist() == [7]
        cache.release(got.slots)
        assert (7 in cache.resident()) == (n == 3)
    got, _ = cache.acquire(np.array([7]))
    assert got.fetch_rows.size == 0 and got.hits == 1


def test_dirty_rows_are_written_back_on_eviction_only():
    cache = RowCache(10, 1)
    got, _ = cache.acquire(np.array([4]))
    cache.mark_dirty(got.slots)
    cache.release(got.slots)
    got, _ = cache.acquire(np.array([6]))
    assert got.evict_rows.tolist() == [4] and got.fetch_rows.tolist() == [6]
    cache.release(got.slots)
    got, _ = cache.acquire(np.array([4]))     # 6 is clean: nothing goes back
    assert got.evict_rows.size == 0


def test_tier_settings_are_checked_with_the_table_named():
    with pytest.raises(ValueError, match="TieredTables holds host and cached"):
        TieredTables(ROWS, DIMS, OPTS[0], [TableMemory()] * 3)
    with pytest.raises(ValueError, match="one TableMemory per table"):
        TieredTables(ROWS, DIMS, OPTS[0], [TableMemory(Tier.HOST)])
    tiered = make(OptimizerKind.SGD, [TableMemory(Tier.HOST)] * 3)
    bad = Bags(np.array([7]), np.array([0, 1, 1, 1]), (1, 0, 2), (0, 4, 8), (False,) * 3, 1, 16)
    with pytest.raises(ValueError, match="id 7 of table1 is outside"):
        tiered.lookup(bad)


def test_cache_benchmark_runs_and_reports_every_setting(tmp_path):
    """scripts/bench_cache.py on a small case: one row per (ids, cache), ratios to device."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "bench_cache.py"
    spec = importlib.util.spec_from_file_location("bench_cache", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cache.json"
    rc = bench.main(["--tables", "2", "--rows", "500", "--dim", "8", "--batch", "64",
                     "--cache", "1", "50", "--dists", "zipf1.2", "uniform", "--warmup", "2",
                     "--iters", "3", "--json", str(out), "--plot", str(tmp_path / "c.png")])
    assert rc == 0 and (tmp_path / "c.png").stat().st_size > 0
    res = json.loads(out.read_text())["results"]
    assert [(r["ids"], r["cache_pct"]) for r in res] == [
        ("zipf1.2", None), ("zipf1.2", 1), ("zipf1.2", 50),
        ("uniform", None), ("uniform", 1), ("uniform", 50)]
    dev = {r["ids"]: r["samples_per_s"] for r in res if r["cache_pct"] is None}
    for r in res:
        assert r["ratio"] == pytest.approx(r["samples_per_s"] / dev[r["ids"]])
        if r["cache_pct"] is not None:
            assert 0 <= r["hit_rate"] <= 1 and r["h2d_mb_per_step"] > 0
    # the skewed ids hit a half-table cache more often than uniform ones
    hit = {(r["ids"], r["cache_pct"]): r.get("hit_rate") for r in res}
    assert hit[("zipf1.2", 50)] > hit[("uniform", 50)]


def test_host_views_drop_open_and_prefetched_steps():
    """Reading the tables mid-step (a state dict after a forward without backward) works;
    the dropped step's backward then raises, and a prefetched batch is looked up afresh."""
    tiered = make(OptimizerKind.SGD, [TableMemory(Tier.CACHED, 3)] * 3)
    rng = np.random.default_rng(2)
    a, b = zipf_bags(rng), zipf_bags(rng)
    out = tiered.lookup(a)
    tiered.prefetch(b)
    before = np.array(tiered.weight(0))
    assert tiered.open_steps() == 0 and not tiered._prefetched
    assert all(not c.pins.any() for c in tiered.caches)
    with pytest.raises(ValueError, match="not an open step"):
        tiered.backward_update(a, out)
    ob = tiered.lookup(b)
    tiered.backward_update(b, np.ones_like(ob))
    assert not np.array_equal(before, tiered.weight(0))


def test_hit_rate_counts_every_id_and_row_hit_rate_each_distinct_row():
    tiered = make(OptimizerKind.SGD, [TableMemory(Tier.CACHED, 5)] * 3)
    warm = Bags(np.array([4]), np.array([0, 1, 1, 1]), (0, 1, 2), (0, 4, 8), (False,) * 3, 1, 16)
    tiered.backward_update(warm, np.zeros_like(tiered.lookup(warm)))
    tiered.take_stats()
    # table 0 reads row 4 (cached) three times and row 9 (not cached) once
    bags = Bags(np.array([4, 4, 4, 9]), np.array([0, 4, 4, 4]), (0, 1, 2), (0, 4, 8),
                (False,) * 3, 1, 16)
    tiered.lookup(bags)
    st = tiered.take_stats()
    assert (st.accesses, st.access_hits, st.lookups, st.hits) == (4, 3, 2, 1)
    assert st.hit_rate == 0.75 and st.row_hit_rate == 0.5
