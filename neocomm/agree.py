"""Fail together: agree on argument validity before anyone blocks.

A collective whose arguments are wrong on one rank must raise on *every*
rank, naming what was wrong where; otherwise the healthy ranks wait forever
for a peer that already raised. :func:`agree` does this with one small
``Allreduce`` (MAX over ``[flag, h, -h, …]``, ``h`` a number of the call's
signature): if any rank reported a problem or the signatures (op, dtype,
counts, root …) differ, a
second, error-path-only ``allgather`` collects the details and every rank
raises the same :class:`~neocomm.errors.CollectiveArgumentError` — in the
spirit of nccl-tests reducing its error count across ranks.
"""
from __future__ import annotations

from time import monotonic as _now
from typing import Sequence

import numpy as np

from neocomm import watchdog
from neocomm.errors import CollectiveArgumentError
from neocomm.types import dtype_from_code

__all__ = ["agree", "Agreement", "Problem"]

#: Most named integers one signature holds.
SIGNATURE_SLOTS = 12

#: The agreement vector: [problem flag, h, -h, fresh, s0, s1, -s0, -s1], reduced with
#: MAX. ``h`` is a 62-bit number of the operation and its signature: every rank's h is
#: equal exactly when max(h) == -max(-h). ``fresh`` and the sizes ``s0, s1`` are values a
#: caller may carry along (their largest, and whether every rank's are equal: see
#: :meth:`Agreement.run`). One length for every agreement, so that ranks making
#: different calls still meet in the same Allreduce.
AGREE_LEN = 8


class Problem(ValueError):
    """A local validation failure: ``field`` names the argument."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _number(op: str, signature) -> int:
    """``h`` of the operation and its signature's values (the same in every process:
    the hash of a tuple of ints does not depend on Python's hash seed), never 0."""
    values = (_OP_IDS.get(op) or _op_id(op),) + tuple(int(v) for _, v in signature)
    return (hash(values) & 0x3FFFFFFFFFFFFFFF) or 1


class Agreement:
    """The agreement of one call, built once and run as often as the call is made.

    ``op`` names the operation, ``signature`` up to :data:`SIGNATURE_SLOTS` named
    integers that must be equal on every rank, ``call`` this rank's call in the
    user's words (a string, or a function that makes it: only an error needs it),
    ``where`` and ``number`` (the call's number, asked only when the wait is reported)
    complete the name the stall watchdog gives the wait. :meth:`run` is one Allreduce of :data:`AGREE_LEN` integers on a prepared vector;
    the details (who differs, how) are gathered only when something does.
    """

    __slots__ = ("op", "signature", "call", "vec", "out", "slot", "_msgs", "_flags", "_sizes")

    def __init__(self, op: str, signature: Sequence[tuple[str, int]] = (), call=None,
                 where: str = "", number=None):
        if len(signature) > SIGNATURE_SLOTS:
            raise ValueError(f"signature: at most {SIGNATURE_SLOTS} fields, "
                             f"got {len(signature)}")
        self.op, self.signature, self.call = op, list(signature), call
        h = _number(op, signature)
        self.vec = np.array([0, h, -h, 0, 0, 0, 0, 0], np.int64)
        self.out = np.empty(AGREE_LEN, np.int64)
        self._msgs = None  # ([vec, INT64_T], [out, INT64_T], MAX): made on the first run
        self._flags, self._sizes = (0, 0), (0, 0)  # what vec holds at [0], [3] and [4:6]
        self.slot = watchdog.Slot(f"argument agreement of {op}{where}", number)

    def run(self, comm, problem: "Problem | str | None" = None, fresh: int = 0,
            sizes: tuple[int, int] | None = None) -> np.ndarray:
        """Agree over ``comm``; raise :class:`CollectiveArgumentError` on every rank when
        a rank has a problem or the signatures differ. Returns the reduced vector:
        ``[3]`` is the largest ``fresh``, ``[4:6]`` the largest ``sizes`` and ``[6:8]``
        minus the smallest (every rank's sizes are equal when ``[4:6] == -[6:8]``)."""
        vec, out, slot = self.vec, self.out, self.slot
        flags = (0 if problem is None else 1, fresh)
        if flags != self._flags:  # (a repeated call writes nothing)
            vec[0], vec[3] = self._flags = flags
        if sizes is not None and sizes != self._sizes:
            vec[4], vec[5] = self._sizes = sizes
            vec[6], vec[7] = -sizes[0], -sizes[1]
        msgs = self._msgs
        if msgs is None:
            msgs = self._msgs = _messages(vec, out)
        slot.since = _now()
        try:
            comm.Allreduce(*msgs)
        finally:
            slot.since = 0.0
        flag, h, minus_h = out[:3].tolist()
        if flag or h != -minus_h:
            _raise_together(comm, self.op, problem, self.signature, self.call)
        return out


