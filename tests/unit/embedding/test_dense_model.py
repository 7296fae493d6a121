"""The dense DLRM: forward reference, finite-difference gradients, buckets and hooks."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.dense import (DenseConfig, DenseModel, DenseOptimizerConfig, auc,
                             bce_with_logits, make_optimizer, plan_buckets)

SMALL = DenseConfig(num_dense=5, num_sparse=3, bottom_mlp=(7, 4), top_mlp=(6, 5, 1),
                    dtype="float64")


def inputs(cfg=SMALL, b=6, seed=0):
    rng = np.random.default_rng(seed)
    dense = rng.random((b, cfg.num_dense))
    pooled = rng.standard_normal((b, cfg.num_sparse, cfg.embedding_dim))
    labels = (rng.random(b) < 0.5).astype(np.float64)
    return dense, pooled, labels


def reference_forward(model: DenseModel, dense, pooled):
    """Loop-based DLRM forward, independent of the model's vectorised code."""
    cfg = model.config
    h = dense
    for i in range(len(cfg.bottom_mlp)):
        h = np.maximum(h @ model.parameter(f"bottom.{i}.weight")
                       + model.parameter(f"bottom.{i}.bias"), 0)
    rows = []
    for b in range(dense.shape[0]):
        t = [h[b]] + [pooled[b, f] for f in range(cfg.num_sparse)]
        feats = list(h[b])
        for i in range(len(t)):
            for j in range(i):
                feats.append(float(t[i] @ t[j]))
        rows.append(feats)
    h = np.array(rows)
    for i in range(len(cfg.top_mlp)):
        h = h @ model.parameter(f"top.{i}.weight") + model.parameter(f"top.{i}.bias")
        if i < len(cfg.top_mlp) - 1:
            h = np.maximum(h, 0)
    return h[:, 0]


def test_forward_matches_loop_reference():
    model = DenseModel(SMALL, seed=2)
    dense, pooled, _ = inputs()
    np.testing.assert_allclose(model.forward(dense, pooled),
                               reference_forward(model, dense, pooled), rtol=1e-12)
    assert SMALL.top_input_dim == 4 + 6  # bottom width + (F + 1) F / 2
    as_list = [pooled[:, f] for f in range(3)]
    np.testing.assert_allclose(model.forward(dense, as_list), model.forward(dense, pooled))


def loss_of(model, dense, pooled, labels):
    return float(bce_with_logits(model.forward(dense, pooled), labels)[0])


def test_gradients_match_finite_differences():
    model = DenseModel(SMALL, seed=3)
    dense, pooled, labels = inputs(seed=1)
    loss, _, d_pooled = model.forward_backward(dense, pooled, labels)
    grads = model.flat_grads.copy()
    p = model.flat_params
    eps = 1e-6
    for i in range(p.size):  # every parameter
        old = p[i]
        p[i] = old + eps
        up = loss_of(model, dense, pooled, labels)
        p[i] = old - eps
        down = loss_of(model, dense, pooled, labels)
        p[i] = old
        assert abs((up - down) / (2 * eps) - grads[i]) < 1e-7, model.parameter_names()
    for idx in np.ndindex(pooled.shape):  # every pooled-embedding element
        e = pooled.copy()
        e[idx] += eps
        up = loss_of(model, dense, e, labels)
        e[idx] -= 2 * eps
        down = loss_of(model, dense, e, labels)
        assert abs((up - down) / (2 * eps) - d_pooled[idx]) < 1e-7
    assert d_pooled.shape == pooled.shape


def test_initialisation_is_deterministic_per_seed():
    a = DenseModel(DenseConfig(), seed=4)
    b = DenseModel(DenseConfig(), seed=4)
    c = DenseModel(DenseConfig(), seed=5)
    assert np.array_equal(a.flat_params, b.flat_params)
    assert not np.array_equal(a.flat_params, c.flat_params)
    assert a.flat_params.size == DenseConfig().num_parameters
    assert a.flat_params.dtype == np.float32
    w = a.parameter("top.0.weight")
    assert w.shape == (128 + 351, 1024)  # MLPerf: 27 vectors, 351 pairwise products
    assert abs(w.std() - np.sqrt(2 / (479 + 1024))) < 2e-3


