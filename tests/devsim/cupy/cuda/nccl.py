"""The stand-in's ``cupy.cuda.nccl``: NCCL's rules, with MPI moving the bytes.

What it enforces, where real NCCL would hang, corrupt or refuse:

- **Communicators** come from a unique id (CuPy 14: 128 bytes; CuPy 13: a
  tuple of 128 ints; the other form is a ``TypeError``), every rank of the
  id must join, and two ranks on one GPU of one host are refused with
  ``ncclInvalidUsage`` naming both ranks, as NCCL does.
- **Stream order.** Every call is queued on its stream and runs when the
  stream reaches it (on the stream's worker, not the host thread), so the
  host must synchronise before reading a result.
- **Collective order.** Calls on a communicator run in issue order; the
  first step of every collective compares the call across ranks (kind,
  count, datatype, reduction, root) and fails on every rank, naming each
  rank's call, when they differ.
- **Point-to-point rendezvous.** A send completes only when the peer has
  posted the matching receive (NCCL's p2p has no unbounded buffering); a
  group (``groupStart``/``groupEnd``) lets its sends and receives progress
  together. Two ranks that each wait for the other (a bare send facing a
  bare send, a collective facing a send) are detected as a deadlock and
  every rank involved fails with both call sites; a wait that makes no
  progress for ``DEVSIM_STALL`` seconds (default 60) fails too.
- **Groups may span streams.** A group's calls may be on several streams, as
  NCCL allows: the launch waits for the work queued so far on each of them,
  and each stream's later work waits for the launch. ``issued`` records the
  stream every call was queued on.
- **Tables.** Only NCCL's datatypes (no int16, no complex) and reductions;
  a receive of another byte count than the matching send is an error.

Any failure aborts the communicator on every rank (later calls raise), as
``ncclCommAbort`` leaves it.
"""
from __future__ import annotations

import collections
import itertools
import os
import secrets
import socket
import threading
import time

import numpy as np

from cupy import _engine

__all__ = ["NcclError", "NcclCommunicator", "get_unique_id", "get_version", "groupStart",
           "groupEnd", "available"]

available = True

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError = 0, 1, 2, 3
ncclInvalidArgument, ncclInvalidUsage = 4, 5
_STATUS = {1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR", 2: "NCCL_ERROR_SYSTEM_ERROR",
           3: "NCCL_ERROR_INTERNAL_ERROR", 4: "NCCL_ERROR_INVALID_ARGUMENT",
           5: "NCCL_ERROR_INVALID_USAGE"}


def _bf16():
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover - a test extra
        return None


#: NCCL datatype -> NumPy dtype (what real NCCL has: no int16, no complex, no bool)
_DTYPES = {NCCL_INT8: np.dtype(np.int8), NCCL_UINT8: np.dtype(np.uint8),
           NCCL_INT32: np.dtype(np.int32), NCCL_UINT32: np.dtype(np.uint32),
           NCCL_INT64: np.dtype(np.int64), NCCL_UINT64: np.dtype(np.uint64),
           NCCL_FLOAT16: np.dtype(np.float16), NCCL_FLOAT32: np.dtype(np.float32),
           NCCL_FLOAT64: np.dtype(np.float64)}
if _bf16() is not None:
    _DTYPES[NCCL_BFLOAT16] = _bf16()
_OPS = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}


class NcclError(RuntimeError):
    """An NCCL error: ``status`` is the ``ncclResult_t``."""

    def __init__(self, status: int, detail: str = ""):
        self.status = status
        self.detail = detail
        name = _STATUS.get(status, f"NCCL_ERROR_{status}")
        super().__init__(f"{name}: {detail}" if detail else name)

    def __reduce__(self):
        return (type(self), (self.status, self.detail))


def get_version() -> int:
    return 22105


def _want_bytes() -> bool:
    import cupy

    return int(cupy.__version__.split(".")[0]) >= 14


def _mpi():
    """``mpi4py.MPI``, started as the runtime starts it: a one-process test that asks the
    stand-in for a unique id must not leave a singleton's shared-memory segment behind."""
    from neocomm.mpistart import mpi

    return mpi()


