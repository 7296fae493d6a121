"""The compiled CPU kernels against the NumPy kernels, byte for byte.

Every case runs twice, once with ``NEOCOMM_EMBEDDING_KERNELS=numpy`` (the
reference) and once with ``compiled``, from the same starting weights and
state: lookups (sum, mean and max pooling, weighted ids, every wire format),
gradient aggregation, the fused backward with each optimizer, and updates of
given rows (duplicates, row-wise AdaGrad's terms) must give the same bytes.
Bags are random multi-hot (Zipf ids, fixed and variable lengths up to 200)
and adversarial (empty bags, one hot id repeated, the last row, ties under max
pooling, a table of one row, dims that are not multiples of 8).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables, TableLayout, compiled, cpu
from embedding.sharding.qcomm import CommPrecision, Wire
from embedding.types import OptimizerConfig, OptimizerKind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from gpu_cases import assert_same_bytes, bag_case  # noqa: E402

KINDS = (OptimizerKind.SGD, OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.ADAM)


def multi_hot(dtype="float32", seed=0, ids_per_bag=32, fixed=True, rows=(1000, 300, 1),
              dims=(16, 64, 5), groups=2, batch=64, weighted=False, mean=(False, True, False),
              slot_max=(False, False, True)):
    """Multi-hot bags over three tables: Zipf ids (a few rows take most of them), bags of
    ``ids_per_bag`` ids (or 0 to 2x that when not ``fixed``), a table of one row."""
    rng = np.random.default_rng(seed)
    layout = TableLayout(rows, dims)
    slot_table = tuple(range(len(rows)))
    cols = tuple(int(x) for x in np.concatenate([[0], np.cumsum(dims)[:-1]]))
    lens, ids = [], []
    for _ in range(groups):
        for t in slot_table:
            n = (np.full(batch, ids_per_bag) if fixed
                 else rng.integers(0, 2 * ids_per_bag + 1, batch))
            lens.extend(int(x) for x in n)
            ids.append((rng.zipf(1.2, int(n.sum())) - 1) % rows[t])
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ids = np.concatenate(ids).astype(np.int64)
    w = rng.uniform(-2, 2, ids.size) if weighted else None
    bags = Bags(ids, offsets, slot_table, cols, mean, batch, int(sum(dims)), groups, w,
                slot_max)
    weights = rng.standard_normal(layout.total_elements).astype(dtype)
    grad = rng.standard_normal((groups * batch, int(sum(dims)))).astype(dtype)
    return layout, bags, weights, grad


def both(monkeypatch, fn):
    """``fn()`` under the NumPy kernels, then under the compiled ones."""
    out = []
    for mode in ("numpy", "compiled"):
        monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", mode)
        out.append(fn())
    return out


def test_the_compiled_kernels_load(monkeypatch):
    # numba is a dependency: without this the comparisons below would compare NumPy with itself
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "compiled")
    assert compiled.kernels(np.float32) is not None and compiled.kernels(np.float64) is not None
    assert compiled.kernels(np.float16) is None   # half tables: the NumPy kernels
    title, state = compiled.info()
    assert state.startswith("compiled (numba")


CASES = {
    "adversarial": lambda dt, w: bag_case(dt, seed=3, weighted=w),
    "1-hot": lambda dt, w: multi_hot(dt, 1, 1, weighted=w),
    "8-hot": lambda dt, w: multi_hot(dt, 2, 8, weighted=w),
    "32-hot": lambda dt, w: multi_hot(dt, 3, 32, weighted=w),
    "variable": lambda dt, w: multi_hot(dt, 4, 32, fixed=False, weighted=w),
    "200-hot": lambda dt, w: multi_hot(dt, 5, 200, rows=(3, 50, 1), batch=8, weighted=w),
    "sum-only": lambda dt, w: multi_hot(dt, 6, 16, weighted=w, slot_max=(False,) * 3),
    # one id per bag and one dim: the lookup is one gather in output order; a table of many
    # rows per id: the backward sorts its ids by radix, not by counting over its rows
    "1-hot one dim": lambda dt, w: multi_hot(dt, 7, 1, rows=(300_000, 1000, 1),
                                             dims=(16, 16, 16), weighted=w),
    "8-hot big table": lambda dt, w: multi_hot(dt, 8, 8, rows=(120_000, 70_000, 1),
                                               dims=(32, 7, 16), weighted=w),
}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_lookup_and_aggregate(monkeypatch, case, dtype, weighted, threads):
    layout, bags, weights, grad = CASES[case](dtype, weighted)
    ref, got = both(monkeypatch, lambda: cpu.pooled_lookup(layout, weights, bags,
                                                           threads=threads))
    assert_same_bytes(got, ref, "lookup")
    ref, got = both(monkeypatch, lambda: cpu.aggregate_grads(layout, bags, grad, threads,
                                                             weights))
    for t, ((rr, rg), (gr, gg)) in enumerate(zip(ref, got)):
        o1, o2 = np.argsort(rr), np.argsort(gr)
        assert_same_bytes(gr[o2], rr[o1], f"rows of table {t}")
        assert_same_bytes(gg[o2], rg[o1], f"gradients of table {t}")


def test_lookup_into_a_strided_out(monkeypatch):
    layout, bags, weights, _ = multi_hot("float32", 7, 8)
    def run():
        big = np.full((bags.out_rows, bags.out_dim + 3), 7.0, np.float32)
        return cpu.pooled_lookup(layout, weights, bags, out=big[:, 1:1 + bags.out_dim]), big
    (ref, rbig), (got, gbig) = both(monkeypatch, run)
    assert_same_bytes(gbig, rbig, "strided out and the columns around it")


@pytest.mark.parametrize("precision", [CommPrecision.FP16, CommPrecision.BF16,
                                       CommPrecision.INT8], ids=lambda p: p.value)
def test_lookup_writes_the_same_wire_bytes(monkeypatch, precision):
    layout, bags, weights, _ = multi_hot("float32", 8, 8, dims=(16, 64, 8))
    kw = {"row": 8} if precision is CommPrecision.INT8 else {"scale": 64.0}
    wire = Wire(precision, np, np.float32, **kw)
    ref, got = both(monkeypatch, lambda: cpu.pooled_lookup(layout, weights, bags, wire=wire,
                                                           threads=2))
    assert_same_bytes(got, ref, precision.value)


def _tables(layout, weights, kind, dtype, threads):
    ft = FusedTables(layout.rows, layout.dims, OptimizerConfig(kind, lr=0.05), dtype=dtype,
                     threads=threads)
    ft.weights[...] = weights
    for name, arr in ft.state.items():   # state that is not zero: a later step, not the first
        if arr.dtype.kind == "f":
            arr[...] = np.random.default_rng(1).uniform(0, 0.5, arr.shape)
        else:
            arr[...] = np.random.default_rng(1).integers(0, 5, arr.shape)
    return ft


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["adversarial", "1-hot", "32-hot", "variable", "200-hot",
                                  "1-hot one dim", "8-hot big table"])
def test_backward_update(monkeypatch, case, dtype, kind, threads):
    layout, bags, weights, grad = CASES[case](dtype, True)

    def run():
        ft = _tables(layout, weights, kind, dtype, threads)
        for _ in range(2):    # two steps: the second reads the state the first wrote
            ft.lookup(bags)
            ft.backward_update(bags, grad)
        return ft

    ref, got = both(monkeypatch, run)
    assert_same_bytes(got.weights, ref.weights, "weights")
    for name in ref.state:
        assert_same_bytes(got.state[name], ref.state[name], name)
    assert not np.array_equal(ref.weights, weights)   # the step did something


@pytest.mark.parametrize("precision", [CommPrecision.FP16, CommPrecision.BF16],
                         ids=lambda p: p.value)
def test_backward_update_reads_the_wire(monkeypatch, precision):
    layout, bags, weights, grad = multi_hot("float32", 9, 8, weighted=True)
    wire = Wire(precision, np, np.float32, scale=128.0)
    received = wire.encode(grad.reshape(-1)).reshape(grad.shape)

    def run():
        ft = _tables(layout, weights, OptimizerKind.ROWWISE_ADAGRAD, "float32", 1)
        ft.backward_update(bags, received, wire)
        return ft

    ref, got = both(monkeypatch, run)
    assert_same_bytes(got.weights, ref.weights, "weights")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize("unique", [True, False])
def test_update_of_given_rows(monkeypatch, kind, unique):
    rng = np.random.default_rng(5)
    layout = TableLayout((50, 7), (16, 3))
    weights = rng.standard_normal(layout.total_elements).astype(np.float32)
    sparse = []
    for t in range(2):
        n = 40
        rows = (rng.integers(0, layout.rows[t], n) if not unique
                else rng.permutation(layout.rows[t])[:min(n, layout.rows[t])])
        sparse.append((rows.astype(np.int64),
                       rng.standard_normal((len(rows), layout.dims[t])).astype(np.float32)))
    terms = [rng.uniform(0, 1, len(r)).astype(np.float32) for r, _ in sparse] \
        if unique and kind is OptimizerKind.ROWWISE_ADAGRAD else None

    def run():
        ft = _tables(layout, weights, kind, "float32", 1)
        ft.update(sparse, unique=unique, row_terms=terms)
        return ft

    ref, got = both(monkeypatch, run)
    assert_same_bytes(got.weights, ref.weights, "weights")
    for name in ref.state:
        assert_same_bytes(got.state[name], ref.state[name], name)


@pytest.mark.parametrize("rows", [50, 70_000, 1 << 20, 1 << 40])
@pytest.mark.parametrize("per_bag", [1, 5])
def test_the_row_sort_is_numpys_stable_sort(rows, per_bag):
    # a counting sort over few rows, a radix sort of 1 to 4 passes over many; bags of ids read
    # where they lie in ``idx`` (runs of bags with gaps between, some bags empty), each id an
    # occurrence of its bag
    jit = compiled._load()
    rng = np.random.default_rng(rows % 997 + per_bag)
    pool = np.concatenate([[0, rows - 1], rng.integers(0, rows, 300)])
    idx = pool[rng.zipf(1.3, 4000) % pool.size].astype(np.int64)
    w = rng.standard_normal(idx.size)
    lens = rng.integers(0, 2 * per_bag + 1, 600) if per_bag > 1 else np.ones(600, np.int64)
    ends = 100 + np.cumsum(lens)            # bags from position 100 on, in two runs
    lo = np.concatenate([[100], ends[:-1]])
    keep = np.r_[0:250, 400:600]            # the bags of 250-399 are left out
    lo, hi = lo[keep], ends[keep]
    bag_occ = rng.integers(0, 1 << 40, lo.size)
    bad, occ, ws, uniq, starts, lens_got = jit.sort_by_row(idx, lo, hi, bag_occ, rows, w, True)
    pos = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
    ids, occ_in, ws_in = idx[pos], np.repeat(bag_occ, hi - lo), w[pos]
    order = np.argsort(ids, kind="stable")
    want_uniq, want_lens = np.unique(ids, return_counts=True)
    assert bad == -1
    assert np.array_equal(occ, occ_in[order]) and np.array_equal(ws, ws_in[order])
    assert np.array_equal(uniq, want_uniq) and np.array_equal(lens_got, want_lens)
    assert np.array_equal(starts, np.concatenate([[0], np.cumsum(want_lens)[:-1]]))
    assert jit.sort_by_row(idx, lo, hi, bag_occ, rows, w[:0], False)[2].size == 0
    for at, wrong in ((pos[7], rows), (pos[-3], -1)):
        bad_ids = idx.copy()
        bad_ids[at] = wrong
        assert jit.sort_by_row(bad_ids, lo, hi, bag_occ, rows, w, True)[0] == at
    outside = idx.copy()
    outside[:100] = -1                      # a bad id outside every bag is never read
    assert jit.sort_by_row(outside, lo, hi, bag_occ, rows, w, True)[0] == -1


def test_a_bad_id_is_named(monkeypatch):
    layout, bags, weights, grad = multi_hot("float32", 10, 4)
    idx = np.array(bags.indices)
    idx[5] = layout.rows[0] + 3
    bad = Bags(idx, bags.offsets, bags.slot_table, bags.slot_col, bags.slot_mean,
               bags.batch_size, bags.out_dim, bags.num_groups, None, bags.slot_max)
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "compiled")
    with pytest.raises(IndexError, match=rf"id {layout.rows[0] + 3} is out of range for local "
                                         rf"table 0 \({layout.rows[0]} rows\)"):
        cpu.pooled_lookup(layout, weights, bad)
    ft = _tables(layout, weights, OptimizerKind.SGD, "float32", 1)
    before = ft.weights.copy()
    with pytest.raises(IndexError, match=r"out of range for local table 0"):
        ft.backward_update(bad, grad)
    assert np.array_equal(ft.weights, before)   # nothing written before the check


@pytest.mark.parametrize("dim", [16, 300], ids=["summed-in-registers", "wide-rows"])
@pytest.mark.parametrize("pos", [0, 5], ids=["first-id", "later-id"])
@pytest.mark.parametrize("wrong", [-1, 1000, -(1 << 62)])
def test_a_bad_id_anywhere_in_a_bag_is_named(monkeypatch, dim, pos, wrong):
    # the first id of a bag is checked apart from the rest; a negative id is out of range
    # even where ids are compared as unsigned numbers
    layout, bags, weights, _ = multi_hot("float32", 13, 8, dims=(dim, 8, 8))
    idx = np.array(bags.indices)
    idx[pos] = wrong                 # group 0, slot 0 (table 0 of 1000 rows), bag 0
    bad = Bags(idx, bags.offsets, bags.slot_table, bags.slot_col, bags.slot_mean,
               bags.batch_size, bags.out_dim, bags.num_groups, None, bags.slot_max)
    for mode in ("numpy", "compiled"):
        monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", mode)
        with pytest.raises(IndexError, match=rf"indices\[{pos}\]: id {wrong} is out of range "
                                             rf"for local table 0 \(1000 rows\)"):
            cpu.pooled_lookup(layout, weights, bad)


def test_which_tables_the_register_sum_serves():
    from embedding.kernels import _jit

    def serves(dtype, d, out_dtype=None, cut=None):
        table = np.zeros((10, d), dtype)
        out = np.zeros((4, d), out_dtype or dtype)
        return _jit.pool_sum_rows(table if cut is None else table[:, :cut], out if cut is None
                                  else out[:, :cut]) is not None

    assert serves(np.float32, 64) and serves(np.float32, 1) and serves(np.float64, 128)
    assert serves(np.float32, 256)                     # 1 KiB a row: still in registers
    assert not serves(np.float32, 257) and not serves(np.float64, 129)   # wider: the loop
    assert not serves(np.float16, 64)                  # widened rows: the loop
    assert not serves(np.float32, 64, np.float64)      # another dtype out: the loop
    table = np.zeros((10, 64), np.float32)
    assert _jit.pool_sum_rows(table[:, ::2], np.zeros((4, 32), np.float32)) is None
    # the backward's sums likewise: in registers up to 1 KiB a row, else the loop for any dim
    loop = _jit.ANY_DIM.segment_update
    assert _jit.update_for(64, np.float32) is not loop
    assert _jit.update_for(128, np.float64) is not loop
    assert _jit.update_for(300, np.float32) is loop and _jit.update_for(129, np.float64) is loop


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype,dims", [("float32", (300, 16, 5)), ("float64", (130, 64, 3))])
def test_rows_wider_than_the_registers_agree_too(monkeypatch, dtype, dims, weighted):
    # sum (table 0, wider than VECTOR_ROW_BYTES: the loops), mean (table 1) and max pooling
    # (table 2), the lookup and the backward with each optimizer
    layout, bags, weights, grad = multi_hot(dtype, 14, 8, dims=dims, weighted=weighted,
                                            fixed=False)
    ref, got = both(monkeypatch, lambda: cpu.pooled_lookup(layout, weights, bags))
    assert_same_bytes(got, ref, "lookup")
    for kind in KINDS:
        def run():
            ft = _tables(layout, weights, kind, dtype, 1)
            ft.backward_update(bags, grad)
            return ft
        ref, got = both(monkeypatch, run)
        assert_same_bytes(got.weights, ref.weights, f"weights after {kind.value}")
        for name in ref.state:
            assert_same_bytes(got.state[name], ref.state[name], name)


@pytest.mark.parametrize("mode", ["numpy", "compiled"])
@pytest.mark.parametrize("wrong", [-1, 1000])
def test_a_bad_id_is_named_when_every_bag_holds_one(monkeypatch, mode, wrong):
    # the one-gather lookup checks each id against its own table, not the flat buffer
    layout, bags, weights, _ = multi_hot("float32", 11, 1, rows=(1000, 50, 1), dims=(8,) * 3)
    idx = np.array(bags.indices)
    idx[64 + 9] = wrong              # group 0, slot 1 (table 1 of 50 rows), bag 9
    bad = Bags(idx, bags.offsets, bags.slot_table, bags.slot_col, bags.slot_mean,
               bags.batch_size, bags.out_dim, bags.num_groups, None, bags.slot_max)
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", mode)
    with pytest.raises(IndexError, match=rf"indices\[73\]: id {wrong} is out of range for "
                                         rf"local table 1 \(50 rows\)"):
        cpu.pooled_lookup(layout, weights, bad)


def test_the_setting(monkeypatch):
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "numpy")
    assert compiled.kernels(np.float32) is None
    assert "NumPy" in compiled.info()[1]
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setattr(compiled, "_why", "ModuleNotFoundError: No module named 'numba'")
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "auto")
    assert compiled.kernels(np.float32) is None      # auto: NumPy when numba does not load
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "compiled")
    with pytest.raises(RuntimeError, match="NEOCOMM_EMBEDDING_KERNELS=compiled, but the "
                                           "compiled kernels do not load .*No module named"):
        compiled.kernels(np.float32)


def test_auto_serves_a_process_first_second_from_numpy_then_the_compiled_kernels(
        monkeypatch):
    """auto rents before it buys: the NumPy kernels until RENT_S seconds after the first
    call, then numba's (loaded then, once); bitwise the same results either way."""
    clock = [100.0]
    monkeypatch.setattr(compiled.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setattr(compiled, "_first_call", None)
    layout, bags, weights, _ = multi_hot("float32", 8, 4)
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "numpy")
    want = cpu.pooled_lookup(layout, weights, bags)
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "auto")
    served = []
    for at in (0.0, 0.5, compiled.RENT_S - 0.01, compiled.RENT_S, compiled.RENT_S + 5):
        clock[0] = 100.0 + at
        served.append(compiled.kernels(np.float32) is not None)
        assert_same_bytes(cpu.pooled_lookup(layout, weights, bags), want, f"lookup at {at} s")
    assert served == [False, False, False, True, True], served
    clock[0] = 100.0  # once loaded, the compiled kernels serve from then on
    assert compiled.kernels(np.float32) is not None
    monkeypatch.setenv("NEOCOMM_EMBEDDING_KERNELS", "compiled")  # compiled: from the first call
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setattr(compiled, "_first_call", None)
    assert compiled.kernels(np.float32) is not None


