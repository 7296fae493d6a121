"""Pairwise-exchange AlltoAll(v): ``p - 1`` steps, in step ``s`` rank ``r``
sends to ``r + s`` and receives from ``r - s`` (mod ``p``).

Every rank talks to one peer at a time, so no link carries more than one
message per direction; large blocks go in chunks of their link class. The
block to self is a local copy. Good for large messages; Bruck and the
hierarchical 2-D algorithm cut the number of messages for small ones.
"""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.chunking import transfer
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Pairwise", "pairwise_seconds", "ALGORITHMS"]


def pairwise_seconds(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    """``p - 1`` unpipelined block messages: those within the node over the intra-node
    link, the others sharing the node's NICs with its other ranks; plus the local copy
    of the block to self. ``overhead=False``: steps issued by a library, not Python."""
    p, per_node = fab.size, fab.ranks_per_node
    block = req.max_block or req.nbytes / p
    intra = (per_node - 1) * ab.stream(block, ab.link(fab, False, per_node), fab,
                                       overhead=overhead, pipelined=False)
    inter = (p - per_node) * ab.stream(block, ab.link(fab, True, per_node), fab,
                                       overhead=overhead, pipelined=False)
    return intra + inter + ab.copy(fab, block)


class Pairwise(Algorithm):
    """Pairwise exchange, chunked per link class."""

    name = "pairwise"
    ops = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V})
    order = 20

    def formula(self, request: Request, fabric: FabricModel) -> float:
        return pairwise_seconds(request, fabric)

    def run(self, call: Call):
        r, p = call.rank, call.size
        sc, rc, sd, rd = call.send_counts, call.recv_counts, call.send_displs, call.recv_displs
        send, recv = call.sendbuf, call.recvbuf
        recv[rd[r]:rd[r] + rc[r]] = send[sd[r]:sd[r] + sc[r]]
        for step in range(1, p):
            dst, src = (r + step) % p, (r - step) % p
            yield from transfer(call, [(dst, send[sd[dst]:sd[dst] + sc[dst]])],
                                [(src, recv[rd[src]:rd[src] + rc[src]])])


ALGORITHMS = (Pairwise(),)
