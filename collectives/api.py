"""The dense collectives: AlltoAll(v), ReduceScatter, AllReduce, AllGather, Broadcast.

Every function runs on any process group (``group=None``: the world group
of :func:`neocomm.init`), on NumPy or CuPy buffers (read as flat 1-D,
C-contiguous), blocking or — ``async_op=True`` — returning a handle whose
``wait()`` returns what the blocking call would have returned. Counts are
in elements. ``algo=`` forces an algorithm (as ``NEOCOMM_ALGO_<OP>`` does),
``chunk_bytes=`` the chunk size (as ``NEOCOMM_CHUNK_BYTES`` does). Bad
arguments on any rank raise :class:`~neocomm.errors.CollectiveArgumentError`
on every rank.

Every call runs through its :class:`~collectives.plan.Plan`, by one door
(:func:`collectives.plan.call`): the first call of a layout (operation,
options, dtype, sizes) is checked, agreed and selected and leaves its plan
with the group; the next ones run it, on the same buffers or new ones,
blocking or not (see :mod:`collectives.plan`). Each collective here only
says its layout (the key of its plan) and how to plan a new call.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from neocomm.agree import Problem
from neocomm.types import REDUCE_CODES, ReduceOp
from collectives import symmetric
from collectives.algorithms import displs
from collectives.arrays import foreign_arrays
from collectives.plan import OP_CODES, build, call, context, kept
from collectives.types import CollectiveOp, Request
from collectives.validate import (check_buffer, check_counts, check_overlap, check_peer,
                                  check_same_dtype, counts_digest, first, same_memory)
from collectives.validate import dtype_code_of as _dcode

__all__ = ["all_to_all", "reduce_scatter", "all_reduce", "all_gather", "broadcast"]

_NDARRAY = np.ndarray
#: The types of an ``op=`` that may be part of a plan's key.
_REDUCE = frozenset({ReduceOp, str})


def _options(algo, chunk_bytes) -> bool:
    """Whether ``algo=`` and ``chunk_bytes=`` may be part of a plan's key: None, a name
    and an integer (anything else is for the call's checks to name). The callers ask
    only when one of them is not None."""
    return (algo is None or type(algo) is str) and (
        chunk_bytes is None or type(chunk_bytes) is int or isinstance(chunk_bytes, np.integer))


def _device_array(buf) -> bool:
    """Whether ``buf`` is a CuPy array. A NumPy or CuPy array's dtype and size may key a
    plan; of anything else the call's checks say what is wrong."""
    return type(buf).__module__.startswith("cupy")


def _counts_key(counts):
    """Counts as part of a plan's key — an array's dtype and bytes (quick to hash), a
    sequence's integers — or None when they cannot be (the call's checks say why)."""
    t = type(counts)
    if t is _NDARRAY:
        return counts.dtype.char, counts.tobytes()
    if t is list or t is tuple or t is range:
        for c in counts:
            if type(c) is not int and not isinstance(c, np.integer):
                return None
        return tuple(counts)
    return None


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


def _described(name: str, buf, *args, async_op: bool = False, **kw):
    """This rank's call in the user's words (``all_to_all_v(float32, counts [8, 8])``),
    made only when an error needs it (it keeps no reference to the buffer: a plan holds
    it)."""
    dt = getattr(getattr(buf, "dtype", None), "name", type(buf).__name__)

    def text() -> str:
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


def _backend_reduces(ctx, sendbuf, rop: ReduceOp) -> Problem | None:
    """The problem of a reduction the group's backend cannot do on ``sendbuf``'s dtype
    (bfloat16 on NCCL before 2.10), for the call's agreement to raise on every rank."""
    why = ctx.backend.reduce_reason(sendbuf.dtype, rop)
    return None if why is None else Problem("sendbuf", f"sendbuf: {why}")


def _apart(sendbuf, recvbuf):
    """``sendbuf``, or a copy of it when ``recvbuf`` is the same memory: an exchange in
    place would overwrite blocks before they are sent."""
    if recvbuf is not None and sendbuf is not None and same_memory(sendbuf, recvbuf):
        return sendbuf.copy()
    return sendbuf


def _request(ctx, op, nbytes, itemsize, **kw) -> Request:
    """The call as the selector sees it (the same on every rank once agreed)."""
    return Request(op, max(0, int(nbytes)), max(1, int(itemsize)), ctx.group.size,
                   device=ctx.xp.__name__ != "numpy", uniform_nodes=ctx.layout.uniform, **kw)


@foreign_arrays("sendbuf", "recvbuf")
def all_to_all(sendbuf, recvbuf=None, *, group=None, async_op: bool = False,
               algo: str | None = None, chunk_bytes: int | None = None):
    """Block ``j`` of ``sendbuf`` goes to rank ``j``; block ``i`` of the result came from rank
    ``i``.

    Shape contract: ``sendbuf`` holds ``p`` equal blocks (``sendbuf.size %
    p == 0``); the result has ``sendbuf``'s size and dtype (allocated with
    ``sendbuf``'s shape when ``recvbuf`` is None). Example, 2 ranks::

        rank 0: sendbuf [a0 a1 | a2 a3]   ->  result [a0 a1 | b0 b1]
        rank 1: sendbuf [b0 b1 | b2 b3]   ->  result [a2 a3 | b2 b3]

    Returns the result (or a handle whose ``wait()`` returns it).
    """
    key = None
    if (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)) \
            and (type(sendbuf) is _NDARRAY or _device_array(sendbuf)):
        key = ("all_to_all", algo, chunk_bytes, sendbuf.dtype, sendbuf.size, recvbuf is None)
    return call(group, key, _plan_all_to_all, sendbuf, recvbuf, async_op, algo, chunk_bytes)


