"""Prepared collectives: validate once, run many times (MPI-4's persistent collectives).

``prepare_all_to_all(sendbuf, recvbuf)`` is to :func:`collectives.all_to_all`
what ``MPI_Alltoall_init`` is to ``MPI_Alltoall``: the arguments are checked
and agreed across the group once (bad input on any rank raises
:class:`~neocomm.errors.CollectiveArgumentError` on every rank, exactly as
the normal call does), the algorithm and chunking are chosen once, and the
returned :class:`Prepared` then moves whatever the buffers hold at each run::

    with collectives.prepare_all_to_all(x, y) as a2a:
        for step in range(steps):
            x[:] = ...          # new contents, same buffers
            a2a()               # blocking; returns y
            # or: a2a.start(); ...overlap...; y = a2a.wait()

When the chosen algorithm is ``native`` on host (NumPy) buffers over MPI,
each blocking run is one MPI call under the stall watchdog: an MPI persistent
request's ``Start`` and ``Wait`` for AlltoAll, AlltoAllv and Broadcast, the
blocking mpi4py call itself for AllReduce, ReduceScatter and AllGather (Open
MPI 5 builds persistent collectives from its non-blocking ones, which for these
three run slower than its tuned blocking algorithms; see
``neocomm bench --prepared``). Otherwise a run reruns the prepared algorithm.

Every rank of the group prepares, runs and frees the same collectives in
the same order, and runs them the same way: every rank calls it, or every
rank calls :meth:`Prepared.start` and :meth:`Prepared.wait` (as MPI never
matches a blocking collective with a non-blocking one). A prepared run
matches only runs of the same prepared collective on the other ranks
(never a plain call). A :class:`Prepared` keeps
its buffers alive until :meth:`Prepared.free`; the buffers must keep their
size, dtype and memory while it lives (fill them in place).
"""
from __future__ import annotations

from time import monotonic as _now
import numpy as np

from neocomm.agree import Problem
from neocomm.errors import GroupGoneError
from neocomm.watchdog import Slot
from neocomm.world import group_or_world

from collectives import api, plans, progress
from collectives._launch import OP_CODES, array_module, context, fail
from collectives.types import CollectiveOp

__all__ = ["Prepared", "prepare_all_to_all", "prepare_all_to_all_v", "prepare_all_reduce",
           "prepare_reduce_scatter", "prepare_all_gather", "prepare_broadcast"]


