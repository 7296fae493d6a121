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
from collectives import settings
from collectives.algorithms import displs
from collectives.arrays import foreign_arrays
from collectives.api import (_NDARRAY, _apart, _check_out, _counts_key, _described,
                             _device_array, _flat, _options, _request, _shown, _total)
from collectives.plan import (MISS, OP_CODES, VPlan, _agreements, _raise_here, allocator, build,
                              call, context, remember, stale)
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
    if recv_counts is None:  # the kept send side learns them (see _Sender)
        key = _key("send", algo, chunk_bytes, sendbuf, recvbuf, send_counts, ())
    else:
        key = _key("given", algo, chunk_bytes, sendbuf, recvbuf, send_counts, recv_counts)
    return call(group, key, _plan_all_to_all_v, sendbuf, recvbuf, async_op, send_counts,
                recv_counts, algo, chunk_bytes)


def _key(kind: str, algo, chunk_bytes, sendbuf, recvbuf, send_counts, recv_counts):
    """The cache key of an AlltoAllv layout: ``kind`` ``"given"`` (the caller's recv
    counts), ``"send"`` (the send side of a call that learns them) or ``"learned"``;
    None when an argument cannot be part of a key (the call's checks then say why)."""
    if not (type(sendbuf) is _NDARRAY or _device_array(sendbuf)) \
            or not (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)):
        return None
    if recvbuf is not None and not (type(recvbuf) is _NDARRAY or _device_array(recvbuf)):
        return None
    sc, rc = _counts_key(send_counts), _counts_key(recv_counts)
    if sc is None or rc is None:
        return None
    return ("all_to_all_v", kind, algo, chunk_bytes, sendbuf.dtype, sendbuf.size,
            None if recvbuf is None else recvbuf.size, sc, rc)


class _Sender:
    """The checked send side of an AlltoAllv that learns its recv counts, kept under the
    call's ``"send"`` key: a call of the same layout agrees and exchanges the counts
    without checking its arguments again (buffers other than the last ones proved are
    checked on the spot), then runs the plan of the counts learned."""

    __slots__ = ("ctx", "agreements", "sc", "sizes", "key", "algo", "chunk_bytes", "_check",
                 "_version", "_refs", "_exchange")

    def __init__(self, ctx, agreements, sc, sizes, sendbuf, recvbuf, algo, chunk_bytes):
        self.ctx, self.agreements, self.sc, self.sizes = ctx, agreements, sc, sizes
        self.algo, self.chunk_bytes = algo, chunk_bytes
        self.key, self._check, self._version = None, ctx.check, settings.version()
        self._refs = (weakref.ref(sendbuf), None if recvbuf is None else weakref.ref(recvbuf))
        self._exchange = _count_exchange(ctx)

    def replay(self, sendbuf, recvbuf, async_op: bool):
        """What the call returns (see :meth:`~collectives.plan.Plan.replay`), or
        :data:`~collectives.plan.MISS` when these buffers need a call of their own."""
        if not self.accept(sendbuf, recvbuf):
            return MISS
        ctx, agreements = self.ctx, self.agreements
        out = agreements[int(bool(async_op))].run(ctx.group.comm, None, sizes=self.sizes)
        plan, bufs = _v_plan(ctx, agreements, sendbuf, recvbuf, self.sc, None, out, async_op,
                             self.algo, self.chunk_bytes, None, self._exchange)
        return plan.first(bufs, async_op)

    def accept(self, sendbuf, recvbuf) -> bool:
        """Whether ``sendbuf`` and ``recvbuf`` are valid for this send side."""
        if self._check is not self.ctx.state.check or self._version != settings.VERSION:
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


def _count_exchange(ctx):
    """The group's exchange of counts (one int64 per rank), MPI's own AlltoAll."""
    return ctx.group.backend(_NO_COUNTS).direct("all_to_all", _NO_COUNTS.dtype)


_NO_COUNTS = np.zeros(0, np.int64)  # (host counts: the MPI backend moves them)


