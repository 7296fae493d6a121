"""Stall detection: a blocked collective must end the job, not hang it.

Blocking waits run inside :func:`guard`. A daemon thread checks the oldest
open guard; when it has been open longer than ``NEOCOMM_TIMEOUT`` seconds it
writes which rank is stuck in what, and aborts the whole MPI job. The hot
path costs one clock read and a dict write per guarded wait.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time

__all__ = ["guard", "configure", "Watchdog"]


class Watchdog:
    """Aborts the job when a guarded wait outlives ``timeout`` seconds."""

    def __init__(self, timeout: float, rank: int, abort=None):
        self.timeout = float(timeout)
        self.rank = rank
        self._abort = abort or _mpi_abort
        self._open: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.timeout > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="neocomm-watchdog",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def guard(self, what: str) -> "_Guard":
        return _Guard(self._open, next(self._ids), what)

    def _loop(self) -> None:
        interval = min(1.0, max(self.timeout / 4, 0.05))
        while not self._stop.wait(interval):
            now = time.monotonic()
            for what, since in list(self._open.values()):
                if now - since > self.timeout:
                    msg = (f"neocomm: rank {self.rank}: {what} has not completed after "
                           f"{now - since:.1f} s (NEOCOMM_TIMEOUT={self.timeout:g}); a peer "
                           f"never arrived or died. Aborting the job.\n")
                    sys.stderr.write(msg)
                    sys.stderr.flush()
                    self._abort(msg)
                    return


class _Guard:
    """Registers one open wait with the watchdog (a plain class: this is the hot path)."""

    __slots__ = ("_open", "_key", "_what")

    def __init__(self, open_waits: dict, key: int, what: str):
        self._open = open_waits
        self._key = key
        self._what = what

    def __enter__(self) -> None:
        self._open[self._key] = (self._what, time.monotonic())

    def __exit__(self, *exc) -> None:
        self._open.pop(self._key, None)


def _mpi_abort(msg: str) -> None:  # pragma: no cover - ends the process
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(3)
    finally:
        os._exit(3)


_ACTIVE: Watchdog | None = None


def configure(timeout: float, rank: int) -> Watchdog:
    """Install the process-wide watchdog (replacing any earlier one)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
    _ACTIVE = Watchdog(timeout, rank)
    _ACTIVE.start()
    return _ACTIVE


_NULL = contextlib.nullcontext()


def guard(what: str):
    """Context manager around a blocking wait; a no-op before ``neocomm.init()``."""
    wd = _ACTIVE
    if wd is None or wd.timeout <= 0:
        return _NULL
    return _Guard(wd._open, next(wd._ids), what)
