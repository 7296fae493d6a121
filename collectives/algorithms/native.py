"""The backend's own collective (MPI's or NCCL's), as one plug-in among the others.

For ManyToMany it is one dense AlltoAll(v) with zero counts for the ranks
that exchange nothing. A blocking call uses the backend's blocking
collective (MPI's tuned algorithms), an ``async_op=True`` call its
non-blocking twin.
"""
from __future__ import annotations

import functools

import numpy as np

from neocomm import watchdog

from collectives.algorithms import Algorithm, Call, displs
from collectives.types import CollectiveOp

__all__ = ["Native", "ALGORITHMS"]


class Native(Algorithm):
    """The backend's collective call."""

    name = "native"
    ops = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V,
                     CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE,
                     CollectiveOp.ALL_GATHER, CollectiveOp.BROADCAST,
                     CollectiveOp.MANY_TO_MANY})

    def run(self, call: Call):
        b, op, kw = call.backend, call.op, {"async_op": not call.blocking, "validate": False}
        if op is CollectiveOp.ALL_TO_ALL:
            h = b.all_to_all(call.sendbuf, call.recvbuf, **kw)
        elif op is CollectiveOp.ALL_TO_ALL_V:
            h = b.all_to_all_v(call.sendbuf, call.recvbuf, send_counts=call.send_counts,
                               recv_counts=call.recv_counts, **kw)
        elif op is CollectiveOp.REDUCE_SCATTER:
            counts = call.recv_counts
            uniform = bool((counts == counts[0]).all())
            h = b.reduce_scatter(call.sendbuf, call.recvbuf, op=call.reduce_op,
                                 recv_counts=None if uniform else counts, **kw)
        elif op is CollectiveOp.ALL_REDUCE:
            in_place = call.recvbuf is call.sendbuf
            h = b.all_reduce(call.sendbuf, None if in_place else call.recvbuf,
                             op=call.reduce_op, **kw)
        elif op is CollectiveOp.ALL_GATHER:
            h = b.all_gather(call.sendbuf, call.recvbuf, **kw)
        elif op is CollectiveOp.BROADCAST:
            h = b.broadcast(call.recvbuf, root=call.root, **kw)
        elif op is CollectiveOp.MANY_TO_MANY:
            yield from _dense_many_to_many(call, kw)
            return
        else:  # pragma: no cover - supports() keeps other ops away
            raise ValueError(f"native: no backend call for {op.value}")
        yield (h,)

    def fast(self, call: Call):
        """A direct mpi4py call for a repeated blocking call on host buffers of a
        dtype mpi4py maps by itself (None otherwise): see :mod:`collectives.plans`."""
        from neocomm.types import BackendKind

        buf = call.sendbuf if call.sendbuf is not None else call.recvbuf
        if (call.xp.__name__ != "numpy" or call.backend.kind is not BackendKind.MPI
                or buf.dtype.name not in _AUTO_TYPES):
            return None
        from mpi4py import MPI

        comm, op, s, r = call.group.comm, call.op, call.sendbuf, call.recvbuf
        mop = getattr(MPI, call.reduce_op.name) if call.reduce_op is not None else None
        if op is CollectiveOp.ALL_TO_ALL:
            fn = functools.partial(comm.Alltoall, s, r)
        elif op is CollectiveOp.ALL_TO_ALL_V:
            fn = functools.partial(
                comm.Alltoallv, [s, (call.send_counts.tolist(), call.send_displs.tolist())],
                [r, (call.recv_counts.tolist(), call.recv_displs.tolist())])
        elif op is CollectiveOp.ALL_REDUCE:
            fn = functools.partial(comm.Allreduce, MPI.IN_PLACE if r is s else s, r, mop)
        elif op is CollectiveOp.REDUCE_SCATTER:
            counts = call.recv_counts
            if bool((counts == counts[0]).all()):
                fn = functools.partial(comm.Reduce_scatter_block, s, r, mop)
            else:
                fn = functools.partial(comm.Reduce_scatter, s, r, counts.tolist(), mop)
        elif op is CollectiveOp.ALL_GATHER:
            fn = functools.partial(comm.Allgather, s, r)
        elif op is CollectiveOp.BROADCAST:
            fn = functools.partial(comm.Bcast, r, call.root)
        else:
            return None
        what = op.value

        def run():
            with watchdog.guard(what):
                fn()

        return run


#: dtypes whose MPI datatype mpi4py infers from the buffer itself.
_AUTO_TYPES = frozenset({"float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                         "uint16", "uint32", "uint64"})


def _dense_many_to_many(call: Call, kw):
    """ManyToMany as one AlltoAll(v): counts are zero for the ranks without traffic."""
    xp, p = call.xp, call.size
    send_counts = np.zeros(p, np.int64)
    recv_counts = np.zeros(p, np.int64)
    send_counts[call.send_peers] = call.send_counts
    recv_counts[call.recv_peers] = call.recv_counts
    sendbuf, recvbuf = call.sendbuf, call.recvbuf
    send_sorted = _ascending(call.send_peers)
    recv_sorted = _ascending(call.recv_peers)
    if not send_sorted:  # pack in rank order
        packed = xp.empty_like(sendbuf)
        dense_off = displs(send_counts)
        for peer, off, n in zip(call.send_peers, call.send_displs, call.send_counts):
            packed[dense_off[peer]:dense_off[peer] + n] = sendbuf[off:off + n]
        sendbuf = packed
    target = recvbuf if recv_sorted else xp.empty_like(recvbuf)
    h = call.backend.all_to_all_v(sendbuf, target, send_counts=send_counts,
                                  recv_counts=recv_counts, **kw)
    yield (h,)
    if not recv_sorted:
        dense_off = displs(recv_counts)
        for peer, off, n in zip(call.recv_peers, call.recv_displs, call.recv_counts):
            recvbuf[off:off + n] = target[dense_off[peer]:dense_off[peer] + n]


def _ascending(peers) -> bool:
    peers = np.asarray(peers)
    return bool(peers.size < 2 or (np.diff(peers) > 0).all())


ALGORITHMS = (Native(),)
