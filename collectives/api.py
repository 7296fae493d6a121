"""The dense collectives: AlltoAll(v), ReduceScatter, AllReduce, AllGather, Broadcast.

Every function runs on any process group (``group=None``: the world group
of :func:`neocomm.init`), on NumPy or CuPy buffers (read as flat 1-D,
C-contiguous), blocking or — ``async_op=True`` — returning a handle whose
``wait()`` returns what the blocking call would have returned. Counts are
in elements. ``algo=`` forces an algorithm (as ``NEOCOMM_ALGO_<OP>`` does),
``chunk_bytes=`` the chunk size (as ``NEOCOMM_CHUNK_BYTES`` does). Bad
arguments on any rank raise :class:`~neocomm.errors.CollectiveArgumentError`
on every rank.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from neocomm import watchdog
from neocomm.agree import Problem
from neocomm.backends.checks import (REDUCE_CODES, check_buffer, check_counts, check_overlap,
                                     check_peer, check_same_dtype, counts_digest, first,
                                     same_memory)
from neocomm.backends.checks import dtype_code_of as _dcode
from neocomm.types import ReduceOp
from collectives import plans, symmetric
from collectives._launch import OP_CODES, context, fail, launch
from collectives.algorithms import displs
from collectives.types import CollectiveOp, Request

__all__ = ["all_to_all", "all_to_all_v", "reduce_scatter", "all_reduce", "all_gather",
           "broadcast"]



def _size(buf) -> int:
    return int(getattr(buf, "size", -1))


def _total(counts, buf) -> int:
    """What ``counts`` must sum to: ``buf.size``, or their own sum without a buffer."""
    if buf is not None:
        return _size(buf)
    try:
        return int(np.sum(np.asarray(counts, dtype=np.int64)))
    except (TypeError, ValueError):
        return -1


def _check_out(sendbuf, recvbuf, dev: bool, size: int | None = None,
               expected: str = "") -> Problem | None:
    """``recvbuf``: an array of this call's kind and ``sendbuf``'s dtype, with
    ``size`` elements when given (``expected`` says how many, in words)."""
    problem = first(check_buffer("recvbuf", recvbuf, device=dev, writable=True),
                    check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf))
    if problem is None:
        problem = check_overlap("sendbuf", sendbuf, "recvbuf", recvbuf)
    if problem is None and size is not None and recvbuf.size != size:
        problem = Problem("recvbuf", f"recvbuf: expected {expected}, got {recvbuf.size}")
    return problem


def _counts_key(counts):
    """Counts as part of a plan key: a list or tuple as its tuple (cheap), else bytes."""
    kind = type(counts)
    if kind is tuple:
        return counts
    if kind is list:
        return tuple(counts)
    return np.asarray(counts, np.int64).tobytes()


def _flat(buf):
    """``buf`` as a flat view (None for None and for what is not an array)."""
    return buf.reshape(-1) if hasattr(buf, "reshape") and hasattr(buf, "dtype") else None


def _shown(value) -> str:
    """A user's argument as they wrote it (counts as a list), for messages."""
    if isinstance(value, str):
        return repr(value)
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):
        return repr(value.value)  # a ReduceOp
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    try:
        return str([int(x) for x in np.asarray(value).reshape(-1)])
    except (TypeError, ValueError):
        return repr(value)


def _call(name: str, buf, *args, async_op: bool = False, **kw):
    """This rank's call in the user's words (``all_to_all_v(float32, counts [8, 8])``),
    made only when an error needs it."""
    def text() -> str:
        dt = getattr(getattr(buf, "dtype", None), "name", type(buf).__name__)
        parts = [dt] + [str(a) for a in args] + [f"{k}={_shown(v)}" for k, v in kw.items()]
        if async_op:
            parts.append("async_op=True")
        return f"{name}({', '.join(parts)})"
    return text


def _reduce_op(op) -> tuple[ReduceOp, Problem | None]:
    """The reduce op, or SUM and the problem naming the op as given."""
    try:
        return ReduceOp.parse(op), None
    except (ValueError, TypeError) as exc:
        return ReduceOp.SUM, Problem("op", str(exc))


