"""Array-module dispatch: the same dense code runs on NumPy and on CuPy arrays."""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["array_module", "to_numpy"]


def _cupy():
    """CuPy when this process has imported it, else None: a CuPy array exists only once
    CuPy is imported, so nothing is imported here (importing CuPy takes most of a second,
    which every process would pay at start-up, GPU or not)."""
    return sys.modules.get("cupy")


def array_module(*arrays):
    """``cupy`` when any of ``arrays`` is a CuPy array, else ``numpy``."""
    cupy = _cupy()
    if cupy is not None:
        return cupy.get_array_module(*arrays)
    return np


def to_numpy(a) -> np.ndarray:
    """A NumPy copy (or view) of ``a``, moving it off the device when needed."""
    cupy = _cupy()
    if cupy is not None and isinstance(a, cupy.ndarray):
        return a.get()
    return np.asarray(a)
