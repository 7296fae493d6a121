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
    :func:`time.monotonic` second it began) is above 0; ``what`` names it, followed by
    ``, call #N`` when ``number`` (a function giving the number of the call that
    waits) is given: it is asked only when the wait is reported."""

    __slots__ = ("_what", "since", "number", "__weakref__")

    def __init__(self, what: str, number=None):
        self._what = what
        self.number = number
        self.since = 0.0
        key = id(self)
        _SLOTS[key] = weakref.ref(self, lambda _, key=key: _SLOTS.pop(key, None))

    @property
    def what(self) -> str:
        number = self.number
        return self._what if number is None else f"{self._what}, call #{number()}"

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

    def __init__(self, timeout: float, rank: int, abort=None, open_waits: dict | None = None,
                 comm=None):
        self.timeout = float(timeout)
        self.rank = rank
        self._abort = abort or _mpi_abort
        self._open: dict = {} if open_waits is None else open_waits
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: a communicator of the whole job that only the watchdogs use: the stall inspector
        #: asks every rank where it is (MPI_THREAD_MULTIPLE; None: no inspector)
        self._comm = comm
        self._sends: list = []  # the inspector's messages in flight (kept until sent)

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

    def _waits(self) -> list:
        waits = [(g.what, since) for g, since in list(self._open.items())]
        if self._open is OPEN:
            waits += _open_slots()
        return waits

    def _loop(self) -> None:
        interval = min(1.0, max(self.timeout / 4, 0.05))
        while not self._stop.wait(interval):
            self._answer()
            now = time.monotonic()
            for what, since in self._waits():
                if now - since > self.timeout:
                    msg = (f"neocomm: rank {self.rank}: {what} has not completed after "
                           f"{now - since:.1f} s (NEOCOMM_TIMEOUT={self.timeout:g}); "
                           f"{self._inspect(what)}. Aborting the job.\n")
                    _say(msg)
                    self._abort(msg)
                    return

    # -- the stall inspector (after Horovod's): who arrived, who did not -------------------
    def _answer(self) -> None:
        """Tell every rank that asked where this rank is (its open waits)."""
        comm = self._comm
        if comm is None:
            return
        from mpi4py import MPI

        status = MPI.Status()
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ASK, status=status):
            comm.recv(source=status.Get_source(), tag=_ASK)
            where = [what for what, _ in self._waits()]
            self._sends.append(comm.isend(where, dest=status.Get_source(), tag=_WHERE))
        self._sends = [r for r in self._sends if not r.Test()]

    def _inspect(self, what: str) -> str:
        """Ask every rank where it is; name the ranks in the same wait and the others."""
        comm = self._comm
        if comm is None or comm.Get_size() == 1:
            return "a peer never arrived or died"
        from mpi4py import MPI

        me, size = comm.Get_rank(), comm.Get_size()
        for r in range(size):
            if r != me:
                self._sends.append(comm.isend(None, dest=r, tag=_ASK))
        answers: dict[int, list] = {me: [what]}
        status = MPI.Status()
        # every live rank's watchdog answers within its interval (1 s at most)
        end = time.monotonic() + min(10.0, max(3.0, self.timeout))
        while len(answers) < size and time.monotonic() < end:
            self._answer()  # others may be asking too
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_WHERE, status=status):
                src = status.Get_source()
                answers[src] = comm.recv(source=src, tag=_WHERE)
            else:
                time.sleep(0.01)
        arrived = sorted(r for r, ws in answers.items() if what in ws)
        parts = [f"ranks {arrived} are in it"]
        for r in range(size):
            if r in arrived:
                continue
            if r not in answers:
                parts.append(f"rank {r} did not answer (dead, or blocked outside Python)")
            elif answers[r]:
                parts.append(f"rank {r} is in {'; '.join(answers[r])}")
            else:
                parts.append(f"rank {r} is not in any neocomm collective")
        missing = [r for r in range(size) if r not in arrived]
        return f"waiting for rank(s) {missing}: " + "; ".join(parts)


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
_ASK, _WHERE = 7301, 7302  # tags of the inspector's questions and answers


def _say(msg: str) -> None:
    """Write ``msg`` to the process's standard error file itself: the job is about to end,
    and a Python-level redirection of ``sys.stderr`` would swallow it."""
    try:
        sys.stderr.flush()
        os.write(2, msg.encode(errors="replace"))
    except OSError:  # pragma: no cover - no stderr
        pass


def _mpi_abort(msg: str) -> None:  # pragma: no cover - ends the process
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(3)
    finally:
        os._exit(3)


_ACTIVE: Watchdog | None = None


def configure(timeout: float, rank: int, comm=None) -> Watchdog:
    """Install the process-wide watchdog (replacing any earlier one; open waits stay
    open). ``comm``: a communicator of the whole job for the stall inspector alone (it
    needs MPI_THREAD_MULTIPLE; without it, stalls name only this rank's wait)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.stop()
    if comm is not None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            comm = None
    _ACTIVE = Watchdog(timeout, rank, open_waits=OPEN, comm=comm)
    _ACTIVE.start()
    return _ACTIVE


_NULL = contextlib.nullcontext()


def guard(what: str):
    """Context manager around a blocking wait; a no-op before ``neocomm.init()``."""
    wd = _ACTIVE
    if wd is None or wd.timeout <= 0:
        return _NULL
    return _Guard(OPEN, what)
