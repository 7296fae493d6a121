"""Straightforward loop implementations: the yardstick of the tests.

Deliberately naive (Python loops over bags and ids, float64 by default):
slow, small sizes only. They define what the fused kernels must compute.
"""
from __future__ import annotations

import numpy as np

from embedding.types import Pooling

__all__ = ["pool_bags", "bag_grads"]


def pool_bags(table: np.ndarray, bags: list[list[int]], pooling: Pooling = Pooling.SUM,
              weights: list[list[float]] | None = None) -> np.ndarray:
    """``[len(bags), dim]``: each bag's (weighted) sum, mean or per-column max of ``table`` rows.

    Empty bags give zeros."""
    out = np.zeros((len(bags), table.shape[1]), table.dtype)
    for b, ids in enumerate(bags):
        for j, i in enumerate(ids):
            w = 1.0 if weights is None else weights[b][j]
            if pooling is Pooling.MAX:
                out[b] = w * table[i] if j == 0 else np.maximum(out[b], w * table[i])
            else:
                out[b] += w * table[i]
        if pooling is Pooling.MEAN and ids:
            out[b] /= len(ids)
    return out


def bag_grads(num_rows: int, bags: list[list[int]], grad: np.ndarray,
              pooling: Pooling = Pooling.SUM, weights: list[list[float]] | None = None,
              table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dense ``[num_rows, dim]`` gradient of :func:`pool_bags` and the touched-row mask.

    Max pooling needs the ``table`` that was pooled: a column's gradient goes
    to the first id of the bag holding its maximum."""
    dense = np.zeros((num_rows, grad.shape[1]), grad.dtype)
    touched = np.zeros(num_rows, bool)
    for b, ids in enumerate(bags):
        scale = 1.0 / len(ids) if pooling is Pooling.MEAN and ids else 1.0
        if pooling is Pooling.MAX and ids:
            ws = [1.0 if weights is None else weights[b][j] for j in range(len(ids))]
            vals = np.stack([w * table[i] for w, i in zip(ws, ids)])
            first = np.argmax(vals, axis=0)  # the first maximum of each column
            for j, i in enumerate(ids):
                dense[i] += np.where(first == j, ws[j] * grad[b], 0)
                touched[i] = True
            continue
        for j, i in enumerate(ids):
            w = 1.0 if weights is None else weights[b][j]
            dense[i] += w * scale * grad[b]
            touched[i] = True
    return dense, touched
