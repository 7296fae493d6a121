"""The CuPy twin of the dense model: same numbers as NumPy (on a GPU, or the stand-in)."""
from __future__ import annotations

import cupy as cp
import numpy as np
import pytest

from embedding.dense import (DenseConfig, DenseModel, DenseOptimizerConfig, NonFiniteError,
                             check_finite, make_optimizer)

CFG = DenseConfig(num_dense=13, num_sparse=5, bottom_mlp=(32, 16), top_mlp=(24, 1),
                  dtype="float64")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_cupy_matches_numpy(kind):
    rng = np.random.default_rng(0)
    dense = rng.random((16, 13))
    pooled = rng.standard_normal((16, 5, 16))
    labels = (rng.random(16) < 0.3).astype(np.float64)
    host = DenseModel(CFG, seed=1, bucket_bytes=2048)
    dev = DenseModel(CFG, seed=1, xp=cp, bucket_bytes=2048)
    opt_h = make_optimizer(DenseOptimizerConfig(kind=kind, lr=0.01))
    opt_d = make_optimizer(DenseOptimizerConfig(kind=kind, lr=0.01))
    fired = []
    for _ in range(3):
        lh, zh, dh = host.forward_backward(dense, pooled, labels)
        ld, zd, dd = dev.forward_backward(cp.asarray(dense), cp.asarray(pooled),
                                          cp.asarray(labels),
                                          hook=lambda b, g: fired.append(type(g)))
        np.testing.assert_allclose(float(ld), float(lh), rtol=1e-10)
        np.testing.assert_allclose(cp.asnumpy(dd), dh, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(cp.asnumpy(dev.flat_grads), host.flat_grads, rtol=1e-8,
                                   atol=1e-12)
        opt_h.step(host.flat_params, host.flat_grads)
        opt_d.step(dev.flat_params, dev.flat_grads)
    np.testing.assert_allclose(cp.asnumpy(dev.flat_params), host.flat_params, rtol=1e-8)
    assert fired and all(t is cp.ndarray for t in fired)
    bad = cp.asarray([0.0, cp.nan])
    with pytest.raises(NonFiniteError, match="step 3: x"):
        check_finite(3, x=bad)
