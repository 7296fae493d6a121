"""Hierarchical 2-D AlltoAll(v): aggregate inside the node, then one stream per
remote node over the rail.

Rank ``(a, i)`` (node ``a``, local rank ``i``) is the relay of rail ``i``:
for every remote node ``b`` it collects, from each rank ``(a, k)`` of its
node, the block ``(a, k) -> (b, i)`` and sends the concatenation to
``(b, i)`` as one aggregated stream. A node therefore puts ``N - 1``
streams per rail on the network instead of ``(N - 1) * L`` messages per
rank: fewer, larger network messages, which is what wins when blocks are
small and the network's per-message cost is high.

Memory stays bounded: the aggregate is assembled chunk by chunk in staging
buffers (chunks of the inter-node link class) — intra-node senders cut
their blocks at the relay's chunk boundaries and each piece lands directly
in place — and each chunk leaves over the rail as soon as it is complete.
Received aggregates land straight in the output when the sending node's
ranks are consecutive in the group (else via staging). Blocks within the
node go directly. Needs at least two nodes of equal size with at least two
ranks each.
"""
from __future__ import annotations

import collections

import numpy as np

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.chunking import transfer
from collectives.pipeline import Segments
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["HierarchicalAllToAll", "hierarchical_shape_reason", "ALGORITHMS"]


def hierarchical_shape_reason(fabric: FabricModel) -> str | None:
    """Why a two-level (intra-node, then rail) algorithm cannot run on ``fabric``'s
    shape, or None: it needs at least 2 nodes of at least 2 ranks."""
    if fabric.nodes < 2:
        return "needs at least 2 nodes"
    if fabric.ranks_per_node < 2:
        return "needs at least 2 ranks per node"
    return None


class HierarchicalAllToAll(Algorithm):
    """Intra-node aggregation, then one stream per (rail, remote node)."""

    name = "hierarchical"
    ops = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V})
    order = 40

    def shape_reason(self, op: CollectiveOp, fabric: FabricModel,
                     group_size: int | None = None) -> str | None:
        return hierarchical_shape_reason(fabric)

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """Intra-node messages of ``nodes`` blocks, ``nodes - 1`` rail streams of
        ``ranks_per_node`` blocks (the node's ranks share its NICs), and three local
        passes over the data (pack, regroup, unpack)."""
        p, per_node, nodes = fabric.size, fabric.ranks_per_node, fabric.nodes
        block = request.max_block or request.nbytes / p
        intra = (per_node - 1) * ab.stream(nodes * block, ab.link(fabric, False, per_node), fabric,
                                           pipelined=False)
        inter = (nodes - 1) * ab.stream(per_node * block, ab.link(fabric, True, per_node),
                                        fabric, pipelined=False)
        return intra + inter + ab.copy(fabric, 3 * request.nbytes)

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        reason = super().supports(request, fabric)
        if reason is None and not request.uniform_nodes:
            reason = "needs nodes with equal numbers of ranks"
        return reason

    def run(self, call: Call):
        layout, me = call.layout, call.rank
        a, i = layout.node[me], layout.local[me]
        nodes, n_nodes = layout.nodes, len(layout.nodes)
        counts = _count_matrix(call)
        sd, rd = call.send_displs, call.recv_displs
        send, recv = call.sendbuf, call.recvbuf
        # Blocks within the node go directly.
        local = nodes[a]
        recv[rd[me]:rd[me] + call.recv_counts[me]] = send[sd[me]:sd[me] + call.send_counts[me]]
        yield from transfer(
            call, [(j, send[sd[j]:sd[j] + call.send_counts[j]]) for j in local if j != me],
            [(k, recv[rd[k]:rd[k] + call.recv_counts[k]]) for k in local if k != me],
            call.tags(0))
        for t in range(1, n_nodes):
            b, c = (a + t) % n_nodes, (a - t) % n_nodes
            yield from _step(call, counts, nodes[a], nodes[b], nodes[c], i)


def _count_matrix(call: Call) -> np.ndarray:
    """``counts[x, y]``: elements group rank ``x`` sends to ``y`` (every rank's row)."""
    p = call.size
    if call.op is CollectiveOp.ALL_TO_ALL:
        return np.full((p, p), int(call.send_counts[0]), np.int64)
    matrix = np.empty((p, p), np.int64)
    mine = np.ascontiguousarray(call.send_counts, np.int64)
    call.group.backend(mine).direct("all_gather", mine.dtype)(mine, matrix)  # host: MPI
    return matrix


