"""The targeted collectives: OneToMany and ManyToMany.

Like the dense ones they run on any group, on NumPy or CuPy buffers,
blocking or behind a handle, and every rank of the group calls them (ranks
with nothing to do return at once after the argument agreement).
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from neocomm.agree import Problem
from neocomm import types
from neocomm.types import ReduceOp, dtype_from_code

from neocomm import watchdog

from collectives.algorithms import displs
from collectives.arrays import foreign_arrays
from collectives.api import (_NDARRAY, _counts_key, _dcode, _device_array, _flat, _options,
                             _request, _shown)
from collectives.fabric import fabric_for
from collectives.plan import (OP_CODES, VPlan, _agreements, _raise_here, allocator, build, call,
                              context, remember, stale)
from collectives.types import CollectiveOp
from collectives.validate import check_buffer, check_peer, check_same_dtype, first

__all__ = ["one_to_many", "many_to_many"]


_HOST = np.zeros(0, np.int64)  # (what picks a group's host backend: MPI)


def _digest(values) -> int:
    return zlib.crc32(np.asarray(values, np.int64).tobytes()) & 0x7FFFFFFF


def _dtype_of(code: int) -> np.dtype:
    name = dtype_from_code(code)
    return np.dtype(types.bfloat16) if name == "bfloat16" else np.dtype(name)


def _peers(name: str, peers, size: int) -> tuple[Problem | None, list[int]]:
    try:
        out = [int(x) for x in peers]
    except (TypeError, ValueError):
        return Problem(name, f"{name}: expected a sequence of group ranks, got {peers!r}"), []
    if any(not 0 <= x < size for x in out):
        return Problem(name, f"{name}: expected group ranks in [0, {size}), got {out}"), out
    if len(set(out)) != len(out):
        return Problem(name, f"{name}: names a rank twice: {out}"), out
    return None, out


def _counts(name: str, counts, n: int) -> tuple[Problem | None, np.ndarray]:
    try:
        arr = np.asarray(counts)
        if arr.ndim != 1 or arr.size != n or (arr.size and not np.issubdtype(arr.dtype,
                                                                            np.integer)):
            raise ValueError
        arr = arr.astype(np.int64)
    except (TypeError, ValueError):
        return Problem(name, f"{name}: expected {n} integers, got {counts!r}"), \
            np.zeros(n, np.int64)
    if (arr < 0).any():
        return Problem(name, f"{name}: counts must be >= 0, got {arr.tolist()}"), arr
    return None, arr


@foreign_arrays("sendbuf", "recvbuf")
def one_to_many(sendbuf=None, recvbuf=None, *, root: int, ranks: Sequence[int],
                counts: Sequence[int] | None = None, group=None, async_op: bool = False,
                algo: str | None = None, chunk_bytes: int | None = None):
    """The root sends a payload to each rank of ``ranks`` (group ranks, the same
    list on every rank; the root may be among them).

    Identical payload (``counts=None``): the root's ``sendbuf`` goes to every
    receiver, whose ``recvbuf`` must have its size (a broadcast to a chosen
    set: binomial tree, pipelined chain or direct sends). Distinct payloads:
    ``counts[i]`` elements for ``ranks[i]``, packed in ``sendbuf`` in that
    order (the data reader handing each trainer its slice); ``recvbuf`` may
    then be None and is allocated. Example, root 0, ranks [1, 2], counts [2, 1]::

        rank 0: sendbuf [a b | c]  ->  returns None
        rank 1: recvbuf None       ->  returns [a b]
        rank 2: recvbuf None       ->  returns [c]

    Returns the received payload on receivers, None on other ranks. The
    algorithm is priced with the host links (ranks outside ``ranks`` may have
    no buffer to tell them the array kind).
    """
    key = _key("one_to_many", algo, chunk_bytes, sendbuf, recvbuf, root, ranks, counts)
    a, b = (sendbuf, recvbuf) if sendbuf is not None else (recvbuf, None)
    return call(group, key, _plan_one_to_many, a, b, async_op, sendbuf, recvbuf, root, ranks,
                counts, algo, chunk_bytes)


def _key(name, algo, chunk_bytes, sendbuf, recvbuf, *layout):
    """The cache key of a targeted call: this rank's buffers (dtype and size, or None) and
    the call's ``layout`` (peers, counts, root); None when an argument cannot be part of a
    key (the call's checks then say why)."""
    if not (algo is None and chunk_bytes is None or _options(algo, chunk_bytes)):
        return None
    key = [name, algo, chunk_bytes]
    for x in (sendbuf, recvbuf):
        if x is None:
            key.append(None)
        elif type(x) is _NDARRAY or _device_array(x):
            key.append((x.dtype, x.size))
        else:
            return None
    for x in layout:
        if x is None or type(x) is int or isinstance(x, np.integer):
            key.append(x if x is None else int(x))
        else:
            part = _counts_key(x)
            if part is None:
                return None
            key.append(part)
    return tuple(key)


def _plan_one_to_many(state, key, _a, _b, async_op, sendbuf, recvbuf, root, ranks, counts,
                      algo, chunk_bytes):
    """A new OneToMany call: checked and agreed, the payload's dtype and size sent from the
    root, then selected: ``(plan, buffers)``, the plan kept under ``key`` when there is
    one."""
    kind = CollectiveOp.ONE_TO_MANY
    probe = sendbuf if sendbuf is not None else recvbuf
    ctx = context(None, probe if probe is not None else np.empty(0, np.uint8), kind.value,
                  state)
    # Ranks outside ``ranks`` may hold no buffer: every rank prices the algorithms
    # with the host fabric, so that all of them select alike.
    ctx.fabric = fabric_for(ctx.group)
    p, me, dev = ctx.group.size, ctx.group.rank, ctx.backend.device
    problem = check_peer("root", root, p)
    pp, members = _peers("ranks", ranks, p)
    problem = problem or pp
    identical = counts is None
    cnt = np.zeros(len(members), np.int64)
    if problem is None and not identical:
        problem, cnt = _counts("counts", counts, len(members))
    is_root = problem is None and me == int(root)
    receiver = problem is None and me in members
    if problem is None and is_root:
        if sendbuf is None:
            problem = Problem("sendbuf", "sendbuf: the root must pass the payload")
        else:
            problem = check_buffer("sendbuf", sendbuf, device=dev)
            if problem is None and not identical and sendbuf.size != int(cnt.sum()):
                problem = Problem("sendbuf", f"sendbuf: counts sum to {int(cnt.sum())} but "
                                             f"sendbuf holds {sendbuf.size} elements")
    if problem is None and receiver and recvbuf is not None:
        problem = check_buffer("recvbuf", recvbuf, device=dev, writable=True)
        if problem is None and is_root:
            problem = check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf)
        want = int(sendbuf.size) if is_root and identical else \
            (None if identical else int(cnt[members.index(me)]))
        if problem is None and want is not None and recvbuf.size != want:
            problem = Problem("recvbuf", f"recvbuf: expected {want} elements, got "
                                         f"{recvbuf.size}")
    if problem is None and receiver and recvbuf is None and identical and not is_root:
        problem = Problem("recvbuf", "recvbuf: receivers of an identical payload must pass "
                                     "a buffer of its size (or give counts)")
    sig = [("op", OP_CODES[kind]), ("root", int(root) if isinstance(root, (int, np.integer))
                                    else -1),
           ("ranks", _digest(members)), ("counts", 0 if identical else _digest(cnt))]
    agreements = _agreements(kind.value, sig, lambda: f"one_to_many(root={root!r}, ranks="
                             f"{_shown(ranks)}, counts={_shown(counts)})", ctx.group)
    out = _agree_new(ctx, agreements, problem, async_op)
    role = (is_root, receiver, identical)
    return _o2m_plan(ctx, agreements, role, sendbuf, recvbuf, int(root), members, cnt,
                     out, async_op, algo, chunk_bytes, key)


