"""Staged backend: device buffers over MPI through reusable pinned host buffers.

The path for hosts without NCCL, or without GPUDirect (the PyPI MPI wheels
are not CUDA-aware). Each operation runs in pieces: a piece is copied to a
pinned host buffer, moved by the MPI backend, and copied back. The pinned
pool is allocated once (``NEOCOMM_STAGING_BYTES``) and reused, so host
memory does not grow with message size. Piece boundaries are derived from
values every rank knows (sizes, counts), so all ranks run the same number of
pieces. Every copy into a pool piece finishes (the stream is synchronised)
before the piece is reused, since copies from pinned memory are asynchronous.
Non-blocking sends and receives stage whole messages in buffers of their own.
"""
from __future__ import annotations

import numpy as np

from neocomm import config
from neocomm.backends.base import Backend, CompletedHandle, Handle, cuda_availability
from neocomm.backends.mpi import MpiBackend
from neocomm.types import BackendKind

__all__ = ["StagedBackend"]


class StagedBackend(Backend):
    """CuPy buffers over MPI through a pinned host staging pool."""

    kind = BackendKind.STAGED
    device = True

    @classmethod
    def availability(cls):
        return cuda_availability()

    def __init__(self, group, *, xp=None, pool_bytes: int | None = None):
        super().__init__(group)
        if xp is None:
            import cupy as xp
        self._xp = xp
        self._mpi = MpiBackend(group)
        self.pool_bytes = int(pool_bytes or config.get("STAGING_BYTES"))
        self._pool: np.ndarray | None = None

    # -- the staging pool ----------------------------------------------
    def _host(self, dtype, *shapes):
        """Views of the pinned pool, one per shape, laid end to end."""
        if self._pool is None:
            if self._xp is np:
                self._pool = np.empty(self.pool_bytes, np.uint8)
            else:
                mem = self._xp.cuda.alloc_pinned_memory(self.pool_bytes)
                self._pool = np.frombuffer(mem, np.uint8, self.pool_bytes)
        dtype = np.dtype(dtype)
        views, offset = [], 0
        for shape in shapes:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            views.append(self._pool[offset:offset + nbytes].view(dtype).reshape(shape))
            offset += nbytes
        return views

    def _elems(self, itemsize: int, parts: int) -> int:
        """Elements per part when the pool is split into ``parts`` equal parts."""
        return max(1, self.pool_bytes // (itemsize * max(parts, 1)))

    def _d2h(self, src, dst: np.ndarray) -> None:
        if self._xp is np:
            np.copyto(dst, src.reshape(dst.shape))
        else:
            self._xp.ascontiguousarray(src).reshape(dst.shape).get(out=dst)

    def _h2d(self, src: np.ndarray, dst) -> None:
        """Copy host ``src`` into device ``dst`` and wait for it: from pinned memory the
        copy is asynchronous, and the pool piece is overwritten by the next piece."""
        if self._xp is np:
            dst[...] = src.reshape(dst.shape)
            return
        dst[...] = self._xp.asarray(src).reshape(dst.shape)
        self._xp.cuda.get_current_stream().synchronize()

    def _gather_pieces(self, flat, displs, off: int, counts: np.ndarray, host: np.ndarray) -> None:
        """Copy ``counts[j]`` elements from ``flat[displs[j] + off:]`` of each peer block, packed."""
        pos = 0
        for j, count in enumerate(counts):
            if count:
                self._d2h(flat[displs[j] + off:displs[j] + off + count], host[pos:pos + count])
                pos += count

    @staticmethod
    def _pieces(total: int, step: int):
        for off in range(0, total, step):
            yield off, min(step, total - off)

    # -- point to point ----------------------------------------------
    # Blocking calls go piece by piece through the pool. Non-blocking ones cannot share
    # the pool (a peer's matching call may come after other traffic): each stages its
    # message whole in a host buffer of its own and returns at once, so an algorithm
    # that posts a send and then a receive to the same peer never blocks in the send.
    def _send(self, buf, peer, tag, async_op):
        if async_op:
            host = np.empty(buf.size, buf.dtype)
            self._d2h(buf.reshape(-1), host)
            sent = self._mpi.send(host, peer, tag=tag, async_op=True)
            return Handle(sent.wait, sent.test, None)  # the closures keep ``host`` alive
        flat = buf.reshape(-1)
        for off, k in self._pieces(flat.size, self._elems(buf.itemsize, 1)):
            (h,) = self._host(buf.dtype, (k,))
            self._d2h(flat[off:off + k], h)
            self._mpi.send(h, peer, tag=tag)
        return CompletedHandle()

    def _recv(self, buf, peer, tag, async_op):
        if async_op:
            host = np.empty(buf.size, buf.dtype)
            got = self._mpi.recv(host, peer, tag=tag, async_op=True)
            return Handle(got.wait, got.test, buf,
                          on_done=lambda: self._h2d(host, buf.reshape(-1)))
        flat = buf.reshape(-1)
        for off, k in self._pieces(flat.size, self._elems(buf.itemsize, 1)):
            (h,) = self._host(buf.dtype, (k,))
            self._mpi.recv(h, peer, tag=tag)
            self._h2d(h, flat[off:off + k])
        return CompletedHandle(buf)

    # -- collectives --------------------------------------------------
    def _all_to_all(self, sendbuf, recvbuf, async_op):
        n = self.size
        block = sendbuf.size // n
        src, dst = sendbuf.reshape(n, block), recvbuf.reshape(n, block)
        for off, k in self._pieces(block, self._elems(sendbuf.itemsize, 2 * n)):
            hs, hr = self._host(sendbuf.dtype, (n, k), (n, k))
            self._d2h(src[:, off:off + k], hs)
            self._mpi.all_to_all(hs, hr)
            self._h2d(hr, dst[:, off:off + k])
        return CompletedHandle(recvbuf)

    def _all_to_all_v(self, sendbuf, recvbuf, send_counts, recv_counts, async_op):
        n = self.size
        step = self._elems(sendbuf.itemsize, 2 * n)
        # Every rank must run the same number of rounds: agree on the largest count.
        largest = np.array([max(int(send_counts.max(initial=0)), int(recv_counts.max(initial=0)))])
        self._mpi.all_reduce(largest, op="max")
        sdis = np.concatenate(([0], np.cumsum(send_counts)))
        rdis = np.concatenate(([0], np.cumsum(recv_counts)))
        sflat, rflat = sendbuf.reshape(-1), recvbuf.reshape(-1)
        for off in range(0, int(largest[0]), step):
            sc = np.clip(send_counts - off, 0, step)
            rc = np.clip(recv_counts - off, 0, step)
            hs, hr = self._host(sendbuf.dtype, (int(sc.sum()),), (int(rc.sum()),))
            self._gather_pieces(sflat, sdis, off, sc, hs)
            self._mpi.all_to_all_v(hs, hr, send_counts=sc, recv_counts=rc)
            pos = 0
            for i in range(n):
                if rc[i]:
                    self._h2d(hr[pos:pos + rc[i]], rflat[rdis[i] + off:rdis[i] + off + rc[i]])
                    pos += rc[i]
        return CompletedHandle(recvbuf)

    def _all_reduce(self, sendbuf, recvbuf, op, async_op):
        out = sendbuf if recvbuf is None else recvbuf
        src, dst = sendbuf.reshape(-1), out.reshape(-1)
        for off, k in self._pieces(src.size, self._elems(sendbuf.itemsize, 1)):
            (h,) = self._host(sendbuf.dtype, (k,))
            self._d2h(src[off:off + k], h)
            self._mpi.all_reduce(h, op=op)
            self._h2d(h, dst[off:off + k])
        return CompletedHandle(out)

    def _reduce_scatter(self, sendbuf, recvbuf, op, recv_counts, async_op):
        n = self.size
        counts = np.full(n, recvbuf.size, np.int64) if recv_counts is None else recv_counts
        displs = np.concatenate(([0], np.cumsum(counts)))
        step = self._elems(sendbuf.itemsize, n + 1)
        sflat, rflat = sendbuf.reshape(-1), recvbuf.reshape(-1)
        for off in range(0, int(counts.max(initial=0)), step):
            kc = np.clip(counts - off, 0, step)
            hs, hr = self._host(sendbuf.dtype, (int(kc.sum()),), (int(kc[self.rank]),))
            self._gather_pieces(sflat, displs, off, kc, hs)
            self._mpi.reduce_scatter(hs, hr, op=op, recv_counts=kc)
            if kc[self.rank]:
                self._h2d(hr, rflat[off:off + kc[self.rank]])
        return CompletedHandle(recvbuf)

    def _all_gather(self, sendbuf, recvbuf, async_op):
        n, count = self.size, sendbuf.size
        src, dst = sendbuf.reshape(-1), recvbuf.reshape(n, count)
        for off, k in self._pieces(count, self._elems(sendbuf.itemsize, n + 1)):
            hs, hr = self._host(sendbuf.dtype, (k,), (n, k))
            self._d2h(src[off:off + k], hs)
            self._mpi.all_gather(hs, hr)
            self._h2d(hr, dst[:, off:off + k])
        return CompletedHandle(recvbuf)

    def _broadcast(self, buf, root, async_op):
        flat = buf.reshape(-1)
        for off, k in self._pieces(flat.size, self._elems(buf.itemsize, 1)):
            (h,) = self._host(buf.dtype, (k,))
            if self.rank == root:
                self._d2h(flat[off:off + k], h)
            self._mpi.broadcast(h, root=root)
            if self.rank != root:
                self._h2d(h, flat[off:off + k])
        return CompletedHandle(buf)

    def _barrier(self, async_op):
        return self._mpi.barrier(async_op=async_op)
