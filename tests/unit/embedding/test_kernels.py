"""NumPy fused kernels against straightforward reference loops (tiny sizes)."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables, TableLayout, kernel_module
from embedding.kernels import cpu
from embedding.kernels.reference import bag_grads, pool_bags
from embedding.kernels.segments import (jagged_sum, positions_of_segments, segments_of_sorted,
                                        stable_argsort)
from embedding.optim import dense_reference_update, state_specs
from embedding.types import OptimizerConfig, OptimizerKind, Pooling


class Case:
    """Random bags over a layout, with their Python-list twins for the reference."""

    def __init__(self, seed=0, groups=2, batch=6, max_len=5, weighted=True, dtype=np.float64,
                 fixed_len=None, dim=None):
        rng = np.random.default_rng(seed)
        self.layout = TableLayout((7, 5, 9, 3), (3, 4, 3, 2) if dim is None else (dim,) * 4)
        self.slot_table = (0, 2, 0, 1, 3)
        # table 0 is read by a sum slot and a max slot: one backward mixes both
        self.pools = (Pooling.SUM, Pooling.MEAN, Pooling.MAX, Pooling.MEAN, Pooling.MAX)
        self.slot_mean = tuple(p is Pooling.MEAN for p in self.pools)
        dims = [self.layout.dims[t] for t in self.slot_table]
        self.slot_col = tuple(int(x) for x in np.concatenate([[0], np.cumsum(dims)[:-1]]))
        self.out_dim = int(sum(dims))
        self.groups, self.batch = groups, batch
        self.lists, self.wlists = [], []
        vals, lens, wts = [], [], []
        for g in range(groups):
            for s, t in enumerate(self.slot_table):
                blk, wblk = [], []
                for b in range(batch):
                    n = fixed_len if fixed_len is not None else int(rng.integers(0, max_len + 1))
                    hot = rng.integers(0, 2, n)  # heavy duplicates: rows 0 and 1 are hot
                    ids = np.where(rng.random(n) < 0.5, hot,
                                   rng.integers(0, self.layout.rows[t], n))
                    w = rng.uniform(0.5, 2.0, n)
                    blk.append([int(i) for i in ids])
                    wblk.append([float(x) for x in w])
                    vals.extend(blk[-1])
                    wts.extend(wblk[-1])
                    lens.append(n)
                self.lists.append(blk)
                self.wlists.append(wblk)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.weighted = weighted
        self.bags = Bags(np.asarray(vals, np.int64), offsets, self.slot_table, self.slot_col,
                         batch_size=batch, out_dim=self.out_dim, num_groups=groups,
                         weights=np.asarray(wts) if weighted else None,
                         **Bags.pooling_flags(self.pools))
        self.weights = rng.standard_normal(self.layout.total_elements).astype(dtype)
        self.dtype = dtype

    def table(self, flat, t):
        return cpu.table_view(self.layout, flat, t)

    def block(self, g, s):
        k = g * len(self.slot_table) + s
        return self.lists[k], (self.wlists[k] if self.weighted else None)

    def reference_lookup(self, flat):
        out = np.zeros((self.groups * self.batch, self.out_dim))
        for g in range(self.groups):
            for s, t in enumerate(self.slot_table):
                bags, w = self.block(g, s)
                c = self.slot_col[s]
                out[g * self.batch:(g + 1) * self.batch, c:c + self.layout.dims[t]] = pool_bags(
                    self.table(flat, t).astype(np.float64), bags, self.pools[s], w)
        return out

    def reference_grads(self, grad, flat=None):
        """Dense gradients; max slots read the ``flat`` weights (default: the initial ones)."""
        flat = self.weights if flat is None else flat
        dense = [np.zeros((r, d)) for r, d in zip(self.layout.rows, self.layout.dims)]
        touched = [np.zeros(r, bool) for r in self.layout.rows]
        for g in range(self.groups):
            for s, t in enumerate(self.slot_table):
                bags, w = self.block(g, s)
                c = self.slot_col[s]
                d, tt = bag_grads(self.layout.rows[t], bags,
                                  grad[g * self.batch:(g + 1) * self.batch,
                                       c:c + self.layout.dims[t]], self.pools[s], w,
                                  self.table(flat, t))
                dense[t] += d
                touched[t] |= tt
        return dense, touched


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fixed_len", [None, 1, 3, 0])
def test_pooled_lookup_matches_loops(weighted, fixed_len):
    case = Case(weighted=weighted, fixed_len=fixed_len)
    out = cpu.pooled_lookup(case.layout, case.weights, case.bags)
    np.testing.assert_allclose(out, case.reference_lookup(case.weights), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("weighted", [False, True])
def test_one_id_per_bag_lookup_is_one_gather(weighted, monkeypatch):
    """One id per bag and one dim for all tables: the lookup is a single gather in output
    order; same bits as the per-slot path (sum, mean and max slots, per-id weights)."""
    case = Case(weighted=weighted, fixed_len=1, dim=3, dtype=np.float32)
    lengths = np.diff(case.bags.offsets)
    out = np.empty((case.bags.out_rows, case.out_dim), np.float32)
    assert cpu._one_id_per_bag(case.layout, case.bags, lengths, out)
    cpu.pooled_lookup(case.layout, case.weights, case.bags, out=out)
    np.testing.assert_allclose(out, case.reference_lookup(case.weights), rtol=1e-6)
    monkeypatch.setattr(cpu, "_one_id_per_bag", lambda *a: False)
    np.testing.assert_array_equal(out, cpu.pooled_lookup(case.layout, case.weights, case.bags))
    other = Case(weighted=weighted, fixed_len=1, dtype=np.float32)  # mixed dims: per slot
    assert not cpu._one_id_per_bag(other.layout, other.bags, lengths, out)


def test_pooled_lookup_long_tail_bags():
    """More than the tail threshold of long bags, and a few very long ones."""
    rng = np.random.default_rng(4)
    layout = TableLayout((50,), (3,))
    lens = np.concatenate([rng.integers(0, 4, 60), [40] * 40, [300, 500]])
    ids = rng.integers(0, 50, int(lens.sum()))
    offsets = np.concatenate([[0], np.cumsum(lens)])
    bags = Bags(ids, offsets, (0,), (0,), (False,), len(lens), 3)
    w = rng.standard_normal(150)
    out = cpu.pooled_lookup(layout, w, bags)
    lists = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(lens))]
    np.testing.assert_allclose(out, pool_bags(w.reshape(50, 3), lists), rtol=1e-12, atol=1e-12)


def test_max_pooling_ties_and_negative_rows():
    """Each column's maximum; on a tie the first id gets the gradient; empty bags give zeros."""
    layout = TableLayout((4,), (3,))
    table = np.array([[1.0, -5.0, 2.0], [1.0, -7.0, 3.0], [0.5, -6.0, 3.0], [9.0, 9.0, 9.0]])
    bags = Bags(np.array([1, 0, 2, 2]), np.array([0, 3, 3, 4]), (0,), (0,), (False,), 3, 3,
                slot_max=(True,))
    out = cpu.pooled_lookup(layout, table.reshape(-1), bags)
    np.testing.assert_array_equal(out, [[1.0, -5.0, 3.0], [0, 0, 0], [0.5, -6.0, 3.0]])
    grad = np.array([[1.0, 2.0, 4.0], [8.0, 8.0, 8.0], [16.0, 32.0, 64.0]])
    (rows, grads), = cpu.aggregate_grads(layout, bags, grad, weights=table.reshape(-1))
    sparse = dict(zip(rows.tolist(), grads.tolist()))
    # bag 0 [1, 0, 2]: column 0 ties rows 1 and 0 (row 1 first), column 1 is row 0's, column 2
    # ties rows 1 and 2 (row 1 first); bag 2 [2] takes all of its gradient
    assert sparse == {1: [1.0, 0.0, 4.0], 0: [0.0, 2.0, 0.0], 2: [16.0, 32.0, 64.0]}
    with pytest.raises(ValueError, match="max pooling needs the table weights"):
        cpu.aggregate_grads(layout, bags, grad)


