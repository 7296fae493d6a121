"""The one validation of a collective call's arguments, in the user's terms.

Every check returns this rank's :class:`~neocomm.agree.Problem` (None when
the argument is fine), naming the argument and the value as given; the
call's agreement (:mod:`neocomm.agree`) then raises it on every rank. The
backends below never check: they move what they are given.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from neocomm.agree import Problem
from neocomm.types import DTYPE_CODES, REDUCIBLE_DTYPES
from neocomm.world import rank_device

__all__ = ["check_buffer", "dtype_code_of", "check_same_dtype", "check_counts", "check_peer",
           "check_overlap", "overlapping", "same_memory", "first", "counts_digest"]

_INFO: dict = {}  # np.dtype -> (wire code, reducible); dtype.name is slow on the hot path


def _info(dtype) -> tuple[int, bool]:
    info = _INFO.get(dtype)
    if info is None:
        name = np.dtype(dtype).name
        info = _INFO[dtype] = (DTYPE_CODES.get(name, 0), name in REDUCIBLE_DTYPES)
    return info


def dtype_code_of(buf) -> int:
    """The wire code of ``buf``'s dtype; 0 for anything that is not a supported array."""
    dtype = getattr(buf, "dtype", None)
    if dtype is None:
        return 0
    try:
        return _info(dtype)[0]
    except TypeError:
        return 0


def check_buffer(name: str, buf, *, device: bool, writable: bool = False,
                 reducible: bool = False) -> Problem | None:
    """The array kind, contiguity, dtype and writability of one buffer.

    The common case (a contiguous array of a supported dtype) costs a few
    attribute reads and one dict lookup; the rest writes the message.
    """
    if (type(buf) is np.ndarray) != bool(device) and hasattr(buf, "dtype"):
        flags = buf.flags
        code, can_reduce = _info(buf.dtype)
        if (code and flags.c_contiguous and (can_reduce or not reducible)
                and (not writable or getattr(flags, "writeable", True))  # CuPy: no flag
                and (not device or _on_rank_device(buf))):
            return None
    return _explain(name, buf, device, writable, reducible)


def _on_rank_device(buf) -> bool:
    dev = rank_device()
    return dev is None or buf.device.id == dev


def _explain(name: str, buf, device: bool, writable: bool, reducible: bool) -> Problem | None:
    from collectives.arrays import Refused

    if isinstance(buf, Refused):  # a caller's array with no view (collectives.arrays)
        return Problem(name, buf.message)
    is_device = hasattr(buf, "__cuda_array_interface__")
    if device and not is_device:
        return Problem(name, f"{name}: expected a CuPy (device) array for this backend, "
                             f"got {type(buf).__module__}.{type(buf).__name__}")
    if not device and not isinstance(buf, np.ndarray):
        kind = "a CuPy array; use the NCCL or staged backend" if is_device else \
            f"{type(buf).__module__}.{type(buf).__name__}"
        return Problem(name, f"{name}: expected a NumPy (host) array for the MPI backend, got {kind}")
    if not buf.flags.c_contiguous:
        return Problem(name, f"{name}: must be C-contiguous, got strides {buf.strides} for "
                             f"shape {buf.shape}")
    dt = buf.dtype.name
    if dt not in DTYPE_CODES:
        return Problem(name, f"{name}: dtype {dt} is not supported; expected one of "
                             f"{sorted(DTYPE_CODES)}")
    if reducible and dt not in REDUCIBLE_DTYPES:
        return Problem(name, f"{name}: dtype {dt} cannot be reduced; expected one of "
                             f"{sorted(REDUCIBLE_DTYPES)}")
    if writable and not getattr(buf.flags, "writeable", True):  # CuPy arrays are always writable
        return Problem(name, f"{name}: is read-only, but the operation writes into it")
    if device and not _on_rank_device(buf):
        return Problem(name, f"{name}: the array is on GPU device {buf.device.id}, but this "
                             f"rank's collectives run on device {rank_device()} (allocate it "
                             f"under cupy.cuda.Device({rank_device()}))")
    return None


