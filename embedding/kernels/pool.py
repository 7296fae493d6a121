"""The CPU kernels' threads: a shared pool per thread count, never more threads than cores.

The compiled kernels release the GIL, so tables (or blocks of bags) handed to the pool
run side by side; the NumPy kernels gain where NumPy releases it (gathers, adds).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["host_cores", "run_all"]

_POOLS: dict[int, ThreadPoolExecutor] = {}


def host_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


def run_all(fn, items, threads: int) -> list:
    """``[fn(i) for i in items]``, on a shared pool of ``threads`` threads (never more than
    :func:`host_cores`) when > 1."""
    items = list(items)
    threads = min(threads, host_cores())
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="emb-kernel")
    return list(pool.map(fn, items))
