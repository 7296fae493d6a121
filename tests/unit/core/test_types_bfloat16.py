"""Which array modules hold bfloat16: ``neocomm.types.check_array_bfloat16``.

CuPy's versions are stood in by a module-like object (no GPU needed); NumPy's
version is monkeypatched, as the check reads ``numpy.__version__`` when called.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from neocomm import types as nt

pytestmark = pytest.mark.skipif(nt.bfloat16 is None, reason="ml_dtypes is not installed")


def _cupy(version: str):
    return types.SimpleNamespace(__version__=version)


@pytest.mark.parametrize("numpy_version", ["2.1.1", "2.0.2", "1.26.4", "2.1.2rc1"])
def test_cupy14_bfloat16_with_an_older_numpy_is_refused(monkeypatch, numpy_version):
    monkeypatch.setattr(np, "__version__", numpy_version)
    with pytest.raises(ValueError) as err:
        nt.check_array_bfloat16(_cupy("14.0.1"), "wire_dtype = 'bf16'")
    msg = str(err.value)
    assert msg.startswith("wire_dtype = 'bf16': ")
    assert f"NumPy {numpy_version} is installed" in msg
    assert "NumPy 2.1.2 or later" in msg and "pip install 'numpy>=2.1.2'" in msg


@pytest.mark.parametrize("numpy_version", ["2.1.2", "2.2.0", "3.0.0", "2.10.0"])
def test_cupy14_bfloat16_with_numpy_2_1_2_or_later_is_accepted(monkeypatch, numpy_version):
    monkeypatch.setattr(np, "__version__", numpy_version)
    nt.check_array_bfloat16(_cupy("14.0.1"), "dtype")


def test_cupy13_is_refused_for_its_own_reason_and_numpy_needs_nothing(monkeypatch):
    monkeypatch.setattr(np, "__version__", "2.0.2")
    with pytest.raises(ValueError, match="CuPy 14 or later.*CuPy 13.3.0 is installed"):
        nt.check_array_bfloat16(_cupy("13.3.0"), "dtype")
    nt.check_array_bfloat16(np, "dtype")  # host arrays: ml_dtypes is enough
