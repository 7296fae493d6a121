"""Fast argument checks for the hot path of every collective call.

The common case (a valid, contiguous array of a supported dtype) costs a
few attribute reads and one dict lookup; anything unusual goes to
:mod:`neocomm.backends.checks`, which writes the message.
"""
from __future__ import annotations

import numpy as np

from neocomm.agree import Problem
from neocomm.backends.checks import check_buffer
from neocomm.types import DTYPE_CODES

__all__ = ["check_array", "dtype_code"]

_REDUCIBLE = frozenset(DTYPE_CODES) - {"bool"}
_INFO: dict = {}  # dtype -> (code, reducible)


def _info(dtype):
    info = _INFO.get(dtype)
    if info is None:
        name = dtype.name
        info = _INFO[dtype] = (DTYPE_CODES.get(name, 0), name in _REDUCIBLE)
    return info


def dtype_code(buf) -> int:
    """The wire code of ``buf``'s dtype (0 for anything that is not a supported array)."""
    dtype = getattr(buf, "dtype", None)
    if dtype is None:
        return 0
    try:
        return _info(dtype)[0]
    except TypeError:
        return 0


def check_array(name: str, buf, *, device: bool, writable: bool = False,
                reducible: bool = False) -> Problem | None:
    """None when ``buf`` is a usable buffer for the backend, else the problem."""
    ok = (type(buf) is np.ndarray) != bool(device)
    if ok:
        flags = buf.flags
        code, can_reduce = _info(buf.dtype) if hasattr(buf, "dtype") else (0, False)
        ok = (code != 0 and flags.c_contiguous and (can_reduce or not reducible)
              and (getattr(flags, "writeable", True) or not writable))  # CuPy: no flag
    if ok:
        return None
    return check_buffer(name, buf, device=device, writable=writable, reducible=reducible) \
        or Problem(name, f"{name}: not a usable buffer ({type(buf).__name__})")