def test_uncovered_columns_are_zero():
    case = Case(weighted=False)
    bags = Bags(case.bags.indices, case.bags.offsets, case.slot_table, case.slot_col,
                case.slot_mean, case.batch, case.out_dim + 3, case.groups)
    out = cpu.pooled_lookup(case.layout, case.weights, bags)
    assert np.all(out[:, case.out_dim:] == 0)


@pytest.mark.parametrize("weighted", [False, True])
def test_aggregate_grads_match_loops(weighted):
    case = Case(seed=2, weighted=weighted)
    grad = np.random.default_rng(9).standard_normal((case.groups * case.batch, case.out_dim))
    dense, touched = case.reference_grads(grad)
    sparse = cpu.aggregate_grads(case.layout, case.bags, grad, weights=case.weights)
    for t, (rows, g) in enumerate(sparse):
        assert len(set(rows.tolist())) == len(rows)
        assert sorted(rows.tolist()) == np.flatnonzero(touched[t]).tolist()
        np.testing.assert_allclose(g, dense[t][rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("threads", [1, 3])
def test_backward_update_matches_dense_reference(kind, threads):
    case = Case(seed=3)
    config = OptimizerConfig(kind, lr=0.1)
    ft = FusedTables(case.layout.rows, case.layout.dims, config, dtype="float64",
                     threads=threads)
    ft.weights[:] = case.weights
    ref_w = [case.table(case.weights, t).copy() for t in range(case.layout.num_tables)]
    ref_state = [{sp.name: np.zeros((r,) if sp.per_row else (r, d), sp.dtype or np.float64)
                  for sp in state_specs(kind)} for r, d in zip(case.layout.rows,
                                                               case.layout.dims)]
    rng = np.random.default_rng(5)
    for _ in range(3):
        grad = rng.standard_normal((case.groups * case.batch, case.out_dim))
        dense, touched = case.reference_grads(grad, np.concatenate(
            [w.reshape(-1) for w in ref_w]))
        ft.backward_update(case.bags, grad)
        for t in range(case.layout.num_tables):
            dense_reference_update(config, ref_w[t], ref_state[t], dense[t], touched[t])
    for t in range(case.layout.num_tables):
        np.testing.assert_allclose(ft.weight(t), ref_w[t], rtol=1e-12, atol=1e-12)
        for sp in state_specs(kind):
            np.testing.assert_allclose(ft.state_view(t, sp.name), ref_state[t][sp.name],
                                       rtol=1e-12, atol=1e-12)


def test_untouched_rows_do_not_change_even_for_adam():
    case = Case(seed=6, weighted=False)
    ft = FusedTables(case.layout.rows, case.layout.dims, OptimizerConfig(OptimizerKind.ADAM),
                     dtype="float64")
    ft.weights[:] = case.weights
    grad = np.zeros((case.groups * case.batch, case.out_dim))
    ft.backward_update(case.bags, grad)
    touched = case.reference_grads(grad)[1]
    for t in range(case.layout.num_tables):
        np.testing.assert_array_equal(ft.state_view(t, "step") > 0, touched[t])
        np.testing.assert_array_equal(ft.weight(t), case.table(case.weights, t))


def test_float32_tracks_float64_reference():
    case = Case(seed=7, dtype=np.float32)
    out = cpu.pooled_lookup(case.layout, case.weights, case.bags)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, case.reference_lookup(case.weights), rtol=1e-5, atol=1e-5)


def test_mixed_optimizers_in_one_buffer():
    case = Case(seed=8)
    configs = [OptimizerConfig(OptimizerKind.SGD, lr=0.2),
               OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1),
               OptimizerConfig(OptimizerKind.ADAM, lr=0.05),
               OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.3, eps=1e-3)]
    ft = FusedTables(case.layout.rows, case.layout.dims, configs, dtype="float64")
    ft.weights[:] = case.weights
    grad = np.random.default_rng(1).standard_normal((case.groups * case.batch, case.out_dim))
    ft.backward_update(case.bags, grad)
    dense, touched = case.reference_grads(grad)
    for t, config in enumerate(configs):
        w = case.table(case.weights, t).copy()
        st = {sp.name: np.zeros((w.shape[0],) if sp.per_row else w.shape, sp.dtype or w.dtype)
              for sp in state_specs(config.kind)}
        dense_reference_update(config, w, st, dense[t], touched[t])
        np.testing.assert_allclose(ft.weight(t), w, rtol=1e-12, atol=1e-12)
    with pytest.raises(KeyError, match="keeps no state 'exp_avg'"):
        ft.state_view(1, "exp_avg")


