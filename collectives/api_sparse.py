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
from neocomm.types import bfloat16, dtype_from_code

from collectives.algorithms import displs
from collectives.api import _dcode, _flat, _request, _shown
from collectives.fabric import fabric_for
from collectives.plan import OP_CODES, build, context, fail
from collectives.types import CollectiveOp
from collectives.validate import check_buffer, check_peer, check_same_dtype, first

__all__ = ["one_to_many", "many_to_many"]


def _digest(values) -> int:
    return zlib.crc32(np.asarray(values, np.int64).tobytes()) & 0x7FFFFFFF


def _dtype_of(code: int) -> np.dtype:
    name = dtype_from_code(code)
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


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
    kind = CollectiveOp.ONE_TO_MANY
    probe = sendbuf if sendbuf is not None else recvbuf
    ctx = context(group, probe if probe is not None else np.empty(0, np.uint8), kind.value)
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
    dtype_code = _dcode(sendbuf if is_root else recvbuf) if (is_root or recvbuf is not None) \
        else 0
    # Size and dtype of the payload travel from the root (receivers may not know them).
    head = np.array([dtype_code, sendbuf.size if is_root and identical else 0], np.int64)
    sig = [("op", OP_CODES[kind]), ("root", int(root) if isinstance(root, (int, np.integer))
                                    else -1),
           ("ranks", _digest(members)), ("counts", 0 if identical else _digest(cnt))]
    fail(ctx, kind, problem, sig, call=lambda: f"one_to_many(root={root!r}, ranks="
                                              f"{_shown(ranks)}, counts={_shown(counts)})")
    ctx.group.comm.Bcast(head, root=int(root))
    code, size = int(head[0]), int(head[1])
    problem = None
    if receiver and recvbuf is not None:
        if _dcode(recvbuf) != code:
            problem = Problem("recvbuf", f"recvbuf: dtype {recvbuf.dtype.name} differs from "
                                         f"the root's payload ({dtype_from_code(code)})")
        elif identical and recvbuf.size != size:
            problem = Problem("recvbuf", f"recvbuf: expected the root's {size} elements, got "
                                         f"{recvbuf.size}")
    fail(ctx, kind, problem, [("op", OP_CODES[kind]), ("dtype", code)])
    dtype = _dtype_of(code)
    if receiver and recvbuf is None:
        recvbuf = ctx.xp.empty(int(cnt[members.index(me)]), dtype=dtype)
    itemsize = dtype.itemsize
    per_receiver = size if identical else int(cnt.max(initial=0))
    request = _request(ctx, kind, per_receiver * itemsize, itemsize,
                       max_block=per_receiver * itemsize, root=int(root),
                       peers=len([m for m in members if m != int(root)]),
                       identical=identical, uniform=identical)
    fields = dict(sendbuf=_flat(sendbuf) if is_root else None,
                  recvbuf=_flat(recvbuf) if receiver else None, root=int(root),
                  members=members, identical=identical,
                  send_counts=cnt, send_displs=displs(cnt))
    return _run_once(ctx, request, None, [("op", OP_CODES[kind])], algo, chunk_bytes, itemsize,
                     fields, recvbuf if receiver else None, async_op)


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
    kind = CollectiveOp.MANY_TO_MANY
    ctx = context(group, sendbuf, kind.value)
    p, dev, comm = ctx.group.size, ctx.backend.device, ctx.group.comm
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
    # Dense view of who sends what to whom: -1 no message, else the count.
    if rpeers is None or ctx.check:
        dense = np.full(p, -1, np.int64)
        if problem is None:
            dense[speers] = sc
        else:
            dense[:] = -2  # this rank reports its own problem
        offered = np.empty(p, np.int64)
        comm.Alltoall(dense, offered)
        if rpeers is None:
            rpeers = [int(x) for x in np.flatnonzero(offered >= 0)]
            rc = offered[rpeers].astype(np.int64)
        elif problem is None and not (offered == -2).any():
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
    if rc is None:
        problem = problem or Problem("recv_counts", "recv_counts: unknown; pass recv_counts "
                                                    "with recv_peers, or turn on "
                                                    "NEOCOMM_CHECK_ARGS")
        rc = np.zeros(len(rpeers or []), np.int64)
    if problem is None and recvbuf is not None and recvbuf.size != int(rc.sum()):
        problem = Problem("recvbuf", f"recvbuf: expected {int(rc.sum())} elements, got "
                                     f"{recvbuf.size}")
    ok = problem is None
    itemsize = sendbuf.dtype.itemsize if ok else 1
    from mpi4py import MPI

    sizes = np.array([int(sc.sum()), int(sc.max(initial=0)), len(speers)] if ok else [0, 0, 0],
                     np.int64)
    comm.Allreduce(MPI.IN_PLACE, sizes, op=MPI.MAX)
    request = _request(ctx, kind, int(sizes[0]) * itemsize, itemsize,
                       max_block=int(sizes[1]) * itemsize, peers=int(sizes[2]), uniform=False)
    if ok and recvbuf is None:
        recvbuf = ctx.xp.empty(int(rc.sum()), dtype=sendbuf.dtype)
    fields = dict(sendbuf=_flat(sendbuf), recvbuf=_flat(recvbuf), send_peers=speers,
                  send_counts=sc, send_displs=displs(sc), recv_peers=rpeers, recv_counts=rc,
                  recv_displs=displs(rc)) if ok else {}
    sig = [("op", OP_CODES[kind]), ("dtype", _dcode(sendbuf))]
    return _run_once(ctx, request, problem, sig, algo, chunk_bytes, itemsize, fields,
                     (recvbuf, rpeers, rc), async_op)


def _run_once(ctx, request, problem, signature, algo, chunk_bytes, itemsize, fields, result,
              async_op):
    """Plan and run a targeted call (its plan is not kept: who sends what to whom is
    each call's own); returns the result (or a handle whose ``wait()`` returns it)."""
    plan = build(ctx, request, problem, signature, algo=algo, chunk_bytes=chunk_bytes,
                 itemsize=itemsize, fields=fields, bufs=None, result_at=0, async_op=async_op)
    return plan.once(result, async_op)
