"""Sparse optimizers of the fused backward: state layout and the update rule.

Every optimizer updates only the rows a batch touched, after the gradients
of duplicate ids have been summed (the non-linear updates below are applied
once per row per step, to the aggregated gradient ``g`` of that row):

- ``SGD``: ``w -= lr * g``.
- ``ROWWISE_ADAGRAD`` (FBGEMM's row-wise AdaGrad): one accumulator per row,
  ``a += mean(g * g)`` over the row's columns, then
  ``w -= lr * g / (sqrt(a) + eps)``.
- ``ADAM`` (lazy Adam): per-element moments ``m = b1 m + (1 - b1) g``,
  ``v = b2 v + (1 - b2) g^2``, and a **per-row step count** ``k`` (the number
  of steps that touched the row, incremented before use). The bias
  corrections use the row's own ``k``: ``w -= lr * (m / (1 - b1^k)) /
  (sqrt(v / (1 - b2^k)) + eps)``. A global step would over-correct rows
  that are seldom touched; the per-row count makes a row's update the
  same as dense Adam run over the steps that touched it.

State is laid out like the weights (see :class:`~embedding.kernels.layout.TableLayout`):
per-row state has one entry per global row, per-element state one per
weight element, so it shards with its rows. Column-wise shards keep their
own copy of per-row state; every slice of a row is touched together, so
the copies stay equal.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding.types import OptimizerConfig, OptimizerKind, enum_arg

__all__ = ["StateSpec", "state_specs", "row_bytes", "sparse_update", "mean_square",
           "dense_reference_update"]


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state array: ``per_row`` (one per row) or per element; its dtype
    (``None``: the weights' dtype)."""

    name: str
    per_row: bool
    dtype: str | None = None


_SPECS = {
    OptimizerKind.SGD: (),
    OptimizerKind.ROWWISE_ADAGRAD: (StateSpec("momentum", True),),
    OptimizerKind.ADAM: (StateSpec("exp_avg", False), StateSpec("exp_avg_sq", False),
                         StateSpec("step", True, "int64")),
}


def state_specs(kind: OptimizerKind) -> tuple[StateSpec, ...]:
    """The state arrays optimizer ``kind`` keeps (all start at zero)."""
    return _SPECS[enum_arg(OptimizerKind, kind, "kind")]


def row_bytes(kind: OptimizerKind, dim: int, dtype, state_dtype=None) -> int:
    """Bytes of one table row of ``dim`` elements of ``dtype`` with its optimizer state
    (float state in ``state_dtype``, default ``dtype``)."""
    item = np.dtype(dtype).itemsize
    n = dim * item
    for spec in state_specs(kind):
        n += (1 if spec.per_row else dim) * np.dtype(spec.dtype or state_dtype or dtype).itemsize
    return n


def sparse_update(config: OptimizerConfig, weight: np.ndarray, state: dict,
                  rows: np.ndarray, grads: np.ndarray, mean_sq: np.ndarray | None = None,
                  store=None) -> None:
    """Apply one step to ``weight[rows]`` (NumPy, in place).

    ``rows`` must be unique (aggregate duplicates first); ``grads`` is
    ``[len(rows), dim]`` in the compute dtype (the weights' dtype, or float32
    for a half table): the rule computes in it, reading the weight rows and
    the state (which may be stored narrower) as that dtype. ``store(rows,
    new_rows)`` writes the new rows (default: assignment, which rounds a
    half table to nearest); state is written back rounding to nearest. ``state`` maps each name of
    :func:`state_specs` to this table's state view (``[rows]`` or
    ``[rows, dim]``). ``mean_sq`` (row-wise AdaGrad only) replaces the
    ``mean(g * g)`` of each row — for a column slice of a table, whose
    accumulator must see the whole row's gradient (see column-wise sharding).
    """
    if len(rows) == 0:
        return
    cdt = grads.dtype
    dt = cdt.type
    lr = dt(config.lr)
    kind = config.kind
    if kind is OptimizerKind.SGD:
        _subtract_rows(weight, rows, grads * lr, store)
        return
    eps = dt(config.eps)
    if kind is OptimizerKind.ROWWISE_ADAGRAD:
        mom = state["momentum"]
        m = mom[rows].astype(cdt, copy=False)
        if mean_sq is None:
            mean_sq = mean_square(grads)
        m += mean_sq
        mom[rows] = m
        scale = lr / (np.sqrt(m) + eps)
        _subtract_rows(weight, rows, grads * scale[:, None], store)
        return
    if kind is OptimizerKind.ADAM:
        b1, b2 = dt(config.beta1), dt(config.beta2)
        one = dt(1)
        step = state["step"]
        k = step[rows] + 1
        step[rows] = k
        kf = k.astype(np.float64)
        bc1 = (1.0 - np.power(float(config.beta1), kf)).astype(cdt)
        bc2 = (1.0 - np.power(float(config.beta2), kf)).astype(cdt)
        ea = state["exp_avg"]
        es = state["exp_avg_sq"]
        tmp = np.multiply(grads, one - b1)
        m = np.take(ea, rows, axis=0).astype(cdt, copy=False)
        m *= b1
        m += tmp                                   # m = b1 m + (1 - b1) g
        np.multiply(grads, grads, out=tmp)
        tmp *= one - b2
        v = np.take(es, rows, axis=0).astype(cdt, copy=False)
        v *= b2
        v += tmp                                   # v = b2 v + (1 - b2) g^2
        ea[rows] = m
        es[rows] = v
        np.divide(v, bc2[:, None], out=tmp)
        np.sqrt(tmp, out=tmp)
        tmp += eps                                 # sqrt(v / bc2) + eps
        np.divide(m, bc1[:, None], out=m)
        m /= tmp
        m *= lr
        _subtract_rows(weight, rows, m, store)
        return
    raise ValueError(f"config.kind: unsupported optimizer {kind}")


