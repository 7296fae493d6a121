"""Prepared collectives: validate once, run many times (MPI-4's persistent collectives).

``prepare_all_to_all(sendbuf, recvbuf)`` is to :func:`collectives.all_to_all`
what ``MPI_Alltoall_init`` is to ``MPI_Alltoall``: the arguments are checked
and agreed across the group once (bad input on any rank raises
:class:`~neocomm.errors.CollectiveArgumentError` on every rank, exactly as
the normal call does), the algorithm and chunking are chosen once, and the
returned :class:`PreparedCollective` then moves whatever the buffers hold at each run::

    with collectives.prepare_all_to_all(x, y) as a2a:
        for step in range(steps):
            x[:] = ...          # new contents, same buffers
            a2a()               # blocking; returns y
            # or: a2a.start(); ...overlap...; y = a2a.wait()

A :class:`PreparedCollective` is the call's :class:`~collectives.plan.Plan` — built
exactly as the plain call builds it — held by the user with its buffers.
When the chosen algorithm is ``native`` on host (NumPy) buffers over MPI,
each blocking run is one MPI call under the stall watchdog: an MPI persistent
request's ``Start`` and ``Wait`` for AlltoAll, AlltoAllv and Broadcast, the
blocking mpi4py call itself for AllReduce, ReduceScatter and AllGather (Open
MPI 5 builds persistent collectives from its non-blocking ones, which for these
three run slower than its tuned blocking algorithms; see
``neocomm bench --prepared``). Otherwise a run reruns the prepared algorithm.

Every rank of the group prepares, runs and frees the same collectives in
the same order, and runs them the same way: every rank calls it, or every
rank calls :meth:`PreparedCollective.start` and :meth:`PreparedCollective.wait` (as MPI never
matches a blocking collective with a non-blocking one). A prepared run
matches only runs of the same prepared collective on the other ranks
(never a plain call). A :class:`PreparedCollective` keeps
its buffers alive until :meth:`PreparedCollective.free`; the buffers must keep their
size, dtype and memory while it lives (fill them in place).
"""
from __future__ import annotations

from time import monotonic as _now

import numpy as np

from neocomm.agree import Problem
from neocomm.errors import GroupGoneError

from collectives.arrays import foreign_arrays
from collectives import api, api_v, progress
from collectives.plan import OP_CODES, array_module, context, fail
from collectives.progress import MpiRequest
from collectives.state import state_of
from collectives.types import CollectiveOp

__all__ = ["PreparedCollective", "prepare_all_to_all", "prepare_all_to_all_v",
           "prepare_all_reduce", "prepare_reduce_scatter", "prepare_all_gather",
           "prepare_broadcast"]


class PreparedCollective:
    """One prepared collective; call it (or :meth:`start` then :meth:`wait`) to run it.

    ``op`` is the collective's name (``"all_to_all"``), ``algo`` the algorithm
    it runs, ``persistent`` whether runs are MPI persistent requests, ``plan``
    the call's plan and ``result`` what every run returns (the receive buffer,
    the in-place buffer, or ``(recvbuf, recv_counts)`` for AlltoAllv).
    """

    __slots__ = ("op", "algo", "result", "plan", "_request", "_handle", "_bufs", "_freed",
                 "_layout", "_group", "_seq")

    def __init__(self, plan, bufs, result, request):
        self.op, self.algo, self.plan, self.result = plan.op, plan.algo, plan, result
        self._request, self._bufs = request, bufs
        self._handle = None
        self._freed = False
        self._group = plan.state.group
        self._seq = plan.state.seq
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
        request = self._request
        if request is None:  # the plan's run, without its agreement (see the module docs)
            self.plan._start(self._bufs, next(self._seq), False)
            return self.result
        next(self._seq)  # every run numbers its group's operations, as any call does
        if not self.plan.state.progress.active:  # else drive the outstanding ones too
            slot = self.plan.slot
            slot.since = _now()
            try:
                request.Start()
                request.Wait()
            finally:
                slot.since = 0.0
            return self.result
        return self._started(False).wait()

    def start(self) -> None:
        """Begin a run without waiting for it; :meth:`wait` finishes it."""
        self._check("start")
        self._check_layout()
        seq = next(self._seq)
        if self._request is None:
            self._handle = self.plan._start(self._bufs, seq, True)
        else:
            self._handle = self._started(True)

    def _started(self, async_op: bool):
        return progress.start(_persistent_steps(self._request), self.result, async_op,
                              self.plan.slot.what, self.plan.state.progress)

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
        handle.wait()
        return self.result

    def free(self) -> None:
        """Release the request and the buffers (idempotent). A started run is
        finished first."""
        if self._freed:
            return
        if self._handle is not None:
            self.wait()
        if self._request is not None:
            self._request.Free()
        self._request = self._bufs = self.result = self.plan = None
        self._layout = ()
        self._freed = True

    def __enter__(self) -> "PreparedCollective":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        state = ("freed" if self._freed else "persistent" if self.persistent
                 else "direct" if self.plan.fast is not None else "rerun")
        return f"<PreparedCollective {self.op} ({self.algo}), {state}>"

    def _check(self, what: str) -> None:
        gone = self._group.gone
        if gone is not None:
            raise GroupGoneError(f"prepared {self.op}: {what}: {gone}", ranks=self._group.ranks)
        if self._freed:
            raise ValueError(f"prepared {self.op}: {what} after free()")
        if self._handle is not None:
            raise ValueError(f"prepared {self.op}: {what} while a started run is not "
                             f"waited for")


