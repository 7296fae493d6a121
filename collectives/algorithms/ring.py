"""Ring ReduceScatter, AllReduce (ReduceScatter then AllGather) and AllGather.

The ring visits the members in group order, so on node-contiguous groups
only one flow per node crosses the network. ReduceScatter runs ``m - 1``
steps; in step ``s`` member ``i`` sends block ``i - s - 1`` (its partial
sum so far) to ``i + 1`` and receives block ``i - s - 2`` from ``i - 1``.
Every block is cut into chunks and the ring is pipelined per chunk: chunk
``k`` of a block is reduced (with an in-place ufunc) and forwarded as soon
as it has arrived, while chunk ``k + 1`` is on the wire, so the reduction
hides behind the transfer instead of following it. Received chunks land in
bounded staging buffers; partial sums of AllReduce accumulate in the output
buffer itself, those of ReduceScatter in the staging buffer that is then
sent on. Results do not depend on the chunk size: every element is reduced
in the same order (around the ring) whatever the chunking.
"""
from __future__ import annotations

import collections

import numpy as np

from collectives import alphabeta as ab
from collectives.algorithms import Algorithm, Call
from collectives.pipeline import Window
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Ring", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "block_bounds",
           "reduce_scatter_seconds", "all_gather_seconds", "all_reduce_seconds",
           "ALGORITHMS"]


