"""Stochastic rounding of half tables over many updates of the same rows: unbiased in time.

The tolerances come from the sample sizes: a stochastic rounding of ``x``
between neighbours ``lo`` and ``lo + gap`` is a Bernoulli draw of ``gap``
with probability ``p = (x - lo) / gap``, so ``n`` draws' mean has standard
error ``gap * sqrt(p (1 - p) / n)`` (at most ``gap / (2 sqrt(n))``). Each
check allows 5 standard errors at a fixed seed: the checks are deterministic,
and a correct rounding fails one with probability below 1e-6 per value.
"""
from __future__ import annotations

import numpy as np
import pytest

from embedding.kernels import Bags, FusedTables
from embedding.precision import Rounding, round_to, storage_dtype
from embedding.types import OptimizerConfig, OptimizerKind

HALVES = ("float16", "bfloat16")


def _neighbours(x: np.ndarray, dt) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, gap)``: the half value at or below ``x`` and the gap to the next one up."""
    near = x.astype(dt)
    lo = np.where(near.astype(np.float64) > x,
                  np.nextafter(near, np.asarray(-np.inf, dt)), near)
    hi = np.nextafter(lo, np.asarray(np.inf, dt))
    return lo.astype(np.float64), hi.astype(np.float64) - lo.astype(np.float64)


@pytest.mark.parametrize("name", HALVES)
def test_one_element_rounded_at_every_step_is_unbiased(name):
    """The same (table, row, column) rounded at steps 0 .. n-1, as a row a training run updates
    again and again: it rounds up as often as the dropped fraction says."""
    dt = storage_dtype(name)
    rng = np.random.default_rng(11)
    rows, dim, n = 8, 16, 4000
    x = (rng.uniform(-1, 1, (rows, dim)) * np.exp2(rng.integers(-20, 4, (rows, 1)))
         ).astype(np.float32)
    lo, gap = _neighbours(x.astype(np.float64), dt)
    p = (x.astype(np.float64) - lo) / gap
    ups = np.zeros(x.shape)
    for step in range(n):
        got = round_to(x, dt, Rounding.STOCHASTIC, seed=5, step=step, table=2,
                       rows=np.arange(rows)).astype(np.float64)
        assert np.all((got == lo) | (got == lo + gap))
        ups += got != lo
    freq = ups / n
    # the frequency of rounding up is p, within 5 standard errors of n Bernoulli draws
    se = np.sqrt(np.maximum(p * (1 - p), 1.0 / n) / n)
    assert np.all(np.abs(freq - p) < 5 * se), np.max(np.abs(freq - p) / se)
    # so the mean is x within 5 standard errors of the mean
    assert np.all(np.abs(lo + freq * gap - x) < 5 * se * gap)


def _store(name: str, rounding: str) -> FusedTables:
    return FusedTables([4], [8], OptimizerConfig(OptimizerKind.SGD, lr=1.0), dtype=name,
                       rounding=rounding, seeds=[3])


@pytest.mark.parametrize("name", HALVES)
def test_updates_below_half_a_unit_move_a_stochastic_row_on_average(name):
    """n SGD steps of a constant update far below half a unit in the last place: nearest
    rounding never moves the row, stochastic rounding moves it by n updates on average
    (the sum of n independent rounding errors, each at most one gap, has standard deviation
    at most ``gap * sqrt(n) / 2``; the test allows 5 of those over the mean of the elements)."""
    dt = storage_dtype(name)
    start, n = 0.75, 1500
    gap = float(np.nextafter(dt.type(start), dt.type(np.inf))) - start
    delta = gap / 8                                     # an update of 1/8 of a unit
    bags = Bags(np.arange(4), np.arange(5), (0,), (0,), (False,), 4, 8)  # rows 0..3, once
    grad = np.full((4, 8), -delta, np.float32)          # SGD with lr 1: w -= grad
    moved = {}
    for rounding in ("nearest", "stochastic"):
        s = _store(name, rounding)
        s.weight(0)[...] = start
        for _ in range(n):
            s.backward_update(bags, grad)
        moved[rounding] = s.weight(0).astype(np.float64) - start
    assert np.all(moved["nearest"] == 0.0)
    want = n * float(np.float32(delta))
    # the rounding may leave [start, start + gap) for the next binade: a gap grows at most 2x
    sd = 2 * gap * np.sqrt(n) / 2 / np.sqrt(moved["stochastic"].size)
    assert abs(moved["stochastic"].mean() - want) < 5 * sd, (moved["stochastic"].mean(), want)
