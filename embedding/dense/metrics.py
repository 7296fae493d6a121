"""Evaluation metrics and the training loss: exact AUC, log-loss, BCE with logits.

The loss works on NumPy and CuPy arrays alike; the metrics move their inputs
to the host (an evaluation pass gathers scores there anyway).
"""
from __future__ import annotations

import numpy as np

from embedding.dense._xp import array_module, to_numpy

__all__ = ["auc", "log_loss", "sigmoid", "bce_with_logits"]


def sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow for large ``|x|``."""
    xp = array_module(x)
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def auc(labels, scores) -> float:
    """Area under the ROC curve, exactly, via the rank-sum (Mann-Whitney) statistic.

    Tied scores share their mid-rank, so a tie between a positive and a
    negative counts one half. ValueError when a class is absent.
    """
    y = to_numpy(labels).reshape(-1)
    s = to_numpy(scores).reshape(-1).astype(np.float64)
    if y.shape != s.shape:
        raise ValueError(f"scores: expected {y.shape[0]} scores for {y.shape[0]} labels, "
                         f"got {s.shape[0]}")
    nan = np.isnan(s)
    if nan.any():
        raise ValueError(f"scores: expected no NaN, got {int(nan.sum())} NaN of {s.size}; the "
                         f"first at index {int(np.flatnonzero(nan)[0])}")
    pos = y == 1
    n_pos = int(pos.sum())
    n_neg = int(y.shape[0] - n_pos)
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"labels: AUC needs both classes, got {n_pos} positives and "
                         f"{n_neg} negatives")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # Tie groups: [starts[g], ends[g]) in sorted order share the mean rank.
    boundary = np.flatnonzero(np.diff(sorted_s)) + 1
    starts = np.concatenate([[0], boundary])
    ends = np.concatenate([boundary, [s.shape[0]]])
    mid = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(s.shape[0])
    ranks[order] = np.repeat(mid, ends - starts)
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` (clipped to [eps, 1 - eps])."""
    y = to_numpy(labels).reshape(-1).astype(np.float64)
    p = np.clip(to_numpy(probs).reshape(-1).astype(np.float64), eps, 1 - eps)
    if y.shape != p.shape:
        raise ValueError(f"probs: expected {y.shape[0]} values, got {p.shape[0]}")
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def bce_with_logits(logits, labels):
    """Mean binary cross-entropy from logits, and its gradient with respect to them.

    ``loss = mean(max(z, 0) - z y + log(1 + exp(-|z|)))``, stable for any
    ``z``; ``dloss/dz = (sigmoid(z) - y) / B``. Returns ``(loss, dlogits)``
    with ``loss`` a 0-d array of ``logits``' module and dtype.
    """
    xp = array_module(logits, labels)
    z = xp.asarray(logits)
    y = xp.asarray(labels, dtype=z.dtype)
    if z.shape != y.shape or z.ndim != 1:
        raise ValueError(f"logits/labels: expected matching 1-D shapes, got {z.shape} and "
                         f"{y.shape}")
    b = z.shape[0]
    if b == 0:
        raise ValueError(f"logits: expected a non-empty batch, got shape {z.shape}")
    loss = (xp.maximum(z, 0) - z * y + xp.log1p(xp.exp(-xp.abs(z)))).mean()
    grad = (sigmoid(z) - y) * (1.0 / b)
    return loss, grad.astype(z.dtype, copy=False)
