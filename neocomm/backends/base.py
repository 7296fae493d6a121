"""The backend contract: one short interface, three implementations.

A backend moves the bytes of one process group. Every operation takes its
buffers first and keyword-only options, and returns a :class:`Handle`;
``async_op=False`` (the default) returns one that is already complete.
Peers and roots are *group* ranks. Counts are in elements of the buffer's
dtype; buffers are C-contiguous arrays (NumPy for host backends, CuPy for
device backends) and are read as flat 1-D.

Public methods validate their arguments and, when ``NEOCOMM_CHECK_ARGS`` is
on, agree them across the group before any data moves (see
:mod:`neocomm.agree`): a bad argument on one rank raises
:class:`~neocomm.errors.CollectiveArgumentError` on every rank instead of a
hang. Callers that have already validated (the collectives layer) pass
``validate=False``.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Sequence

from neocomm.types import BackendKind, ReduceOp

__all__ = ["Backend", "Handle", "CompletedHandle"]


class Handle:
    """A pending operation. ``wait()`` blocks until it is complete and
    returns its result (the receive buffer, or None)."""

    __slots__ = ("_wait", "_test", "_result", "_done", "_on_done")

    def __init__(self, wait: Callable[[], None], test: Callable[[], bool] | None = None,
                 result: Any = None, on_done: Callable[[], None] | None = None):
        self._wait = wait
        self._test = test
        self._result = result
        self._done = False
        self._on_done = on_done

    def wait(self) -> Any:
        """Block until the operation completes; return its result."""
        if not self._done:
            self._wait()
            self._finish()
        return self._result

    def test(self) -> bool:
        """True when the operation has completed (never blocks)."""
        if not self._done and self._test is not None and self._test():
            self._finish()
        return self._done

    @property
    def done(self) -> bool:
        return self._done

    def _finish(self) -> None:
        self._done = True
        if self._on_done is not None:
            cb, self._on_done = self._on_done, None
            cb()


class CompletedHandle(Handle):
    """A handle for an operation that has already completed."""

    __slots__ = ()

    def __init__(self, result: Any = None):
        super().__init__(_noop, None, result)
        self._done = True


def _noop() -> None:
    return None


class Backend(abc.ABC):
    """Moves the bytes of one process group.

    ``available`` says whether the backend can run in this process, and
    ``reason`` why not (class-level, checked without building a group).
    """

    kind: ClassVar[BackendKind]

    def __init__(self, group):
        self.group = group

    # -- availability -------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def availability(cls) -> tuple[bool, str | None]:
        """``(True, None)`` when usable here, else ``(False, reason)``."""

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    # -- point to point ----------------------------------------------
    @abc.abstractmethod
    def send(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             validate: bool = True) -> Handle:
        """Send all of ``buf`` to group rank ``peer``."""

    @abc.abstractmethod
    def recv(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             validate: bool = True) -> Handle:
        """Receive exactly ``buf.size`` elements from group rank ``peer`` into ``buf``."""

    # -- collectives --------------------------------------------------
    @abc.abstractmethod
    def all_to_all(self, sendbuf, recvbuf, *, async_op: bool = False,
                   validate: bool = True) -> Handle:
        """Block j of ``sendbuf`` goes to rank j; block i of ``recvbuf`` comes from rank i.

        Both buffers hold ``size`` equal blocks.
        """

    @abc.abstractmethod
    def all_to_all_v(self, sendbuf, recvbuf, *, send_counts: Sequence[int],
                     recv_counts: Sequence[int], async_op: bool = False,
                     validate: bool = True) -> Handle:
        """AlltoAll with ``send_counts[j]`` elements to rank j, ``recv_counts[i]`` from rank i.

        Blocks are packed in rank order; ``sum(send_counts) == sendbuf.size``.
        """

    @abc.abstractmethod
    def all_reduce(self, sendbuf, recvbuf=None, *, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False, validate: bool = True) -> Handle:
        """Every rank gets the element-wise reduction; ``recvbuf=None`` reduces in place."""

    @abc.abstractmethod
    def reduce_scatter(self, sendbuf, recvbuf, *, op: ReduceOp = ReduceOp.SUM,
                       recv_counts: Sequence[int] | None = None, async_op: bool = False,
                       validate: bool = True) -> Handle:
        """Rank i gets block i of the reduction of every rank's ``sendbuf``.

        Blocks are equal (``recvbuf.size`` each) unless ``recv_counts`` gives them.
        """

    @abc.abstractmethod
    def all_gather(self, sendbuf, recvbuf, *, async_op: bool = False,
                   validate: bool = True) -> Handle:
        """Block i of ``recvbuf`` is rank i's ``sendbuf``."""

    @abc.abstractmethod
    def broadcast(self, buf, *, root: int, async_op: bool = False,
                  validate: bool = True) -> Handle:
        """Every rank's ``buf`` becomes the root's."""

    @abc.abstractmethod
    def barrier(self, *, async_op: bool = False) -> Handle:
        """Returns once every rank of the group has entered."""

    def close(self) -> None:
        """Release resources (communicators, staging buffers)."""
