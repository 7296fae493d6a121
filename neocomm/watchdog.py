"""Stall detection: a blocked collective must end the job, not hang it.

Blocking waits run inside :func:`guard`. A daemon thread checks the open
waits; when one has been open longer than ``NEOCOMM_TIMEOUT`` seconds it
writes which rank is stuck in what, and aborts the whole MPI job.

Open waits are of two kinds, both surviving :func:`configure` being called
again: the guards of :func:`guard`, kept in one process-wide dict
(:data:`OPEN`: guard -> :func:`time.monotonic` start), and :class:`Slot`
objects, one per repeated wait (a plan, a prepared collective), which a hot
path opens and closes itself — two attribute stores and one clock read::

    slot.since = time.monotonic()
    try:
        blocking_call()
    finally:
        slot.since = 0.0
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref

__all__ = ["guard", "configure", "Watchdog", "Slot", "OPEN"]

#: Open guards of this process: guard (has ``.what``) -> monotonic start, seconds.
OPEN: dict = {}

_SLOTS: dict = {}  # id -> weak reference of every live Slot


class Slot:
    """One repeated wait, watched while it lives: open while ``since`` (the
    :func:`time.monotonic` second it began) is above 0; ``what`` names it."""

    __slots__ = ("what", "since", "__weakref__")

    def __init__(self, what: str):
        self.what = what
        self.since = 0.0
        key = id(self)
        _SLOTS[key] = weakref.ref(self, lambda _, key=key: _SLOTS.pop(key, None))

    def __repr__(self) -> str:
        return f"Slot({self.what!r})"


def _open_slots():
    """(what, since) of every open Slot (safe from the watchdog's thread)."""
    out = []
    for ref in list(_SLOTS.values()):
        slot = ref()
        if slot is not None and slot.since > 0.0:
            out.append((slot.what, slot.since))
    return out


class Watchdog:
    """Aborts the job when a wait in ``open_waits`` (by default a dict of its own;
    :data:`OPEN` and the live :class:`Slot` objects for the process-wide one)
    outlives ``timeout`` seconds."""

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
            waits = [(g.what, since) for g, since in list(self._open.items())]
            if self._open is OPEN:
                waits += _open_slots()
            for what, since in waits:
                if now - since > self.timeout:
                    msg = (f"neocomm: rank {self.rank}: {what} has not completed after "
                           f"{now - since:.1f} s (NEOCOMM_TIMEOUT={self.timeout:g}); a peer "
                           f"never arrived or died. Aborting the job.\n")
                    sys.stderr.write(msg)
                    sys.stderr.flush()
                    self._abort(msg)
                    return


class _Guard:
    """One open wait as a context manager (a plain class: this is a hot path)."""

    __slots__ = ("what", "_open")

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
    open)."""
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
