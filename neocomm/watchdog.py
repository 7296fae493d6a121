"""Stall detection: a blocked collective must end the job, not hang it.

Blocking waits run inside :func:`guard`. A daemon thread checks the open
waits; when one has been open longer than ``NEOCOMM_TIMEOUT`` seconds it
writes which rank is stuck in what, and aborts the whole MPI job.

Open waits live in one process-wide dict, :data:`OPEN`, that survives
:func:`configure` being called again: each key is an object with a ``what``
attribute (the text the stall message names), each value the
:func:`time.monotonic` second the wait began. A hot path that repeats one
wait keeps one :class:`Slot` and brackets the blocking call itself::

    OPEN[slot] = time.monotonic()
    try:
        blocking_call()
    finally:
        del OPEN[slot]

which costs one clock read, one dict insert and one delete.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

__all__ = ["guard", "configure", "Watchdog", "Slot", "OPEN"]

#: Open waits of this process: slot (has ``.what``) -> monotonic start, seconds.
OPEN: dict = {}


class Slot:
    """The key of one open wait: names what is being waited for. Hashes by identity."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"Slot({self.what!r})"


class Watchdog:
    """Aborts the job when a wait in ``open_waits`` outlives ``timeout`` seconds."""

    def __init__(self, timeout: float, rank: int, abort=None, open_waits: dict | None = None):
        self.timeout = float(timeout)
        self.rank = rank
        self._abort = abort or _mpi_abort
        self._open: dict = {} if open_waits is None else open_waits
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
        """Context manager registering one wait named ``what`` with this watchdog."""
        return _Guard(self._open, what)

    def _loop(self) -> None:
        interval = min(1.0, max(self.timeout / 4, 0.05))
        while not self._stop.wait(interval):
            now = time.monotonic()
            for slot, since in list(self._open.items()):
                if now - since > self.timeout:
                    msg = (f"neocomm: rank {self.rank}: {slot.what} has not completed after "
                           f"{now - since:.1f} s (NEOCOMM_TIMEOUT={self.timeout:g}); a peer "
                           f"never arrived or died. Aborting the job.\n")
                    sys.stderr.write(msg)
                    sys.stderr.flush()
                    self._abort(msg)
                    return


class _Guard(Slot):
    """One open wait as a context manager (a plain class: this is a hot path)."""

    __slots__ = ("_open",)

    def __init__(self, open_waits: dict, what: str):
        self.what = what
        self._open = open_waits

    def __enter__(self) -> None:
        self._open[self] = _now()

    def __exit__(self, *exc) -> None:
        self._open.pop(self, None)


_now = time.monotonic


def _mpi_abort(msg: str) -> None:  # pragma: no cover - ends the process
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(3)
    finally:
        os._exit(3)


_ACTIVE: Watchdog | None = None


def configure(timeout: float, rank: int) -> Watchdog:
    """Install the process-wide watchdog (replacing any earlier one; open waits stay
    registered in :data:`OPEN`)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
    _ACTIVE = Watchdog(timeout, rank, open_waits=OPEN)
    _ACTIVE.start()
    return _ACTIVE


_NULL = contextlib.nullcontext()


def guard(what: str):
    """Context manager around a blocking wait; a no-op before ``neocomm.init()``."""
    wd = _ACTIVE
    if wd is None or wd.timeout <= 0:
        return _NULL
    return _Guard(OPEN, what)