def _messages(vec, out) -> tuple:
    """The arguments of the agreement's Allreduce, datatype spelled out (mpi4py need
    not read it from the arrays on every run)."""
    from mpi4py import MPI

    return [vec, MPI.INT64_T], [out, MPI.INT64_T], MPI.MAX


def agree(comm, op: str, problem: "Problem | str | None" = None,
          signature: Sequence[tuple[str, int]] = (), call=None, where: str = "") -> None:
    """Raise :class:`CollectiveArgumentError` on every rank if any rank has a problem.

    ``comm`` is an mpi4py communicator (or a ProcessGroup); ``problem`` this
    rank's validation failure (None when fine); ``signature`` up to
    :data:`SIGNATURE_SLOTS` named integers that must be equal on every rank
    (op code, dtype code, count, root, …); ``call`` this rank's call in the
    user's words (a string, or a function that makes it: only an error needs
    it), shown for every rank when the signatures differ; ``where`` (e.g. " on group
    'world', call #3") completes the name of the wait the stall watchdog reports.
    A call made again and again builds its :class:`Agreement` once instead.
    """
    Agreement(op, signature, call, where).run(getattr(comm, "comm", comm), problem)


_OP_IDS: dict[str, int] = {}


def _op_id(op: str) -> int:
    """A number for the operation's name (the same in every process), never 0."""
    import zlib

    found = _OP_IDS[op] = (zlib.crc32(op.encode()) & 0x7FFFFFFF) or 1
    return found


#: signature fields that are internal numbers (codes, digests), never shown to a user
_INTERNAL = {"op", "symmetric buffers", "algo", "chunk", "recv_counts", "ranks", "counts",
             "shape", "plan"}


def _describe(op: str, signature) -> str:
    """A call in the user's words from its signature: ``all_reduce(float32, count=4,
    reduce_op='sum')`` (internal codes left out)."""
    from neocomm.types import REDUCE_CODES

    by_code = {code: rop.value for rop, code in REDUCE_CODES.items()}
    parts = []
    for name, value in signature:
        if name == "dtype":
            parts.insert(0, dtype_from_code(value))
        elif name == "reduce_op":
            parts.append(f"op={by_code.get(value, value)!r}")
        elif name == "async":
            if value:
                parts.append("async_op=True")
        elif name not in _INTERNAL:
            parts.append(f"{name}={value}")
    return f"{op}({', '.join(str(p) for p in parts)})"


def _raise_together(comm, op, problem, signature, call) -> None:
    sig = [_OP_IDS.get(op) or _op_id(op)] + [int(v) for _, v in signature]
    if isinstance(problem, Problem):
        mine = (problem.field, problem.message)
    elif problem is not None:
        mine = ("", str(problem))
    else:
        mine = None
    names = ["op"] + [name for name, _ in signature]
    if callable(call):
        call = call()
    elif call is None:
        call = _describe(op, signature)
    with watchdog.guard(f"error report of {op}"):
        everyone = comm.allgather((mine, names, sig, call))
    per_rank = {r: m[1] for r, (m, _, _, _) in enumerate(everyone) if m is not None}
    if per_rank:
        first = min(per_rank)
        field = everyone[first][0][0]
        ranks = tuple(sorted(per_rank))
        where = "rank " + str(ranks[0]) if len(ranks) == 1 else f"ranks {list(ranks)}"
        msg = f"{op}: {per_rank[first]} (on {where})"
        others = "; ".join(f"rank {r}: {m}" for r, m in per_rank.items()
                           if r != first and m != per_rank[first])
        if others:  # what the other ranks said differently
            msg += f"; also {others}"
        raise CollectiveArgumentError(msg, op=op, field=field, ranks=ranks, per_rank=per_rank)
    # No local problem anywhere: the signatures differ. Name the first field that does,
    # and show every rank's call (as the caller described it, or from its signature).
    sigs = [s for _, _, s, _ in everyone]
    opnames = [n for _, n, _, _ in everyone]
    calls = [c for _, _, _, c in everyone]
    longest = max(len(s) for s in sigs)
    for i in range(longest):
        values = [s[i] if i < len(s) else None for s in sigs]
        if len(set(values)) > 1:
            same_layout = all(n == opnames[0] for n in opnames)
            field = opnames[0][i] if same_layout and i < len(opnames[0]) else "call"
            if field in ("op", "async"):
                field = "call"  # different operations, or blocking and not
            ranks = tuple(r for r, v in enumerate(values) if v != values[0]) or (0,)
            by_rank = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            what = "the ranks' calls differ" if field == "call" else \
                f"{op}: {field} differs across ranks"
            raise CollectiveArgumentError(f"{what}: {by_rank}", op=op, field=field,
                                          ranks=ranks, per_rank=dict(enumerate(calls)))
    raise CollectiveArgumentError(f"{op}: arguments differ across ranks", op=op)  # pragma: no cover
