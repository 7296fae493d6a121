"""Deduplication helper: unique ids and inverse index."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.sharding.dedup import unique_inverse


@pytest.mark.parametrize("high", [5, 70_000, 2 ** 40])
def test_unique_inverse_equals_numpy(high):
    rng = np.random.default_rng(2)
    v = rng.integers(0, high, 4000)
    u, inv = unique_inverse(v, high - 1)
    nu, ninv = np.unique(v, return_inverse=True)
    np.testing.assert_array_equal(u, nu)
    np.testing.assert_array_equal(inv, ninv)
    np.testing.assert_array_equal(u[inv], v)


def test_unique_inverse_empty():
    u, inv = unique_inverse(np.zeros(0, np.int64))
    assert u.size == 0 and inv.size == 0
