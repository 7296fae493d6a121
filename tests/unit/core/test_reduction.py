"""neocomm.reduction: 16-bit floats reduce in float32 and round once; the error bound."""
from __future__ import annotations

import numpy as np
import pytest

from neocomm.reduction import (PIECE, UNIT_ROUNDOFF, combine_many, error_bound, reducer,
                               relative_bound)
from neocomm.types import ReduceOp, bfloat16

HALVES = ["float16"] + (["bfloat16"] if bfloat16 is not None else [])
UFUNC = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
         ReduceOp.PROD: np.multiply}


def _dt(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.value)
@pytest.mark.parametrize("dtype", HALVES)
def test_pair_is_the_float32_result_rounded_once(dtype, op):
    """Over more than one piece, in place too: each element is fl(a op b)."""
    dt, rng = _dt(dtype), np.random.default_rng(1)
    n = 2 * PIECE + 5
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-10, 8, n)).astype(dt)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-10, 8, n)).astype(dt)
    with np.errstate(over="ignore"):
        want = UFUNC[op](a.astype(np.float64), b.astype(np.float64)).astype(np.float32).astype(dt)
    out = np.empty_like(a)
    reducer(np, dt, op)(a, b, out=out)
    in_place = b.copy()
    reducer(np, dt, op)(a, in_place, out=in_place)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))
    assert np.array_equal(in_place.view(np.uint16), want.view(np.uint16))


def test_other_dtypes_keep_their_ufunc():
    assert reducer(np, np.float32, ReduceOp.SUM) is np.add
    assert reducer(np, np.int8, "max") is np.maximum


@pytest.mark.parametrize("dtype", HALVES)
def test_many_inputs_round_once_where_16_bit_accumulation_would_not(dtype):
    """1, u, u, u: float32 holds 1 + 3u and rounds it once (error u); adding in the
    16-bit type rounds 1 + u back to 1 three times (error 3u), past the one-step
    bound and within the three-step one."""
    dt, u = _dt(dtype), UNIT_ROUNDOFF[dtype]
    inputs = [np.full(PIECE + 3, v, dt) for v in (1.0, u, u, u)]
    out = inputs[0].copy()
    combine_many(ReduceOp.SUM, [out] + inputs[1:], out)  # in place
    exact = 1 + 3 * u
    one_step = error_bound(inputs, ReduceOp.SUM, 1)
    assert np.all(np.abs(out.astype(np.float64) - exact) <= one_step)
    naive = inputs[0].copy()
    for x in inputs[1:]:
        naive += x
    naive_err = np.abs(naive.astype(np.float64) - exact)
    assert np.all(naive_err > one_step)
    assert np.all(naive_err <= error_bound(inputs, ReduceOp.SUM, 3))


def test_many_inputs_of_other_dtypes_reduce_in_their_type():
    xs = [np.arange(10, dtype=np.int8) * k for k in (1, 50, 100)]
    out = np.empty(10, np.int8)
    with np.errstate(over="ignore"):
        combine_many(ReduceOp.SUM, xs, out, piece=3)
    assert np.array_equal(out, (np.arange(10) * 151).astype(np.int8))  # wraps


def test_bound_values():
    u = 2.0 ** -11
    s = 3 * u + 3 * 2.0 ** -24
    assert relative_bound("float16", 3, 4) == pytest.approx(s / (1 - s), rel=1e-12)
    assert relative_bound(np.float32, 2, 4) == pytest.approx(2 * 2.0 ** -24, rel=1e-6)
    rows = [np.array([2.0, -1.0], np.float16), np.array([1.0, 3.0], np.float16)]
    assert error_bound(rows, "max", 1).tolist() == [0.0, 0.0]
    assert error_bound(rows, "sum", 1).tolist() == pytest.approx(
        [3 * relative_bound("float16", 1, 2), 4 * relative_bound("float16", 1, 2)])
    assert error_bound(rows, "prod", 0).tolist() == pytest.approx(
        [2 * relative_bound("float16", 1, 2), 3 * relative_bound("float16", 1, 2)])
    with pytest.raises(ValueError, match="dtype: expected one of .* got 'int32'"):
        relative_bound(np.int32, 1, 2)