class Prepared:
    """One prepared collective; call it (or :meth:`start` then :meth:`wait`) to run it.

    ``op`` is the collective's name (``"all_to_all"``), ``algo`` the algorithm
    it runs, ``persistent`` whether runs are MPI persistent requests, and
    ``result`` what every run returns (the receive buffer, the in-place
    buffer, or ``(recvbuf, recv_counts)`` for AlltoAllv).
    """

    __slots__ = ("op", "algo", "result", "_call", "_algo", "_request", "_direct", "_slot",
                 "_seq", "_handle", "_bufs", "_freed", "_layout", "_group")

    def __init__(self, bufs, call, algo, result, request, direct):
        self.op, self.algo, self.result = call.op.value, algo.name, result
        self._call, self._algo, self._request, self._bufs = call, algo, request, bufs
        self._direct = direct  # a blocking mpi4py call over ``bufs`` (native, host, MPI)
        self._slot = Slot(f"{self.op} ({self.algo}, prepared)")
        self._seq = progress.counter(call.group)
        self._handle = None
        self._freed = False
        self._group = call.group
        self._layout = tuple((b, b.dtype, b.shape) for b in bufs)

    @property
    def persistent(self) -> bool:
        """Whether each run is an MPI persistent request (``Start`` + ``Wait``)."""
        return self._request is not None

    def __call__(self):
        """Run once (blocking) and return :attr:`result`."""
        if self._freed or self._handle is not None or self._group.gone is not None:
            self._check("run")
        self._check_layout()
        seq = next(self._seq)  # every run numbers its group's operations, as any call does
        plans.LAST_CHOSEN[self.op] = self.algo
        if not progress._ACTIVE:  # else drive the outstanding operations too
            request = self._request
            if request is not None:
                slot = self._slot
                slot.since = _now()
                try:
                    request.Start()
                    request.Wait()
                finally:
                    slot.since = 0.0
                return self.result
            direct = self._direct
            if direct is not None:
                slot = self._slot
                slot.since = _now()
                try:
                    direct(*self._bufs)
                finally:
                    slot.since = 0.0
                return self.result
        return progress.start(self._steps(seq, True), self.result, False,
                              self._slot.what).wait()

    def start(self) -> None:
        """Begin a run without waiting for it; :meth:`wait` finishes it."""
        self._check("start")
        self._check_layout()
        seq = next(self._seq)
        plans.LAST_CHOSEN[self.op] = self.algo
        self._handle = progress.start(self._steps(seq, False), self.result, True,
                                      self._slot.what)

    def _check_layout(self) -> None:
        """Refuse a run on buffers whose dtype or shape changed since preparing (a loop,
        not a comparison of rebuilt tuples: this runs on every run)."""
        for i, (b, dtype, shape) in enumerate(self._layout):
            if b.dtype != dtype or b.shape != shape:
                raise ValueError(f"prepared {self.op}: buffer {i} is {b.dtype.name} "
                                 f"{tuple(b.shape)} now, it was prepared as {dtype.name} "
                                 f"{tuple(shape)}; prepare the collective again")

    def wait(self):
        """Finish the run begun by :meth:`start`; return :attr:`result`."""
        if self._freed:
            raise ValueError(f"prepared {self.op}: wait() after free()")
        handle, self._handle = self._handle, None
        if handle is None:
            raise ValueError(f"prepared {self.op}: wait() without start()")
        return handle.wait()

    def free(self) -> None:
        """Release the request and the buffers (idempotent). A started run is
        finished first."""
        if self._freed:
            return
        if self._handle is not None:
            self.wait()
        if self._request is not None:
            self._request.Free()
        self._request = self._direct = self._call = self._bufs = self.result = None
        self._layout = ()
        self._freed = True

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        state = ("freed" if self._freed else "persistent" if self.persistent
                 else "direct" if self._direct is not None else "rerun")
        return f"<Prepared {self.op} ({self.algo}), {state}>"

    def _check(self, what: str) -> None:
        gone = self._group.gone
        if gone is not None:
            raise GroupGoneError(f"prepared {self.op}: {what}: {gone}", ranks=self._group.ranks)
        if self._freed:
            raise ValueError(f"prepared {self.op}: {what} after free()")
        if self._handle is not None:
            raise ValueError(f"prepared {self.op}: {what} while a started run is not "
                             f"waited for")

    def _steps(self, seq: int, blocking: bool):
        """Run number ``seq`` as an algorithm generator (for
        :func:`collectives.progress.start`)."""
        request = self._request
        if request is not None:
            request.Start()
            yield (_RequestHandle(request),)
            return
        call = self._call
        call.tag, call.blocking = progress.tag_of(seq), blocking
        yield from self._algo.run(call)


class _RequestHandle:
    """An MPI request as the handle :mod:`collectives.progress` waits on."""

    __slots__ = ("_request", "done")

    def __init__(self, request):
        self._request, self.done = request, False

    def wait(self) -> None:
        self._request.Wait()
        self.done = True

    def test(self) -> bool:
        if not self.done:
            self.done = bool(self._request.Test())
        return self.done


def _prepare(fn, kind: CollectiveOp, group, required: bool, missing: Problem | None, /,
             *args, **kwargs):
    """Capture the validated call of ``fn`` and build its :class:`Prepared`. With
    ``required``, first agree on ``missing`` (an argument the prepared form needs
    that the call itself would do without), so that it fails on every rank."""
    if required:
        fail(context(group, args[0], kind.value), kind, missing, [("op", OP_CODES[kind])])
    bufs, call, algo, result = plans.capture(fn, *args, group=group, **kwargs)
    request = _persistent_request(call, algo, bufs)
    direct = algo.fast(call) if request is None and algo.name == "native" else None
    return Prepared(bufs, call, algo, result, request, direct)


def _persistent_request(call, algo, bufs):
    """The MPI persistent request of a native AlltoAll(v) or Broadcast on host
    buffers, else None."""
    from collectives.algorithms.native import host_datatype

    op = call.op
    if algo.name != "native" or op not in _PERSISTENT:
        return None
    t = host_datatype(call)
    if t is None:
        return None
    comm = call.group.comm
    if op is CollectiveOp.ALL_TO_ALL:
        return comm.Alltoall_init([bufs[0], t], [bufs[1], t])
    if op is CollectiveOp.ALL_TO_ALL_V:
        return comm.Alltoallv_init(
            [bufs[0], call.send_counts.tolist(), call.send_displs.tolist(), t],
            [bufs[1], call.recv_counts.tolist(), call.recv_displs.tolist(), t])
    return comm.Bcast_init([bufs[0], t], call.root)


#: Ops whose native runs use MPI persistent requests (see the module docstring).
_PERSISTENT = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V,
                         CollectiveOp.BROADCAST})


