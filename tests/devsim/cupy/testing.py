"""The stand-in's ``cupy.testing``: NumPy's assertions after a synchronising copy to the host."""
from __future__ import annotations

import numpy as np

__all__ = ["assert_array_equal", "assert_allclose", "assert_array_almost_equal"]


def _host(x):
    import cupy

    return x.get() if isinstance(x, cupy.ndarray) else np.asarray(x)


def assert_array_equal(actual, desired, err_msg="", verbose=True, **kwargs):
    np.testing.assert_array_equal(_host(actual), _host(desired), err_msg=err_msg,
                                  verbose=verbose, **kwargs)


def assert_allclose(actual, desired, rtol=1e-7, atol=0, equal_nan=True, err_msg="",
                    verbose=True):
    np.testing.assert_allclose(_host(actual), _host(desired), rtol=rtol, atol=atol,
                               equal_nan=equal_nan, err_msg=err_msg, verbose=verbose)


def assert_array_almost_equal(actual, desired, decimal=6, err_msg="", verbose=True):
    np.testing.assert_array_almost_equal(_host(actual), _host(desired), decimal=decimal,
                                         err_msg=err_msg, verbose=verbose)
