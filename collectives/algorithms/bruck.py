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

from collectives.algorithms import Algorithm, Call
from collectives.pipeline import Segments, exchange_segments
from collectives.types import CollectiveOp

__all__ = ["Bruck", "ALGORITHMS"]


class Bruck(Algorithm):
    """Bruck et al. (1997) index algorithm."""

    name = "bruck"
    ops = frozenset({CollectiveOp.ALL_TO_ALL})

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