def _apart(sendbuf, recvbuf):
    """``sendbuf``, or a copy of it when ``recvbuf`` is the same memory: an exchange in
    place would overwrite blocks before they are sent."""
    if recvbuf is not None and sendbuf is not None and same_memory(sendbuf, recvbuf):
        return sendbuf.copy()
    return sendbuf


def _request(ctx, op, nbytes, itemsize, **kw) -> Request:
    return Request(op, max(0, int(nbytes)), max(1, int(itemsize)), ctx.group.size,
                   device=ctx.xp.__name__ != "numpy", uniform_nodes=ctx.layout.uniform, **kw)


def all_to_all(sendbuf, recvbuf=None, *, group=None, async_op: bool = False,
               algo: str | None = None, chunk_bytes: int | None = None):
    """Block ``j`` of ``sendbuf`` goes to rank ``j``; block ``i`` of the result came from rank ``i``.

    Shape contract: ``sendbuf`` holds ``p`` equal blocks (``sendbuf.size %
    p == 0``); the result has ``sendbuf``'s size and dtype (allocated with
    ``sendbuf``'s shape when ``recvbuf`` is None). Example, 2 ranks::

        rank 0: sendbuf [a0 a1 | a2 a3]   ->  result [a0 a1 | b0 b1]
        rank 1: sendbuf [b0 b1 | b2 b3]   ->  result [a2 a3 | b2 b3]

    Returns the result (or a handle whose ``wait()`` returns it).
    """
    key = None
    if not async_op and recvbuf is not None:
        key = ("all_to_all", group, id(sendbuf), id(recvbuf), algo, chunk_bytes)
        out = plans.replay(key, sendbuf, recvbuf)
        if out is not None:
            return out
    op = CollectiveOp.ALL_TO_ALL
    ctx = context(group, sendbuf, op.value)
    p, dev = ctx.group.size, ctx.backend.device
    problem = check_buffer("sendbuf", sendbuf, device=dev)
    if problem is None and sendbuf.size % p:
        problem = Problem("sendbuf", f"sendbuf: {sendbuf.size} elements do not split into "
                                     f"{p} equal blocks")
    if problem is None and recvbuf is not None:
        problem = _check_out(sendbuf, recvbuf, dev, sendbuf.size,
                             f"{sendbuf.size} elements (as sendbuf)")
    ok = problem is None
    if ok:
        sendbuf = _apart(sendbuf, recvbuf)
    itemsize = sendbuf.dtype.itemsize if ok else 1
    block = sendbuf.size // p if ok else -1
    bits, symf = symmetric.describe(ctx.group, sendbuf) if ok else (0, {})
    request = _request(ctx, op, block * p * itemsize, itemsize, max_block=block * itemsize,
                       symmetric=bits)
    if ok and recvbuf is None:
        recvbuf = ctx.xp.empty_like(sendbuf)
    counts = np.full(p, max(block, 0), np.int64)
    offs = displs(counts)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_counts=counts,
                  recv_counts=counts, send_displs=offs, recv_displs=offs, **symf)
    sig = [("op", OP_CODES[op]), ("dtype", _dcode(sendbuf)), ("block", block)]
    return _result(launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                          itemsize=itemsize, fields=fields, result=recvbuf,
                          async_op=async_op, plan_key=key, plan_bufs=(sendbuf, recvbuf),
                          call=_call("all_to_all", sendbuf, _size(sendbuf),
                                     async_op=async_op)),
                   async_op)


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
    key = None
    if not async_op and recvbuf is not None and recv_counts is not None:
        try:
            key = ("all_to_all_v", group, id(sendbuf), id(recvbuf), algo, chunk_bytes,
                   _counts_key(send_counts), _counts_key(recv_counts))
            hash(key)  # counts holding lists: no plan, and validation says what is wrong
        except (TypeError, ValueError):
            key = None
        out = plans.replay(key, sendbuf, recvbuf) if key is not None else None
        if out is not None:
            return out
    op = CollectiveOp.ALL_TO_ALL_V
    ctx = context(group, sendbuf, op.value)
    p, dev, comm = ctx.group.size, ctx.backend.device, ctx.group.comm
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
    # Agree on the call before the counts move: a rank in another collective (or in this
    # one with async_op different) is named now instead of meeting the exchange.
    fail(ctx, op, problem, [("op", OP_CODES[op]), ("async", int(bool(async_op))),
                            ("dtype", _dcode(sendbuf))], call)
    if rc is None or ctx.check:  # exchange the counts: to learn them, or to check them
        offered = np.empty(p, np.int64)
        with watchdog.guard("all_to_all_v (exchange of the counts)"):
            comm.Alltoall(sc if problem is None else np.full(p, -1, np.int64), offered)
        rejected = (offered < 0).any()  # that rank reports its own problem
        if rc is None:
            rc = np.where(offered < 0, 0, offered)
            if problem is None and recvbuf is not None and recvbuf.size != int(rc.sum()):
                problem = Problem("recvbuf", f"recvbuf: the peers send {int(rc.sum())} "
                                             f"elements, recvbuf holds {recvbuf.size}")
        elif problem is None and not rejected and not np.array_equal(offered, rc):
            i = int(np.flatnonzero(offered != rc)[0])
            problem = Problem("recv_counts", f"recv_counts[{i}] is {int(rc[i])} but rank {i} "
                                             f"sends {int(offered[i])}")
    ok = problem is None
    itemsize = sendbuf.dtype.itemsize if ok else 1
    # The request must be the same on every rank: agree on the largest sizes.
    sizes = np.array([int(sc.sum()), int(sc.max(initial=0)), int(rc.max(initial=0))]
                     if ok else [0, 0, 0], np.int64)
    from mpi4py import MPI

    with watchdog.guard("all_to_all_v (agreement of the sizes)"):
        comm.Allreduce(MPI.IN_PLACE, sizes, op=MPI.MAX)
    request = _request(ctx, op, sizes[0] * itemsize, itemsize,
                       max_block=int(max(sizes[1], sizes[2])) * itemsize, uniform=False)
    if ok and recvbuf is None:
        recvbuf = ctx.xp.empty(int(rc.sum()), dtype=sendbuf.dtype)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_counts=sc,
                  recv_counts=rc, send_displs=displs(sc), recv_displs=displs(rc)) if ok else {}
    sig = [("op", OP_CODES[op]), ("dtype", _dcode(sendbuf))]
    handle = launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                    itemsize=itemsize, fields=fields, result=(recvbuf, rc), async_op=async_op,
                    plan_key=key, plan_bufs=(sendbuf, recvbuf), call=call)
    return _result(handle, async_op)