def _agree_new(ctx, agreements, problem, async_op):
    """The first agreement of a new targeted call: its problems and signature, and that
    it is new (``fresh``: the ranks that run a plan go on as a new call does). It runs
    with checks off too: a rank running its plan meets it there."""
    return agreements[int(bool(async_op))].run(ctx.group.comm, problem, fresh=1, sizes=(0, 0))


def _o2m_plan(ctx, agreements, role, sendbuf, recvbuf, root, members, cnt, out, async_op,
              algo, chunk_bytes, key):
    """A OneToMany from its agreement on: the payload's dtype and size travel from the
    root (receivers may not know them), then its plan is selected and kept: ``(plan,
    buffers)``."""
    kind = CollectiveOp.ONE_TO_MANY
    is_root, receiver, identical = role
    me, recv_given = ctx.group.rank, recvbuf is not None
    head = np.array([_dcode(sendbuf) if is_root else 0,
                     sendbuf.size if is_root and identical else 0], np.int64)
    with watchdog.guard("one_to_many (the payload's dtype and size)"):
        ctx.group.backend(head).direct("broadcast", head.dtype, root=root)(head)
    code, size = int(head[0]), int(head[1])
    problem = None
    if receiver and recvbuf is not None:
        if _dcode(recvbuf) != code:
            problem = Problem("recvbuf", f"recvbuf: dtype {recvbuf.dtype.name} differs from "
                                         f"the root's payload ({dtype_from_code(code)})")
        elif identical and recvbuf.size != size:
            problem = Problem("recvbuf", f"recvbuf: expected the root's {size} elements, got "
                                         f"{recvbuf.size}")
    if ctx.check:
        agreements[int(bool(async_op))].run(ctx.group.comm, problem)
    elif problem is not None:
        _raise_here(me, kind.value, problem)
    dtype = _dtype_of(code)
    alloc = None
    if receiver and not identical:  # a receiver's payload, when it passes no buffer
        alloc = allocator(ctx.xp, int(cnt[members.index(me)]), dtype)
        if recvbuf is None:
            recvbuf = alloc(None)
    itemsize = dtype.itemsize
    per_receiver = size if identical else int(cnt.max(initial=0))
    request = _request(ctx, kind, per_receiver * itemsize, itemsize,
                       max_block=per_receiver * itemsize, root=root,
                       peers=len([m for m in members if m != root]),
                       identical=identical, uniform=identical)
    fields = dict(sendbuf=_flat(sendbuf) if is_root else None,
                  recvbuf=_flat(recvbuf) if receiver else None, root=root,
                  members=members, identical=identical,
                  send_counts=cnt, send_displs=displs(cnt))
    bufs = tuple(b for b, mine in ((sendbuf, is_root), (recvbuf, receiver)) if mine)
    result_at = len(bufs) - 1 if receiver else None

    def resume(given, agreed, async_again):  # a rank's call is new: go on as it does
        send = given[0] if is_root else None
        recv = given[-1] if receiver and recv_given else None  # (not the plan's own)
        again, now = _o2m_plan(ctx, agreements, role, send, recv, root, members, cnt, agreed,
                               async_again, algo, chunk_bytes, key)
        return again.first(now, async_again)

    plan = build(ctx, request, None, [], algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=bufs, result_at=result_at,
                 async_op=async_op, agreements=agreements, kind=VPlan, alloc=alloc,
                 sizes=(code, size), resume=resume)
    remember(ctx.state, key, plan)
    return plan, bufs


