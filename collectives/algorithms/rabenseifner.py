"""Rabenseifner's ReduceScatter and AllReduce: recursive halving, then doubling.

Members fold to a power of two first (the first ``2 * rem`` members pair up
and the even one of each pair hands its vector to the odd one). The
``pof2`` remaining "virtual" members then halve: in step ``d = pof2/2, ...,
1`` each exchanges half of its current range with the member ``d`` away and
reduces the half it keeps, so after ``log2 pof2`` steps each holds one
fully reduced segment, having moved ``n (pof2 - 1) / pof2`` elements instead
of the ring's ``p - 1`` steps. AllReduce then doubles the segments back
(the same exchanges in reverse, received straight into the output) and
unfolds to the even members. Received halves come in chunks through
staging buffers and are reduced with in-place ufuncs as they arrive.

ReduceScatter keeps its partial sums in a workspace as large as the input,
so it declines inputs larger than the staging budget (``STAGING_BUFFERS``
chunks); the ring takes those.
"""
from __future__ import annotations

import collections

from collectives import alphabeta as ab
from collectives import settings
from collectives.algorithms import Algorithm, Call
from collectives.algorithms.ring import block_bounds, even_counts
from collectives.chunking import transfer
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Rabenseifner", "halving_reduce_scatter", "doubling_all_gather",
           "reduce_scatter_seconds", "all_reduce_seconds", "ALGORITHMS"]


def reduce_scatter_seconds(req: Request, fab: FabricModel) -> float:
    """Fold the extra ranks in, halve the vector ``log2`` times reducing on arrival,
    hand the folded ranks their blocks."""
    n = req.nbytes
    return (ab.fold(fab, n, True) + ab.halving_steps(fab, n, True)
            + ab.fold(fab, req.max_block or n / fab.size, False))


def all_reduce_seconds(req: Request, fab: FabricModel, pipelined: bool = True,
                       overhead: bool = True) -> float:
    """Fold and unfold, recursive halving then doubling of the whole vector.
    ``pipelined=False, overhead=False``: one message per step, issued by a library."""
    n = req.nbytes
    return (ab.fold(fab, n, True, pipelined, overhead)
            + ab.fold(fab, n, False, pipelined, overhead)
            + ab.halving_steps(fab, n, True, pipelined, overhead)
            + ab.halving_steps(fab, n, False, pipelined, overhead))