def test_update_sums_duplicate_rows_when_asked():
    ft = FusedTables((4,), (2,), OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=1.0),
                     dtype="float64")
    g = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, 0.5]])
    ft.update([(np.array([2, 2, 0]), g)], unique=False)
    mom = ft.state_view(0, "momentum")
    np.testing.assert_allclose(mom, [0.25, 0, (16 + 36) / 2, 0])


@pytest.mark.parametrize("make, match", [
    (lambda: TableLayout((3, 4), (2,)), "one dim per table"),
    (lambda: TableLayout((-1,), (2,)), "rows >= 0"),
    (lambda: TableLayout((3,), (0,)), "dim > 0"),
    (lambda: Bags(np.zeros(2, np.int64), np.zeros(3, np.int64), (0,), (0,), (False,), 1, 2),
     "expected num_groups"),
    (lambda: Bags(np.zeros(2, np.int64), np.array([0, 2]), (0,), (0, 1), (False,), 1, 2),
     "slot_col/slot_mean/slot_max"),
    (lambda: Bags(np.zeros(2, np.int64), np.array([0, 2]), (0,), (0,), (True,), 1, 2,
                  slot_max=(True,)), "slot 0 cannot pool by both mean and max"),
    (lambda: Bags(np.zeros(2, np.int64), np.array([0, 2]), (0,), (0,), (False,), 1, 2,
                  weights=np.ones(3)), "one per index"),
    (lambda: FusedTables((3,), (2,), OptimizerConfig(), dtype="int32"), "dtype"),
    (lambda: FusedTables((3,), (2,), OptimizerConfig(), device="tpu"), "device"),
    (lambda: FusedTables((3,), (2,), OptimizerConfig(), threads=0), "threads"),
    (lambda: FusedTables((3,), (2,), "sgd"), "OptimizerConfig"),
    (lambda: kernel_module("tpu"), "device"),
])
def test_bad_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bags_checked_against_layout():
    layout = TableLayout((3,), (2,))
    bad_table = Bags(np.zeros(1, np.int64), np.array([0, 1]), (1,), (0,), (False,), 1, 2)
    with pytest.raises(ValueError, match=r"slot_table\[0\]"):
        cpu.pooled_lookup(layout, np.zeros(6), bad_table)
    too_wide = Bags(np.zeros(1, np.int64), np.array([0, 1]), (0,), (1,), (False,), 1, 2)
    with pytest.raises(ValueError, match=r"slot_col\[0\]"):
        cpu.pooled_lookup(layout, np.zeros(6), too_wide)