@foreign_arrays("sendbuf", "recvbuf")
def many_to_many(sendbuf, send_peers: Sequence[int], send_counts: Sequence[int] | None = None,
                 *, recv_peers: Sequence[int] | None = None,
                 recv_counts: Sequence[int] | None = None, recvbuf=None, group=None,
                 async_op: bool = False, algo: str | None = None,
                 chunk_bytes: int | None = None):
    """Each rank sends only to the peers it names; ranks with nothing to exchange skip.

    ``sendbuf`` packs ``send_counts[i]`` elements for ``send_peers[i]`` in that
    order (``send_counts=None``: equal parts). Without ``recv_peers`` the
    senders are discovered (one small AlltoAll of counts) and the result is
    packed in ascending sender order; with them (and optionally
    ``recv_counts``) they are checked against what the senders name when
    ``NEOCOMM_CHECK_ARGS`` is on — a disagreement raises on every rank
    instead of hanging. Example, 3 ranks::

        rank 0: sendbuf [a b | c], send_peers [1, 2], send_counts [2, 1]
        rank 1: sendbuf [d],       send_peers [2]
        rank 2: sendbuf [],        send_peers []
        ->  rank 0: ([], [], [])   rank 1: ([a b], [0], [2])   rank 2: ([c d], [0, 1], [1, 1])

    Returns ``(recvbuf, recv_peers, recv_counts)``.
    """
    key = None
    if recv_peers is not None and recv_counts is not None:
        key = _key("many_to_many", algo, chunk_bytes, sendbuf, recvbuf, send_peers,
                   send_counts, recv_peers, recv_counts)
    return call(group, key, _plan_many_to_many, sendbuf, recvbuf, async_op, send_peers,
                send_counts, recv_peers, recv_counts, algo, chunk_bytes)


