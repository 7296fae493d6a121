"""Recursive-doubling AllGather for power-of-two groups: ``log2 p`` steps, in
step ``k`` each rank swaps everything it has gathered so far with the rank
``2^k`` away, received straight into the output (no staging)."""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.algorithms.rabenseifner import doubling_all_gather
from collectives.algorithms.ring import block_bounds
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Doubling", "ALGORITHMS"]


class Doubling(Algorithm):
    """Recursive doubling (Thakur, Rabenseifner and Gropp 2005)."""

    name = "doubling"
    ops = frozenset({CollectiveOp.ALL_GATHER})
    order = 30

    def shape_reason(self, op: CollectiveOp, fabric: FabricModel,
                     group_size: int | None = None) -> str | None:
        size = fabric.size if group_size is None else int(group_size)
        if size & (size - 1):
            return f"needs a group whose size is a power of two, got {size} ranks"
        return None

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """``log2 p`` doubling steps; the last moves half the output."""
        return ab.halving_steps(fabric, request.nbytes, False)

    def run(self, call: Call):
        bounds = block_bounds(call.recv_counts)
        lo, hi = bounds[call.rank]
        call.recvbuf[lo:hi] = call.sendbuf
        yield from doubling_all_gather(call, list(range(call.size)), call.recvbuf, call.rank,
                                       call.size, 0, bounds, tag=call.tags(0))


ALGORITHMS = (Doubling(),)