def _v_signature(sendbuf, recvbuf, recv_counts, async_op, algo, chunk_bytes) -> list:
    """What every rank's AlltoAllv call must share (its counts differ by design)."""
    forced = 0 if algo is None else (zlib.crc32(str(algo).encode()) & 0x7FFFFFFF) | 1
    return [("op", OP_CODES[CollectiveOp.ALL_TO_ALL_V]), ("dtype", _dcode(sendbuf)),
            ("recv_counts given", int(recv_counts is not None)),
            ("recvbuf given", int(recvbuf is not None)),
            ("algo", forced), ("chunk_bytes", chunk_bytes if isinstance(chunk_bytes, int)
                                else -1)]


def _plan_all_to_all_v(state, key, sendbuf, recvbuf, async_op, send_counts, recv_counts, algo,
                       chunk_bytes):
    """A new AlltoAllv call: checked, agreed with the largest send sizes, counts exchanged
    when unknown or when checks are on, then selected: ``(plan, buffers)``. Its plan is
    kept under ``key`` when there is one; a call without recv counts keeps its send
    side there instead (:class:`_Sender`), and the plan under the counts learned."""
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
    words = _described("all_to_all_v", sendbuf, f"counts {_shown(send_counts)}",
                       async_op=async_op)
    agreements = _agreements(op.value, _v_signature(sendbuf, recvbuf, recv_counts, async_op,
                                                    algo, chunk_bytes), words, ctx.group)
    sizes = (int(sc.sum()), int(sc.max(initial=0))) if problem is None else (0, 0)
    # Agree on the call before the counts move: a rank in another collective (or in this
    # one with async_op different) is named now instead of meeting the exchange.
    out = agreements[int(bool(async_op))].run(ctx.group.comm, problem, fresh=1, sizes=sizes)
    if recv_counts is None and key is not None:
        remember(state, key, _Sender(ctx, agreements, sc, sizes, sendbuf, recvbuf, algo,
                                     chunk_bytes))
    return _v_plan(ctx, agreements, sendbuf, recvbuf, sc, rc, out, async_op, algo,
                   chunk_bytes, None if recv_counts is None else key)


def _v_plan(ctx, agreements, sendbuf, recvbuf, sc, rc, out, async_op, algo, chunk_bytes,
            key, exchange=None):
    """An AlltoAllv from its agreement on (``out`` is the agreed vector): ``(plan,
    buffers)``, the plan kept under ``key`` (or, for recv counts learned now, under the
    counts learned). ``exchange``: the group's exchange of counts (made when None)."""
    op, comm, p = CollectiveOp.ALL_TO_ALL_V, ctx.group.comm, ctx.group.size
    known = rc is not None
    if not known or (ctx.check and stale(out)):  # exchange the counts: to learn or check them
        offered = np.empty(p, np.int64)
        if exchange is None:
            exchange = _count_exchange(ctx)
        with watchdog.guard("all_to_all_v (exchange of the counts)"):
            exchange(sc, offered)
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
                return plan, bufs
    request = _request(ctx, op, total * itemsize, itemsize, max_block=block * itemsize,
                       uniform=False)
    alloc = allocator(ctx.xp, int(rc.sum()))
    if recvbuf is None:
        recvbuf = alloc(sendbuf)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_counts=sc,
                  recv_counts=rc, send_displs=displs(sc), recv_displs=displs(rc))

    def resume(bufs, agreed, async_again):  # a plan selected anew replaces this one
        again, now = _v_plan(ctx, agreements, bufs[0], bufs[1], sc, rc, agreed, async_again,
                             algo, chunk_bytes, key)
        return again.first(now, async_again)

    plan = build(ctx, request, None, [], algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, extra=(rc,), agreements=agreements, kind=VPlan,
                 sizes=(total, block), resume=resume, alloc=alloc)
    remember(ctx.state, key, plan)
    return plan, (sendbuf, recvbuf)