def _plan_many_to_many(state, key, sendbuf, recvbuf, async_op, send_peers, send_counts,
                       recv_peers, recv_counts, algo, chunk_bytes):
    """A new ManyToMany call: checked and agreed; the senders discovered or checked, the
    sizes agreed; then selected: ``(plan, buffers)``, the plan kept under ``key`` when
    there is one."""
    kind = CollectiveOp.MANY_TO_MANY
    ctx = context(None, sendbuf, kind.value, state)
    p, dev = ctx.group.size, ctx.backend.device
    problem = check_buffer("sendbuf", sendbuf, device=dev)
    pp, speers = _peers("send_peers", send_peers, p)
    problem = problem or pp
    sc = np.zeros(len(speers), np.int64)
    if problem is None:
        if send_counts is None:
            if len(speers) and sendbuf.size % len(speers):
                problem = Problem("send_counts", f"send_counts: {sendbuf.size} elements do "
                                                 f"not split into {len(speers)} equal parts")
            elif len(speers):
                sc = np.full(len(speers), sendbuf.size // len(speers), np.int64)
        else:
            problem, sc = _counts("send_counts", send_counts, len(speers))
            if problem is None and int(sc.sum()) != sendbuf.size:
                problem = Problem("send_counts", f"send_counts: sum to {int(sc.sum())} but "
                                                 f"sendbuf holds {sendbuf.size} elements")
    rpeers, rc = None, None
    if recv_peers is not None:
        prp, rpeers = _peers("recv_peers", recv_peers, p)
        problem = problem or prp
        if problem is None and recv_counts is not None:
            problem, rc = _counts("recv_counts", recv_counts, len(rpeers))
    elif recv_counts is not None and problem is None:
        problem = Problem("recv_counts", "recv_counts: needs recv_peers")
    if problem is None and recvbuf is not None:
        problem = first(check_buffer("recvbuf", recvbuf, device=dev, writable=True),
                        check_same_dtype("sendbuf", sendbuf, "recvbuf", recvbuf))
        if problem is None and rc is not None and recvbuf.size != int(rc.sum()):
            problem = Problem("recvbuf", f"recvbuf: expected {int(rc.sum())} elements, got "
                                         f"{recvbuf.size}")
    if problem is None and rpeers is not None and rc is None and not ctx.check:
        problem = Problem("recv_counts", "recv_counts: unknown; pass recv_counts with "
                                         "recv_peers, or turn on NEOCOMM_CHECK_ARGS")
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf)),
           ("recv_peers given", int(recv_peers is not None)),
           ("recv_counts given", int(recv_counts is not None))]
    agreements = _agreements(kind.value, sig, None, ctx.group)
    out = _agree_new(ctx, agreements, problem, async_op)
    return _m2m_plan(ctx, agreements, sendbuf, recvbuf, speers, sc, rpeers, rc, out,
                     async_op, algo, chunk_bytes, key)


