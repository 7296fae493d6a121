"""AlltoAllv: an exchange whose counts may change from call to call.

Its plan (:class:`~collectives.plan.VPlan`) is kept only when both counts
are given; a call without ``recv_counts`` learns them every time (one small
AlltoAll), as ``MPI_Alltoallv`` callers do. See :func:`all_to_all_v`.
"""
from __future__ import annotations

import weakref
import zlib
from typing import Sequence

import numpy as np

from neocomm import watchdog
from neocomm.agree import Problem
from collectives.algorithms import displs
from collectives.arrays import foreign_arrays
from collectives.api import (_apart, _call, _check_out, _flat, _replay, _request, _shown,
                             _total)
from collectives.plan import (MISS, OP_CODES, VPlan, _agreements, _raise_here, allocator, build,
                              context, remember, stale)
from collectives.state import state_of
from collectives.types import CollectiveOp
from collectives.validate import check_buffer, check_counts, same_memory
from collectives.validate import dtype_code_of as _dcode

__all__ = ["all_to_all_v"]


@foreign_arrays("sendbuf", "recvbuf")
def all_to_all_v(sendbuf, send_counts: Sequence[int], recvbuf=None,
                 recv_counts: Sequence[int] | None = None, *, group=None,
                 async_op: bool = False, algo: str | None = None,
                 chunk_bytes: int | None = None):
    """AlltoAll with ``send_counts[j]`` elements to rank ``j``, packed in rank order.

    Shape contract: ``sum(send_counts) == sendbuf.size``. Without
    ``recv_counts`` the counts are exchanged (one small AlltoAll) and the
    result is allocated; with them they must match what the peers send
    (checked when ``NEOCOMM_CHECK_ARGS`` is on). Example, 2 ranks::

        rank 0: sendbuf [a0 | a1 a2], send_counts [1, 2]  ->  [a0 | b0 b1 b2], recv_counts [1, 3]
        rank 1: sendbuf [b0 b1 b2 | ], send_counts [3, 0] ->  [a1 a2 | ],     recv_counts [2, 0]

    Returns ``(recvbuf, recv_counts)`` (or a handle whose ``wait()`` returns them).
    """
    state = state_of(group)
    if recv_counts is None:
        out = _learn(state, sendbuf, send_counts, recvbuf, async_op, algo, chunk_bytes)
        if out is not MISS:
            return out
    key = _key("given", algo, chunk_bytes, sendbuf, recvbuf, send_counts, recv_counts)
    out = _replay(state, key, sendbuf, recvbuf, async_op)
    if out is not MISS:
        return out
    return _all_to_all_v(state, sendbuf, send_counts, recvbuf, recv_counts, async_op, algo,
                         chunk_bytes, key)


def _key(kind: str, algo, chunk_bytes, sendbuf, recvbuf, send_counts, recv_counts=()):
    """The cache key of an AlltoAllv layout: ``kind`` ``"given"`` (the caller's recv
    counts), ``"send"`` (the send side of a call that learns them) or ``"learned"``;
    None when an argument cannot be a key (the call's checks then say why)."""
    if kind == "given" and recv_counts is None:
        return None
    try:
        return ("all_to_all_v", kind, algo, chunk_bytes, sendbuf.dtype, sendbuf.size,
                None if recvbuf is None else recvbuf.size, _counts_key(send_counts),
                _counts_key(recv_counts))
    except (AttributeError, TypeError):
        return None


def _counts_key(counts):
    """Counts as part of a key: an array's dtype and bytes (quick to hash), a sequence's
    values."""
    if type(counts) is np.ndarray:
        return counts.dtype.char, counts.tobytes()
    return tuple(counts)