# -- segment primitives -------------------------------------------------------------
@pytest.mark.parametrize("high", [3, 2 ** 16 - 1, 2 ** 17 + 5, 2 ** 40, 2 ** 50])
def test_stable_argsort_equals_numpy_stable(high):
    rng = np.random.default_rng(high % 97)
    keys = rng.integers(0, high + 1, 5000).astype(np.int64)
    np.testing.assert_array_equal(stable_argsort(keys, high), np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(stable_argsort(keys), np.argsort(keys, kind="stable"))


def test_segment_helpers():
    assert positions_of_segments([5, 0, 9], [2, 0, 3]).tolist() == [5, 6, 9, 10, 11]
    uniq, starts, lens = segments_of_sorted(np.array([1, 1, 4, 7, 7, 7]))
    assert uniq.tolist() == [1, 4, 7] and starts.tolist() == [0, 2, 3]
    assert lens.tolist() == [2, 1, 3]


def test_jagged_sum_adds_in_segment_order():
    """Same bits as a sequential loop (the order the device kernel uses)."""
    rng = np.random.default_rng(11)
    src = (rng.standard_normal((20, 4)) * 10.0 ** rng.integers(-6, 6, (20, 1))).astype(np.float32)
    # enough segments for positional passes, then a tail of a few long ones
    lens = np.concatenate([rng.integers(0, 7, 600), [70, 90]])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    index = rng.integers(0, 20, int(lens.sum()))
    w = rng.uniform(0.5, 2, int(lens.sum())).astype(np.float32)
    out = jagged_sum(src, index, starts, lens, w)
    for k in range(len(lens)):
        acc = np.zeros(4, np.float32)
        for j in range(lens[k]):
            x = src[index[starts[k] + j]] * w[starts[k] + j]
            acc = x if j == 0 else acc + x
        np.testing.assert_array_equal(out[k], acc)