def get_unique_id():
    """A fresh id naming this rank as the root (bytes on CuPy 14, a tuple of ints on 13)."""
    MPI = _mpi()

    raw = b"NCSI" + secrets.token_bytes(16) + MPI.COMM_WORLD.Get_rank().to_bytes(4, "little")
    raw = raw.ljust(128, b"\0")
    if _want_bytes():
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)


# -- groups -------------------------------------------------------------------------

_group = threading.local()


def groupStart() -> None:
    _group.depth = getattr(_group, "depth", 0) + 1
    if _group.depth == 1:
        _group.ops = []


def groupEnd() -> None:
    depth = getattr(_group, "depth", 0)
    if depth == 0:
        raise NcclError(ncclInvalidUsage, "groupEnd() without groupStart()")
    _group.depth = depth - 1
    if _group.depth == 0:
        ops, _group.ops = _group.ops, []
        by_comm: dict = {}
        for op in ops:
            by_comm.setdefault(id(op.comm), []).append(op)
        for unit in by_comm.values():
            unit[0].comm._submit(unit)


class _Op:
    __slots__ = ("kind", "comm", "send", "recv", "count", "dtype", "op", "root", "peer",
                 "stream", "site", "dcode")

    def describe(self) -> str:
        parts = [f"count={self.count}", _name_of(self.dcode)]
        if self.op is not None:
            parts.append(_OPS[self.op])
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.insert(0, f"peer={self.peer}")
        return f"nccl{self.kind[0].upper()}{self.kind[1:]}({', '.join(parts)}) at {self.site}"


def _name_of(code) -> str:
    dt = _DTYPES.get(code)
    return dt.name if dt is not None else f"datatype {code}"


# -- communicators --------------------------------------------------------------------

_CTRL, _DATA = 1, 2
_RDV_TAG = 31_001


def _stall_seconds() -> float:
    return float(os.environ.get("DEVSIM_STALL", "60"))


