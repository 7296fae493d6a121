"""NCCL backend: device (CuPy) buffers through ``cupy.cuda.nccl``.

One NCCL communicator per process group, created from a unique id that the
group's rank 0 draws and broadcasts over MPI (CuPy 13 hands the id out as a
tuple of 128 ints, CuPy 14 as 128 bytes; both are accepted). CuPy wraps no
native all-to-all, so AlltoAll(v) is grouped send/recv. Operations are
enqueued on the current CUDA stream; a handle's ``wait()`` synchronises the
host with an event recorded after them. The MPI communicator stays the
control plane (argument agreement).
"""
from __future__ import annotations

import numpy as np

from neocomm import watchdog
from neocomm.backends.base import Backend, Handle, cuda_availability
from neocomm.types import BackendKind, ReduceOp

__all__ = ["NcclBackend", "normalize_unique_id"]

# ncclDataType_t and ncclRedOp_t values from nccl.h (used when CuPy lacks a constant).
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9, "bool": 1}
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
UNIQUE_ID_BYTES = 128


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
        uid = nccl.get_unique_id() if group.rank == 0 else None
        uid = group.comm.bcast(uid, root=0)
        want_bytes = int(cupy.__version__.split(".")[0]) >= 14
        self._comm = nccl.NcclCommunicator(group.size, normalize_unique_id(uid, want_bytes),
                                           group.rank)

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.destroy()

    # -- helpers -------------------------------------------------------
    def _dtype(self, arr) -> int:
        name = arr.dtype.name
        return getattr(self._nccl, f"NCCL_{name.upper()}", _NCCL_DTYPES[name])

    def _op(self, op: ReduceOp) -> int:
        return getattr(self._nccl, f"NCCL_{op.name}", _NCCL_OPS[op])

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def _enqueued(self, what: str, result=None) -> Handle:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record()

        def wait():
            with watchdog.guard(what):
                event.synchronize()

        return Handle(wait, lambda: event.done, result)

    # -- point to point ----------------------------------------------
    def _send(self, buf, peer, tag, async_op):
        self._comm.send(buf.data.ptr, buf.size, self._dtype(buf), peer, self._stream())
        return self._enqueued(f"send to {peer}")

    def _recv(self, buf, peer, tag, async_op):
        self._comm.recv(buf.data.ptr, buf.size, self._dtype(buf), peer, self._stream())
        return self._enqueued(f"recv from {peer}", buf)

    # -- collectives --------------------------------------------------
    def _exchange(self, sendbuf, recvbuf, send_counts, recv_counts, what):
        """Grouped send/recv: ``send_counts[j]`` elements to j, ``recv_counts[i]`` from i."""
        dt, stream, item = self._dtype(sendbuf), self._stream(), sendbuf.itemsize
        sdis = np.concatenate(([0], np.cumsum(send_counts[:-1])))
        rdis = np.concatenate(([0], np.cumsum(recv_counts[:-1])))
        self._nccl.groupStart()
        try:
            for peer in range(self.size):
                if send_counts[peer]:
                    self._comm.send(sendbuf.data.ptr + int(sdis[peer]) * item,
                                    int(send_counts[peer]), dt, peer, stream)
                if recv_counts[peer]:
                    self._comm.recv(recvbuf.data.ptr + int(rdis[peer]) * item,
                                    int(recv_counts[peer]), dt, peer, stream)
        finally:
            self._nccl.groupEnd()
        return self._enqueued(what, recvbuf)

    def _all_to_all(self, sendbuf, recvbuf, async_op):
        counts = np.full(self.size, sendbuf.size // self.size, np.int64)
        return self._exchange(sendbuf, recvbuf, counts, counts, "all_to_all")

    def _all_to_all_v(self, sendbuf, recvbuf, send_counts, recv_counts, async_op):
        return self._exchange(sendbuf, recvbuf, send_counts, recv_counts, "all_to_all_v")

    def _all_reduce(self, sendbuf, recvbuf, op, async_op):
        out = sendbuf if recvbuf is None else recvbuf
        self._comm.allReduce(sendbuf.data.ptr, out.data.ptr, sendbuf.size, self._dtype(sendbuf),
                             self._op(op), self._stream())
        return self._enqueued("all_reduce", out)

    def _reduce_scatter(self, sendbuf, recvbuf, op, recv_counts, async_op):
        if recv_counts is None:
            self._comm.reduceScatter(sendbuf.data.ptr, recvbuf.data.ptr, recvbuf.size,
                                     self._dtype(sendbuf), self._op(op), self._stream())
            return self._enqueued("reduce_scatter", recvbuf)
        # Uneven blocks: NCCL has no reduce_scatter_v; reduce each block to its owner.
        dt, nop, stream, item = self._dtype(sendbuf), self._op(op), self._stream(), sendbuf.itemsize
        displs = np.concatenate(([0], np.cumsum(recv_counts[:-1])))
        self._nccl.groupStart()
        try:
            for root in range(self.size):
                count = int(recv_counts[root])
                if count:
                    dst = recvbuf.data.ptr if root == self.rank else 0
                    self._comm.reduce(sendbuf.data.ptr + int(displs[root]) * item, dst, count,
                                      dt, nop, root, stream)
        finally:
            self._nccl.groupEnd()
        return self._enqueued("reduce_scatter", recvbuf)

    def _all_gather(self, sendbuf, recvbuf, async_op):
        self._comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.size,
                             self._dtype(sendbuf), self._stream())
        return self._enqueued("all_gather", recvbuf)

    def _broadcast(self, buf, root, async_op):
        self._comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, self._stream())
        return self._enqueued("broadcast", buf)

    def _barrier(self, async_op):
        # A one-element all-reduce on the stream, then the host waits on it.
        token = self._cupy.zeros(1, self._cupy.int32)
        self._comm.allReduce(token.data.ptr, token.data.ptr, 1, self._dtype(token),
                             self._op(ReduceOp.SUM), self._stream())
        return self._enqueued("barrier")
