"""Pipelined-chain Broadcast and OneToMany (identical payload).

The members form a chain from the root; the payload is cut into segments
and member ``q`` forwards segment ``k`` to ``q + 1`` as soon as it has it,
so ``n - 2 + k`` segment times move the payload through ``n`` members:
bandwidth-optimal for large payloads. The number of segments minimises
the alpha-beta time (:func:`collectives.alphabeta.chain_segments`); segments are
never smaller than one chunk of the link.
"""
from __future__ import annotations

from collectives import alphabeta as ab
from collectives.alphabeta import chain_segments
from collectives.algorithms import Call
from collectives.algorithms.binomial import _TreeBase, tree_broadcast, tree_member, tree_members
from collectives.types import FabricModel, Request

__all__ = ["Chain", "chain_seconds", "ALGORITHMS"]


def chain_seconds(req: Request, fab: FabricModel, overhead: bool = True) -> float:
    """``members - 2 + k`` segment times of ``alpha + nbytes / k / bandwidth``, ``k``
    from :func:`~collectives.alphabeta.chain_segments`. ``overhead=False``: steps
    issued by a library, not Python."""
    members = tree_members(req, fab)
    if members < 2 or req.nbytes == 0:
        return 0.0
    latency, bandwidth, chunk = ab.link(fab, fab.nodes > 1, 1)
    alpha = latency + (fab.step_overhead if overhead else 0.0)
    segments = chain_segments(req.nbytes, members, alpha, bandwidth, chunk)
    return (members - 2 + segments) * (alpha + req.nbytes / segments / bandwidth)


class Chain(_TreeBase):
    """Pipelined chain (a tree of fan-out one)."""

    name = "chain"
    order = 30

    def formula(self, request: Request, fabric: FabricModel) -> float:
        return chain_seconds(request, fabric)

    def run(self, call: Call):
        found = tree_member(call)
        if found is None:
            return
        members, pos, buf = found
        fabric = call.fabric
        inter = fabric.nodes > 1
        link = fabric.inter if inter else fabric.intra
        itemsize = buf.dtype.itemsize
        chunk = call.policy.elems(inter)
        segments = chain_segments(buf.size * itemsize, len(members),
                                  link.latency + fabric.step_overhead, link.bandwidth,
                                  chunk * itemsize)
        seg = max(chunk, -(-buf.size // max(1, segments))) if buf.size else 1
        parent = members[pos - 1] if pos > 0 else None
        children = [members[pos + 1]] if pos + 1 < len(members) else []
        yield from tree_broadcast(call, buf, parent, children, seg, tag=call.tags(0))


ALGORITHMS = (Chain(),)
