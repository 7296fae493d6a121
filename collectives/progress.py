"""Driving algorithms: blocking, or in the background of a handle.

An algorithm's ``run(call)`` is a generator that posts non-blocking sends
and receives and yields a tuple of handles: it resumes as soon as *any* of
them has completed (one handle: when that one has), and checks which. A
blocking call drives it to the end at once. An ``async_op=True`` call posts
the first step and returns a :class:`~neocomm.backends.base.Handle`; its
``wait()`` drives the algorithm, and every other unfinished one of this
process, so that two outstanding operations waited for in different orders
on different ranks cannot deadlock.
"""
from __future__ import annotations

import os
from time import monotonic as _now

from neocomm import watchdog
from neocomm.backends.base import CompletedHandle, Handle

__all__ = ["Operation", "MpiRequest", "Progress", "RequestHandle", "progress_of", "start", "idle", "tag_of",
           "TAG_PHASE"]

#: Tag distance between the phases of one operation (lanes use the tags in between).
TAG_PHASE = 16
_TAGS_PER_OP = 16 * TAG_PHASE
_TAG_SLOTS = 120  # 120 * 256 < 32767, the smallest MPI_TAG_UB MPI allows



def tag_of(seq: int) -> int:
    """Base tag of the operation numbered ``seq`` on its group (every rank numbers its
    group's operations alike, since every rank calls them in the same order)."""
    return 1 + _TAGS_PER_OP * (seq % _TAG_SLOTS)


class Operation:
    """One running algorithm: its generator and the handles it waits for."""

    __slots__ = ("_gen", "_pending", "done", "__weakref__")

    def __init__(self, gen):
        self._gen = gen
        self._pending = ()
        self.done = False

    def advance(self, block: bool) -> bool:
        """Run until the operation is done, or (``block=False``) until it waits on an
        incomplete handle. Returns ``done``."""
        while not self.done:
            pending = self._pending
            if len(pending) == 1:
                if block:
                    pending[0].wait()
                elif not pending[0].test():
                    return False
            elif pending:
                while not any(h.done or h.test() for h in pending):
                    if not block:
                        return False
                    _yield()  # let a rank sharing this core run (oversubscribed jobs)
            try:
                self._pending = next(self._gen)
            except StopIteration:
                self._pending = ()
                self.done = True
        return True


class MpiRequest:
    """An mpi4py request with the handle interface the algorithms (and
    :mod:`collectives.progress`) use."""

    __slots__ = ("req", "done")

    def __init__(self, req):
        self.req = req
        self.done = False

    def test(self) -> bool:
        if not self.done and self.req.Test():
            self.done = True
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.req.Wait()
            self.done = True


class Progress:
    """The outstanding asynchronous operations of one world (this process): every wait
    drives all of them, whatever their group."""

    __slots__ = ("active",)

    def __init__(self, world=None):
        self.active: list[Operation] = []

    def close(self) -> None:
        self.active.clear()


def progress_of(world) -> Progress:
    """The :class:`Progress` of ``world`` (kept in its runtime state)."""
    return world.state("collectives.progress", Progress)


_yield = getattr(os, "sched_yield", lambda: None)


def _drive_until(op: Operation, active: list) -> None:
    while not op.done:
        others = [o for o in active if o is not op and not o.done]
        if not others:
            op.advance(block=True)
            break
        op.advance(block=False)
        for other in others:
            other.advance(block=False)
        active[:] = [o for o in active if not o.done]
        if not op.done:
            _yield()
    if op in active:
        active.remove(op)


def idle(group=None) -> bool:
    """True when no asynchronous operation of this process (the world of ``group``,
    None: the current world) is outstanding."""
    from neocomm.world import group_or_world

    return not progress_of(group_or_world(group).world).active


def start(gen, result, async_op: bool, what: str, progress: Progress) -> Handle:
    """Run ``gen`` to completion (``async_op=False``) or start it and return a
    handle whose ``wait()`` finishes it and returns ``result``. Blocking waits
    run under the stall watchdog as one guarded wait named ``what``; every wait
    drives the other outstanding operations of ``progress`` too."""
    op = Operation(gen)
    active = progress.active
    if not async_op:
        with watchdog.guard(what):
            _drive_until(op, active) if active else op.advance(block=True)
        return CompletedHandle(result)
    op.advance(block=False)
    if op.done:
        return CompletedHandle(result)
    active.append(op)

    def wait():
        with watchdog.guard(what):
            _drive_until(op, active)

    def test():
        op.advance(block=False)
        if op.done and op in active:  # done: no wait needs to drive it any more
            active.remove(op)
        return op.done

    return Handle(wait, test, result)


class RequestHandle(Handle):
    """The handle of one non-blocking MPI collective (a plan's direct call): ``wait()``
    waits for its request under the stall watchdog (``slot``), driving meanwhile the
    process's other outstanding operations (``active``), as every wait does. It keeps
    the call's buffers (``bufs``) alive until the request completes: MPI reads and
    writes them until then, and the caller may hold none of them."""

    __slots__ = ("_req", "_slot", "_active", "_bufs")

    def __init__(self, req, result, slot: watchdog.Slot, active: list, bufs=()):
        super().__init__(_nothing, None, result)
        self._req, self._slot, self._active, self._bufs = req, slot, active, bufs

    def wait(self):
        if not self._done:
            req, slot, active = self._req, self._slot, self._active
            slot.since = _now()
            try:
                if not active:
                    req.Wait()
                else:  # the request as a one-step operation, driven with the others
                    _drive_until(Operation(_steps(MpiRequest(req))), active)
            finally:
                slot.since = 0.0
            self._done, self._bufs = True, ()
        return self._result

    def test(self) -> bool:
        if not self._done and self._req.Test():
            self._done, self._bufs = True, ()
        return self._done


def _nothing() -> None:
    return None


def _steps(handle):
    """The steps of an operation that waits for ``handle`` only."""
    yield (handle,)
