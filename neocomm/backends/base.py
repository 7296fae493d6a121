"""The backend contract: one short interface, three implementations.

A backend moves the bytes of one process group. Every operation takes its
buffers first and keyword-only options, and returns a :class:`Handle`;
``async_op=False`` (the default) returns one that is already complete.
Peers and roots are *group* ranks. Counts are in elements of the buffer's
dtype; buffers are C-contiguous arrays (NumPy for host backends, CuPy for
device backends) and are read as flat 1-D.

A backend is a thin, unchecked mover: it neither validates, agrees nor plans.
The collectives layer (:mod:`collectives`) checks a call's arguments once, in
the user's words, agrees them across the group and plans the call; code that
calls a backend directly owns the validity of what it passes.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from contextlib import nullcontext

from neocomm.types import BackendKind, ReduceOp

__all__ = ["Backend", "Handle", "CompletedHandle", "cuda_availability"]


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


_NOWHERE = nullcontext()


def cuda_availability() -> tuple[bool, str | None]:
    """Whether CuPy and a CUDA device are usable here, and why not."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed (pip install 'neocomm[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return False, "no CUDA device is visible"
    except Exception as exc:  # noqa: BLE001 - driver errors have many types
        return False, f"no usable CUDA driver ({exc.__class__.__name__}: {exc})"
    return True, None


class Backend(abc.ABC):
    """Moves the bytes of one process group: the transport of one array kind.

    Public methods take valid arguments (the collectives layer checks and
    agrees them once, :mod:`collectives.validate`) and run the backend's
    ``_op`` at once: no checks, no agreement, no planning. ``stream=`` (device
    backends) enqueues the work on that CUDA stream instead of the current one.
    ``availability()`` says whether the backend can run in this process, and
    why not.
    """

    kind: ClassVar[BackendKind]
    #: True for backends that take CuPy arrays, False for NumPy.
    device: ClassVar[bool] = False

    def __init__(self, group):
        self.group = group
        self.comm = group.comm

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

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()
        return handle

    def _on(self, stream):
        """The context that makes ``stream`` current for this call (device backends)."""
        if stream is None:
            return _NOWHERE
        if not self.device:
            raise ValueError(f"stream: the {self.kind.value} backend moves host buffers; "
                             f"stream applies to device backends, got {stream!r}")
        return stream

    # -- point to point ----------------------------------------------
    def send(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             stream=None) -> Handle:
        """Send all of ``buf`` to group rank ``peer``."""
        with self._on(stream):
            return self._finish(self._send(buf, peer, tag, async_op), async_op)

    def recv(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             stream=None) -> Handle:
        """Receive exactly ``buf.size`` elements from group rank ``peer`` into ``buf``.

        A message of another size raises ValueError naming both sizes.
        """
        with self._on(stream):
            return self._finish(self._recv(buf, peer, tag, async_op), async_op)

    # -- collectives --------------------------------------------------
    def all_to_all(self, sendbuf, recvbuf, *, async_op: bool = False, stream=None) -> Handle:
        """Block j of ``sendbuf`` goes to rank j; block i of ``recvbuf`` comes from rank i.

        Both buffers hold ``size`` equal blocks of the same dtype.
        """
        with self._on(stream):
            return self._finish(self._all_to_all(sendbuf, recvbuf, async_op), async_op)

    def all_to_all_v(self, sendbuf, recvbuf, *, send_counts: Sequence[int],
                     recv_counts: Sequence[int], async_op: bool = False,
                     stream=None) -> Handle:
        """AlltoAll with ``send_counts[j]`` elements to rank j, ``recv_counts[i]`` from rank i.

        Blocks are packed in rank order; the counts sum to the buffer sizes,
        and ``send_counts[j]`` on rank i equals ``recv_counts[i]`` on rank j.
        """
        sc = np.asarray(send_counts, np.int64)
        rc = np.asarray(recv_counts, np.int64)
        with self._on(stream):
            return self._finish(self._all_to_all_v(sendbuf, recvbuf, sc, rc, async_op),
                                async_op)

    def all_reduce(self, sendbuf, recvbuf=None, *, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False, stream=None) -> Handle:
        """Every rank gets the element-wise reduction; ``recvbuf=None`` reduces in place."""
        op = ReduceOp.parse(op)
        with self._on(stream):
            return self._finish(self._all_reduce(sendbuf, recvbuf, op, async_op), async_op)

    def reduce_scatter(self, sendbuf, recvbuf, *, op: ReduceOp = ReduceOp.SUM,
                       recv_counts: Sequence[int] | None = None, async_op: bool = False,
                       stream=None) -> Handle:
        """Rank i gets block i of the reduction of every rank's ``sendbuf``.

        Blocks are equal (``recvbuf.size`` each) unless ``recv_counts`` gives
        each rank's block size (the same vector on every rank).
        """
        op = ReduceOp.parse(op)
        counts = None if recv_counts is None else np.asarray(recv_counts, np.int64)
        with self._on(stream):
            return self._finish(self._reduce_scatter(sendbuf, recvbuf, op, counts, async_op),
                                async_op)

    def all_gather(self, sendbuf, recvbuf, *, async_op: bool = False, stream=None) -> Handle:
        """Block i of ``recvbuf`` is rank i's ``sendbuf`` (equal sizes on every rank)."""
        with self._on(stream):
            return self._finish(self._all_gather(sendbuf, recvbuf, async_op), async_op)

    def broadcast(self, buf, *, root: int, async_op: bool = False, stream=None) -> Handle:
        """Every rank's ``buf`` becomes the root's (same size and dtype everywhere)."""
        with self._on(stream):
            return self._finish(self._broadcast(buf, int(root), async_op), async_op)

    def barrier(self, *, async_op: bool = False, stream=None) -> Handle:
        """Returns once every rank of the group has entered."""
        with self._on(stream):
            return self._finish(self._barrier(async_op), async_op)

    def close(self) -> None:
        """Release resources (communicators, staging buffers)."""

    def reduce_reason(self, dtype, op: ReduceOp) -> str | None:
        """Why this backend cannot reduce ``dtype`` with ``op``, in the user's terms
        (naming the dtype, the op and what it does reduce), or None when it can. The
        collectives layer asks before a reducing call and agrees the answer across
        the group. Every dtype of :func:`collectives.validate.check_buffer`'s
        reducible list by default."""
        return None

    # -- what a backend implements (arguments already valid) -------------
    @abc.abstractmethod
    def _send(self, buf, peer: int, tag: int, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _recv(self, buf, peer: int, tag: int, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _all_to_all(self, sendbuf, recvbuf, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _all_to_all_v(self, sendbuf, recvbuf, send_counts: np.ndarray,
                      recv_counts: np.ndarray, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _all_reduce(self, sendbuf, recvbuf, op: ReduceOp, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _reduce_scatter(self, sendbuf, recvbuf, op: ReduceOp, recv_counts: np.ndarray | None,
                        async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _all_gather(self, sendbuf, recvbuf, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _broadcast(self, buf, root: int, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _barrier(self, async_op: bool) -> Handle: ...
