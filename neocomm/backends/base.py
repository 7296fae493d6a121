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

import numpy as np

from neocomm.agree import Problem, agree
from neocomm.backends.checks import (OP_CODES, REDUCE_CODES, check_buffer, check_counts,
                                     check_peer, check_same_dtype, counts_digest, dtype_code_of,
                                     first)
from neocomm.errors import CollectiveArgumentError
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
    """Moves the bytes of one process group.

    Subclasses implement the ``_op`` methods (arguments already valid,
    ``async_op`` says whether to return before completion); the public
    methods here validate and agree arguments once for every backend.
    ``availability()`` says whether the backend can run in this process, and
    why not.
    """

    kind: ClassVar[BackendKind]
    #: True for backends that take CuPy arrays, False for NumPy.
    device: ClassVar[bool] = False

    def __init__(self, group):
        from neocomm import config

        self.group = group
        self.comm = group.comm
        self.check_args = bool(config.get("CHECK_ARGS"))

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

    # -- validation ----------------------------------------------------
    def _agree(self, op: str, problem: Problem | None, signature) -> None:
        if self.check_args:
            agree(self.comm, op, problem, signature)
        elif problem is not None:
            raise CollectiveArgumentError(f"{op}: {problem.message}", op=op, field=problem.field,
                                          ranks=(self.rank,), per_rank={self.rank: problem.message})

    def _buf(self, name, buf, **kw) -> Problem | None:
        return check_buffer(name, buf, device=self.device, **kw)

    _dcode = staticmethod(dtype_code_of)

    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()
        return handle

    # -- point to point ----------------------------------------------
    def send(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             validate: bool = True) -> Handle:
        """Send all of ``buf`` to group rank ``peer``."""
        if validate:
            self._local("send", first(self._buf("buf", buf), check_peer("peer", peer, self.size)))
        return self._finish(self._send(buf, int(peer), tag, async_op), async_op)

    def recv(self, buf, peer: int, *, tag: int = 0, async_op: bool = False,
             validate: bool = True) -> Handle:
        """Receive exactly ``buf.size`` elements from group rank ``peer`` into ``buf``.

        A message of another size raises ValueError naming both sizes.
        """
        if validate:
            self._local("recv", first(self._buf("buf", buf, writable=True),
                                      check_peer("peer", peer, self.size)))
        return self._finish(self._recv(buf, int(peer), tag, async_op), async_op)

    def _local(self, op: str, problem: Problem | None) -> None:
        """Point-to-point checks concern this rank alone: raise here, at once."""
        if problem is not None:
            raise CollectiveArgumentError(f"{op}: {problem.message}", op=op, field=problem.field,
                                          ranks=(self.rank,), per_rank={self.rank: problem.message})

    # -- collectives --------------------------------------------------
    def all_to_all(self, sendbuf, recvbuf, *, async_op: bool = False,
                   validate: bool = True) -> Handle:
        """Block j of ``sendbuf`` goes to rank j; block i of ``recvbuf`` comes from rank i.

        Both buffers hold ``size`` equal blocks of the same dtype.
        """
        if validate:
            n = self.size
            p = first(self._buf("sendbuf", sendbuf), self._buf("recvbuf", recvbuf, writable=True))
            p = p or check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
            if p is None and sendbuf.size % n:
                p = Problem("sendbuf", f"sendbuf: {sendbuf.size} elements do not split into "
                                       f"{n} equal blocks")
            if p is None and recvbuf.size != sendbuf.size:
                p = Problem("recvbuf", f"recvbuf: expected {sendbuf.size} elements (as sendbuf), "
                                       f"got {recvbuf.size}")
            block = sendbuf.size // n if p is None else 0
            self._agree("all_to_all", p, [("op", OP_CODES["all_to_all"]),
                                          ("dtype", self._dcode(sendbuf)), ("block", block)])
        return self._finish(self._all_to_all(sendbuf, recvbuf, async_op), async_op)

    def all_to_all_v(self, sendbuf, recvbuf, *, send_counts: Sequence[int],
                     recv_counts: Sequence[int], async_op: bool = False,
                     validate: bool = True) -> Handle:
        """AlltoAll with ``send_counts[j]`` elements to rank j, ``recv_counts[i]`` from rank i.

        Blocks are packed in rank order; the counts sum to the buffer sizes,
        and ``send_counts[j]`` on rank i equals ``recv_counts[i]`` on rank j
        (checked with one small count exchange when ``NEOCOMM_CHECK_ARGS``).
        """
        n = self.size
        if validate:
            p = first(self._buf("sendbuf", sendbuf), self._buf("recvbuf", recvbuf, writable=True))
            p = p or check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
            ps, sc = check_counts("send_counts", send_counts, n,
                                  getattr(sendbuf, "size", -1), "sendbuf")
            pr, rc = check_counts("recv_counts", recv_counts, n,
                                  getattr(recvbuf, "size", -1), "recvbuf")
            p = first(p, ps, pr)
            if self.check_args:
                offered = np.empty(n, np.int64)
                self.comm.Alltoall(sc if ps is None else np.full(n, -1, np.int64), offered)
                if p is None and not np.array_equal(offered, rc):
                    i = int(np.flatnonzero(offered != rc)[0])
                    p = Problem("recv_counts", f"recv_counts[{i}] is {int(rc[i])} but rank {i} "
                                               f"sends {int(offered[i])}")
            self._agree("all_to_all_v", p, [("op", OP_CODES["all_to_all_v"]),
                                            ("dtype", self._dcode(sendbuf))])
        else:
            sc = np.asarray(send_counts, np.int64)
            rc = np.asarray(recv_counts, np.int64)
        return self._finish(self._all_to_all_v(sendbuf, recvbuf, sc, rc, async_op), async_op)

    def all_reduce(self, sendbuf, recvbuf=None, *, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False, validate: bool = True) -> Handle:
        """Every rank gets the element-wise reduction; ``recvbuf=None`` reduces in place."""
        op = ReduceOp.parse(op)
        if validate:
            p = self._buf("sendbuf", sendbuf, reducible=True, writable=recvbuf is None)
            if recvbuf is not None:
                p = p or self._buf("recvbuf", recvbuf, writable=True)
                p = p or check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
                if p is None and recvbuf.size != sendbuf.size:
                    p = Problem("recvbuf", f"recvbuf: expected {sendbuf.size} elements (as "
                                           f"sendbuf), got {recvbuf.size}")
            self._agree("all_reduce", p, [("op", OP_CODES["all_reduce"]),
                                          ("dtype", self._dcode(sendbuf)),
                                          ("count", getattr(sendbuf, "size", -1)),
                                          ("reduce_op", REDUCE_CODES[op])])
        return self._finish(self._all_reduce(sendbuf, recvbuf, op, async_op), async_op)

    def reduce_scatter(self, sendbuf, recvbuf, *, op: ReduceOp = ReduceOp.SUM,
                       recv_counts: Sequence[int] | None = None, async_op: bool = False,
                       validate: bool = True) -> Handle:
        """Rank i gets block i of the reduction of every rank's ``sendbuf``.

        Blocks are equal (``recvbuf.size`` each) unless ``recv_counts`` gives
        each rank's block size (the same vector on every rank).
        """
        op = ReduceOp.parse(op)
        n = self.size
        counts = None
        if validate:
            p = first(self._buf("sendbuf", sendbuf, reducible=True),
                      self._buf("recvbuf", recvbuf, writable=True))
            p = p or check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
            if p is None and recv_counts is None and sendbuf.size != n * recvbuf.size:
                p = Problem("recvbuf", f"recvbuf: expected sendbuf.size / {n} = "
                                       f"{sendbuf.size / n:g} elements, got {recvbuf.size}")
            if p is None and recv_counts is not None:
                p, counts = check_counts("recv_counts", recv_counts, n, sendbuf.size, "sendbuf")
                if p is None and counts[self.rank] != recvbuf.size:
                    p = Problem("recvbuf", f"recvbuf: recv_counts[{self.rank}] is "
                                           f"{int(counts[self.rank])} but recvbuf holds "
                                           f"{recvbuf.size} elements")
            self._agree("reduce_scatter", p, [("op", OP_CODES["reduce_scatter"]),
                                              ("dtype", self._dcode(sendbuf)),
                                              ("count", getattr(sendbuf, "size", -1)),
                                              ("reduce_op", REDUCE_CODES[op]),
                                              ("recv_counts", counts_digest(counts))])
        elif recv_counts is not None:
            counts = np.asarray(recv_counts, np.int64)
        return self._finish(self._reduce_scatter(sendbuf, recvbuf, op, counts, async_op),
                            async_op)

    def all_gather(self, sendbuf, recvbuf, *, async_op: bool = False,
                   validate: bool = True) -> Handle:
        """Block i of ``recvbuf`` is rank i's ``sendbuf`` (equal sizes on every rank)."""
        if validate:
            p = first(self._buf("sendbuf", sendbuf), self._buf("recvbuf", recvbuf, writable=True))
            p = p or check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
            if p is None and recvbuf.size != self.size * sendbuf.size:
                p = Problem("recvbuf", f"recvbuf: expected {self.size} x {sendbuf.size} = "
                                       f"{self.size * sendbuf.size} elements, got {recvbuf.size}")
            self._agree("all_gather", p, [("op", OP_CODES["all_gather"]),
                                          ("dtype", self._dcode(sendbuf)),
                                          ("count", getattr(sendbuf, "size", -1))])
        return self._finish(self._all_gather(sendbuf, recvbuf, async_op), async_op)

    def broadcast(self, buf, *, root: int, async_op: bool = False,
                  validate: bool = True) -> Handle:
        """Every rank's ``buf`` becomes the root's (same size and dtype everywhere)."""
        if validate:
            p = first(self._buf("buf", buf, writable=True), check_peer("root", root, self.size))
            self._agree("broadcast", p, [("op", OP_CODES["broadcast"]),
                                         ("dtype", self._dcode(buf)),
                                         ("count", getattr(buf, "size", -1)),
                                         ("root", root if isinstance(root, (int, np.integer)) else -1)])
        return self._finish(self._broadcast(buf, int(root), async_op), async_op)

    def barrier(self, *, async_op: bool = False) -> Handle:
        """Returns once every rank of the group has entered."""
        return self._finish(self._barrier(async_op), async_op)

    def close(self) -> None:
        """Release resources (communicators, staging buffers)."""

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