class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)``: this process's rank of a communicator."""

    def __init__(self, ndev: int, commId, rank: int):
        MPI = _mpi()

        want_bytes = _want_bytes()
        if want_bytes and not isinstance(commId, bytes):  # bytearray too: CuPy 14's check
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        if not want_bytes and not isinstance(commId, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got "
                            f"{type(commId).__name__})")
        raw = bytes(commId) if want_bytes else bytes((int(v) + 256) % 256 for v in commId)
        if len(raw) != 128:
            raise ValueError(f"commId length {len(raw)} != 128.")
        if raw[:4] != b"NCSI":
            raise NcclError(ncclInvalidArgument, "commId is not a unique id from get_unique_id()")
        if not 0 <= rank < ndev:
            raise NcclError(ncclInvalidArgument, f"rank {rank} is not in [0, {ndev})")
        self._ndev, self._rank = int(ndev), int(rank)
        self._device = _engine.current_device()
        token = raw[4:20].hex()
        root = int.from_bytes(raw[20:24], "little")
        world = MPI.COMM_WORLD
        me = {"token": token, "rank": self._rank, "world": world.Get_rank(),
              "host": socket.gethostname(), "device": self._device}
        if self._rank == 0 and world.Get_rank() != root:
            raise NcclError(ncclInvalidUsage, f"rank 0 must be the process that created the "
                                              f"unique id (world rank {root})")
        if world.Get_rank() == root:
            members = [me] + [world.recv(source=MPI.ANY_SOURCE, tag=_RDV_TAG)
                              for _ in range(self._ndev - 1)]
            error = _check_members(members, token, self._ndev)
            answer = {"error": error,
                      "worlds": [m["world"] for m in sorted(members, key=lambda m: m["rank"])]}
            for m in members[1:]:
                world.send(answer, dest=m["world"], tag=_RDV_TAG + 1)
        else:
            world.send(me, dest=root, tag=_RDV_TAG)
            answer = world.recv(source=root, tag=_RDV_TAG + 1)
        if answer["error"]:
            raise NcclError(ncclInvalidUsage, answer["error"])
        group = world.Get_group().Incl(answer["worlds"])
        self._mpi = world.Create_group(group, tag=_RDV_TAG + 2)
        group.Free()
        self._lock = threading.Condition()
        self._issued = itertools.count()
        self._next_run = 0
        # launches with collectives this rank finished: a peer that finished more has
        # contributed to the one this rank is in, and waits for nothing of it
        self._colls_done = 0
        self._skipped: set = set()  # launches that failed to enqueue: their turn passes
        self._aborted: str | None = None
        self._rts: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._rtr: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._sent_to = collections.Counter()    # sends issued to each peer, all units
        self._recvd_from = collections.Counter()  # receives issued from each peer, all units
        self._outbox: list = []
        #: (kind, peer, stream pointer) of the latest calls, in issue order: which stream
        #: each call was queued on (the stand-in's record, for tests)
        self.issued: collections.deque = collections.deque(maxlen=4096)

    # -- introspection -----------------------------------------------------------
    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    def destroy(self) -> None:
        mpi, self._mpi = getattr(self, "_mpi", None), None
        if mpi is not None and self._aborted is None:
            MPI = _mpi()

            if not MPI.Is_finalized():
                mpi.Free()

    def abort(self) -> None:
        self._aborted = self._aborted or "the communicator was aborted"
        self._mpi = None

    # -- calls ---------------------------------------------------------------------
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._call("allReduce", sendbuf, recvbuf, count, datatype, op=op, stream=stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._call("reduce", sendbuf, recvbuf if self._rank == root else None, count, datatype,
                   op=op, root=root, stream=stream)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._call("broadcast", sendbuff if self._rank == root else None, recvbuff, count,
                   datatype, root=root, stream=stream)

    def bcast(self, buff, count, datatype, root, stream):
        self._call("bcast", buff if self._rank == root else None, buff, count, datatype,
                   root=root, stream=stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._call("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op=op, stream=stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._call("allGather", sendbuf, recvbuf, count, datatype, stream=stream)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._call("send", sendbuf, None, count, datatype, peer=peer, stream=stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._call("recv", None, recvbuf, count, datatype, peer=peer, stream=stream)

    def _call(self, kind, send, recv, count, datatype, *, op=None, root=None, peer=None,
              stream=0):
        if count < 0:  # CuPy's size_t count: refused as it is converted, before NCCL runs
            raise OverflowError("can't convert negative value to size_t")
        if self._mpi is None:
            raise NcclError(ncclInvalidUsage if self._aborted is None else ncclSystemError,
                            self._aborted or "the communicator was destroyed")
        if datatype not in _DTYPES:
            raise NcclError(ncclInvalidArgument, f"nccl{kind}: invalid datatype {datatype} "
                                                 f"(NCCL has no such type)")
        if op is not None and op not in _OPS:
            raise NcclError(ncclInvalidArgument, f"nccl{kind}: invalid reduction op {op}")
        for name, value in (("root", root), ("peer", peer)):
            if value is not None and not 0 <= value < self._ndev:
                raise NcclError(ncclInvalidArgument, f"nccl{kind}: {name} {value} is not in "
                                                     f"[0, {self._ndev})")
        o = _Op()
        o.kind, o.comm, o.count, o.dcode, o.op, o.root, o.peer = (kind, self, int(count),
                                                                  datatype, op, root, peer)
        o.dtype = _DTYPES[datatype]
        o.site = _engine.call_site()
        o.stream = self._stream(stream, kind)
        n = self._ndev
        send_elems = {"reduceScatter": count * n}.get(kind, count)
        recv_elems = {"allGather": count * n}.get(kind, count)
        o.send = self._view(send, send_elems, o, "sendbuff") if send is not None else None
        o.recv = self._view(recv, recv_elems, o, "recvbuff") if recv is not None else None
        if getattr(_group, "depth", 0):
            _group.ops.append(o)
        else:
            self._submit([o])

    def _stream(self, ptr: int, kind: str):
        if ptr == 0:
            return _engine.null_stream(self._device)
        for s in list(_engine._ALL_STREAMS):
            if s.ptr == ptr:
                if s.device != self._device:
                    raise NcclError(ncclInvalidArgument, f"nccl{kind}: the stream belongs to "
                                                         f"device {s.device}, the communicator "
                                                         f"to device {self._device}")
                return s
        raise NcclError(ncclInvalidArgument, f"nccl{kind}: {ptr:#x} is not a CUDA stream")

    def _view(self, ptr, elems, o, what):
        try:
            alloc, view = _engine.resolve(int(ptr), elems * o.dtype.itemsize,
                                          f"nccl{o.kind} {what}")
        except _engine.CudaError as exc:
            raise NcclError(ncclInvalidArgument, str(exc)) from None
        if alloc.device != self._device:
            raise NcclError(ncclInvalidArgument,
                            f"nccl{o.kind}: {what} is on device {alloc.device}, the "
                            f"communicator on device {self._device}")
        return alloc.id, view.view(o.dtype)

    def _submit(self, ops: list) -> None:
        """Queue one launch: a bare call, or a group's calls. A group may hold calls on
        several streams (NCCL allows it): the launch runs on the first call's stream once
        every other stream has run the work queued on it so far, and the work each other
        stream queues afterwards waits for the launch (NCCL joins the streams with events)."""
        streams: list = []
        for o in ops:
            if not any(o.stream is s for s in streams):
                streams.append(o.stream)
            self.issued.append((o.kind, o.peer, o.stream.ptr))
        launch, others = streams[0], streams[1:]
        for other in others:
            self._join(launch, other, "waits for the work queued on the group's other streams")
        seq = next(self._issued)
        for o in ops:
            if o.kind == "send":
                self._sent_to[o.peer] += 1
            elif o.kind == "recv":
                self._recvd_from[o.peer] += 1
        reads = {o.send[0] for o in ops if o.send is not None}
        writes = {o.recv[0] for o in ops if o.recv is not None}
        what = ops[0].describe() if len(ops) == 1 else \
            f"group of {len(ops)} NCCL calls from {ops[0].site}"
        try:
            _engine.enqueue(launch, lambda: self._run_in_turn(seq, ops), eager=True,
                            reads=reads, writes=writes, what=what, site=ops[0].site)
        except BaseException:
            with self._lock:
                self._skipped.add(seq)
                self._lock.notify_all()
            raise
        for other in others:
            self._join(other, launch, "later work waits for the NCCL group")

    @staticmethod
    def _join(stream, other, what: str) -> None:
        """``stream``'s work from now on runs after the work queued on ``other`` so far."""
        upto, site = other.last, _engine.call_site()
        _engine.note_wait(stream, other, other.tick, dict(other.waited))
        _engine.enqueue(stream, lambda: other.wait_upto(upto), eager=True, waits=True,
                        what=f"NCCL group: {what}", site=site)

    # -- execution (on the stream's worker) --------------------------------------------
    def _run_in_turn(self, seq: int, ops: list) -> None:
        started = time.monotonic()
        with self._lock:
            while self._next_run != seq:
                if self._next_run in self._skipped:
                    self._skipped.discard(self._next_run)
                    self._next_run += 1
                    continue
                if time.monotonic() - started > _stall_seconds():
                    raise NcclError(ncclSystemError, f"stand-in: launch {seq} on rank "
                                    f"{self._rank} waited {_stall_seconds():.0f} s for launch "
                                    f"{self._next_run} of its communicator to run first")
                self._lock.wait(0.05)
        try:
            if self._aborted is not None:
                raise NcclError(ncclSystemError, self._aborted)
            unit = _Unit(self, ops)
            unit.run()
            if unit.colls:
                self._colls_done += 1
        finally:
            with self._lock:
                self._next_run += 1
                self._lock.notify_all()

    def _post(self, peer: int, msg: dict) -> None:
        self._outbox.append(self._mpi.isend(msg, dest=peer, tag=_CTRL))

    def _fail(self, message: str) -> "NcclError":
        """Abort the communicator on every rank with ``message``."""
        if self._aborted is None:
            self._aborted = message
            for peer in range(self._ndev):
                if peer != self._rank:
                    self._post(peer, {"t": "abort", "msg": message, "from": self._rank})
        return NcclError(ncclSystemError, message)


def _check_members(members, token, ndev) -> str | None:
    bad = [m["world"] for m in members if m["token"] != token]
    if bad:
        return f"world rank(s) {bad} joined with another unique id"
    ranks = sorted(m["rank"] for m in members)
    if ranks != list(range(ndev)):
        return f"ranks {ranks} joined a communicator of {ndev}"
    seen: dict = {}
    for m in sorted(members, key=lambda m: m["rank"]):
        key = (m["host"], m["device"])
        if key in seen:
            return (f"Duplicate GPU detected: rank {seen[key]} and rank {m['rank']} both on "
                    f"CUDA device {m['device']} of host {m['host']}")
        seen[key] = m["rank"]
    return None


from cupy.cuda._nccl_launch import _Unit  # noqa: E402  (it uses the names above)
