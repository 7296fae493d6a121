"""Collectives on symmetric memory (:mod:`collectives.symmetric`): loads, not messages.

When a call's buffers lie in a symmetric region, every rank of the group
(one node) can read its peers' buffers in place, so the data never goes
through MPI: ranks synchronise (a small all-reduce that also checks that
every rank passed the same dtype, allocations, offsets and sizes, then
barriers; tagged messages instead for ``async_op=True`` calls) and copy or
reduce straight from the peers' memory.

- AlltoAll: rank ``r`` copies block ``r`` of every peer's send buffer.
- ReduceScatter: rank ``r`` reduces block ``r`` of every send buffer into
  its result, in cache-sized pieces.
- AllReduce, two-shot (the output is symmetric too, or in place): rank
  ``r`` reduces segment ``r`` of every input into its own output, a barrier,
  then it copies the other segments from their owners' outputs. One-shot
  (only the input is symmetric): every rank reduces the whole buffer, in
  the same order everywhere, so the results are bitwise identical.
- AllGather: rank ``r`` copies every peer's send buffer.
- Broadcast: every rank copies the root's buffer.

A last barrier keeps a rank from returning (and overwriting its buffers)
while a peer still reads them. Host memory only; the group must lie within
one node.
"""
from __future__ import annotations

import math

import numpy as np

from neocomm.errors import CollectiveArgumentError
from neocomm.reduction import combine_many
from neocomm.types import ReduceOp

from collectives import alphabeta as ab
from collectives import symmetric as sym
from collectives.algorithms import Algorithm, Call, displs
from collectives.types import CollectiveOp, FabricModel, Request

__all__ = ["Symmetric", "ALGORITHMS", "all_pairs", "reduce_into"]

#: Elements per piece of a multi-peer reduction (the accumulator stays in cache).
_PIECE_BYTES = 256 << 10


def _sync_seconds(fab: FabricModel) -> float:
    """One barrier of the group (dissemination: log2 p shared-memory hops)."""
    return ab.log2ceil(fab.size) * fab.intra.latency + fab.step_overhead


class Symmetric(Algorithm):
    """Direct loads from the peers' symmetric buffers."""

    name = "symmetric"
    ops = frozenset({CollectiveOp.ALL_TO_ALL, CollectiveOp.REDUCE_SCATTER,
                     CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER,
                     CollectiveOp.BROADCAST})
    order = 90

    def shape_reason(self, op: CollectiveOp, fabric: FabricModel,
                     group_size: int | None = None) -> str | None:
        if fabric.nodes > 1:
            return "needs a group within one node (shared memory)"
        return None

    def rounding_steps(self, request: Request, fabric: FabricModel) -> int:
        """One: a rank reduces every input of its segment at once (16-bit floats in
        float32, rounded once)."""
        return min(1, max(0, int(request.group_size) - 1))

    def formula(self, request: Request, fabric: FabricModel) -> float:
        """Direct loads from the peers' symmetric buffers: syncs plus local memory work.

        A copy out of a peer's buffer crosses cores as a shared-memory transfer
        does (intra-node bandwidth); a reduction streams the peers' inputs at the
        reduction throughput, with no transport copy before it. Infinite when
        the send side is not symmetric (the algorithm cannot run)."""
        req, fab = request, fabric
        if not req.symmetric & sym.SEND:
            return math.inf
        p, n, op = fab.size, req.nbytes, req.op
        peer_bw = fab.intra.bandwidth
        if op is CollectiveOp.REDUCE_SCATTER:
            block = req.max_block or n / p
            return 2 * _sync_seconds(fab) + (p - 1) * block / fab.reduce_bandwidth
        if op is CollectiveOp.ALL_REDUCE:
            if req.symmetric & sym.RECV:  # two-shot
                seg = n / p
                return (3 * _sync_seconds(fab) + (p - 1) * seg / fab.reduce_bandwidth
                        + (p - 1) * seg / peer_bw)
            return 2 * _sync_seconds(fab) + (p - 1) * n / fab.reduce_bandwidth
        if op is CollectiveOp.BROADCAST:
            return 2 * _sync_seconds(fab) + n / peer_bw
        block = req.max_block or n / p  # AlltoAll: n is the send buffer; AllGather: the output
        return 2 * _sync_seconds(fab) + (p - 1) * block / peer_bw + ab.copy(fab, block)

    def supports(self, request: Request, fabric: FabricModel) -> str | None:
        reason = super().supports(request, fabric)
        if reason is not None:
            return reason
        if request.device:
            return "host buffers only"
        if not request.symmetric & sym.SEND:
            return ("the buffers are not symmetric memory of this group "
                    "(allocate them with collectives.symmetric.empty)")
        return None

    def run(self, call: Call):
        op = call.op
        yield from _enter(call)
        if op is CollectiveOp.ALL_TO_ALL:
            _all_to_all(call)
        elif op is CollectiveOp.REDUCE_SCATTER:
            lo = int(displs(call.recv_counts)[call.rank])
            n = int(call.recv_counts[call.rank])
            reduce_into(call, [v[lo:lo + n] for v in call.peer_send], call.recvbuf,
                    first=call.rank)
        elif op is CollectiveOp.ALL_GATHER:
            n = call.sendbuf.size
            for q, view in enumerate(call.peer_send):
                call.recvbuf[q * n:(q + 1) * n] = view
        elif op is CollectiveOp.BROADCAST:
            if call.rank != call.root:
                call.recvbuf[...] = call.peer_send[call.root]
        elif call.peer_recv is not None:  # ALL_REDUCE, two-shot
            yield from _all_reduce_two_shot(call)
        else:  # ALL_REDUCE, one-shot
            reduce_into(call, call.peer_send, call.recvbuf, first=0)
        yield from _sync(call, 2)