def _plan_all_to_all(state, key, sendbuf, recvbuf, async_op, algo, chunk_bytes):
    """A new AlltoAll call checked, agreed and selected: ``(plan, buffers)``, the plan
    kept under ``key`` when there is one (as every ``_plan_*`` here returns)."""
    given = sendbuf, recvbuf
    op = CollectiveOp.ALL_TO_ALL
    ctx = context(None, sendbuf, op.value, state)
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
    alloc = _like_send(ctx.xp)
    if ok and recvbuf is None:
        recvbuf = alloc(sendbuf)
    counts = np.full(p, max(block, 0), np.int64)
    offs = displs(counts)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_counts=counts,
                  recv_counts=counts, send_displs=offs, recv_displs=offs, **symf)
    sig = [("op", OP_CODES[op]), ("dtype", _dcode(sendbuf)), ("block", block)]
    plan = build(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, alloc=alloc,
                 call=_described("all_to_all", sendbuf, _size(sendbuf), async_op=async_op))
    return kept(state, key, plan, (sendbuf, recvbuf), *given)


def _like_send(xp):
    """How a run without a ``recvbuf`` makes one: like ``sendbuf``."""
    return xp.empty_like


@foreign_arrays("sendbuf", "recvbuf")
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
    counts = None if recv_counts is None else _counts_key(recv_counts)
    if (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)) \
            and (type(sendbuf) is _NDARRAY or _device_array(sendbuf)) \
            and type(op) in _REDUCE and (counts is not None or recv_counts is None):
        key = ("reduce_scatter", algo, chunk_bytes, op, sendbuf.dtype, sendbuf.size,
               recvbuf is None, counts)
    return call(group, key, _plan_reduce_scatter, sendbuf, recvbuf, async_op, recv_counts, op,
                algo, chunk_bytes)


def _plan_reduce_scatter(state, key, sendbuf, recvbuf, async_op, recv_counts, op, algo,
                         chunk_bytes):
    given = sendbuf, recvbuf
    kind = CollectiveOp.REDUCE_SCATTER
    rop, problem = _reduce_op(op)
    ctx = context(None, sendbuf, kind.value, state)
    p, dev = ctx.group.size, ctx.backend.device
    problem = problem or check_buffer("sendbuf", sendbuf, device=dev, reducible=True)
    problem = problem or _backend_reduces(ctx, sendbuf, rop)
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
    mine = int(counts[ctx.group.rank]) if ok else 0
    xp = ctx.xp
    alloc = (lambda s: xp.empty(mine, dtype=s.dtype))
    if ok and recvbuf is None:
        recvbuf = alloc(sendbuf)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), recv_counts=counts,
                  reduce_op=rop, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)), ("count", _size(sendbuf)),
           ("reduce_op", REDUCE_CODES[rop]), ("recv_counts", counts_digest(counts))]
    extra = {} if recv_counts is None else {"recv_counts": recv_counts}
    plan = build(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, alloc=alloc,
                 call=_described("reduce_scatter", sendbuf, _size(sendbuf), op=op,
                                 async_op=async_op, **extra))
    return kept(state, key, plan, (sendbuf, recvbuf), *given)


