"""Fail together: agree on argument validity before anyone blocks.

A collective whose arguments are wrong on one rank must raise on *every*
rank, naming what was wrong where; otherwise the healthy ranks wait forever
for a peer that already raised. :func:`agree` does this with one small
``Allreduce`` (MAX over ``[flag, signature, -signature]``): if any rank
reported a problem or the signatures (op, dtype, counts, root …) differ, a
second, error-path-only ``allgather`` collects the details and every rank
raises the same :class:`~neocomm.errors.CollectiveArgumentError` — in the
spirit of nccl-tests reducing its error count across ranks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from neocomm import watchdog
from neocomm.errors import CollectiveArgumentError
from neocomm.types import dtype_from_code

__all__ = ["agree", "Problem"]

#: Fixed number of signature slots, so ranks calling different ops still agree on the layout.
SIGNATURE_SLOTS = 12


class Problem(ValueError):
    """A local validation failure: ``field`` names the argument."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


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
    """
    comm = getattr(comm, "comm", comm)
    if len(signature) > SIGNATURE_SLOTS:
        raise ValueError(f"signature: at most {SIGNATURE_SLOTS} fields, got {len(signature)}")
    sig = np.zeros(_SLOTS, np.int64)
    sig[0] = _OP_IDS.get(op) or _op_id(op)  # different operations never agree
    for i, (_, value) in enumerate(signature, 1):
        sig[i] = value
    vec = np.empty(1 + 2 * _SLOTS, np.int64)
    vec[0] = 1 if problem is not None else 0
    vec[1:1 + _SLOTS] = sig
    vec[1 + _SLOTS:] = -sig
    out = np.empty_like(vec)
    from mpi4py import MPI

    with watchdog.guard(f"argument agreement of {op}{where}"):
        comm.Allreduce(vec, out, op=MPI.MAX)
    mismatch = not np.array_equal(out[1:1 + _SLOTS], -out[1 + _SLOTS:])
    if out[0] == 0 and not mismatch:
        return
    _raise_together(comm, op, problem, signature, sig, call)


_SLOTS = 1 + SIGNATURE_SLOTS  # the operation's own number first
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
    from neocomm.backends.checks import REDUCE_CODES

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


def _raise_together(comm, op, problem, signature, sig, call) -> None:
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
        everyone = comm.allgather((mine, names, sig.tolist(), call))
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
    for i in range(_SLOTS):
        values = [s[i] for s in sigs]
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