def _m2m_plan(ctx, agreements, sendbuf, recvbuf, speers, sc, rpeers, rc, out, async_op,
              algo, chunk_bytes, key):
    """A ManyToMany from its agreement on: the senders discovered (no ``recv_peers``) or,
    with checks on and some rank's call new, checked against what the senders name;
    then the sizes agreed, and its plan selected and kept: ``(plan, buffers)``."""
    kind = CollectiveOp.MANY_TO_MANY
    p, comm, check = ctx.group.size, ctx.group.comm, ctx.check
    mpi = ctx.group.backend(_HOST)  # the counts and sizes are host data: MPI moves them
    exchange = rpeers is None or (check and stale(out))
    if exchange:  # who sends what to whom: -1 no message, else the count
        dense = np.full(p, -1, np.int64)
        dense[speers] = sc
        offered = np.empty(p, np.int64)
        with watchdog.guard("many_to_many (exchange of the counts)"):
            mpi.direct("all_to_all", dense.dtype)(dense, offered)
        problem = None
        if rpeers is None:
            rpeers = [int(x) for x in np.flatnonzero(offered >= 0)]
            rc = offered[rpeers].astype(np.int64)
        else:
            senders = set(int(x) for x in np.flatnonzero(offered >= 0))
            if senders != set(rpeers):
                extra = sorted(senders - set(rpeers))
                missing = sorted(set(rpeers) - senders)
                problem = Problem("recv_peers", f"recv_peers: {rpeers} disagree with the "
                                                f"senders (ranks {extra} send here but are "
                                                f"not listed; ranks {missing} are listed but "
                                                f"send nothing here)")
            else:
                got = offered[rpeers]
                if rc is not None and not np.array_equal(got, rc):
                    i = int(np.flatnonzero(got != rc)[0])
                    problem = Problem("recv_counts", f"recv_counts[{i}] is {int(rc[i])} but "
                                                    f"rank {rpeers[i]} sends {int(got[i])}")
                rc = got.astype(np.int64)
        if problem is None and recvbuf is not None and recvbuf.size != int(rc.sum()):
            problem = Problem("recvbuf", f"recvbuf: expected {int(rc.sum())} elements, got "
                                         f"{recvbuf.size}")
        if check:  # a problem found now: together
            agreements[int(bool(async_op))].run(comm, problem)
        elif problem is not None:
            _raise_here(ctx.group.rank, kind.value, problem)
    sizes = np.array([int(sc.sum()), int(sc.max(initial=0)), len(speers)], np.int64)
    with watchdog.guard("many_to_many (agreement of the sizes)"):
        mpi.direct("all_reduce", sizes.dtype, reduce_op=ReduceOp.MAX, in_place=True)(sizes)
    itemsize = sendbuf.dtype.itemsize
    request = _request(ctx, kind, int(sizes[0]) * itemsize, itemsize,
                       max_block=int(sizes[1]) * itemsize, peers=int(sizes[2]), uniform=False)
    alloc = allocator(ctx.xp, int(rc.sum()))
    if recvbuf is None:
        recvbuf = alloc(sendbuf)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_peers=speers,
                  send_counts=sc, send_displs=displs(sc), recv_peers=rpeers, recv_counts=rc,
                  recv_displs=displs(rc))

    def resume(bufs, agreed, async_again):  # a rank's call is new: go on as it does
        again, now = _m2m_plan(ctx, agreements, bufs[0], bufs[1], speers, sc, rpeers, rc,
                               agreed, async_again, algo, chunk_bytes, key)
        return again.first(now, async_again)

    # the sizes the plan was selected for, as two numbers every rank's plan must share
    chosen = (int(sizes[0]), (int(sizes[1]) << 16) | int(sizes[2]))
    plan = build(ctx, request, None, [], algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=(sendbuf, recvbuf), result_at=1,
                 async_op=async_op, extra=(rpeers, rc), agreements=agreements, kind=VPlan,
                 alloc=alloc, sizes=chosen, resume=resume)
    remember(ctx.state, key, plan)
    return plan, (sendbuf, recvbuf)
