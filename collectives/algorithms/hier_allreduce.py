"""Hierarchical AllReduce: reduce inside each node, across nodes over the rails,
then gather inside each node.

1. ReduceScatter among the ranks of a node (pipelined ring): local rank
   ``i`` holds the node's sum of slice ``i`` of the vector.
2. AllReduce of slice ``i`` among the local-rank-``i`` ranks of every node
   (the rail): ring or Rabenseifner, whichever the cost model prefers for
   the rail's shape. Each rail carries ``1 / ranks_per_node`` of the data,
   so with one NIC per GPU every NIC works at once.
3. AllGather among the ranks of a node (ring), straight into the output.

When the input and output are symmetric memory on a node (the same slice of
one :mod:`collectives.symmetric` allocation on each of its ranks; the
members exchange what they hold, so they decide alike), steps 1 and 3 on
that node are loads instead of messages: local rank ``i`` reduces slice
``i`` straight from its node peers' inputs, and after the rail step copies
the other slices from their owners' outputs. Nodes decide independently;
the rail step is the same either way.

Needs at least two nodes of equal size with at least two ranks each.
"""
from __future__ import annotations

import numpy as np

from collectives import alphabeta as ab
from collectives import symmetric
from collectives.algorithms import Algorithm, Call, lookup
from collectives.algorithms import rabenseifner, ring
from collectives.algorithms.hier_alltoall import hierarchical_shape_reason
from collectives.algorithms.rabenseifner import doubling_all_gather, halving_reduce_scatter
from collectives.algorithms.ring import (block_bounds, even_counts, ring_all_gather,
                                         ring_reduce_scatter)
from collectives.algorithms.symmetric import all_pairs, reduce_into
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["HierarchicalAllReduce", "ALGORITHMS"]


class HierarchicalAllReduce(Algorithm):
    """Intra-node ReduceScatter, inter-node AllReduce per rail, intra-node AllGather."""

    name = "hierarchical"
    ops = frozenset({CollectiveOp.ALL_REDUCE})
    order = 40

    def shape_reason(self, op: CollectiveOp, fabric: FabricModel,
                     group_size: int | None = None) -> str | None:
        return hierarchical_shape_reason(fabric)

    def rounding_steps(self, request: Request, fabric: FabricModel) -> int:
        """Ring ReduceScatter in the node (``ranks_per_node - 1``; one when the node's
        buffers are symmetric), then a ring or Rabenseifner AllReduce over the
        rails (at most ``nodes - 1``)."""
        return max(0, fabric.ranks_per_node - 1) + max(0, fabric.nodes - 1)

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """Ring ReduceScatter in the node, the cheaper of ring and Rabenseifner
        AllReduce of ``1 / ranks_per_node`` of the data over each rail (one NIC share
        per rail), ring AllGather in the node."""
        per_node, nodes, n = fabric.ranks_per_node, fabric.nodes, request.nbytes
        local = fabric.with_shape(per_node, 1)
        rail = FabricModel(ranks_per_node=1, nodes=nodes, intra=fabric.intra,
                           inter=fabric.inter.__class__(fabric.inter.latency,
                                                        ab.inter_bandwidth(fabric, per_node),
                                                        fabric.inter.chunk_bytes),
                           nics_per_node=1, copy_bandwidth=fabric.copy_bandwidth,
                           reduce_bandwidth=fabric.reduce_bandwidth,
                           step_overhead=fabric.step_overhead)
        shard = Request(CollectiveOp.ALL_REDUCE, int(n / per_node), request.itemsize, nodes)
        rail_ar = min(ring.all_reduce_seconds(shard, rail),
                      rabenseifner.all_reduce_seconds(shard, rail))
        scatter = Request(CollectiveOp.REDUCE_SCATTER, n, request.itemsize, per_node)
        return (ring.reduce_scatter_seconds(scatter, local) + rail_ar
                + ring.all_gather_seconds(n, local))

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        reason = super().supports(request, fabric)
        if reason is None and not request.uniform_nodes:
            reason = "needs nodes with equal numbers of ranks"
        return reason

    def run(self, call: Call):
        layout = call.layout
        node_members = list(layout.nodes[layout.node[call.rank]])
        local = layout.local[call.rank]
        rail = [members[local] for members in layout.nodes]
        n, per_node = call.sendbuf.size, len(node_members)
        bounds = block_bounds(even_counts(n, per_node))
        out = call.recvbuf
        inputs, outputs = yield from _node_symmetric(call, node_members)
        lo, hi = bounds[local]
        if inputs is not None:  # the node's buffers are symmetric: load, do not send
            reduce_into(call, [v[lo:hi] for v in inputs], out[lo:hi], first=local)
        else:
            yield from ring_reduce_scatter(call, node_members, call.sendbuf, bounds, acc=out,
                                           tag=call.tags(0))
        piece = out[lo:hi]
        rail_bounds = block_bounds(even_counts(hi - lo, len(rail)))
        if _rail_prefers_ring(call, hi - lo):
            yield from ring_reduce_scatter(call, rail, piece, rail_bounds, acc=piece,
                                           tag=call.tags(1))
            yield from ring_all_gather(call, rail, piece, rail_bounds, tag=call.tags(3))
        else:
            v, pof2, rem, segs = yield from halving_reduce_scatter(
                call, rail, piece, piece, rail_bounds, tag=call.tags(2))
            yield from doubling_all_gather(call, rail, piece, v, pof2, rem, segs,
                                           tag=call.tags(8))
        if inputs is not None:
            yield from all_pairs(call, 14, _NOTHING, node_members)  # every slice is final
            for j, view in enumerate(outputs):
                if j != local:
                    a, b = bounds[j]
                    out[a:b] = view[a:b]
            yield from all_pairs(call, 12, _NOTHING, node_members)  # peers are done reading
        else:
            yield from ring_all_gather(call, node_members, out, bounds, tag=call.tags(15))


_NOTHING = np.zeros(0, np.int64)


def _node_symmetric(call: Call, node_members):
    """The peers' views of the input and output on this node when every member's
    buffers are the same slice of one symmetric allocation, else ``(None, None)``.
    The members exchange what they hold (host buffers only), so they all decide
    alike; the exchange also tells each that the others' inputs are ready."""
    if call.xp is not np:
        return None, None
    inputs, outputs, check = symmetric.node_views(call.group, node_members, call.sendbuf,
                                                  call.recvbuf)
    got = yield from all_pairs(call, 13, np.array(check, np.int64), node_members)
    if inputs is None or not (got == got[0]).all():
        return None, None
    return inputs, outputs


def _rail_prefers_ring(call: Call, count: int) -> bool:
    fabric = call.fabric
    rail = FabricModel(ranks_per_node=1, nodes=fabric.nodes, intra=fabric.intra,
                       inter=fabric.inter, nics_per_node=fabric.nics_per_node,
                       copy_bandwidth=fabric.copy_bandwidth,
                       reduce_bandwidth=fabric.reduce_bandwidth,
                       step_overhead=fabric.step_overhead)
    request = Request(CollectiveOp.ALL_REDUCE, count * call.sendbuf.dtype.itemsize,
                      call.sendbuf.dtype.itemsize, fabric.nodes)
    return (lookup(CollectiveOp.ALL_REDUCE, "ring").cost(request, rail)
            <= lookup(CollectiveOp.ALL_REDUCE, "rabenseifner").cost(request, rail))


ALGORITHMS = (HierarchicalAllReduce(),)