def _virtual(m: int):
    """``(pof2, rem, vrank_of_position, position_of_vrank)``; folded members get -1."""
    pof2 = 1 << (m.bit_length() - 1)
    rem = m - pof2
    vof = [(pos // 2 if pos % 2 else -1) if pos < 2 * rem else pos - rem for pos in range(m)]
    pos_of = [2 * v + 1 if v < rem else v + rem for v in range(pof2)]
    return pof2, rem, vof, pos_of


def _segments(bounds, rem: int, pof2: int):
    """Element range of each virtual member: a pair's two blocks, or one block."""
    out = []
    for v in range(pof2):
        if v < rem:
            out.append((bounds[2 * v][0], bounds[2 * v + 1][1]))
        else:
            out.append(bounds[v + rem])
    return out


def _swap_reduce(call: Call, peer: int, send_view, cur, acc, lo: int, hi: int, tag: int):
    """Send ``send_view`` to ``peer`` while receiving its copy of ``[lo, hi)`` and
    reducing it into ``acc[lo:hi] = cur[lo:hi] (op) received``, chunk by chunk."""
    pool, policy = call.pool, call.policy
    dtype = acc.dtype
    ufunc = call.reducer(dtype)
    chunk, depth, lanes = policy.elems(call.is_inter(peer)), policy.depth, policy.lanes
    sends = [call.isend(send_view[a:a + chunk], peer, tag + (i % lanes))
             for i, a in enumerate(range(0, send_view.size, chunk))]
    pieces = [(a, min(hi, a + chunk)) for a in range(lo, hi, chunk)]
    posted: collections.deque = collections.deque()

    def post(i):
        a, b = pieces[i]
        buf = pool.take(b - a, dtype)
        posted.append((a, b, buf, call.irecv(buf, peer, tag + (i % lanes))))

    for i in range(min(depth, len(pieces))):
        post(i)
    nxt = len(posted)
    while posted:
        a, b, buf, h = posted.popleft()
        yield (h,)
        ufunc(cur[a:b], buf, out=acc[a:b])
        pool.give(buf)
        if nxt < len(pieces):
            post(nxt)
            nxt += 1
    for h in sends:
        yield (h,)


def halving_reduce_scatter(call: Call, members, src, acc, bounds, *, tag: int):
    """Generator: fold, then recursive halving. Returns (via StopIteration value)
    ``(vrank, pof2, rem, segments)``; virtual member ``vrank`` then holds the
    reduced ``acc[segments[vrank]]`` (vrank -1: this member folded out)."""
    m = len(members)
    me = members.index(call.rank)
    pof2, rem, vof, pos_of = _virtual(m)
    n = src.size
    cur = src
    if me < 2 * rem:
        if me % 2 == 0:  # hand the whole vector to the odd partner
            yield from transfer(call, [(members[me + 1], src)], [], tag)
        else:
            yield from _swap_reduce(call, members[me - 1], src[0:0], src, acc, 0, n, tag)
            cur = acc
    v = vof[me]
    segs = _segments(bounds, rem, pof2)
    if v < 0:
        return v, pof2, rem, segs
    lo_v, hi_v, d, step = 0, pof2, pof2 // 2, 1
    while d >= 1:
        partner = members[pos_of[v ^ d]]
        mid = lo_v + d
        if v & d:
            send_lo, send_hi, lo_v = lo_v, mid, mid
        else:
            send_lo, send_hi, hi_v = mid, hi_v, mid
        s_a, s_b = segs[send_lo][0], segs[send_hi - 1][1]
        k_a, k_b = segs[lo_v][0], segs[hi_v - 1][1]
        yield from _swap_reduce(call, partner, cur[s_a:s_b], cur, acc, k_a, k_b,
                                tag + step * 16)
        cur = acc
        d //= 2
        step += 1
    if cur is not acc:  # a group of one: nothing was exchanged
        a, b = segs[v]
        acc[a:b] = src[a:b]
    return v, pof2, rem, segs


def doubling_all_gather(call: Call, members, buf, v: int, pof2: int, rem: int, segs,
                        *, tag: int):
    """Generator: recursive doubling of the virtual segments in ``buf``, then unfold
    (odd pair members hand the whole result to the even ones)."""
    me = members.index(call.rank)
    _, _, _, pos_of = _virtual(len(members))
    if v >= 0:
        lo_v, hi_v, d, step = v, v + 1, 1, 1
        while d < pof2:
            partner = members[pos_of[v ^ d]]
            p_lo = lo_v + d if (v & d) == 0 else lo_v - d
            p_hi = p_lo + (hi_v - lo_v)
            mine = buf[segs[lo_v][0]:segs[hi_v - 1][1]]
            theirs = buf[segs[p_lo][0]:segs[p_hi - 1][1]]
            yield from transfer(call, [(partner, mine)], [(partner, theirs)], tag + step * 16)
            lo_v, hi_v = min(lo_v, p_lo), max(hi_v, p_hi)
            d *= 2
            step += 1
    if me < 2 * len(members) - 2 * pof2:
        if me % 2:
            yield from transfer(call, [(members[me - 1], buf)], [], tag)
        else:
            yield from transfer(call, [], [(members[me + 1], buf)], tag)


class Rabenseifner(Algorithm):
    """Recursive halving ReduceScatter (+ recursive doubling AllGather for AllReduce)."""

    name = "rabenseifner"
    ops = frozenset({CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE})
    order = 30

    def formula(self, request: Request, fabric: FabricModel) -> float:
        if request.op is CollectiveOp.REDUCE_SCATTER:
            return reduce_scatter_seconds(request, fabric)
        return all_reduce_seconds(request, fabric)

    def rounding_steps(self, request: Request, fabric: FabricModel) -> int:
        """``ceil(log2 p)``: a fold step (groups of no power of two) and ``log2`` of the
        largest power of two not above ``p`` halving steps."""
        return ab.log2ceil(int(request.group_size))

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        reason = super().supports(request, fabric)
        if reason is None and request.op is CollectiveOp.REDUCE_SCATTER:
            budget = settings.staging_buffers() * max(fabric.intra.chunk_bytes,
                                                      fabric.inter.chunk_bytes)
            if request.nbytes > budget:
                reason = (f"its workspace ({request.nbytes} bytes) would exceed the staging "
                          f"budget ({budget} bytes = NEOCOMM_STAGING_BUFFERS chunks)")
        return reason

    def run(self, call: Call):
        members = list(range(call.size))
        if call.op is CollectiveOp.ALL_REDUCE:
            bounds = block_bounds(even_counts(call.sendbuf.size, call.size))
            acc = call.recvbuf
            v, pof2, rem, segs = yield from halving_reduce_scatter(
                call, members, call.sendbuf, acc, bounds, tag=call.tags(0))
            yield from doubling_all_gather(call, members, acc, v, pof2, rem, segs,
                                           tag=call.tags(8))
            return
        bounds = block_bounds(call.recv_counts)
        acc = call.xp.empty_like(call.sendbuf)
        v, pof2, rem, segs = yield from halving_reduce_scatter(
            call, members, call.sendbuf, acc, bounds, tag=call.tags(0))
        me = call.rank
        lo, hi = bounds[me]
        if v >= 0:
            if me < 2 * rem:  # odd member of a pair: hand the even one its block
                e_lo, e_hi = bounds[me - 1]
                yield from transfer(call, [(me - 1, acc[e_lo:e_hi])], [], call.tags(15))
            call.recvbuf[:] = acc[lo:hi]
        else:
            yield from transfer(call, [], [(me + 1, call.recvbuf)], call.tags(15))


ALGORITHMS = (Rabenseifner(),)