def reduce_scatter(sendbuf, recvbuf=None, *, recv_counts: Sequence[int] | None = None,
                   op: ReduceOp | str = ReduceOp.SUM, group=None, async_op: bool = False,
                   algo: str | None = None, chunk_bytes: int | None = None):
    """Rank ``i`` gets block ``i`` of the element-wise reduction of every rank's ``sendbuf``.

    Shape contract: equal blocks (``sendbuf.size % p == 0``, result of
    ``sendbuf.size // p`` elements) unless ``recv_counts`` (the same on
    every rank, summing to ``sendbuf.size``) gives each rank's block.
    Example, 2 ranks, sum::

        rank 0: sendbuf [1 2 | 3 4]   ->  result [11 22]
        rank 1: sendbuf [10 20 | 30 40] -> result [33 44]

    Returns the result (allocated when ``recvbuf`` is None).
    """
    key = None
    if not async_op and recvbuf is not None:
        key = ("reduce_scatter", group, id(sendbuf), id(recvbuf), algo, chunk_bytes,
               op if op.__class__ is str else getattr(op, "_value_", None))
        if recv_counts is not None:
            try:
                key += (np.asarray(recv_counts, np.int64).tobytes(),)
            except (TypeError, ValueError):
                key = None
        out = plans.replay(key, sendbuf, recvbuf) if key is not None else None
        if out is not None:
            return out
    kind = CollectiveOp.REDUCE_SCATTER
    rop, problem = _reduce_op(op)
    ctx = context(group, sendbuf, kind.value)
    p, dev = ctx.group.size, ctx.backend.device
    problem = problem or check_buffer("sendbuf", sendbuf, device=dev, reducible=True)
    counts = None
    if problem is None:
        if recv_counts is None:
            if sendbuf.size % p:
                problem = Problem("sendbuf", f"sendbuf: {sendbuf.size} elements do not split "
                                             f"into {p} equal blocks; pass recv_counts")
            else:
                counts = np.full(p, sendbuf.size // p, np.int64)
        else:
            problem, counts = check_counts("recv_counts", recv_counts, p, sendbuf.size,
                                           "sendbuf")
    if problem is None and recvbuf is not None:
        mine = int(counts[ctx.group.rank])
        problem = _check_out(sendbuf, recvbuf, dev, mine, f"{mine} elements")
    ok = problem is None
    itemsize = sendbuf.dtype.itemsize if ok else 1
    bits, symf = symmetric.describe(ctx.group, sendbuf) if ok else (0, {})
    request = _request(ctx, kind, _size(sendbuf) * itemsize if ok else 0, itemsize,
                       max_block=int(counts.max()) * itemsize if ok else 0,
                       uniform=recv_counts is None, reduce_op=rop.value, symmetric=bits)
    if ok and recvbuf is None:
        recvbuf = ctx.xp.empty(int(counts[ctx.group.rank]), dtype=sendbuf.dtype)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), recv_counts=counts,
                  reduce_op=rop, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)), ("count", _size(sendbuf)),
           ("reduce_op", REDUCE_CODES[rop]), ("recv_counts", counts_digest(counts))]
    extra = {} if recv_counts is None else {"recv_counts": recv_counts}
    return _result(launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                          itemsize=itemsize, fields=fields, result=recvbuf,
                          async_op=async_op, plan_key=key, plan_bufs=(sendbuf, recvbuf),
                          call=_call("reduce_scatter", sendbuf, _size(sendbuf), op=op,
                                     async_op=async_op, **extra)),
                   async_op)


