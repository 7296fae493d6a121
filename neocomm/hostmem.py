"""Host memory a training step frees is kept for the next step, not handed back to the OS.

A step makes the same temporaries every time (the ids sorted for the backward,
the pooled rows, the gradients, the exchange buffers: megabytes each). With
glibc's defaults, an allocation over its mmap threshold is mapped fresh from
the OS, and freed memory at the top of the heap beyond its trim threshold is
handed back; either way the next step touches fresh pages, and each first touch
is a page fault (thousands per step; on a virtual machine each costs
microseconds). :func:`keep_freed_memory` raises both thresholds once per
process (``mallopt``), so those temporaries come from memory the process
already holds:

- ``M_TRIM_THRESHOLD`` = ``NEOCOMM_HOST_KEEP_FREED`` (default 1 GiB): up to this
  much freed memory stays with the process;
- ``M_MMAP_THRESHOLD`` = the same, at most :data:`MMAP_CAP` (64 MiB): smaller
  allocations come from the heap; the tables themselves, larger, are still
  mapped on their own and returned whole when freed.

The price is memory: a process keeps up to that much of what it freed (its
resident size stays near its peak instead of falling between steps).
``NEOCOMM_HOST_KEEP_FREED=0`` leaves the C library's defaults. Other C libraries
(musl, macOS) are left alone. ``neocomm.init()`` and the fused embedding tables
apply it.
"""
from __future__ import annotations

import ctypes
import threading

from neocomm import config

__all__ = ["keep_freed_memory", "MMAP_CAP"]

#: the largest allocation served from the reused heap (larger ones are mapped on their own)
MMAP_CAP = 64 << 20
#: glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

_lock = threading.Lock()
_applied: int | None = None


def _glibc_mallopt():
    """glibc's ``mallopt``, or None under another C library."""
    try:
        libc = ctypes.CDLL(None)   # the symbols this process already has: its C library's
        libc.gnu_get_libc_version  # glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_memory(keep: int | None = None) -> int:
    """Keep up to ``keep`` bytes of freed host memory in this process for reuse (default
    ``NEOCOMM_HOST_KEEP_FREED``); returns the bytes now kept, 0 when nothing was changed
    (``keep`` 0, or not glibc). The first call in a process decides; later calls return
    its result."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        if keep is None:
            keep = config.get("HOST_KEEP_FREED")
        keep = int(keep)
        if keep < 0:
            raise ValueError(f"keep: expected >= 0 bytes, got {keep}")
        mallopt = _glibc_mallopt() if keep else None
        if mallopt is None:
            _applied = 0
            return 0
        keep = min(keep, (1 << 31) - 1)   # mallopt takes a C int
        ok = mallopt(_M_TRIM_THRESHOLD, keep) and mallopt(_M_MMAP_THRESHOLD,
                                                          min(keep, MMAP_CAP))
        _applied = keep if ok else 0
        return _applied
