"""NCCL backend: device (CuPy) buffers through ``cupy.cuda.nccl``.

One NCCL communicator per process group, created from a unique id that the
group's rank 0 draws and broadcasts over MPI (CuPy 13 hands the id out as a
tuple of 128 ints, CuPy 14 as 128 bytes; both are accepted). Before the
communicator is made, the group checks that no two of its ranks drive the
same GPU of one host (NCCL refuses that with ``ncclInvalidUsage``).

Operations are enqueued on the current CUDA stream; a handle's ``wait()``
synchronises the host with an event recorded after them. The MPI
communicator stays the control plane (argument agreement).

Point-to-point: NCCL's send and receive complete only together with the
peer's matching call, so sends and receives that must progress together
have to be issued inside one ``groupStart()``/``groupEnd()``. Non-blocking
sends and receives (``async_op=True``, and every send and receive of the
collectives' algorithms through :meth:`NcclBackend.post`) are therefore
*posted* and issued as one group when any of them is first waited for or
tested (:meth:`NcclBackend.flush`); every rank posts them in the same
order, so the groups match. A collective flushes what is posted first. Each
post is issued on the stream that was current when it was posted (the
``stream=`` of ``send``/``recv``), whatever stream is current at the flush:
one NCCL group may hold calls on several streams (NCCL then orders the
group after the work queued so far on each of them, and each stream's later
work after the group), and a handle's ``wait()`` synchronises with its
post's stream.

Datatypes: copies (AlltoAll(v), AllGather, Broadcast, send/recv) move
bytes, so every dtype travels. Reductions use NCCL's types; int16 and
uint16, which NCCL lacks, reduce as int32/uint32 and wrap back, which is
exact (two's-complement wrap-around, as MPI and NCCL define for the other
integer types). float16 reduces in NCCL's kernels, one rounding per step;
bfloat16 needs NCCL 2.10 or later, and a reducing call on an older NCCL is
refused on every rank before it starts (:meth:`NcclBackend.reduce_reason`).
"""
from __future__ import annotations

import socket

import numpy as np

from neocomm import watchdog
from neocomm.backends.base import Backend, Handle, cuda_availability
from neocomm.errors import BackendUnavailableError
from neocomm.types import BackendKind, ReduceOp

__all__ = ["NcclBackend", "normalize_unique_id", "NCCL_REDUCIBLE", "version_text"]

# ncclDataType_t and ncclRedOp_t values from nccl.h (used when CuPy lacks a constant).
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
#: dtypes NCCL cannot reduce, and the type they reduce as (exact: see the module docstring)
_WIDEN = {"int16": "int32", "uint16": "uint32"}
#: every dtype the NCCL backend reduces
NCCL_REDUCIBLE = tuple(_NCCL_DTYPES) + tuple(_WIDEN)
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
_UINT8 = 1
#: the first NCCL version code with bfloat16 (2.10.0)
_BF16_VERSION = 21000
UNIQUE_ID_BYTES = 128


class _Posted:
    """A posted send or receive. Testing or waiting for it issues every operation posted
    so far as one NCCL group, unless an earlier flush already issued it (then nothing
    more is issued: later posts wait for their own round). Completion is stream-ordered
    on ``stream`` (the stream current at the post): work queued on it afterwards sees the
    data, the host does after a sync."""

    __slots__ = ("_backend", "done", "stream")

    def __init__(self, backend: "NcclBackend", stream):
        self._backend = backend
        self.stream = stream  # the CuPy stream the operation is issued on
        self.done = False  # True once issued

    def test(self) -> bool:
        if not self.done:
            self._backend.flush()
        return True

    def wait(self) -> None:
        self.test()


def normalize_unique_id(uid, want_bytes: bool):
    """Convert a NCCL unique id between CuPy 14's bytes and CuPy 13's tuple of ints.

    CuPy 13's tuple holds C ``char`` values (-128..127); bytes hold 0..255.
    """
    if isinstance(uid, (bytes, bytearray)):
        raw = bytes(uid)
    else:
        raw = bytes((int(v) + 256) % 256 for v in uid)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"unique id: expected {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    if want_bytes:
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)


