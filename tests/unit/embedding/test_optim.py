"""Sparse optimizer rules against hand-written per-row loops."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.optim import dense_reference_update, sparse_update, state_specs
from embedding.types import OptimizerConfig, OptimizerKind


def _state(kind, rows, dim):
    return {sp.name: np.zeros((rows,) if sp.per_row else (rows, dim), sp.dtype or np.float64)
            for sp in state_specs(kind)}


def test_state_specs():
    assert state_specs(OptimizerKind.SGD) == ()
    assert [s.name for s in state_specs(OptimizerKind.ROWWISE_ADAGRAD)] == ["momentum"]
    adam = {s.name: s for s in state_specs(OptimizerKind.ADAM)}
    assert adam["step"].per_row and adam["step"].dtype == "int64"
    assert not adam["exp_avg"].per_row


def test_sgd_by_hand():
    w = np.arange(8.0).reshape(4, 2)
    sparse_update(OptimizerConfig(OptimizerKind.SGD, lr=0.5), w, {}, np.array([1, 3]),
                  np.array([[2.0, 4.0], [-2.0, 0.0]]))
    np.testing.assert_allclose(w, [[0, 1], [1, 1], [4, 5], [7, 7]])


def test_rowwise_adagrad_by_hand():
    cfg = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=1.0, eps=0.0)
    w = np.zeros((3, 2))
    st = _state(cfg.kind, 3, 2)
    g = np.array([[3.0, 4.0]])
    sparse_update(cfg, w, st, np.array([1]), g)
    # accumulator = mean(9, 16) = 12.5; step = g / sqrt(12.5)
    np.testing.assert_allclose(st["momentum"], [0, 12.5, 0])
    np.testing.assert_allclose(w[1], -g[0] / np.sqrt(12.5))
    sparse_update(cfg, w, st, np.array([1]), g, mean_sq=np.array([1.5]))
    np.testing.assert_allclose(st["momentum"], [0, 14.0, 0])


def test_adam_counts_steps_per_row():
    cfg = OptimizerConfig(OptimizerKind.ADAM, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    w = np.zeros((2, 1))
    st = _state(cfg.kind, 2, 1)
    g = np.array([[1.0]])
    sparse_update(cfg, w, st, np.array([0]), g)
    sparse_update(cfg, w, st, np.array([0]), g)
    sparse_update(cfg, w, st, np.array([1]), g)
    assert st["step"].tolist() == [2, 1]
    # A row's first step is lr * sign(g) whatever the other rows did (per-row bias correction).
    np.testing.assert_allclose(w[1, 0], -0.1, rtol=1e-6)
    m = 0.9 * 0.1 + 0.1
    v = 0.99 * 0.01 + 0.01
    second = 0.1 * (m / (1 - 0.81)) / (np.sqrt(v / (1 - 0.99 ** 2)) + 1e-8)
    np.testing.assert_allclose(w[0, 0], -0.1 / (1 + 1e-8) - second, rtol=1e-12)


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sparse_update_matches_dense_loop(kind, dtype):
    rng = np.random.default_rng(1)
    cfg = OptimizerConfig(kind, lr=0.05)
    w0 = rng.standard_normal((10, 3)).astype(dtype)
    a, b = w0.copy(), w0.astype(np.float64)
    sa, sb = _state(kind, 10, 3), _state(kind, 10, 3)
    for k in list(sa):
        sa[k] = sa[k].astype(dtype) if sa[k].dtype.kind == "f" else sa[k]
    for _ in range(3):
        rows = np.unique(rng.integers(0, 10, 5))
        g = rng.standard_normal((rows.size, 3))
        sparse_update(cfg, a, sa, rows, g.astype(dtype))
        dense = np.zeros((10, 3))
        dense[rows] = g
        touched = np.zeros(10, bool)
        touched[rows] = True
        dense_reference_update(cfg, b, sb, dense, touched)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_empty_update_is_a_no_op():
    w = np.ones((2, 2))
    sparse_update(OptimizerConfig(OptimizerKind.ADAM), w, _state(OptimizerKind.ADAM, 2, 2),
                  np.zeros(0, np.int64), np.zeros((0, 2)))
    assert np.all(w == 1)


def test_config_rejects_bad_lr():
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=0)