def _step(call: Call, counts, mine, dest, source, i: int):
    """One remote node: relay ``mine -> dest[i]``, receive ``source[i] -> me``."""
    me, xp_dtype = call.rank, call.sendbuf.dtype
    pool, policy = call.pool, call.policy
    chunk, depth, lanes = policy.inter, policy.depth, policy.lanes
    send, sd = call.sendbuf, call.send_displs
    tag_piece, tag_rail = call.tags(1), call.tags(2)
    target, origin = dest[i], source[i]
    # What I relay to ``target``: blocks (mine[k] -> target), k in node order.
    out_len = counts[list(mine), target]
    out_off = np.concatenate(([0], np.cumsum(out_len)))
    # My pieces for the other relays of my node, cut at their chunk boundaries.
    my_k = list(mine).index(me)
    intra_sends = []
    for j, relay in enumerate(mine):
        if relay == me:
            continue
        lens = counts[list(mine), dest[j]]
        lo = int(lens[:my_k].sum())
        hi = lo + int(lens[my_k])
        base = int(sd[dest[j]])
        pos = lo
        while pos < hi:
            stop = min(hi, (pos // chunk + 1) * chunk)
            intra_sends.append(call.isend(send[base + pos - lo:base + stop - lo], relay,
                                          tag_piece))
            pos = stop
    # What I receive from ``origin``: blocks (source[k] -> me).
    in_segs = Segments(call.recvbuf, call.recv_displs[list(source)],
                       call.recv_counts[list(source)])
    in_direct = in_segs.contiguous()
    total_out, total_in = int(out_off[-1]), in_segs.total
    n_out, n_in = -(-total_out // chunk), -(-total_in // chunk)
    assembling: collections.deque = collections.deque()  # (q, staging, handles)
    rail_sends: collections.deque = collections.deque()  # (handle, staging)
    rail_recvs: collections.deque = collections.deque()  # (q, lo, hi, buf, handle)
    next_out = next_in = 0

    def assemble(q):
        lo, hi = q * chunk, min(total_out, (q + 1) * chunk)
        buf = pool.take(hi - lo, xp_dtype)
        handles = []
        for k, sender in enumerate(mine):
            s_lo, s_hi = max(lo, int(out_off[k])), min(hi, int(out_off[k + 1]))
            if s_lo >= s_hi:
                continue
            if sender == me:
                base = int(sd[target]) + s_lo - int(out_off[k])
                buf[s_lo - lo:s_hi - lo] = send[base:base + s_hi - s_lo]
            else:
                handles.append(call.irecv(buf[s_lo - lo:s_hi - lo], sender, tag_piece))
        assembling.append((q, buf, handles))

    def post_in(q):
        lo, hi = q * chunk, min(total_in, (q + 1) * chunk)
        buf = in_direct[lo:hi] if in_direct is not None else pool.take(hi - lo, xp_dtype)
        rail_recvs.append((q, lo, hi, buf, call.irecv(buf, origin, tag_rail + q % lanes)))

    while True:
        while next_out < n_out and len(assembling) + len(rail_sends) < depth:
            assemble(next_out)
            next_out += 1
        # Complete chunks leave over the rail in order (before waiting on anything).
        while assembling and all(h.done or h.test() for h in assembling[0][2]):
            q, buf, _ = assembling.popleft()
            rail_sends.append((call.isend(buf, target, tag_rail + q % lanes), buf))
        # (a transport in stream order receives only once this node's sends are out)
        while next_in < n_in and len(rail_recvs) < depth and (
                policy.ahead or (next_out == n_out and not assembling)):
            post_in(next_in)
            next_in += 1
        done_sends = [x for x in rail_sends if x[0].done or x[0].test()]
        for _, buf in done_sends:
            pool.give(buf)
        done_recvs = [x for x in rail_recvs if x[4].done or x[4].test()]
        for _, lo, hi, buf, _ in done_recvs:
            if in_direct is None:
                in_segs.scatter(lo, hi, buf)
                pool.give(buf)
        if done_sends:
            rail_sends = collections.deque(x for x in rail_sends if not x[0].done)
        if done_recvs:
            rail_recvs = collections.deque(x for x in rail_recvs if not x[4].done)
        if done_sends or done_recvs:
            continue
        waiting = [h for _, _, hs in assembling for h in hs if not h.done]
        waiting += [h for h, _ in rail_sends] + [r[4] for r in rail_recvs]
        if not waiting:
            if assembling or next_out < n_out or next_in < n_in:
                continue
            break
        yield tuple(waiting)
    for h in intra_sends:
        yield (h,)


ALGORITHMS = (HierarchicalAllToAll(),)