def _persistent_steps(request):
    """One run of an MPI persistent request as an algorithm generator."""
    request.Start()
    yield (MpiRequest(request),)


def _prepare(plan, bufs, result, kind: CollectiveOp) -> PreparedCollective:
    """The :class:`PreparedCollective` of a plan built for ``bufs`` (with an MPI persistent request
    when its runs can be one)."""
    return PreparedCollective(plan, bufs, result, _persistent_request(plan, bufs, kind))


def _persistent_request(plan, bufs, kind: CollectiveOp):
    """The MPI persistent request of a native AlltoAll(v) or Broadcast on host
    buffers (those the MPI backend runs directly: ``plan.fast``), made by the MPI
    backend, else None."""
    if plan.fast is None or kind not in _PERSISTENT:
        return None
    call = plan._call
    mpi = call.backend.persistent
    if kind is CollectiveOp.ALL_TO_ALL:
        return mpi("all_to_all", bufs[0], bufs[1])
    if kind is CollectiveOp.ALL_TO_ALL_V:
        return mpi("all_to_all_v", bufs[0], bufs[1], counts=(
            call.send_counts, call.send_displs, call.recv_counts, call.recv_displs))
    return mpi("broadcast", bufs[0], root=call.root)


#: Ops whose native runs use MPI persistent requests (see the module docstring).
_PERSISTENT = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V,
                         CollectiveOp.BROADCAST})


def _like(buf, shape):
    """A new array of ``buf``'s kind and dtype, or None when ``buf`` is no array."""
    if not (hasattr(buf, "dtype") and hasattr(buf, "shape")):
        return None
    return array_module(buf).empty(shape, dtype=buf.dtype)


def _require(state, kind: CollectiveOp, buf, missing: Problem | None) -> None:
    """Agree on ``missing`` (an argument the prepared form needs that the call itself
    would do without), so that it fails on every rank."""
    fail(context(None, buf, kind.value, state), kind, missing, [("op", OP_CODES[kind])])


