"""Element-wise reduction of two or more arrays, 16-bit float types included.

Every reduction that neocomm computes itself goes through here: MPI's user
ops for the 2-byte floats, and the local steps of the collectives'
algorithms (ring, Rabenseifner, hierarchical, symmetric shared memory), on
NumPy and CuPy arrays alike.

float16 and bfloat16 are widened to float32 a piece at a time (at most
:data:`PIECE` elements, so the float32 scratch stays small and the data is
read once), reduced in float32, and rounded back once. One reduction step
(``out = a op b``, or ``out = x0 op x1 op ... op xk`` of a symmetric
reduction) therefore costs one rounding to the 16-bit type, never more.
Other dtypes reduce with the ufunc in their own type.

Error bound (:func:`relative_bound`): a result reached by ``steps`` roundings
to a 16-bit type of unit roundoff ``u`` (2^-11 for float16, 2^-8 for
bfloat16; :data:`UNIT_ROUNDOFF`), over ``ranks`` inputs, satisfies per
element, away from overflow,

    SUM:      |result - exact| <= g(steps) * sum_r |x_r|
    PROD:     |result - exact| <= g(ranks - 1) * |exact|   (away from underflow too)
    MAX, MIN: result == exact

with ``g(k) = s / (1 - s)`` and ``s = k * u + (ranks - 1) * 2^-24`` (the
second term covers the float32 roundings of the widened partial results).
For a sum, ``steps`` is the depth of the reduction tree: the algorithm's
``rounding_steps`` (ring ``p - 1``, Rabenseifner ``ceil(log2 p)``,
symmetric 1; any tree over ``p`` inputs is at most ``p - 1`` deep), since a
rounding at a node perturbs only the inputs below it. A product carries the
relative error of every one of its ``ranks - 1`` multiplications, whatever
the tree's shape.
"""
from __future__ import annotations

import math

import numpy as np

from neocomm.types import HALF_DTYPES, ReduceOp, is_half

__all__ = ["UNIT_ROUNDOFF", "PIECE", "reducer", "combine_many",
           "relative_bound", "error_bound"]

#: unit roundoff (half an ulp of 1, round to nearest even) of each float type
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53}
#: elements widened to float32 at a time (64 KiB of float32 scratch)
PIECE = 1 << 14

_UFUNC_NAMES = {ReduceOp.SUM: "add", ReduceOp.MAX: "maximum", ReduceOp.MIN: "minimum",
                ReduceOp.PROD: "multiply"}
_WIDE = 2.0 ** -24  # float32's unit roundoff


def _xp_of(arr):
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def reducer(xp, dtype, op: ReduceOp):
    """``f(a, b, out=c)``: ``c = a op b`` element-wise on arrays of ``xp`` and ``dtype``
    (``c`` may be ``a`` or ``b``). The ufunc itself for most dtypes; for float16 and
    bfloat16 a function that widens each piece to float32 and rounds once."""
    ufunc = getattr(xp, _UFUNC_NAMES[ReduceOp.parse(op)])
    if not is_half(dtype):
        return ufunc

    def widened(a, b, out):
        n = out.size
        wide = xp.float32
        if xp is np:
            ta = np.empty(min(n, PIECE), np.float32)
            tb = np.empty_like(ta)
        for s in range(0, n, PIECE):
            e = min(n, s + PIECE)
            if xp is np:
                x, y = ta[:e - s], tb[:e - s]
                x[...] = a[s:e]
                y[...] = b[s:e]
            else:
                x, y = a[s:e].astype(wide), b[s:e].astype(wide)
            ufunc(x, y, out=x)
            if xp is np:
                with np.errstate(over="ignore"):  # IEEE: beyond the type's range is inf
                    out[s:e] = x  # the one rounding
            else:
                out[s:e] = x.astype(out.dtype)

    return widened


def combine_many(op: ReduceOp, inputs, out, piece: int = PIECE) -> None:
    """``out = inputs[0] op inputs[1] op ...`` element-wise, in pieces of ``piece``
    elements (at most :data:`PIECE` for 16-bit floats); ``out`` may be ``inputs[0]``
    (in place). 16-bit floats accumulate in float32 and round once per element."""
    xp = _xp_of(out)
    ufunc = getattr(xp, _UFUNC_NAMES[ReduceOp.parse(op)])
    if len(inputs) == 1:
        if not xp.shares_memory(out, inputs[0]):
            out[...] = inputs[0]
        return
    half = is_half(out.dtype)
    n = out.size
    piece = max(1, min(int(piece), PIECE) if half else int(piece))
    for s in range(0, n, piece):
        e = min(n, s + piece)
        if half:
            acc = inputs[0][s:e].astype(xp.float32)
            for view in inputs[1:]:
                ufunc(acc, view[s:e].astype(xp.float32), out=acc)
            with np.errstate(over="ignore"):  # IEEE: beyond the type's range is inf
                out[s:e] = acc.astype(out.dtype)  # the one rounding
        else:
            acc = out[s:e]
            ufunc(inputs[0][s:e], inputs[1][s:e], out=acc)
            for view in inputs[2:]:
                ufunc(acc, view[s:e], out=acc)


def relative_bound(dtype, steps: int, ranks: int) -> float:
    """``g`` of the module's error bound: a reduction of ``ranks`` inputs of ``dtype``
    whose result went through ``steps`` roundings to ``dtype``."""
    name = np.dtype(dtype).name
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: expected one of {sorted(UNIT_ROUNDOFF)}, got {name!r}")
    s = int(steps) * UNIT_ROUNDOFF[name]
    if name in HALF_DTYPES:
        s += max(0, int(ranks) - 1) * _WIDE
    if s >= 1:
        return math.inf
    return s / (1 - s)


def error_bound(inputs, op: ReduceOp, steps: int, dtype=None) -> np.ndarray:
    """The per-element bound on ``|result - exact|`` (float64) of reducing ``inputs``
    (one array per rank, the values as reduced, of ``dtype``: theirs by default) with
    ``op`` by a tree ``steps`` deep (see the module docstring)."""
    rows = np.stack([np.asarray(x, np.float64) for x in inputs])
    op = ReduceOp.parse(op)
    dtype = np.asarray(inputs[0]).dtype if dtype is None else dtype
    ranks = len(inputs)
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        return np.zeros(rows.shape[1:])
    if op is ReduceOp.PROD:
        return relative_bound(dtype, ranks - 1, ranks) * np.abs(np.prod(rows, axis=0))
    return relative_bound(dtype, steps, ranks) * np.abs(rows).sum(axis=0)
