"""Dense optimizers against their formulas; AUC, log-loss, BCE and the non-finite checks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from embedding.data import BatchError
from embedding.dense import (NonFiniteError, DenseOptimizerConfig, auc, bce_with_logits,
                             check_finite, check_labels, check_loss, log_loss, make_optimizer,
                             sigmoid)


def run(kind, steps=3, **kw):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(10)
    grads = [rng.standard_normal(10) for _ in range(steps)]
    opt = make_optimizer(DenseOptimizerConfig(kind=kind, **kw))
    for g in grads:
        opt.step(p, g)
    return rng, p, grads, opt


def test_sgd_with_momentum_and_decay():
    _, p, grads, _ = run("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    q = np.random.default_rng(0).standard_normal(10)
    buf = np.zeros(10)
    for g in grads:
        buf = 0.9 * buf + g + 0.01 * q
        q = q - 0.1 * buf
    np.testing.assert_allclose(p, q)


def test_adagrad():
    _, p, grads, _ = run("adagrad", lr=0.1, initial_accumulator=0.1)
    q = np.random.default_rng(0).standard_normal(10)
    acc = np.full(10, 0.1)
    for g in grads:
        acc += g * g
        q = q - 0.1 * g / (np.sqrt(acc) + 1e-8)
    np.testing.assert_allclose(p, q)


def test_adam_with_bias_correction_and_decoupled_decay():
    _, p, grads, _ = run("adam", lr=0.01, weight_decay=0.1)
    q = np.random.default_rng(0).standard_normal(10)
    m = v = np.zeros(10)
    for t, g in enumerate(grads, 1):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        q = q * (1 - 0.01 * 0.1)
        q = q - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    np.testing.assert_allclose(p, q)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_state_dict_resumes_identically(kind):
    rng = np.random.default_rng(1)
    p = rng.standard_normal(8).astype(np.float32)
    grads = [rng.standard_normal(8).astype(np.float32) for _ in range(6)]
    cfg = DenseOptimizerConfig(kind=kind, lr=0.05, momentum=0.5 if kind == "sgd" else 0.0)
    a = make_optimizer(cfg)
    pa = p.copy()
    for g in grads:
        a.step(pa, g)
    b = make_optimizer(cfg)
    pb = p.copy()
    for g in grads[:3]:
        b.step(pb, g)
    c = make_optimizer(cfg)
    c.load_state_dict(b.state_dict())
    for g in grads[3:]:
        c.step(pb, g)
    np.testing.assert_array_equal(pa, pb)
    assert c.state_dict()["steps"] == 6
    if kind != "sgd":
        with pytest.raises(ValueError, match="missing"):
            make_optimizer(cfg).load_state_dict({"steps": np.asarray(1)})


def test_optimizer_bad_arguments():
    with pytest.raises(ValueError, match="lr"):
        DenseOptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="beta2"):
        DenseOptimizerConfig(beta2=1.0)
    with pytest.raises(ValueError):
        DenseOptimizerConfig(kind="lamb")
    with pytest.raises(ValueError, match="grads"):
        make_optimizer().step(np.zeros(3), np.zeros(4))


def brute_auc(y, s):
    pos = [a for a, t in zip(s, y) if t == 1]
    neg = [a for a, t in zip(s, y) if t == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_exact_with_ties():
    rng = np.random.default_rng(2)
    for _ in range(20):
        y = rng.integers(0, 2, 40)
        y[:2] = [0, 1]
        s = rng.integers(0, 5, 40).astype(float)  # many ties
        assert auc(y, s) == pytest.approx(brute_auc(y, s), abs=1e-12)
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert auc([0, 1, 0, 1], [0.5] * 4) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auc([1, 1], [0.2, 0.3])
    with pytest.raises(ValueError, match="scores"):
        auc([0, 1], [0.2])


def test_log_loss_and_bce_with_logits():
    y = np.array([0, 1, 1, 0], np.float64)
    z = np.array([-2.0, 0.5, 3.0, 1.0])
    p = 1 / (1 + np.exp(-z))
    ref = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert log_loss(y, p) == pytest.approx(ref)
    loss, grad = bce_with_logits(z, y)
    assert float(loss) == pytest.approx(ref)
    np.testing.assert_allclose(grad, (p - y) / 4)
    big, g = bce_with_logits(np.array([1000.0, -1000.0]), np.array([0.0, 1.0]))
    assert float(big) == pytest.approx(1000.0) and np.isfinite(g).all()
    assert sigmoid(np.array([-1000.0, 1000.0])).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="logits"):
        bce_with_logits(np.zeros(3), np.zeros(2))


def test_checks_name_step_and_tensor():
    check_finite(3, a=np.ones(3), ids=np.arange(3))
    with pytest.raises(NonFiniteError, match=r"step 41: logits holds 2 non-finite value\(s\) "
                                             r"of 4; the first is nan at flat index 1") as e:
        check_finite(41, dense=np.ones(2), logits=np.array([0.0, np.nan, 1.0, -np.inf]))
    assert (e.value.step, e.value.tensor, e.value.count, e.value.index) == (41, "logits", 2, 1)
    with pytest.raises(NonFiniteError, match="step 7: loss") as e:
        check_loss(np.float32(np.inf), step=7)
    assert e.value.tensor == "loss"
    assert check_loss(np.asarray(0.25), step=1) == 0.25
    with pytest.raises(BatchError, match="step 2: labels") as e:
        check_labels(np.array([0.0, 1.0, 0.5]), step=2)
    assert e.value.index == 2
    import pickle  # errors survive being shipped between ranks

    err = pickle.loads(pickle.dumps(NonFiniteError("x", step=1, tensor="t", count=1, index=0)))
    assert err.tensor == "t" and err.step == 1