@foreign_arrays("sendbuf", "recvbuf", prepared=True)
def prepare_all_to_all(sendbuf, recvbuf=None, *, group=None, algo: str | None = None,
                       chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.all_to_all` on these buffers (``recvbuf=None``:
    allocated once, with ``sendbuf``'s shape). Runs return ``recvbuf``."""
    state = state_of(group)
    if recvbuf is None:
        recvbuf = _like(sendbuf, getattr(sendbuf, "shape", ()))
    _require(state, CollectiveOp.ALL_TO_ALL, sendbuf, _same_memory(sendbuf, recvbuf))
    plan, bufs = api._plan_all_to_all(state, None, sendbuf, recvbuf, False, algo, chunk_bytes)
    return _prepare(plan, bufs, bufs[1], CollectiveOp.ALL_TO_ALL)


def _same_memory(sendbuf, recvbuf) -> Problem | None:
    """A prepared exchange needs two buffers (the plain call copies an in-place one)."""
    from collectives.validate import same_memory

    if recvbuf is not None and sendbuf is not None and same_memory(sendbuf, recvbuf):
        return Problem("recvbuf", "recvbuf: a prepared exchange needs a buffer of its own, "
                                  "got sendbuf's memory")
    return None


@foreign_arrays("sendbuf", "recvbuf", prepared=True)
def prepare_all_to_all_v(sendbuf, send_counts, recvbuf, recv_counts, *, group=None,
                         algo: str | None = None,
                         chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.all_to_all_v` with fixed counts. ``recvbuf`` and
    ``recv_counts`` are required (as ``MPI_Alltoallv_init`` needs them). Runs
    return ``(recvbuf, recv_counts)``."""
    state = state_of(group)
    missing = None
    if recvbuf is None or recv_counts is None:
        name = "recvbuf" if recvbuf is None else "recv_counts"
        missing = Problem(name, f"{name}: a prepared all_to_all_v needs it, got None")
    _require(state, CollectiveOp.ALL_TO_ALL_V, sendbuf,
             missing or _same_memory(sendbuf, recvbuf))
    plan, bufs = api_v._plan_all_to_all_v(state, None, sendbuf, recvbuf, False, send_counts,
                                          recv_counts, algo, chunk_bytes)
    return _prepare(plan, bufs, (bufs[1],) + plan._extra, CollectiveOp.ALL_TO_ALL_V)


@foreign_arrays("sendbuf", "recvbuf", prepared=True)
def prepare_all_reduce(sendbuf, recvbuf=None, *, op="sum", group=None,
                       algo: str | None = None,
                       chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.all_reduce` (``recvbuf=None``: in place). Runs
    return the result buffer."""
    from collectives.validate import same_memory

    state = state_of(group)
    if recvbuf is not None and sendbuf is not None and same_memory(sendbuf, recvbuf):
        recvbuf = None
    plan, bufs = api._plan_all_reduce(state, None, sendbuf, recvbuf, False, op, algo,
                                      chunk_bytes)
    return _prepare(plan, bufs, bufs[-1], CollectiveOp.ALL_REDUCE)


@foreign_arrays("sendbuf", "recvbuf", prepared=True)
def prepare_reduce_scatter(sendbuf, recvbuf=None, *, recv_counts=None, op="sum", group=None,
                           algo: str | None = None,
                           chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.reduce_scatter` (``recvbuf=None``: allocated once).
    Runs return ``recvbuf``."""
    state = state_of(group)
    if recvbuf is None:
        recvbuf = _like(sendbuf, _rs_count(sendbuf, recv_counts, state.group))
    _require(state, CollectiveOp.REDUCE_SCATTER, sendbuf, _same_memory(sendbuf, recvbuf))
    plan, bufs = api._plan_reduce_scatter(state, None, sendbuf, recvbuf, False, recv_counts,
                                          op, algo, chunk_bytes)
    return _prepare(plan, bufs, bufs[1], CollectiveOp.REDUCE_SCATTER)


def _rs_count(sendbuf, recv_counts, group) -> int:
    """This rank's block of a reduce-scatter (a guess the call's checks judge)."""
    if recv_counts is not None:
        try:
            return max(0, int(np.asarray(recv_counts, np.int64)[group.rank]))
        except (TypeError, ValueError, IndexError):
            return 0
    return int(getattr(sendbuf, "size", 0)) // group.size


@foreign_arrays("sendbuf", "recvbuf", prepared=True)
def prepare_all_gather(sendbuf, recvbuf=None, *, group=None, algo: str | None = None,
                       chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.all_gather` (``recvbuf=None``: allocated once with
    shape ``(p,) + sendbuf.shape``). Runs return ``recvbuf``."""
    state = state_of(group)
    if recvbuf is None:
        recvbuf = _like(sendbuf, (state.group.size,) + tuple(getattr(sendbuf, "shape", ())))
    _require(state, CollectiveOp.ALL_GATHER, sendbuf, _same_memory(sendbuf, recvbuf))
    plan, bufs = api._plan_all_gather(state, None, sendbuf, recvbuf, False, algo, chunk_bytes)
    return _prepare(plan, bufs, bufs[1], CollectiveOp.ALL_GATHER)


@foreign_arrays("buf", prepared=True)
def prepare_broadcast(buf, *, root: int = 0, group=None, algo: str | None = None,
                      chunk_bytes: int | None = None) -> PreparedCollective:
    """Prepare :func:`collectives.broadcast` of ``buf`` from ``root``. Runs return ``buf``."""
    state = state_of(group)
    missing = None
    if isinstance(root, np.integer):
        root = int(root)
    if not isinstance(root, int):
        missing = Problem("root", f"root: expected a group rank, got {root!r}")
    _require(state, CollectiveOp.BROADCAST, buf, missing)
    plan, bufs = api._plan_broadcast(state, None, buf, None, False, root, algo, chunk_bytes)
    return _prepare(plan, bufs, bufs[0], CollectiveOp.BROADCAST)