def test_buckets_layout_and_order():
    model = DenseModel(DenseConfig(), bucket_bytes=1 << 20)
    names = model.parameter_names()
    assert names[:2] == ["top.4.weight", "top.4.bias"] and names[-1] == "bottom.0.bias"
    pos = 0
    for b in model.buckets:
        assert b.offset == pos
        pos += b.numel
        assert b.numel * 4 <= 1 << 20 or len(b.params) == 1
    assert pos == model.flat_params.size
    # a bucket holds whole parameters; their views alias the bucket views
    b = model.buckets[1]
    assert np.shares_memory(model.buffers.bucket_grads[1], model.buffers.grad(b.params[0]))
    assert plan_buckets([("a", 3), ("b", 3), ("c", 10)], 4, 24) == (
        plan_buckets([("a", 3), ("b", 3)], 4, 24)[0],
        type(b)(1, 6, 10, ("c",)))
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", 1)], 4, 0)


def test_hook_fires_per_bucket_while_backward_continues():
    cfg = DenseConfig(num_dense=13, num_sparse=4, bottom_mlp=(16, 8), top_mlp=(32, 16, 1))
    model = DenseModel(cfg, bucket_bytes=600)
    assert len(model.buckets) >= 4
    dense, pooled, labels = inputs(cfg, b=8)
    seen = []

    def hook(bucket, grad):
        # this bucket is complete; when the first fires, the first layer's are not yet written
        assert np.isfinite(grad).all()
        if bucket.index == 0:
            assert np.isnan(model.buffers.bucket_grads[-1]).all()
        assert np.shares_memory(grad, model.flat_grads)
        seen.append(bucket.index)

    model.flat_grads[...] = np.nan
    model.forward_backward(dense, pooled, labels, hook=hook)
    assert seen == list(range(len(model.buckets)))
    assert np.isfinite(model.flat_grads).all()


def test_training_lowers_the_loss():
    cfg = DenseConfig(num_dense=13, num_sparse=4, bottom_mlp=(16, 8), top_mlp=(16, 1))
    model = DenseModel(cfg, seed=0)
    opt = make_optimizer(DenseOptimizerConfig(kind="adam", lr=0.01))
    dense, pooled, _ = inputs(cfg, b=64, seed=3)
    labels = (pooled[:, 0, 0] + dense[:, 0] > 0.5).astype(np.float32)
    first = None
    for _ in range(60):
        loss, logits, _ = model.forward_backward(dense.astype(np.float32),
                                                 pooled.astype(np.float32), labels)
        first = float(loss) if first is None else first
        opt.step(model.flat_params, model.flat_grads)
    assert float(loss) < 0.5 * first
    assert auc(labels, logits) > 0.95


def test_state_dict_round_trip():
    a = DenseModel(SMALL, seed=1)
    b = DenseModel(SMALL, seed=2)
    b.load_state_dict(a.state_dict())
    assert np.array_equal(a.flat_params, b.flat_params)
    with pytest.raises(ValueError, match="state"):
        b.load_state_dict({"params": np.zeros(3)})


def test_bad_inputs():
    model = DenseModel(SMALL)
    dense, pooled, labels = inputs()
    with pytest.raises(ValueError, match="pooled: expected shape"):
        model.forward(dense, pooled[:, :2])
    with pytest.raises(ValueError, match="pooled: expected 3"):
        model.forward(dense, [pooled[:, 0]])
    with pytest.raises(ValueError, match="dense: expected shape"):
        model.forward(dense[:, :4], pooled)
    with pytest.raises(RuntimeError, match="forward first"):
        DenseModel(SMALL).backward(np.zeros(6))
    model.forward(dense, pooled)
    with pytest.raises(ValueError, match="dlogits"):
        model.backward(np.zeros(5))
    with pytest.raises(ValueError, match="bottom_mlp"):
        DenseConfig(bottom_mlp=())
    with pytest.raises(ValueError, match="ending in 1"):
        DenseConfig(top_mlp=(4, 2))
    with pytest.raises(ValueError, match="dtype"):
        DenseConfig(dtype="float16")