class NcclBackend(Backend):
    """CuPy buffers over NCCL."""

    kind = BackendKind.NCCL
    device = True
    #: sends and receives pair up in posting order (no tags): see the module docstring
    in_order_p2p = True

    @classmethod
    def availability(cls):
        ok, reason = cuda_availability()
        if not ok:
            return ok, reason
        try:
            from cupy.cuda import nccl
        except ImportError as exc:
            return False, f"CuPy was built without NCCL ({exc})"
        if not getattr(nccl, "available", True):
            return False, "CuPy's NCCL bindings report NCCL as unavailable"
        return True, None

    def __init__(self, group):
        super().__init__(group)
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self._posted: list = []
        _check_one_gpu_per_rank(group, cupy.cuda.Device().id)
        uid = nccl.get_unique_id() if group.rank == 0 else None
        uid = group.comm.bcast(uid, root=0)
        want_bytes = int(cupy.__version__.split(".")[0]) >= 14
        self._comm = nccl.NcclCommunicator(group.size, normalize_unique_id(uid, want_bytes),
                                           group.rank)

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.destroy()

    def reduce_reason(self, dtype, op: ReduceOp) -> str | None:
        """NCCL reduces bfloat16 from version 2.10 on (``cupy.cuda.nccl.get_version()``
        >= 21000); every other dtype of :data:`NCCL_REDUCIBLE` with every op."""
        name = np.dtype(dtype).name
        if name == "bfloat16":
            version = int(self._nccl.get_version())
            if version < _BF16_VERSION:
                others = ", ".join(n for n in NCCL_REDUCIBLE if n != "bfloat16")
                return (f"the nccl backend cannot reduce bfloat16 ({op.value}): NCCL "
                        f"{version_text(version)} has no bfloat16 reductions (NCCL >= 2.10 "
                        f"has); it reduces {others} (or use NEOCOMM_BACKEND=staged)")
        elif name not in NCCL_REDUCIBLE:
            return (f"the nccl backend cannot reduce {name} ({op.value}); it reduces "
                    f"{', '.join(NCCL_REDUCIBLE)}")
        return None

    # -- helpers -------------------------------------------------------
    def _code(self, name: str) -> int:
        return getattr(self._nccl, f"NCCL_{name.upper()}", _NCCL_DTYPES[name])

    def _reduce_type(self, arr, op: ReduceOp, what: str) -> int:
        name = arr.dtype.name
        if name not in _NCCL_DTYPES:
            raise TypeError(f"{what}: NCCL cannot reduce {name} ({op.value}); it reduces "
                            f"{', '.join(NCCL_REDUCIBLE)}")
        return self._code(name)

    def _op(self, op: ReduceOp) -> int:
        return getattr(self._nccl, f"NCCL_{op.name}", _NCCL_OPS[op])

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def _enqueued(self, what: str, result=None, stream=None) -> Handle:
        """A handle on the work queued so far on ``stream`` (default: the current one)."""
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)

        def wait():
            with watchdog.guard(what):
                event.synchronize()

        return Handle(wait, lambda: event.done, result)

    # -- point to point ----------------------------------------------
    def post(self, kind: str, buf, peer: int) -> _Posted:
        """Post a send (``kind`` "send") or receive of all of ``buf`` with group rank
        ``peer`` on the current stream; it is issued there, grouped with every other posted
        one, by :meth:`flush`."""
        handle = _Posted(self, self._cupy.cuda.get_current_stream())
        self._posted.append((kind == "send", buf, peer, handle))
        return handle

    def flush(self) -> None:
        """Issue every posted send and receive as one NCCL group, in posting order, each on
        the stream it was posted on."""
        posted, self._posted = self._posted, []
        if not posted:
            return
        send, recv = self._comm.send, self._comm.recv
        self._nccl.groupStart()
        try:
            for is_send, buf, peer, handle in posted:
                (send if is_send else recv)(buf.data.ptr, buf.nbytes, _UINT8, peer,
                                            handle.stream.ptr)
                handle.done = True
        finally:
            self._nccl.groupEnd()

    def _send(self, buf, peer, tag, async_op):
        return self._p2p("send", buf, peer, async_op, f"send to {peer}", None)

    def _recv(self, buf, peer, tag, async_op):
        return self._p2p("recv", buf, peer, async_op, f"recv from {peer}", buf)

    def _p2p(self, kind, buf, peer, async_op, what, result) -> Handle:
        posted = self.post(kind, buf, peer)
        if not async_op:
            self.flush()

        def wait():
            posted.wait()
            self._enqueued(what, stream=posted.stream).wait()
        return Handle(wait, None, result)

    # -- collectives --------------------------------------------------
    def _exchange(self, sendbuf, recvbuf, send_counts, recv_counts, what):
        """Grouped send/recv of bytes: ``send_counts[j]`` elements to j, ``recv_counts[i]``
        from i."""
        self.flush()
        stream, item = self._stream(), sendbuf.itemsize
        sdis = np.concatenate(([0], np.cumsum(send_counts[:-1])))
        rdis = np.concatenate(([0], np.cumsum(recv_counts[:-1])))
        sptr, rptr = sendbuf.data.ptr, recvbuf.data.ptr
        self._nccl.groupStart()
        try:
            for peer in range(self.size):
                if send_counts[peer]:
                    self._comm.send(sptr + int(sdis[peer]) * item, int(send_counts[peer]) * item,
                                    _UINT8, peer, stream)
                if recv_counts[peer]:
                    self._comm.recv(rptr + int(rdis[peer]) * item, int(recv_counts[peer]) * item,
                                    _UINT8, peer, stream)
        finally:
            self._nccl.groupEnd()
        return self._enqueued(what, recvbuf)

    def _all_to_all(self, sendbuf, recvbuf, async_op):
        counts = np.full(self.size, sendbuf.size // self.size, np.int64)
        return self._exchange(sendbuf, recvbuf, counts, counts, "all_to_all")

    def _all_to_all_v(self, sendbuf, recvbuf, send_counts, recv_counts, async_op):
        return self._exchange(sendbuf, recvbuf, send_counts, recv_counts, "all_to_all_v")

    def _widened(self, sendbuf, recvbuf, run):
        """Run reduction ``run(send, recv)`` on buffers NCCL can reduce: int16/uint16
        travel as int32/uint32 and are cast back (wrapping) into ``recvbuf``."""
        wide = _WIDEN.get(sendbuf.dtype.name)
        if wide is None:
            return run(sendbuf, recvbuf)
        ws = sendbuf.astype(wide)
        wr = ws if recvbuf is sendbuf else self._cupy.empty(recvbuf.size, wide)
        handle = run(ws, wr)
        recvbuf[...] = wr.reshape(recvbuf.shape).astype(recvbuf.dtype)  # stream-ordered
        return handle

    def _all_reduce(self, sendbuf, recvbuf, op, async_op):
        self.flush()
        out = sendbuf if recvbuf is None else recvbuf

        def run(s, r):
            self._comm.allReduce(s.data.ptr, r.data.ptr, s.size,
                                 self._reduce_type(s, op, "all_reduce"), self._op(op),
                                 self._stream())
        self._widened(sendbuf, out, run)
        return self._enqueued("all_reduce", out)

    def _reduce_scatter(self, sendbuf, recvbuf, op, recv_counts, async_op):
        self.flush()
        if recv_counts is None:
            def run(s, r):
                self._comm.reduceScatter(s.data.ptr, r.data.ptr, r.size,
                                         self._reduce_type(s, op, "reduce_scatter"),
                                         self._op(op), self._stream())
            self._widened(sendbuf, recvbuf, run)
            return self._enqueued("reduce_scatter", recvbuf)
        # Uneven blocks: NCCL has no reduce_scatter_v; reduce each block to its owner.
        def run_v(s, r):
            dt, nop = self._reduce_type(s, op, "reduce_scatter"), self._op(op)
            stream, item = self._stream(), s.itemsize
            displs = np.concatenate(([0], np.cumsum(recv_counts[:-1])))
            self._nccl.groupStart()
            try:
                for root in range(self.size):
                    count = int(recv_counts[root])
                    if count:
                        dst = r.data.ptr if root == self.rank else 0
                        self._comm.reduce(s.data.ptr + int(displs[root]) * item, dst, count,
                                          dt, nop, root, stream)
            finally:
                self._nccl.groupEnd()
        self._widened(sendbuf, recvbuf, run_v)
        return self._enqueued("reduce_scatter", recvbuf)

    def _all_gather(self, sendbuf, recvbuf, async_op):
        self.flush()
        self._comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.nbytes, _UINT8,
                             self._stream())
        return self._enqueued("all_gather", recvbuf)

    def _broadcast(self, buf, root, async_op):
        self.flush()
        self._comm.bcast(buf.data.ptr, buf.nbytes, _UINT8, root, self._stream())
        return self._enqueued("broadcast", buf)

    def _barrier(self, async_op):
        # A one-element all-reduce on the stream, then the host waits on it.
        self.flush()
        token = self._cupy.zeros(1, self._cupy.int32)
        self._comm.allReduce(token.data.ptr, token.data.ptr, 1, self._code("int32"),
                             self._op(ReduceOp.SUM), self._stream())
        return self._enqueued("barrier")


def version_text(code: int) -> str:
    """``"2.10.3"`` of an NCCL version code: ``major * 10000 + minor * 100 + patch`` from
    2.9 on, ``major * 1000 + minor * 100 + patch`` before (``NCCL_VERSION_CODE``)."""
    code = int(code)
    major, rest = (code // 10000, code % 10000) if code >= 10000 else (code // 1000,
                                                                       code % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _check_one_gpu_per_rank(group, device: int) -> None:
    """Raise on every rank of ``group`` when two of its ranks drive one GPU of one host
    (NCCL would refuse the communicator with ``ncclInvalidUsage``)."""
    seen: dict = {}
    clashes = []
    for rank, key in enumerate(group.comm.allgather((socket.gethostname(), int(device)))):
        if key in seen:
            clashes.append(f"ranks {seen[key]} and {rank} both on GPU {key[1]} of host {key[0]}")
        else:
            seen[key] = rank
    if clashes:
        raise BackendUnavailableError(
            "nccl", f"NCCL needs one GPU per rank of a group, but in group {group.name!r} "
                    f"{'; '.join(clashes)} (give each rank of a host its own GPU, e.g. fewer "
                    f"ranks per host, or use the staged backend: NEOCOMM_BACKEND=staged)")