class _Sender:
    """The checked send side of an AlltoAllv that learns its recv counts: a call of the
    same layout agrees and exchanges the counts without checking its arguments again
    (buffers other than the last ones proved are checked on the spot)."""

    __slots__ = ("ctx", "agreements", "sc", "sizes", "key", "_check", "_refs")

    def __init__(self, ctx, agreements, sc, sizes, sendbuf, recvbuf):
        self.ctx, self.agreements, self.sc, self.sizes = ctx, agreements, sc, sizes
        self.key, self._check = None, ctx.check
        self._refs = (weakref.ref(sendbuf), None if recvbuf is None else weakref.ref(recvbuf))

    def accept(self, sendbuf, recvbuf) -> bool:
        """Whether ``sendbuf`` and ``recvbuf`` are valid for this send side."""
        if self._check is not self.ctx.state.check:
            return False
        last_send, last_recv = self._refs
        if last_send() is sendbuf and (recvbuf is None or last_recv() is recvbuf):
            return True
        dev = self.ctx.backend.device
        if check_buffer("sendbuf", sendbuf, device=dev) is not None:
            return False
        if recvbuf is not None and (_check_out(sendbuf, recvbuf, dev) is not None
                                    or same_memory(sendbuf, recvbuf)):
            return False
        self._refs = (weakref.ref(sendbuf), None if recvbuf is None else weakref.ref(recvbuf))
        return True


def _learn(state, sendbuf, send_counts, recvbuf, async_op, algo, chunk_bytes):
    """An AlltoAllv without recv counts whose send side a call of this layout checked
    already: agreed, counts exchanged, and run on the plan of the counts learned (made
    once per counts); :data:`MISS` when the call is new."""
    skey = _key("send", algo, chunk_bytes, sendbuf, recvbuf, send_counts)
    sender = None if skey is None else state.plans.get(skey)
    if sender is None or not sender.accept(sendbuf, recvbuf):
        return MISS
    ctx, agreements = sender.ctx, sender.agreements
    out = agreements[int(bool(async_op))].run(ctx.group.comm, None, sizes=sender.sizes)
    return _v_resume(ctx, agreements, sendbuf, recvbuf, sender.sc, None, out, async_op, algo,
                     chunk_bytes, None)


def _v_signature(sendbuf, recvbuf, recv_counts, async_op, algo, chunk_bytes) -> list:
    """What every rank's AlltoAllv call must share (its counts differ by design)."""
    forced = 0 if algo is None else (zlib.crc32(str(algo).encode()) & 0x7FFFFFFF) | 1
    return [("op", OP_CODES[CollectiveOp.ALL_TO_ALL_V]), ("dtype", _dcode(sendbuf)),
            ("recv_counts given", int(recv_counts is not None)),
            ("recvbuf given", int(recvbuf is not None)),
            ("algo", forced), ("chunk_bytes", chunk_bytes if isinstance(chunk_bytes, int)
                                else -1)]


def _all_to_all_v(state, sendbuf, send_counts, recvbuf, recv_counts, async_op, algo,
                  chunk_bytes, key, run: bool = True):
    """A new AlltoAllv call: checked, agreed with the largest send sizes, counts exchanged
    when unknown or when checks are on, then selected and run (leaving its plan under
    ``key`` when there is one)."""
    op = CollectiveOp.ALL_TO_ALL_V
    ctx = context(None, sendbuf, op.value, state)
    p, dev = ctx.group.size, ctx.backend.device
    problem = check_buffer("sendbuf", sendbuf, device=dev)
    sc = np.zeros(p, np.int64)
    if problem is None:
        problem, sc = check_counts("send_counts", send_counts, p, sendbuf.size, "sendbuf")
    rc = None
    if recv_counts is not None:
        prc, rc = check_counts("recv_counts", recv_counts, p, _total(recv_counts, recvbuf),
                               "recvbuf")
        problem = problem or prc
    if problem is None and recvbuf is not None:
        problem = _check_out(sendbuf, recvbuf, dev)
    if problem is None:
        sendbuf = _apart(sendbuf, recvbuf)
    call = _call("all_to_all_v", sendbuf, f"counts {_shown(send_counts)}", async_op=async_op)
    agreements = _agreements(op.value, _v_signature(sendbuf, recvbuf, recv_counts, async_op,
                                                    algo, chunk_bytes), call, ctx.group)
    sizes = (int(sc.sum()), int(sc.max(initial=0))) if problem is None else (0, 0)
    # Agree on the call before the counts move: a rank in another collective (or in this
    # one with async_op different) is named now instead of meeting the exchange.
    out = agreements[int(bool(async_op))].run(ctx.group.comm, problem, fresh=1, sizes=sizes)
    if recv_counts is None and run:
        remember(state, _key("send", algo, chunk_bytes, sendbuf, recvbuf, send_counts),
                 _Sender(ctx, agreements, sc, sizes, sendbuf, recvbuf))
    return _v_resume(ctx, agreements, sendbuf, recvbuf, sc, rc, out, async_op, algo,
                     chunk_bytes, key, run)


