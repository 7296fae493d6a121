"""CuPy CUDA kernels against their NumPy twins (same inputs, same semantics).

Sums run in the same order on both sides and every device operation is
rounded like NumPy's, so lookups and SGD agree to the last bit; row-wise
AdaGrad (a warp reduction of the squares) and Adam (device ``pow``) agree
to a few ulps. The one exception: float32 arithmetic on the device flushes
subnormal inputs and results to zero (CuPy compiles with ``-ftz=true``),
NumPy keeps them.
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.kernels import FusedTables, TableLayout
from embedding.kernels import cpu
from embedding.types import OptimizerConfig, OptimizerKind
from gpu_cases import bag_case

cp = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu


def _case(dtype, seed=0, weighted=True):
    return bag_case(dtype, seed, weighted, batch=64, rows=(500, 37, 1000, 3),
                    dims=(16, 64, 130, 8), slot_table=(0, 2, 0, 1, 3),
                    slot_mean=(False, True, False, True, False))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_matches_numpy_bitwise(dtype, weighted):
    from embedding.kernels import cuda

    layout, bags, weights, _ = _case(dtype, weighted=weighted)
    host = cpu.pooled_lookup(layout, weights, bags)
    dev = cuda.pooled_lookup(layout, cp.asarray(weights), bags)
    np.testing.assert_array_equal(cp.asnumpy(dev), host)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_subnormal_weights_are_flushed_in_float32_only(dtype):
    """Every weight subnormal: the float32 device lookup flushes them (each pooled value is
    a zero) where the NumPy twin keeps them; float64 keeps subnormals on the device too and
    agrees with the twin bit for bit."""
    from embedding.kernels import cuda

    layout, bags, weights, _ = _case(dtype, weighted=True)
    tiny = np.finfo(dtype).smallest_normal
    weights = (weights / np.abs(weights).max() * (tiny * 0.75)).astype(dtype)
    assert np.all(np.abs(weights) < tiny) and np.any(weights != 0)
    host = cpu.pooled_lookup(layout, weights, bags)
    dev = cp.asnumpy(cuda.pooled_lookup(layout, cp.asarray(weights), bags))
    assert np.any(host != 0)
    if dtype == np.float32:
        np.testing.assert_array_equal(dev, np.zeros_like(host))
    else:
        np.testing.assert_array_equal(dev, host)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_aggregate_matches_numpy(dtype):
    from embedding.kernels import cuda

    layout, bags, weights, grad = _case(dtype, seed=1)
    assert bags.any_max
    host = cpu.aggregate_grads(layout, bags, grad, weights=weights)
    dev = cuda.aggregate_grads(layout, bags, cp.asarray(grad), cp.asarray(weights))
    for (hr, hg), (dr, dg) in zip(host, dev):
        order = np.argsort(hr)
        np.testing.assert_array_equal(cp.asnumpy(dr), hr[order])
        np.testing.assert_array_equal(cp.asnumpy(dg), hg[order])


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_update_matches_numpy(kind, dtype):
    layout, bags, weights, grad = _case(dtype, seed=2)
    config = OptimizerConfig(kind, lr=0.05)
    host = FusedTables(layout.rows, layout.dims, config, dtype=np.dtype(dtype).name)
    dev = FusedTables(layout.rows, layout.dims, config, dtype=np.dtype(dtype).name,
                      device="cuda")
    host.weights[:] = weights
    dev.weights[:] = cp.asarray(weights)
    for step in range(3):
        g = grad * (step + 1)
        host.backward_update(bags, g)
        dev.backward_update(bags, cp.asarray(g))
    tol = dict(rtol=0, atol=0) if kind is OptimizerKind.SGD else (
        dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13))
    np.testing.assert_allclose(cp.asnumpy(dev.weights), host.weights, **tol)
    for name, arr in host.state.items():
        np.testing.assert_allclose(cp.asnumpy(dev.state[name]), arr, **tol)


@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
def test_sparse_rows_update_matches_numpy(kind):
    from embedding.kernels import cuda

    rng = np.random.default_rng(3)
    layout = TableLayout((50, 20), (8, 33))
    config = OptimizerConfig(kind, lr=0.1)
    host = FusedTables(layout.rows, layout.dims, config, dtype="float64")
    dev = FusedTables(layout.rows, layout.dims, config, dtype="float64", device="cuda")
    w = rng.standard_normal(layout.total_elements)
    host.weights[:] = w
    dev.weights[:] = cp.asarray(w)
    sparse = [(rng.integers(0, r, 40), rng.standard_normal((40, d)))
              for r, d in zip(layout.rows, layout.dims)]
    host.update(sparse, unique=False)
    dev.update([(cp.asarray(r), cp.asarray(g)) for r, g in sparse], unique=False)
    np.testing.assert_allclose(cp.asnumpy(dev.weights), host.weights, rtol=1e-12, atol=1e-13)
    rows, g = cuda.aggregate_rows(cp.asarray(sparse[1][0]), cp.asarray(sparse[1][1]), 20)
    hr, hg = cpu.aggregate_rows(sparse[1][0], sparse[1][1], 20)
    order = np.argsort(hr)
    np.testing.assert_array_equal(cp.asnumpy(rows), hr[order])
    np.testing.assert_allclose(cp.asnumpy(g), hg[order], rtol=1e-13, atol=1e-14)


def test_row_terms_replace_mean_of_squares():
    layout = TableLayout((10,), (4,))
    config = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    host = FusedTables(layout.rows, layout.dims, config, dtype="float64")
    dev = FusedTables(layout.rows, layout.dims, config, dtype="float64", device="cuda")
    rows = np.array([1, 4, 7])
    g = np.arange(12.0).reshape(3, 4)
    term = np.array([0.5, 2.0, 3.0])
    host.update([(rows, g)], row_terms=[term])
    dev.update([(cp.asarray(rows), cp.asarray(g))], row_terms=[cp.asarray(term)])
    np.testing.assert_allclose(cp.asnumpy(dev.state["momentum"]), host.state["momentum"])
    np.testing.assert_allclose(cp.asnumpy(dev.weights), host.weights, rtol=1e-14)