def all_reduce(sendbuf, recvbuf=None, *, op: ReduceOp | str = ReduceOp.SUM, group=None,
               async_op: bool = False, algo: str | None = None,
               chunk_bytes: int | None = None):
    """Every rank gets the element-wise reduction of every rank's ``sendbuf``.

    Shape contract: the same size and dtype on every rank; ``recvbuf=None``
    reduces in place (into ``sendbuf``). Example, 2 ranks, sum::

        rank 0: sendbuf [1 2 3]    ->  result [11 22 33]
        rank 1: sendbuf [10 20 30] ->  result [11 22 33]

    Returns the result buffer.
    """
    key = None
    if not async_op:
        key = ("all_reduce", group, id(sendbuf), id(recvbuf), algo, chunk_bytes,
               op if op.__class__ is str else getattr(op, "_value_", None))
        out = plans.replay(key, sendbuf, recvbuf)
        if out is not None:
            return out
    if recvbuf is not None and same_memory(sendbuf, recvbuf):
        # the same memory: the in-place call (left without a plan: the plan of a call
        # is kept under the buffers it was given, and this one drops one)
        recvbuf, key = None, None
    bufs = (sendbuf,) if recvbuf is None else (sendbuf, recvbuf)
    kind = CollectiveOp.ALL_REDUCE
    rop, problem = _reduce_op(op)
    ctx = context(group, sendbuf, kind.value)
    dev = ctx.backend.device
    problem = problem or check_buffer("sendbuf", sendbuf, device=dev, reducible=True,
                                      writable=recvbuf is None)
    if problem is None and recvbuf is not None:
        problem = _check_out(sendbuf, recvbuf, dev, sendbuf.size,
                             f"{sendbuf.size} elements (as sendbuf)")
    ok = problem is None
    itemsize = sendbuf.dtype.itemsize if ok else 1
    out = sendbuf if recvbuf is None else recvbuf
    bits, symf = symmetric.describe(ctx.group, sendbuf, out) if ok else (0, {})
    request = _request(ctx, kind, _size(sendbuf) * itemsize if ok else 0, itemsize,
                       in_place=recvbuf is None, reduce_op=rop.value, symmetric=bits)
    flat_in = _flat(sendbuf) if ok else None
    fields = dict(sendbuf=flat_in, recvbuf=flat_in if recvbuf is None else _flat(recvbuf),
                  reduce_op=rop, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)), ("count", _size(sendbuf)),
           ("reduce_op", REDUCE_CODES[rop])]
    return _result(launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                          itemsize=itemsize, fields=fields, result=out, async_op=async_op,
                          plan_key=key, plan_bufs=bufs,
                          call=_call("all_reduce", sendbuf, _size(sendbuf), op=op,
                                     async_op=async_op)), async_op)


