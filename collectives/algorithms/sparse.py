"""Sparse ManyToMany: messages only between the pairs that exchange data.

Every rank posts a receive per peer that sends to it and a send per peer
it names (chunked per link class, all in flight at once, bounded windows
per message); pairs with nothing to exchange cost nothing, unlike a dense
AlltoAll(v) that visits every rank.
"""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.chunking import transfer
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Sparse", "ALGORITHMS"]


class Sparse(Algorithm):
    """Point-to-point messages between named peers only."""

    name = "sparse"
    ops = frozenset({CollectiveOp.MANY_TO_MANY})
    order = 5

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """A message latency per peer (``peers``: the most of any rank), the bytes
        once over a link shared by the node's ranks."""
        peers = request.peers if request.peers else fabric.size - 1
        if peers == 0:
            return 0.0
        latency, bandwidth, _ = ab.link(fabric, fabric.nodes > 1, fabric.ranks_per_node)
        return peers * (latency + fabric.step_overhead) + request.nbytes / bandwidth

    def run(self, call: Call):
        me = call.rank
        sends, recvs = [], []
        for peer, off, n in zip(call.send_peers, call.send_displs, call.send_counts):
            view = call.sendbuf[int(off):int(off) + int(n)]
            if peer == me:
                continue
            sends.append((int(peer), view))
        for peer, off, n in zip(call.recv_peers, call.recv_displs, call.recv_counts):
            view = call.recvbuf[int(off):int(off) + int(n)]
            if peer == me:
                s = list(call.send_peers).index(me)
                a = int(call.send_displs[s])
                view[:] = call.sendbuf[a:a + int(call.send_counts[s])]
                continue
            recvs.append((int(peer), view))
        yield from transfer(call, sends, recvs, call.tags(0))


ALGORITHMS = (Sparse(),)