def check_same_dtype(a_name: str, a, b_name: str, b) -> Problem | None:
    if a.dtype != b.dtype:
        return Problem(b_name, f"{b_name}: dtype {b.dtype.name} differs from {a_name}'s "
                               f"{a.dtype.name}")
    return None


def _span(buf) -> tuple[int, int]:
    """``(first byte address, one past the last)`` of a contiguous array (host or device)."""
    iface = getattr(buf, "__cuda_array_interface__", None) or buf.__array_interface__
    start = int(iface["data"][0])
    return start, start + int(buf.nbytes)


def same_memory(a, b) -> bool:
    """Whether arrays ``a`` and ``b`` are the very same bytes (an in-place call)."""
    if a is b:
        return True
    try:
        return a.nbytes == b.nbytes and a.nbytes > 0 and _span(a) == _span(b)
    except (AttributeError, KeyError, TypeError):
        return False


def overlapping(a, b) -> bool:
    """Whether arrays ``a`` and ``b`` share any byte (the same memory included)."""
    try:
        if a.nbytes == 0 or b.nbytes == 0:
            return False
        (a0, a1), (b0, b1) = _span(a), _span(b)
    except (AttributeError, KeyError, TypeError):
        return True
    return not (a1 <= b0 or b1 <= a0)


def check_overlap(a_name: str, a, b_name: str, b) -> Problem | None:
    """``b`` is ``a`` itself (in place) or memory of its own: a partial overlap (views of
    one array at different offsets) would be read after it was written."""
    if a is b or a.nbytes == 0 or b.nbytes == 0:
        return None
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a0 == b0 and a1 == b1 or a1 <= b0 or b1 <= a0:
        return None  # the same memory (in place), or disjoint
    return Problem(b_name, f"{b_name}: overlaps {a_name} in part (bytes {max(a0, b0) - a0} to "
                           f"{min(a1, b1) - a0} of {a_name}); pass the same array for an "
                           f"in-place call, or arrays that do not overlap")


def check_counts(name: str, counts, size: int, total: int, buf_name: str) -> tuple[Problem | None, np.ndarray]:
    """Per-peer counts: ``size`` non-negative integers summing to ``total``."""
    try:
        arr = np.asarray(counts)
    except Exception:  # noqa: BLE001 - anything unconvertible is a bad argument
        return Problem(name, f"{name}: expected {size} integers, got {counts!r}"), np.zeros(size, np.int64)
    if arr.ndim != 1 or arr.shape[0] != size:
        return Problem(name, f"{name}: expected one count per rank ({size}), got shape "
                             f"{arr.shape}"), np.zeros(size, np.int64)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.mod(arr, 1) == 0):
            return Problem(name, f"{name}: counts must be integers, got {arr.tolist()}"), \
                np.zeros(size, np.int64)
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        return Problem(name, f"{name}: counts must be >= 0, got {arr.tolist()}"), arr
    if int(arr.sum()) != total:
        return Problem(name, f"{name}: counts sum to {int(arr.sum())} but {buf_name} holds "
                             f"{total} elements"), arr
    return None, arr


def check_peer(name: str, peer, size: int) -> Problem | None:
    if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < size:
        return Problem(name, f"{name}: expected a group rank in [0, {size}), got {peer!r}")
    return None


def first(*problems: Problem | None) -> Problem | None:
    """The first real problem among ``problems``."""
    for p in problems:
        if p is not None:
            return p
    return None


def counts_digest(counts: Sequence[int] | None) -> int:
    """A 31-bit digest of a count vector, for signatures that must agree."""
    if counts is None:
        return 0
    return zlib.crc32(np.asarray(counts, np.int64).tobytes()) & 0x7FFFFFFF