def test_threads_never_exceed_the_cores(monkeypatch, caplog):
    from embedding.kernels import pool
    from embedding.train import threads

    monkeypatch.setattr(threads, "host_cores", lambda: 2)
    assert threads.rank_threads(0, 2) == 1          # the default: cores over local ranks
    assert threads.rank_threads(2, 4) == 2
    with caplog.at_level("WARNING"):
        assert threads.rank_threads(16, 1) == 2
    assert "threads = 16, but this rank may run on 2 cores: using 2" in caplog.text
    seen = set()
    monkeypatch.setattr(pool, "host_cores", lambda: 1)   # one core: no pool at all
    import threading
    pool.run_all(lambda i: seen.add(threading.get_ident()), range(8), threads=8)
    assert seen == {threading.get_ident()}


@pytest.mark.parametrize("case", ["empty", "one", "repeated", "zipf", "extremes", "negative"])
def test_unique_is_numpys(monkeypatch, case):
    rng = np.random.default_rng(11)
    ids = {"empty": np.zeros(0, np.int64), "one": np.array([7]),
           "repeated": np.full(1000, 3),
           "zipf": rng.zipf(1.1, 50_000) - 1,
           "extremes": np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 0, -1,
                                 np.iinfo(np.int64).max, 2 ** 40, -(2 ** 40)]),
           "negative": -rng.integers(0, 1000, 5000)}[case].astype(np.int64)
    ref, got = both(monkeypatch, lambda: compiled.unique(ids))
    for r, g, what in zip(ref, got, ("unique", "inverse", "counts")):
        assert_same_bytes(g.astype(np.int64), r.astype(np.int64), what)