#: lanes of the device's warp: row-wise AdaGrad's sum of squares is reduced in their order
WARP = 32


def mean_square(grads: np.ndarray) -> np.ndarray:
    """Row-wise AdaGrad's ``mean(g * g)`` of each row of ``grads``, in ``grads``' dtype, summed
    in the device kernel's order: lane ``l`` of a 32-lane warp adds the squares of columns
    ``l, l + 32, ...`` in turn, then the lanes are combined by an XOR butterfly (lane ``l``
    adds lane ``l ^ o`` for ``o`` = 16, 8, 4, 2, 1); the total is divided by the width. The
    compiled CPU kernels sum in the same order, so the three agree bit for bit."""
    n, d = grads.shape
    sq = grads * grads
    lanes = np.zeros((n, WARP), grads.dtype)
    for c0 in range(0, d, WARP):
        w = min(WARP, d - c0)
        lanes[:, :w] += sq[:, c0:c0 + w]
    partner = np.arange(WARP)
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, partner ^ o]
    return lanes[:, 0] / grads.dtype.type(d)


def _subtract_rows(weight: np.ndarray, rows: np.ndarray, delta: np.ndarray, store) -> None:
    """``weight[rows] -= delta`` for unique rows, as one gather, one subtract (in ``delta``'s
    dtype), one scatter (``store(rows, new)`` when given)."""
    cur = np.take(weight, rows, axis=0).astype(delta.dtype, copy=False)
    np.subtract(cur, delta, out=cur)
    if store is None:
        weight[rows] = cur
    else:
        store(rows, cur)


def dense_reference_update(config: OptimizerConfig, weight: np.ndarray, state: dict,
                           grad: np.ndarray, touched: np.ndarray) -> None:
    """Straightforward per-row loop of the same rule on a dense gradient (tests' reference).

    ``grad`` is ``[rows, dim]`` (summed over the batch), ``touched`` a bool
    mask of the rows the batch read. Slow; for small tables only.
    """
    for r in np.flatnonzero(touched):
        g = grad[r]
        if config.kind is OptimizerKind.SGD:
            weight[r] -= config.lr * g
        elif config.kind is OptimizerKind.ROWWISE_ADAGRAD:
            state["momentum"][r] += np.mean(g * g)
            weight[r] -= config.lr * g / (np.sqrt(state["momentum"][r]) + config.eps)
        else:
            state["step"][r] += 1
            k = state["step"][r]
            state["exp_avg"][r] = config.beta1 * state["exp_avg"][r] + (1 - config.beta1) * g
            state["exp_avg_sq"][r] = (config.beta2 * state["exp_avg_sq"][r]
                                      + (1 - config.beta2) * g * g)
            mhat = state["exp_avg"][r] / (1 - config.beta1 ** k)
            vhat = state["exp_avg_sq"][r] / (1 - config.beta2 ** k)
            weight[r] -= config.lr * mhat / (np.sqrt(vhat) + config.eps)