@foreign_arrays("sendbuf", "recvbuf")
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
    if recvbuf is sendbuf:
        recvbuf = None  # the in-place call
    key = None
    if (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)) \
            and (type(sendbuf) is _NDARRAY or _device_array(sendbuf)) and type(op) in _REDUCE:
        key = ("all_reduce", algo, chunk_bytes, op, sendbuf.dtype, sendbuf.size,
               recvbuf is None)
    return call(group, key, _plan_all_reduce, sendbuf, recvbuf, async_op, op, algo,
                chunk_bytes)


def _plan_all_reduce(state, key, sendbuf, recvbuf, async_op, op, algo, chunk_bytes):
    given = sendbuf, recvbuf
    if recvbuf is not None and same_memory(sendbuf, recvbuf):
        recvbuf = None  # the same memory: the in-place call
    kind = CollectiveOp.ALL_REDUCE
    rop, problem = _reduce_op(op)
    ctx = context(None, sendbuf, kind.value, state)
    dev = ctx.backend.device
    problem = problem or check_buffer("sendbuf", sendbuf, device=dev, reducible=True,
                                      writable=recvbuf is None)
    problem = problem or _backend_reduces(ctx, sendbuf, rop)
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
           ("reduce_op", REDUCE_CODES[rop]), ("in place", int(recvbuf is None))]
    bufs = (sendbuf,) if recvbuf is None else (sendbuf, recvbuf)
    plan = build(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=bufs, result_at=len(bufs) - 1,
                 async_op=async_op,
                 call=_described("all_reduce", sendbuf, _size(sendbuf), op=op,
                                 async_op=async_op))
    return kept(state, key, plan, bufs, *given)


@foreign_arrays("sendbuf", "recvbuf")
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
    if (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)) \
            and (type(sendbuf) is _NDARRAY or _device_array(sendbuf)):
        key = ("all_gather", algo, chunk_bytes, sendbuf.dtype, sendbuf.size, recvbuf is None)
    return call(group, key, _plan_all_gather, sendbuf, recvbuf, async_op, algo, chunk_bytes)


def _plan_all_gather(state, key, sendbuf, recvbuf, async_op, algo, chunk_bytes):
    given = sendbuf, recvbuf
    kind = CollectiveOp.ALL_GATHER
    ctx = context(None, sendbuf, kind.value, state)
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
    xp = ctx.xp
    alloc = (lambda s: xp.empty((p,) + tuple(s.shape), dtype=s.dtype))
    if ok and recvbuf is None:
        recvbuf = alloc(sendbuf)
    counts = np.full(p, max(_size(sendbuf), 0), np.int64)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), recv_counts=counts, **symf)
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)), ("count", _size(sendbuf))]
    plan = build(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, alloc=alloc,
                 call=_described("all_gather", sendbuf, _size(sendbuf), async_op=async_op))
    return kept(state, key, plan, (sendbuf, recvbuf), *given)


@foreign_arrays("buf")
def broadcast(buf, *, root: int = 0, group=None, async_op: bool = False,
              algo: str | None = None, chunk_bytes: int | None = None):
    """Every rank's ``buf`` becomes the root's (same size and dtype everywhere).

    Example, 3 ranks, root 1::

        rank 0: buf [0 0]  ->  [7 8]
        rank 1: buf [7 8]  ->  [7 8]
        rank 2: buf [0 0]  ->  [7 8]

    Returns ``buf``.
    """
    key = None  # (a root that is no int, 0.0 or "0", is for the call's checks: no key)
    if (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)) \
            and (type(buf) is _NDARRAY or _device_array(buf)) \
            and (type(root) is int or isinstance(root, np.integer)):
        key = ("broadcast", algo, chunk_bytes, int(root), buf.dtype, buf.size)
    return call(group, key, _plan_broadcast, buf, None, async_op, root, algo, chunk_bytes)


def _plan_broadcast(state, key, buf, _, async_op, root, algo, chunk_bytes):
    given = buf
    kind = CollectiveOp.BROADCAST
    ctx = context(None, buf, kind.value, state)
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
    plan = build(ctx, request, problem, sig, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(buf,), result_at=0,
                 async_op=async_op,
                 call=_described("broadcast", buf, _size(buf), root=root, async_op=async_op))
    return kept(state, key, plan, (buf,), given, None)