def _v_resume(ctx, agreements, sendbuf, recvbuf, sc, rc, out, async_op, algo, chunk_bytes,
              key, run: bool = True):
    """An AlltoAllv from its agreement on: ``out`` is the agreed vector."""
    op, comm, p = CollectiveOp.ALL_TO_ALL_V, ctx.group.comm, ctx.group.size
    known = rc is not None
    if not known or (ctx.check and stale(out)):  # exchange the counts: to learn or check them
        offered = np.empty(p, np.int64)
        with watchdog.guard("all_to_all_v (exchange of the counts)"):
            ctx.group.backend(sc).direct("all_to_all", sc.dtype)(sc, offered)  # host: MPI
        problem = None
        if not known:
            rc = offered
            if recvbuf is not None and recvbuf.size != int(rc.sum()):
                problem = Problem("recvbuf", f"recvbuf: the peers send {int(rc.sum())} "
                                             f"elements, recvbuf holds {recvbuf.size}")
        elif not np.array_equal(offered, rc):
            i = int(np.flatnonzero(offered != rc)[0])
            problem = Problem("recv_counts", f"recv_counts[{i}] is {int(rc[i])} but rank {i} "
                                             f"sends {int(offered[i])}")
        if ctx.check and (known or recvbuf is not None):  # a problem found now: together
            check = agreements[int(bool(async_op))]
            check.run(comm, problem)
        elif problem is not None:
            _raise_here(ctx.group.rank, op.value, problem)
    itemsize = sendbuf.dtype.itemsize
    total, block = int(out[4]), int(out[5])
    if not known:  # the plan of the counts learned, when a call made it for these sizes
        key = _key("learned", algo, chunk_bytes, sendbuf, recvbuf, sc, rc)
        plan = ctx.state.plans.get(key)
        if plan is not None and plan.sizes == (total, block):
            bufs = plan.accept(sendbuf, recvbuf)
            if bufs is not MISS:
                return plan.first(bufs, async_op)
    request = _request(ctx, op, total * itemsize, itemsize, max_block=block * itemsize,
                       uniform=False)
    alloc = allocator(ctx.xp, int(rc.sum()))
    if recvbuf is None:
        recvbuf = alloc(sendbuf)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_counts=sc,
                  recv_counts=rc, send_displs=displs(sc), recv_displs=displs(rc))

    def resume(bufs, agreed, async_again):  # a plan selected anew replaces this one
        return _v_resume(ctx, agreements, bufs[0], bufs[1], sc, rc, agreed, async_again,
                         algo, chunk_bytes, key)

    plan = build(ctx, request, None, [], algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, extra=(rc,), agreements=agreements, kind=VPlan,
                 sizes=(total, block), resume=resume, alloc=alloc)
    remember(ctx.state, key, plan)
    if not run:
        return plan, (sendbuf, recvbuf)
    return plan.first((sendbuf, recvbuf), async_op)