def block_bounds(counts) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``counts`` elements."""
    out, pos = [], 0
    for c in counts:
        out.append((pos, pos + int(c)))
        pos += int(c)
    return out


def ring_reduce_scatter(call: Call, members, src, bounds, *, acc=None, final=None,
                        tag: int):
    """Generator: pipelined ring ReduceScatter among ``members`` (group ranks, ring order).

    ``bounds[m]`` is the element range of member ``m``'s block in ``src``.
    With ``acc`` (a full-length buffer, may be ``src`` itself) partial sums
    accumulate there and this member's reduced block ends in
    ``acc[bounds[me]]``; without it, in staging, and the block ends in
    ``final``. ``src`` is only read (unless it is ``acc``).
    """
    m = len(members)
    if m == 1:
        lo, hi = bounds[0]
        if acc is not None and acc is not src:
            acc[lo:hi] = src[lo:hi]
        elif acc is None:
            final[:] = src[lo:hi]
        return
    pool, dtype = call.pool, src.dtype
    ufunc = call.reducer(dtype)
    me = members.index(call.rank)
    my_lo = bounds[me][0]

    def own(a, b):
        return src[a:b], None

    def target(s, a, b):
        buf = pool.take(b - a, dtype)
        return buf, (lambda: pool.give(buf))

    def arrived(s, a, b, buf):
        """Reduce a received chunk; return (what to forward or None, its release)."""
        last = s == m - 2
        if acc is not None:
            ufunc(src[a:b], buf, out=acc[a:b])
            pool.give(buf)
            return (None, None) if last else (acc[a:b], None)
        if last:
            ufunc(src[a:b], buf, out=final[a - my_lo:b - my_lo])
            pool.give(buf)
            return None, None
        ufunc(buf, src[a:b], out=buf)
        return buf, (lambda: pool.give(buf))

    yield from _ring_pass(call, members, bounds, tag, own, target, arrived, shift=1)


def ring_all_gather(call: Call, members, buf, bounds, *, tag: int):
    """Generator: ring AllGather in place in ``buf``: member ``i``'s block
    ``buf[bounds[i]]`` must hold its data on entry; every block holds on exit.
    Chunks are received straight into ``buf`` and forwarded as they arrive."""
    m = len(members)
    if m == 1:
        return

    def own(a, b):
        return buf[a:b], None

    def target(s, a, b):
        return buf[a:b], None

    def arrived(s, a, b, view):
        return (None, None) if s == m - 2 else (view, None)

    yield from _ring_pass(call, members, bounds, tag, own, target, arrived, shift=0)


def ring_all_reduce(call: Call, members, src, acc, bounds, *, tag: int):
    """Generator: ring AllReduce as one pipelined pass of ``2 (m - 1)`` steps.

    The first ``m - 1`` steps are the ReduceScatter (received chunks reduced
    into ``acc``), the next ``m - 1`` the AllGather (received straight into
    ``acc``). A chunk goes on to the AllGather as soon as it is fully
    reduced, so the gathering of chunk ``k`` overlaps the reduction of the
    chunks after it instead of waiting for the whole ReduceScatter.
    """
    m = len(members)
    if m == 1:
        if acc is not src:
            acc[:] = src
        return
    pool, dtype = call.pool, src.dtype
    ufunc = call.reducer(dtype)

    def own(a, b):
        return src[a:b], None

    def target(s, a, b):
        if s < m - 1:
            buf = pool.take(b - a, dtype)
            return buf, (lambda: pool.give(buf))
        return acc[a:b], None

    def arrived(s, a, b, view):
        if s < m - 1:
            ufunc(src[a:b], view, out=acc[a:b])
            pool.give(view)
            return acc[a:b], None
        return (None, None) if s == 2 * m - 3 else (view, None)

    yield from _ring_pass(call, members, bounds, tag, own, target, arrived, shift=1,
                          steps=2 * (m - 1))


def _ring_pass(call: Call, members, bounds, tag, own, target, arrived, *, shift: int,
               steps: int | None = None):
    """The schedule shared by ring ReduceScatter (``shift=1``), AllGather (0) and
    AllReduce (``shift=1``, ``2 (m - 1)`` steps).

    In step ``s`` member ``i`` sends block ``i - s - shift`` and receives
    block ``i - s - shift - 1`` (mod ``m``); what it receives in step ``s``
    it sends on in step ``s + 1``. Work goes chunk-major: chunk ``k`` of every
    step before chunk ``k + 1``, each received chunk processed by
    ``arrived`` and forwarded at once. A member's own blocks (step 0) travel
    under one tag, forwarded chunks under another, so own chunks can be
    posted ahead without breaking the order of either stream. Sends in
    flight are bounded (``depth + 1``), which cannot deadlock: a member
    never waits for a send before having posted the receives its left
    neighbour's earlier chunks need.
    """
    m = len(members)
    me = members.index(call.rank)
    right, left = members[(me + 1) % m], members[(me - 1) % m]
    policy = call.policy
    chunk = min(policy.elems(call.is_inter(right)), policy.elems(call.is_inter(left)))
    lanes, depth = min(policy.lanes, 8), policy.depth
    tag_own, tag_fwd = tag, tag + 8
    steps = m - 1 if steps is None else steps
    send_block = [(me - s - shift) % m for s in range(steps)]
    recv_block = [(me - s - shift - 1) % m for s in range(steps)]

    def piece(block, k):
        lo, hi = bounds[block]
        a = lo + k * chunk
        return (a, min(hi, a + chunk)) if a < hi else None

    nchunks = max(-(-(hi - lo) // chunk) for lo, hi in bounds)
    order = [(k, s) for k in range(nchunks) for s in range(steps)
             if piece(recv_block[s], k) is not None]
    own_order = [k for k in range(nchunks) if piece(send_block[0], k) is not None]
    posted: collections.deque = collections.deque()
    sends = Window(depth + 1)
    counters = {"recv": 0, "own": 0, "fwd": 0, "recv_fwd": 0}

    def post_recv():
        k, s = order[counters["recv"]]
        a, b = piece(recv_block[s], k)
        view, release = target(s, a, b)
        if s == 0:
            t = tag_own + k % lanes
        else:
            t = tag_fwd + counters["recv_fwd"] % lanes
            counters["recv_fwd"] += 1
        h = call.irecv(view, left, t)
        posted.append((k, s, a, b, view, h))
        counters["recv"] += 1

    def post_own():
        k = own_order[counters["own"]]
        a, b = piece(send_block[0], k)
        view, release = own(a, b)
        counters["own"] += 1
        return call.isend(view, right, tag_own + k % lanes), release

    own_sends: collections.deque = collections.deque()

    def post_own_until(k_limit):
        # Own chunks go out up to ``depth`` chunks ahead of the one being processed.
        while counters["own"] < len(own_order) and own_order[counters["own"]] <= k_limit:
            own_sends.append(post_own())
        while own_sends and own_sends[0][0].test():
            _, release = own_sends.popleft()
            if release is not None:
                release()

    for _ in range(min(depth, len(order))):
        post_recv()
    post_own_until(depth - 1)
    while posted:
        k, s, a, b, view, h = posted.popleft()
        post_own_until(k + depth)
        yield (h,)
        fwd, release = arrived(s, a, b, view)
        if fwd is not None:
            t = tag_fwd + counters["fwd"] % lanes
            counters["fwd"] += 1
            h = call.isend(fwd, right, t)
            yield from sends.push((h,), release)
        if counters["recv"] < len(order):
            post_recv()
    post_own_until(nchunks)
    while own_sends:
        h, release = own_sends.popleft()
        yield (h,)
        if release is not None:
            release()
    yield from sends.drain()


class Ring(Algorithm):
    """Pipelined ring over the whole group."""

    name = "ring"
    ops = frozenset({CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_REDUCE,
                     CollectiveOp.ALL_GATHER})
    order = 20

    def formula(self, request: Request, fabric: FabricModel) -> float:
        if request.op is CollectiveOp.REDUCE_SCATTER:
            return reduce_scatter_seconds(request, fabric)
        if request.op is CollectiveOp.ALL_REDUCE:
            return all_reduce_seconds(request, fabric)
        return all_gather_seconds(request.nbytes, fabric)

    def run(self, call: Call):
        members = list(range(call.size))
        if call.op is CollectiveOp.REDUCE_SCATTER:
            bounds = block_bounds(call.recv_counts)
            yield from ring_reduce_scatter(call, members, call.sendbuf, bounds,
                                           final=call.recvbuf, tag=call.tags(0))
        elif call.op is CollectiveOp.ALL_REDUCE:
            bounds = block_bounds(even_counts(call.sendbuf.size, call.size))
            yield from ring_all_reduce(call, members, call.sendbuf, call.recvbuf, bounds,
                                       tag=call.tags(0))
        else:
            bounds = block_bounds(call.recv_counts)
            lo, hi = bounds[call.rank]
            call.recvbuf[lo:hi] = call.sendbuf
            yield from ring_all_gather(call, members, call.recvbuf, bounds, tag=call.tags(0))


def reduce_scatter_seconds(req: Request, fab: FabricModel, pipelined: bool = True,
                           overhead: bool = True) -> float:
    """``p - 1`` ring steps of one block (``max_block``, else ``nbytes / p``) each,
    reduced on arrival; a node-ordered ring has one inter-node flow per node.
    ``pipelined=False, overhead=False``: one message per step, issued by a library."""
    p = fab.size
    block = req.max_block or req.nbytes / p
    return (p - 1) * ab.stream(block, ab.ring_link(fab), fab, reduce=True,
                               pipelined=pipelined, overhead=overhead)


def all_gather_seconds(nbytes: float, fab: FabricModel, overhead: bool = True) -> float:
    """``p - 1`` pipelined ring steps of ``nbytes / p`` (``nbytes``: the output)."""
    p = fab.size
    return (p - 1) * ab.stream(nbytes / p, ab.ring_link(fab), fab, overhead=overhead)


def all_reduce_seconds(req: Request, fab: FabricModel) -> float:
    """Ring ReduceScatter, then ring AllGather of the whole buffer."""
    return reduce_scatter_seconds(req, fab) + all_gather_seconds(req.nbytes, fab)


def even_counts(total: int, parts: int) -> np.ndarray:
    """``parts`` block sizes summing to ``total``, as equal as possible."""
    base, extra = divmod(int(total), int(parts))
    counts = np.full(parts, base, np.int64)
    counts[:extra] += 1
    return counts


ALGORITHMS = (Ring(),)
