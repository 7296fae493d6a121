"""Direct OneToMany: the root sends every receiver its payload itself.

The only algorithm for distinct payloads (the broadcast data reader of the
DLRM papers hands each trainer its own slice of the batch); for identical
payloads it wins when there are few receivers.
"""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.algorithms.binomial import local_copy
from collectives.chunking import transfer
from collectives.progress import MpiRequest
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Direct", "ALGORITHMS"]


class Direct(Algorithm):
    """Root-to-receiver messages, chunked per link class."""

    name = "direct"
    ops = frozenset({CollectiveOp.ONE_TO_MANY})
    order = 5

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """One message per receiver from the root, one after the other."""
        receivers = request.peers if request.peers else fabric.size - 1
        latency, bandwidth, _ = ab.link(fabric, fabric.nodes > 1, 1)
        return receivers * (latency + fabric.step_overhead + request.nbytes / bandwidth)

    def run(self, call: Call):
        mpi = self.fast(call, call.blocking)
        if mpi is not None:  # MPI's own call: the same one a plan's direct call makes
            out = mpi(*_role_buffers(call))
            if not call.blocking:
                yield (MpiRequest(out),)
            return
        local_copy(call)
        root = call.root
        if call.rank == root:
            sends = []
            for i, peer in enumerate(call.members):
                if peer == root:
                    continue
                if call.identical:
                    sends.append((peer, call.sendbuf))
                else:
                    a = int(call.send_displs[i])
                    sends.append((peer, call.sendbuf[a:a + int(call.send_counts[i])]))
            yield from transfer(call, sends, [], call.tags(0))
        elif call.rank in call.members:
            yield from transfer(call, [], [(root, call.recvbuf)], call.tags(0))

    def fast(self, call: Call, blocking: bool = True):
        """The root's messages as one MPI call on host buffers (the MPI backend's
        :meth:`~neocomm.backends.mpi.MpiBackend.direct` call) when every rank of the
        group takes part (the root and the receivers: MPI's collective needs all of
        them): distinct payloads as ``MPI_Scatterv`` (the root's own part included), an
        identical payload as ``MPI_Bcast`` (when the root is not among the receivers);
        ``blocking=False``: the ``MPI_I…`` twin, whose request the callable returns.
        None otherwise. :meth:`run` makes the same call, so that every rank runs the
        same MPI operation whether its plan takes this direct call or not. The callable
        takes the rank's buffers: ``(sendbuf,)`` or ``(sendbuf, recvbuf)`` on the root,
        ``(recvbuf,)`` on a receiver."""
        from collectives.algorithms.native import INT_MAX, host_datatype

        members, root, p = list(call.members), call.root, call.size
        if set(members) | {root} != set(range(p)) or \
                (call.identical and root in members):
            return None
        if host_datatype(call) is None:
            return None
        buf = call.sendbuf if call.sendbuf is not None else call.recvbuf
        direct = call.backend.direct
        if call.identical:
            return direct("broadcast", buf.dtype, root=root, blocking=blocking)
        counts, displs = [0] * p, [0] * p
        for peer, n, at in zip(members, call.send_counts, call.send_displs):
            counts[peer], displs[peer] = int(n), int(at)
        if sum(counts) > INT_MAX:  # (the same on every rank: the counts are agreed)
            return None
        return direct("scatter_v", buf.dtype, root=root, counts=(counts, displs),
                      blocking=blocking)


def _role_buffers(call: Call) -> tuple:
    """The buffers :meth:`Direct.fast`'s callable takes on this rank."""
    if call.rank == call.root:
        return (call.sendbuf,) if call.recvbuf is None else (call.sendbuf, call.recvbuf)
    return (call.recvbuf,)


ALGORITHMS = (Direct(),)
