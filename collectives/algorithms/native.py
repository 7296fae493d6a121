"""The backend's own collective (MPI's or NCCL's), as one plug-in among the others.

For ManyToMany it is one dense AlltoAll(v) with zero counts for the ranks
that exchange nothing; for a OneToMany of one payload to every other rank,
the backend's broadcast. A blocking call uses the backend's blocking
collective (MPI's tuned algorithms), an ``async_op=True`` call its
non-blocking twin.
"""
from __future__ import annotations

import numpy as np

from collectives import alphabeta as ab
from collectives.algorithms import (Algorithm, Call, binomial, chain, displs, pairwise,
                                    rabenseifner, ring)
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Native", "ALGORITHMS", "host_datatype", "doubling_all_reduce",
           "MPI_RABENSEIFNER_BYTES"]

#: bytes from which an MPI library reduces a host vector by Rabenseifner's algorithm
#: (recursive halving, then doubling; the ranks above the largest power of two fold
#: in first and get the result last), whatever the group's size: Open MPI 5's tuned
#: component picks it (``coll_tuned_decision_fixed.c``, commutative operations) from
#: 256 KiB at 2 and 3 ranks, from 8 KiB at 4 to 15, and from 256 KiB or less at every
#: larger size; MPICH's default (``reduce_scatter_allgather``) from 2 KiB. Below it the
#: libraries' picks differ by size and group, and the model takes the cheapest.
MPI_RABENSEIFNER_BYTES = 256 << 10


class Native(Algorithm):
    """The backend's collective call."""

    name = "native"
    ops = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V,
                     CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE,
                     CollectiveOp.ALL_GATHER, CollectiveOp.BROADCAST,
                     CollectiveOp.MANY_TO_MANY, CollectiveOp.ONE_TO_MANY})
    order = 10

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """The classic schedules a library picks from (pairwise AlltoAll(v), ring
        ReduceScatter and AllGather, the cheapest of ring and Rabenseifner AllReduce and,
        for MPI on host buffers, recursive doubling (Open MPI's and MPICH's pick for
        small vectors: ``log2 p`` steps where Rabenseifner takes twice as many), the
        cheaper of binomial and chain Broadcast), one message per step and no Python
        step overhead; ManyToMany as the dense AlltoAll(v) of the same bytes. MPI's
        AllReduce of a host vector of :data:`MPI_RABENSEIFNER_BYTES` or more is the
        Rabenseifner schedule the library runs, cheapest or not: in a group that is not
        a power of two its fold and unfold move the whole vector twice more (3 ranks:
        three times the vector on the critical path, where a ring moves 4/3 of it)."""
        op = request.op
        if op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V):
            return pairwise.pairwise_seconds(request, fabric, overhead=False)
        if op is CollectiveOp.REDUCE_SCATTER:
            return ring.reduce_scatter_seconds(request, fabric, pipelined=False,
                                               overhead=False)
        if op is CollectiveOp.ALL_REDUCE:
            # (a fabric of GPUs, NVLink or PCIe within nodes, moves device buffers over
            # NCCL, whatever the request says: the planner prices its calls without it)
            mpi_host = not request.device and fabric.intra.kind not in ("nvlink", "pcie")
            if mpi_host and request.nbytes >= MPI_RABENSEIFNER_BYTES:
                return rabenseifner.all_reduce_seconds(request, fabric, pipelined=False,
                                                       overhead=False)
            rings = (ring.reduce_scatter_seconds(request, fabric, pipelined=False,
                                                 overhead=False)
                     + ring.all_gather_seconds(request.nbytes, fabric, overhead=False))
            best = min(rings, rabenseifner.all_reduce_seconds(request, fabric, pipelined=False,
                                                              overhead=False))
            return best if request.device else min(best, doubling_all_reduce(request, fabric))
        if op is CollectiveOp.ALL_GATHER:
            return ring.all_gather_seconds(request.nbytes, fabric, overhead=False)
        if op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY):
            return min(binomial.binomial_seconds(request, fabric, overhead=False),
                       chain.chain_seconds(request, fabric, overhead=False))
        if op is CollectiveOp.MANY_TO_MANY:
            dense = Request(CollectiveOp.ALL_TO_ALL_V, request.nbytes, request.itemsize,
                            fabric.size, max_block=request.max_block)
            return pairwise.pairwise_seconds(dense, fabric, overhead=False)
        raise ValueError(f"native: no cost formula for {op.value}")

    def supports(self, request, fabric) -> str | None:
        reason = super().supports(request, fabric)
        if reason is None and request.op is CollectiveOp.ONE_TO_MANY and (
                not request.identical or request.peers != request.group_size - 1):
            reason = "a OneToMany is the backend's broadcast only for one payload to " \
                     "every other rank"
        if reason is None and not request.device:
            reason = _count_reason(request)
        return reason

    def run(self, call: Call):
        b, op, kw = call.backend, call.op, {"async_op": not call.blocking}
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
        elif op is CollectiveOp.ONE_TO_MANY:  # one payload to every other rank
            binomial.local_copy(call)  # (the root among the receivers keeps its own copy)
            root = call.root
            h = b.broadcast(call.sendbuf if call.rank == root else call.recvbuf, root=root,
                            **kw)
        elif op is CollectiveOp.MANY_TO_MANY:
            yield from _dense_many_to_many(call, kw)
            return
        else:  # pragma: no cover - supports() keeps other ops away
            raise ValueError(f"native: no backend call for {op.value}")
        yield (h,)

    def fast(self, call: Call, blocking: bool = True):
        """MPI's own call as the MPI backend makes it directly
        (:meth:`~neocomm.backends.mpi.MpiBackend.direct`), for a repeated call on host
        buffers of a dtype with a predefined MPI datatype, or None (see
        :mod:`collectives.plan`): the blocking collective, or (``blocking=False``) its
        non-blocking twin, whose request the callable returns.

        The callable takes the buffers as the API call holds them —
        ``(sendbuf, recvbuf)``, or ``(buf,)`` for a one-buffer call (broadcast,
        in-place all-reduce) — and holds no reference to them.
        """
        if host_datatype(call) is None or \
                max(_size(call.sendbuf), _size(call.recvbuf)) > INT_MAX:
            return None  # (a buffer beyond MPI's int counts goes through the backend)
        op, kw = call.op, {"blocking": blocking}
        buf = call.sendbuf if call.sendbuf is not None else call.recvbuf
        direct, dtype = call.backend.direct, buf.dtype
        if op is CollectiveOp.ALL_TO_ALL:
            return direct("all_to_all", dtype, **kw)
        if op is CollectiveOp.ALL_TO_ALL_V:
            return direct("all_to_all_v", dtype, counts=(call.send_counts, call.send_displs,
                                                         call.recv_counts, call.recv_displs),
                          **kw)
        if op is CollectiveOp.MANY_TO_MANY:  # MPI_Alltoallv, blocks where they lie
            p = call.size
            sc, sd, rc, rd = [0] * p, [0] * p, [0] * p, [0] * p
            for peer, n, at in zip(call.send_peers, call.send_counts, call.send_displs):
                sc[peer], sd[peer] = int(n), int(at)
            for peer, n, at in zip(call.recv_peers, call.recv_counts, call.recv_displs):
                rc[peer], rd[peer] = int(n), int(at)
            return direct("all_to_all_v", dtype, counts=(sc, sd, rc, rd), **kw)
        if op is CollectiveOp.ALL_REDUCE:  # in place: called with (buf,)
            return direct("all_reduce", dtype, reduce_op=call.reduce_op,
                          in_place=call.recvbuf is call.sendbuf, **kw)
        if op is CollectiveOp.REDUCE_SCATTER:
            counts = call.recv_counts
            uniform = bool((counts == counts[0]).all())
            return direct("reduce_scatter", dtype, reduce_op=call.reduce_op,
                          counts=None if uniform else counts, **kw)
        if op is CollectiveOp.ALL_GATHER:
            return direct("all_gather", dtype, **kw)
        if op is CollectiveOp.BROADCAST or (op is CollectiveOp.ONE_TO_MANY
                                             and call.root not in call.members):
            return direct("broadcast", dtype, root=call.root, **kw)  # (sendbuf,) or (recvbuf,)
        return None