def _all_to_all(call: Call) -> None:
    r, out = call.rank, call.recvbuf
    for q, view in enumerate(call.peer_send):
        n = int(call.recv_counts[q])
        lo, at = int(call.send_displs[r]), int(call.recv_displs[q])
        out[at:at + n] = view[lo:lo + n]


def _all_reduce_two_shot(call: Call):
    p, r, n = call.size, call.rank, call.recvbuf.size
    seg = -(-n // p)
    a, b = min(n, r * seg), min(n, (r + 1) * seg)
    reduce_into(call, [v[a:b] for v in call.peer_send], call.recvbuf[a:b], first=r)
    yield from _sync(call, 1)
    for q, view in enumerate(call.peer_recv):
        if q != r:
            a, b = min(n, q * seg), min(n, (q + 1) * seg)
            call.recvbuf[a:b] = view[a:b]


def reduce_into(call: Call, inputs, out, first: int) -> None:
    """``out = inputs[first] op inputs[first+1] op ...`` (cyclic order), in pieces;
    ``out`` may be ``inputs[first]`` itself (in place). float16 and bfloat16 accumulate
    in float32 and round once (:func:`neocomm.reduction.combine_many`)."""
    order = [inputs[(first + i) % len(inputs)] for i in range(len(inputs))]
    n = out.size
    piece = n if len(order) == 2 else _PIECE_BYTES // out.itemsize
    combine_many(call.reduce_op, order, out, piece)


def _enter(call: Call):
    """Every rank's inputs are ready, and every rank passed the same dtype,
    allocations, offsets and sizes (else every rank raises)."""
    mine = call.sym_check  # a tuple of ints
    k = len(mine)
    if call.blocking:
        out = np.empty(2 * k, np.int64)
        most = call.backend.direct("all_reduce", _INT64, reduce_op=ReduceOp.MAX)
        most(np.array(mine + tuple(-v for v in mine), np.int64), out)
        both = out.tolist()
        hi, lo = both[:k], [-v for v in both[k:]]
    else:
        got = yield from all_pairs(call, 0, np.array(mine, np.int64))
        lo, hi = got.min(axis=0).tolist(), got.max(axis=0).tolist()
    if lo != hi:
        fields = ("dtype", "send allocation", "send offset", "send bytes",
                  "receive allocation", "receive offset", "receive bytes")
        bad = [fields[i] for i in range(k) if lo[i] != hi[i]]
        msg = (f"{call.op.value}: symmetric buffers differ across ranks ({', '.join(bad)}): "
               f"every rank must pass the same slice of the same symmetric allocation")
        raise CollectiveArgumentError(msg, op=call.op.value, field="sendbuf")


def _sync(call: Call, phase: int):
    """A barrier of the group. Blocking: MPI's. Asynchronous: tagged messages, since
    a background operation's steps interleave with other calls in an order that
    differs across ranks, and MPI matches collectives by their order."""
    if call.blocking:
        call.backend.direct("barrier", None)()
    else:
        yield from all_pairs(call, phase, _NOTHING)


_NOTHING = np.zeros(0, np.int64)
_INT64 = np.dtype(np.int64)


def all_pairs(call: Call, phase: int, payload: np.ndarray, members=None):
    """Send ``payload`` to every peer (every other rank of ``members``, group
    ranks; default the group) and receive theirs; returns them, one row per
    member in ``members`` order (yielding the requests, so that the waits
    drive other operations too)."""
    members = range(call.size) if members is None else members
    me = call.rank
    got = np.empty((len(members), payload.size), np.int64)
    tag = call.tags(phase)
    handles = []
    for i, q in enumerate(members):
        if q == me:
            got[i] = payload
        else:
            handles.append(call.irecv(got[i], q, tag))
            handles.append(call.isend(payload, q, tag))
    for handle in handles:
        if not handle.test():
            yield (handle,)
    return got


ALGORITHMS = (Symmetric(),)
