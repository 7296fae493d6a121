"""Half-precision table storage: rounding, the NumPy kernels, the store and the planner."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables
from embedding.planner.estimate import shard_memory, touch_bytes_per_id
from embedding.precision import Rounding, random_bits, round_bits, round_to, storage_dtype
from embedding.types import OptimizerConfig, OptimizerKind, TableConfig

HALVES = ("float16", "bfloat16")


def _finite_float32(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 20, n))).astype(np.float32)
    both = np.concatenate([x, y])
    return both[np.isfinite(both)]


@pytest.mark.parametrize("name", HALVES)
def test_nearest_rounding_is_astype_bit_for_bit(name):
    x = _finite_float32(200_000)
    dt = storage_dtype(name)
    with np.errstate(over="ignore"):
        want = x.astype(dt).view(np.uint16)
    np.testing.assert_array_equal(round_bits(x, dt), want)


@pytest.mark.parametrize("name", HALVES)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(name):
    dt = storage_dtype(name)
    x = np.float32([0.1, -1.0 / 3, 3e-3, 1234.567, 6e-6])   # 6e-6: a float16 subnormal
    n = 20_000
    vals = np.broadcast_to(x, (n, x.size))
    got = round_to(vals, dt, Rounding.STOCHASTIC, seed=7, step=3, table=1,
                   rows=np.arange(n)).astype(np.float64)
    # every result is one of the two neighbours of x
    down = np.nextafter(x.astype(dt), np.asarray(-np.inf, dt)).astype(np.float64)
    up = np.nextafter(x.astype(dt), np.asarray(np.inf, dt)).astype(np.float64)
    near = x.astype(dt).astype(np.float64)
    assert np.all((got == near) | (got == down) | (got == up))
    gap = up - down
    # the mean converges to the float32 value (within 5 standard errors of the gap)
    err = np.abs(got.mean(axis=0) - x.astype(np.float64))
    assert np.all(err < 5 * (gap / 2) / np.sqrt(n)), (err, gap)
    # nearest rounding of the same values is biased by far more for at least one value
    assert np.max(np.abs(near - x) / gap) > 0.1


def test_random_bits_are_reproducible_and_keyed():
    a = random_bits(1, 2, 3, np.arange(5), 8)
    np.testing.assert_array_equal(a, random_bits(1, 2, 3, np.arange(5), 8))
    for other in (random_bits(2, 2, 3, np.arange(5), 8), random_bits(1, 3, 3, np.arange(5), 8),
                  random_bits(1, 2, 4, np.arange(5), 8), random_bits(1, 2, 3, np.arange(5) + 1, 8)):
        assert np.mean(a == other) < 0.1
    assert len(np.unique(a)) == a.size


def test_table_config_validates_precision():
    with pytest.raises(ValueError, match=r"dtype of table 'u'.*float16.*'int8'"):
        TableConfig("u", 10, 4, dtype="int8")
    with pytest.raises(ValueError, match=r"rounding of table 'u'.*'stochastic'.*float32"):
        TableConfig("u", 10, 4, rounding="stochastic")
    with pytest.raises(ValueError, match=r"rounding of table 'u'.*'up'"):
        TableConfig("u", 10, 4, dtype="bfloat16", rounding="up")
    with pytest.raises(ValueError, match=r"rounding_seed of table 'u'.*-1"):
        TableConfig("u", 10, 4, dtype="float16", rounding="stochastic", rounding_seed=-1)
    with pytest.raises(ValueError, match=r"state_dtype of table 'u'.*'int16'"):
        TableConfig("u", 10, 4, dtype="float16", state_dtype="int16")
    t = TableConfig("u", 10, 4, dtype="bfloat16", rounding="stochastic", rounding_seed=5,
                    state_dtype="bfloat16")
    assert t.rounding is Rounding.STOCHASTIC and t.optimizer_state_dtype == "bfloat16"
    assert TableConfig.from_dict(t.to_dict()) == t
    assert "rounding" not in TableConfig("v", 10, 4).to_dict()
    assert TableConfig("v", 10, 4, dtype="float16").optimizer_state_dtype == "float32"


def _bags(rng, rows, n_bags=12, max_len=4, dim=8, mean=False):
    """``n_bags`` bags of one slot of table 0 (``dim`` columns), 0 to ``max_len`` ids each."""
    lengths = rng.integers(0, max_len + 1, n_bags)
    idx = rng.integers(0, rows, int(lengths.sum()))
    return Bags(idx, np.concatenate([[0], np.cumsum(lengths)]), (0,), (0,), (mean,), n_bags, dim)


def _store(dtype, kind=OptimizerKind.ROWWISE_ADAGRAD, rows=50, dim=8, **kw):
    return FusedTables([rows], [dim], OptimizerConfig(kind, lr=0.05), dtype=dtype, **kw)


@pytest.mark.parametrize("name", HALVES)
@pytest.mark.parametrize("kind", list(OptimizerKind))
def test_half_store_computes_in_float32_and_rounds_to_nearest(name, kind):
    rng = np.random.default_rng(1)
    init = rng.standard_normal((50, 8)).astype(storage_dtype(name))
    half, ref = _store(name, kind), _store("float32", kind)
    half.weight(0)[...] = init
    ref.weight(0)[...] = init.astype(np.float32)
    bags = _bags(rng, 50)
    out = half.lookup(bags)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref.lookup(bags))     # exact rows, float32 sums
    g = rng.standard_normal(out.shape).astype(np.float32)
    half.backward_update(bags, g)
    ref.backward_update(bags, g)
    with np.errstate(over="ignore"):
        want = ref.weight(0).astype(storage_dtype(name))
    np.testing.assert_array_equal(half.weight(0).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("name", HALVES)
def test_stochastic_updates_reproduce_and_stay_unbiased(name):
    rng = np.random.default_rng(2)
    bags = _bags(rng, 50, n_bags=30)
    grads = [rng.standard_normal((30, 8)).astype(np.float32) for _ in range(3)]

    def run(seed):
        s = _store(name, OptimizerKind.SGD, rounding="stochastic", seeds=[seed])
        s.weight(0)[...] = 0.25
        for g in grads:
            s.backward_update(bags, g)
        return s.weight(0).view(np.uint16).copy()
    a = run(3)
    np.testing.assert_array_equal(a, run(3))
    assert not np.array_equal(a, run(4))
    # the mean over seeds of one SGD step's stochastic result converges to the float32 value
    dt = storage_dtype(name)
    ref = _store("float32", OptimizerKind.SGD)
    ref.weight(0)[...] = 0.25
    ref.backward_update(bags, grads[0])
    touched = np.unique(bags.indices)
    acc = np.zeros((len(touched), 8))
    n = 400
    for seed in range(n):
        s = _store(name, OptimizerKind.SGD, rounding="stochastic", seeds=[seed])
        s.weight(0)[...] = 0.25
        s.backward_update(bags, grads[0])
        acc += s.weight(0)[touched].astype(np.float64)
    exact = ref.weight(0)[touched].astype(np.float64)
    gap = np.abs(np.nextafter(exact.astype(dt), np.asarray(np.inf, dt)).astype(np.float64)
                 - exact.astype(dt).astype(np.float64))
    sr_err = np.abs(acc / n - exact).mean()
    near_err = np.abs(exact.astype(dt).astype(np.float64) - exact).mean()
    assert sr_err < near_err / 3, (sr_err, near_err)
    assert np.all(np.abs(acc / n - exact) < 5 * gap / np.sqrt(n) + 1e-12)


@pytest.mark.parametrize("name", HALVES)
def test_master_copy_follows_the_float32_run(name):
    rng = np.random.default_rng(3)
    init = rng.standard_normal((50, 8)).astype(storage_dtype(name))
    half = _store(name, OptimizerKind.ADAM, rounding="master")
    ref = _store("float32", OptimizerKind.ADAM)
    half.weight(0)[...] = init
    half.sync_master()
    ref.weight(0)[...] = init.astype(np.float32)
    for _ in range(3):
        bags = _bags(rng, 50)
        g = rng.standard_normal((12, 8)).astype(np.float32)
        half.backward_update(bags, g)
        ref.backward_update(bags, g)
    np.testing.assert_array_equal(half.master, ref.weights)   # the rule ran on float32 rows
    np.testing.assert_array_equal(half.weights.view(np.uint16),
                                  ref.weights.astype(storage_dtype(name)).view(np.uint16))


def test_half_optimizer_state_rounds_to_nearest():
    rng = np.random.default_rng(4)
    bags = _bags(rng, 50)
    g = rng.standard_normal((12, 8)).astype(np.float32)
    half = _store("bfloat16", state_dtype="bfloat16")
    ref = _store("bfloat16")
    half.backward_update(bags, g)
    ref.backward_update(bags, g)
    mom = half.state_view(0, "momentum")
    assert mom.dtype == storage_dtype("bfloat16")
    np.testing.assert_array_equal(mom.view(np.uint16),
                                  ref.state_view(0, "momentum").astype(mom.dtype).view(np.uint16))


def test_store_refuses_half_where_unsupported():
    with pytest.raises(ValueError, match=r"rounding.*stochastic.*float32"):
        _store("float32", rounding="stochastic")
    with pytest.raises(ValueError, match=r"state_dtype: .*bfloat16 optimizer state.*float64"):
        _store("float64", state_dtype="bfloat16", device="cuda")
    with pytest.raises(ValueError, match=r"dtype: expected one of .*'int8'"):
        _store("int8")


def test_planner_counts_half_bytes():
    full = TableConfig("t", 1000, 64, optimizer=OptimizerConfig(OptimizerKind.ADAM))
    half = TableConfig("t", 1000, 64, dtype="bfloat16",
                       optimizer=OptimizerConfig(OptimizerKind.ADAM))
    narrow = TableConfig("t", 1000, 64, dtype="float16", state_dtype="float16",
                         optimizer=OptimizerConfig(OptimizerKind.ADAM))
    master = TableConfig("t", 1000, 64, dtype="float16", rounding="master",
                         optimizer=OptimizerConfig(OptimizerKind.ADAM))
    f, h, n, m = (shard_memory(t, 1000, 64) for t in (full, half, narrow, master))
    assert (f.weights, h.weights) == (1000 * 64 * 4, 1000 * 64 * 2)
    assert f.optimizer == h.optimizer == 2 * 1000 * 64 * 4
    assert n.optimizer == 2 * 1000 * 64 * 2
    assert m.optimizer == 2 * 1000 * 64 * 4 + 1000 * 64 * 4
    assert touch_bytes_per_id(half, 64) == 3 * 64 * 2 + 2 * 2 * 64 * 4


def _collection(dtype, rounding="nearest", seed=5):
    from embedding.collection import ShardedEmbeddingCollection
    from embedding.types import Pooling, ShardingPlan, TablePlan, cyclic_shards

    opt = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
    tables = [TableConfig("a", 30, 8, Pooling.SUM, optimizer=opt, dtype=dtype,
                          rounding=rounding),
              TableConfig("b", 7, 4, Pooling.MEAN, optimizer=opt)]
    plan = ShardingPlan(1, 1, tuple(TablePlan(t.name, "table_wise",
                                              cyclic_shards(t.num_rows, t.dim, 1))
                                    for t in tables))
    return ShardedEmbeddingCollection(tables, plan, seed=seed), plan


def _train(coll, steps=2, seed=3):
    from embedding.jagged import KeyedJagged

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kjt = KeyedJagged.from_lists({f: [rng.integers(0, n, rng.integers(0, 4)).tolist()
                                          for _ in range(6)] for f, n in (("a", 30), ("b", 7))})
        out = coll.forward(kjt)
        assert out.dtype == np.float32
        coll.backward(rng.standard_normal(out.shape).astype(np.float32))


@pytest.mark.parametrize("name", HALVES)
def test_collection_mixes_precisions_and_checkpoints_round_trip(tmp_path, name):
    from embedding.checkpoint.reader import load_checkpoint
    from embedding.checkpoint.writer import CheckpointWriter
    from embedding.train.state import load_shards, shard_arrays

    coll, plan = _collection(name, "stochastic")
    assert len(coll.strategies) == 2          # one store per storage precision
    _train(coll)
    arrays, slices = shard_arrays(coll, plan, 0)
    w = CheckpointWriter(tmp_path, step=2)
    w.write(arrays, slices)
    path = w.commit(plan=plan, tables=coll.tables)
    ckpt = load_checkpoint(path)
    ckpt.check_compatible(coll.tables)
    for target in (name, "float32", "float16" if name == "bfloat16" else "bfloat16"):
        other, _ = _collection(target, seed=9)
        ckpt.check_compatible(other.tables)      # any float precision loads
        load_shards(ckpt, other, plan, 0)
        want = coll.gather_table("a")            # float32, the collection's dtype
        got = other.gather_table("a")
        if target == "float32" or target == name:  # exact
            np.testing.assert_array_equal(got, want)
        else:                                    # rounded to nearest
            np.testing.assert_array_equal(got, want.astype(storage_dtype(target))
                                          .astype(np.float32))
        np.testing.assert_array_equal(other.gather_table("b"), coll.gather_table("b"))
    # a float32 checkpoint loads into a half table, rounded to nearest, and sets its master
    f32, _ = _collection("float32")
    _train(f32)
    arrays, slices = shard_arrays(f32, plan, 0)
    w = CheckpointWriter(tmp_path / "f32", step=2)
    w.write(arrays, slices)
    ckpt = load_checkpoint(w.commit(plan=plan, tables=f32.tables))
    half, _ = _collection(name, "master")
    load_shards(ckpt, half, plan, 0)
    want = f32.gather_table("a").astype(storage_dtype(name)).astype(np.float32)
    np.testing.assert_array_equal(half.gather_table("a"), want)
    store = half.strategies[0].fused
    # the master copy takes the checkpoint's float32 rows, not their rounding
    np.testing.assert_array_equal(store.master_weight(0), f32.gather_table("a"))


@pytest.mark.parametrize("rounding", ["stochastic", "master"])
@pytest.mark.parametrize("name", HALVES)
def test_a_resume_continues_a_half_table_bit_for_bit(tmp_path, name, rounding):
    """Saved after 2 steps and resumed: stochastic rounding draws the bits the run straight
    through would (the update counter resumes at the checkpoint's step), and a master table
    resumes its float32 rows, not their rounding."""
    from embedding.checkpoint.reader import load_checkpoint
    from embedding.checkpoint.writer import CheckpointWriter
    from embedding.train.state import load_shards, shard_arrays

    straight, plan = _collection(name, rounding)
    _train(straight, steps=2, seed=3)
    _train(straight, steps=3, seed=4)
    first, _ = _collection(name, rounding)
    _train(first, steps=2, seed=3)
    arrays, slices = shard_arrays(first, plan, 0)
    if rounding == "master":
        assert arrays["emb/a/0/weight"].dtype == np.float32
        assert not np.array_equal(arrays["emb/a/0/weight"],
                                  first.gather_table("a"))  # more precise than storage
    w = CheckpointWriter(tmp_path, step=2)
    w.write(arrays, slices)
    ckpt = load_checkpoint(w.commit(plan=plan, tables=first.tables))
    resumed, _ = _collection(name, rounding, seed=9)
    load_shards(ckpt, resumed, plan, 0)
    _train(resumed, steps=3, seed=4)
    for t in ("a", "b"):
        np.testing.assert_array_equal(resumed.gather_table(t), straight.gather_table(t))
    a, b = straight.strategies[0].fused, resumed.strategies[0].fused
    for key in a.state:
        np.testing.assert_array_equal(np.asarray(a.state[key]), np.asarray(b.state[key]))
    if rounding == "master":
        np.testing.assert_array_equal(a.master_weight(0), b.master_weight(0))


def test_trainer_config_reads_precision_and_names_bad_keys(tmp_path):
    from embedding.train.config import load_config
    from embedding.train.setup import build_tables
    from embedding.train.types import ConfigError

    p = tmp_path / "c.toml"
    p.write_text('[tables]\ndtype = "bfloat16"\nrounding = "stochastic"\nrounding_seed = 4\n'
                 'state_dtype = "float16"\n')
    cfg = load_config(str(p))
    t = build_tables(cfg, [10, 20], ["f0", "f1"], (), ())[0]
    assert (t.dtype, t.rounding, t.rounding_seed, t.state_dtype) == (
        "bfloat16", Rounding.STOCHASTIC, 4, "float16")
    for text, key in (('[tables]\ndtype = "int8"\n', "tables.dtype"),
                      ('[tables]\nrounding = "stochastic"\n', "tables.rounding"),
                      ('[tables]\ndtype = "float16"\n[model]\ndtype = "float64"\n',
                       "tables.dtype")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(str(p))
    # half tables may be host-resident or dynamic
    for text in ('[tables]\ndtype = "float16"\ntier = "host"\n',
                 '[tables]\ndtype = "bfloat16"\nrounding = "master"\ndynamic = true\n'):
        p.write_text(text)
        load_config(str(p))