def doubling_all_reduce(request: Request, fabric: FabricModel) -> float:
    """Recursive-doubling AllReduce as an MPI library runs it: the extra ranks of a
    group that is not a power of two fold in, then ``log2`` steps each swap the whole
    vector with the rank ``d`` away and reduce it, then the folded ranks get the result."""
    n, core = request.nbytes, ab.pow2_floor(fabric.size)
    total, d = 0.0, core // 2
    while d >= 1:
        hop = ab.link(fabric, ab.pair_step_is_inter(fabric, d), fabric.ranks_per_node)
        total += ab.stream(n, hop, fabric, reduce=True, overhead=False, pipelined=False)
        d //= 2
    return (total + ab.fold(fabric, n, True, pipelined=False, overhead=False)
            + ab.fold(fabric, n, False, pipelined=False, overhead=False))


#: MPI's counts and displacements are C ints
INT_MAX = 2**31 - 1


def _count_reason(request) -> str | None:
    """Why MPI's own call cannot take ``request``'s counts (C ints), or None. AllReduce
    and Broadcast are elementwise: the MPI backend cuts them into calls that fit."""
    op = request.op
    if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.BROADCAST):
        return None
    item = max(1, request.itemsize)
    block = request.max_block // item
    total = request.nbytes // item
    if block > INT_MAX:
        return f"MPI counts are C ints: a block of {block} elements is more than 2^31 - 1"
    if op in (CollectiveOp.ALL_TO_ALL_V, CollectiveOp.MANY_TO_MANY, CollectiveOp.ALL_GATHER,
              CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_TO_ALL) and total > INT_MAX:
        return (f"MPI counts and displacements are C ints: {total} elements in one call "
                f"are more than 2^31 - 1")
    return None


def _size(buf) -> int:
    return 0 if buf is None else int(buf.size)


def host_datatype(call: Call):
    """The predefined MPI datatype of ``call``'s elements when it moves host (NumPy)
    buffers over the MPI backend, else None."""
    from neocomm.backends.mpi import predefined_datatype
    from neocomm.types import BackendKind

    if call.xp.__name__ != "numpy" or call.backend.kind is not BackendKind.MPI:
        return None
    buf = call.sendbuf if call.sendbuf is not None else call.recvbuf
    return predefined_datatype(buf.dtype)


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
