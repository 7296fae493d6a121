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


ALGORITHMS = (Direct(),)
