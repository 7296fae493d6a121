"""Array-module dispatch: the same dense code runs on NumPy and on CuPy arrays."""
from __future__ import annotations

import numpy as np

__all__ = ["array_module", "to_numpy"]

try:  # CuPy is optional; without it every array is a NumPy array
    import cupy as _cupy
except ImportError:  # pragma: no cover - depends on the environment
    _cupy = None


def array_module(*arrays):
    """``cupy`` when any of ``arrays`` is a CuPy array, else ``numpy``."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return np


def to_numpy(a) -> np.ndarray:
    """A NumPy copy (or view) of ``a``, moving it off the device when needed."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return a.get()
    return np.asarray(a)