def all_gather(sendbuf, recvbuf=None, *, group=None, async_op: bool = False,
               algo: str | None = None, chunk_bytes: int | None = None):
    """Block ``i`` of the result is rank ``i``'s ``sendbuf``.

    Shape contract: ``sendbuf`` has the same size on every rank; the result
    holds ``p * sendbuf.size`` elements (allocated with shape
    ``(p,) + sendbuf.shape`` when ``recvbuf`` is None). Example, 2 ranks::

        rank 0: sendbuf [a0 a1]  ->  result [[a0 a1] [b0 b1]]
        rank 1: sendbuf [b0 b1]  ->  result [[a0 a1] [b0 b1]]
    """
    key = None
    if not async_op and recvbuf is not None:
        key = ("all_gather", group, id(sendbuf), id(recvbuf), algo, chunk_bytes)
        out = plans.replay(key, sendbuf, recvbuf)
        if out is not None:
            return out
    kind = CollectiveOp.ALL_GATHER
    ctx = context(group, sendbuf, kind.value)
    p, dev = ctx.group.size, ctx.backend.device
    problem = check_buffer("sendbuf", sendbuf, device=dev)
    if problem is None and recvbuf is not None:
        problem = _check_out(sendbuf, recvbuf, dev, p * sendbuf.size,
                             f"{p} x {sendbuf.size} = {p * sendbuf.size} elements")
    ok = problem is None
    itemsize = sendbuf.dtype.itemsize if ok else 1
    bits, symf = symmetric.describe(ctx.group, sendbuf) if ok else (0, {})
    request = _request(ctx, kind, p * _size(sendbuf) * itemsize if ok else 0, itemsize,
                       max_block=_size(sendbuf) * itemsize if ok else 0, symmetric=bits)
    if ok and recvbuf is None:
        recvbuf = ctx.xp.empty((p,) + tuple(sendbuf.shape), dtype=sendbuf.dtype)
    counts = np.full(p, max(_size(sendbuf), 0), np.int64)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), recv_counts=counts, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)), ("count", _size(sendbuf))]
    return _result(launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                          itemsize=itemsize, fields=fields, result=recvbuf,
                          async_op=async_op, plan_key=key, plan_bufs=(sendbuf, recvbuf),
                          call=_call("all_gather", sendbuf, _size(sendbuf),
                                     async_op=async_op)),
                   async_op)


def broadcast(buf, *, root: int = 0, group=None, async_op: bool = False,
              algo: str | None = None, chunk_bytes: int | None = None):
    """Every rank's ``buf`` becomes the root's (same size and dtype everywhere).

    Example, 3 ranks, root 1::

        rank 0: buf [0 0]  ->  [7 8]
        rank 1: buf [7 8]  ->  [7 8]
        rank 2: buf [0 0]  ->  [7 8]

    Returns ``buf``.
    """
    key = None
    if not async_op and isinstance(root, int):
        key = ("broadcast", group, id(buf), algo, chunk_bytes, root)
        out = plans.replay(key, buf)
        if out is not None:
            return out
    kind = CollectiveOp.BROADCAST
    ctx = context(group, buf, kind.value)
    p, dev = ctx.group.size, ctx.backend.device
    problem = first(check_buffer("buf", buf, device=dev, writable=True),
                    check_peer("root", root, p))
    ok = problem is None
    itemsize = buf.dtype.itemsize if ok else 1
    bits, symf = symmetric.describe(ctx.group, buf) if ok else (0, {})
    request = _request(ctx, kind, _size(buf) * itemsize if ok else 0, itemsize,
                       root=int(root) if ok else 0, symmetric=bits)
    fields = dict(recvbuf=_flat(buf), root=int(root) if ok else 0,
                  members=list(range(p)), identical=True, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(buf)), ("count", _size(buf)),
           ("root", int(root) if isinstance(root, (int, np.integer)) else -1)]
    return _result(launch(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                          itemsize=itemsize, fields=fields, result=buf, async_op=async_op,
                          plan_key=key, plan_bufs=(buf,),
                          call=_call("broadcast", buf, _size(buf), root=root,
                                     async_op=async_op)), async_op)


def _result(handle, async_op: bool):
    return handle if async_op else handle.wait()