def _group_size(group, buf) -> int:
    return group_or_world(group).size


def _like(buf, shape):
    """A new array of ``buf``'s kind and dtype, or None when ``buf`` is no array."""
    if not (hasattr(buf, "dtype") and hasattr(buf, "shape")):
        return None
    return array_module(buf).empty(shape, dtype=buf.dtype)


def prepare_all_to_all(sendbuf, recvbuf=None, *, group=None, algo: str | None = None,
                       chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.all_to_all` on these buffers (``recvbuf=None``:
    allocated once, with ``sendbuf``'s shape). Runs return ``recvbuf``."""
    if recvbuf is None:
        recvbuf = _like(sendbuf, getattr(sendbuf, "shape", ()))
    return _prepare(api.all_to_all, CollectiveOp.ALL_TO_ALL, group, False, None, sendbuf,
                    recvbuf,
                    algo=algo, chunk_bytes=chunk_bytes)


def prepare_all_to_all_v(sendbuf, send_counts, recvbuf, recv_counts, *, group=None,
                         algo: str | None = None,
                         chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.all_to_all_v` with fixed counts. ``recvbuf`` and
    ``recv_counts`` are required (as ``MPI_Alltoallv_init`` needs them). Runs
    return ``(recvbuf, recv_counts)``."""
    missing = None
    if recvbuf is None or recv_counts is None:
        name = "recvbuf" if recvbuf is None else "recv_counts"
        missing = Problem(name, f"{name}: a prepared all_to_all_v needs it, got None")
    return _prepare(api.all_to_all_v, CollectiveOp.ALL_TO_ALL_V, group, True, missing, sendbuf,
                    send_counts, recvbuf, recv_counts, algo=algo, chunk_bytes=chunk_bytes)


def prepare_all_reduce(sendbuf, recvbuf=None, *, op="sum", group=None,
                       algo: str | None = None, chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.all_reduce` (``recvbuf=None``: in place). Runs
    return the result buffer."""
    return _prepare(api.all_reduce, CollectiveOp.ALL_REDUCE, group, False, None, sendbuf,
                    recvbuf,
                    op=op, algo=algo, chunk_bytes=chunk_bytes)


def prepare_reduce_scatter(sendbuf, recvbuf=None, *, recv_counts=None, op="sum", group=None,
                           algo: str | None = None,
                           chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.reduce_scatter` (``recvbuf=None``: allocated once).
    Runs return ``recvbuf``."""
    if recvbuf is None:
        recvbuf = _like(sendbuf, _rs_count(sendbuf, recv_counts, group))
    return _prepare(api.reduce_scatter, CollectiveOp.REDUCE_SCATTER, group, False, None,
                    sendbuf,
                    recvbuf, recv_counts=recv_counts, op=op, algo=algo,
                    chunk_bytes=chunk_bytes)


def _rs_count(sendbuf, recv_counts, group) -> int:
    """This rank's block of a reduce-scatter (a guess the call's checks judge)."""
    if recv_counts is not None:
        try:
            g = group_or_world(group)
            return max(0, int(np.asarray(recv_counts, np.int64)[g.rank]))
        except (TypeError, ValueError, IndexError):
            return 0
    return int(getattr(sendbuf, "size", 0)) // _group_size(group, sendbuf)


def prepare_all_gather(sendbuf, recvbuf=None, *, group=None, algo: str | None = None,
                       chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.all_gather` (``recvbuf=None``: allocated once with
    shape ``(p,) + sendbuf.shape``). Runs return ``recvbuf``."""
    if recvbuf is None:
        p = _group_size(group, sendbuf)
        recvbuf = _like(sendbuf, (p,) + tuple(getattr(sendbuf, "shape", ())))
    return _prepare(api.all_gather, CollectiveOp.ALL_GATHER, group, False, None, sendbuf,
                    recvbuf,
                    algo=algo, chunk_bytes=chunk_bytes)


def prepare_broadcast(buf, *, root: int = 0, group=None, algo: str | None = None,
                      chunk_bytes: int | None = None) -> Prepared:
    """Prepare :func:`collectives.broadcast` of ``buf`` from ``root``. Runs return ``buf``."""
    missing = None
    if isinstance(root, np.integer):
        root = int(root)
    if not isinstance(root, int):
        missing = Problem("root", f"root: expected a group rank, got {root!r}")
    return _prepare(api.broadcast, CollectiveOp.BROADCAST, group, True, missing, buf,
                    root=root,
                    algo=algo, chunk_bytes=chunk_bytes)
