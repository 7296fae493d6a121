"""Bruck's AlltoAll for small messages: ``ceil(log2 p)`` steps instead of ``p - 1``.

Block ``i`` of this rank's working layout is the block travelling ``i``
ranks forward. In step ``k`` every block whose index has bit ``k`` set
moves ``2^k`` ranks forward in one packed message, so each rank sends about
half its data ``log2 p`` times: fewer, larger messages, paid for with more
bytes on the wire and local packing. The working layout is kept directly in
the receive buffer (block ``i`` at position ``(r - i) mod p``), so no
rotation buffer is needed and every packed message goes through bounded
staging chunks. Equal blocks only (AlltoAll, not AlltoAll(v)).
"""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.pipeline import Segments, exchange_segments
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Bruck", "ALGORITHMS"]


class Bruck(Algorithm):
    """Bruck et al. (1997) index algorithm."""

    name = "bruck"
    ops = frozenset({CollectiveOp.ALL_TO_ALL})
    order = 30

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """``ceil(log2 p)`` steps of half the data each, packed and unpacked, plus the
        initial and final rotation. Step ``k`` sends to ``r + 2^k``: the last ``2^k``
        ranks of every node cross nodes."""
        p, total = fabric.size, 0.0
        half = request.nbytes / 2.0
        for k in range(ab.log2ceil(p)):
            flows = min(fabric.ranks_per_node, 1 << k)
            total += ab.stream(half, ab.link(fabric, fabric.nodes > 1, flows), fabric,
                               pipelined=False)
            total += ab.copy(fabric, 2 * half)
        return total + ab.copy(fabric, 2 * request.nbytes)

    def run(self, call: Call):
        r, p = call.rank, call.size
        send, recv = call.sendbuf, call.recvbuf
        block = int(call.send_counts[0]) if p else 0
        # Phase 1: the block destined to rank r + i lands at position (r - i) mod p.
        for i in range(p):
            dst, pos = (r + i) % p, (r - i) % p
            recv[pos * block:(pos + 1) * block] = send[dst * block:(dst + 1) * block]
        if block == 0:
            return
        k = 0
        while (1 << k) < p:
            d = 1 << k
            moving = [i for i in range(1, p) if i & d]
            starts = [((r - i) % p) * block for i in moving]
            counts = [block] * len(moving)
            segs = Segments(recv, starts, counts)
            yield from exchange_segments(call, (r + d) % p, segs, (r - d) % p,
                                         Segments(recv, starts, counts), call.tags(k),
                                         stage_send=True)
            k += 1


ALGORITHMS = (Bruck(),)
