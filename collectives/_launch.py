"""What every collective call does before its algorithm runs.

Resolve the group and its backend, build the request, select the
algorithm and the chunking, agree all of it across the group (so a bad
argument anywhere raises :class:`~neocomm.errors.CollectiveArgumentError`
everywhere), then start the algorithm blocking or behind a handle.
"""
from __future__ import annotations

import zlib

from neocomm.agree import Problem, agree
from neocomm.config import SettingsError
from neocomm.errors import CollectiveArgumentError

from collectives import plans, progress
from collectives.algorithms import Call, registry
from collectives.chunking import ChunkPolicy, staging_pool
from collectives.fabric import fabric_for, layout_of
from collectives.select import SelectionError, select
from collectives.types import CollectiveOp, Request

__all__ = ["Context", "context", "launch", "fail", "OP_CODES"]

#: Stable op codes of the collectives layer in agreement signatures.
OP_CODES = {op: 101 + i for i, op in enumerate(CollectiveOp)}


class Context:
    """The group, backend, array module, fabric and layout of one call."""

    __slots__ = ("group", "backend", "xp", "fabric", "layout", "check")

    def __init__(self, group, backend, xp, op: str = ""):
        self.group, self.backend, self.xp = group, backend, xp
        self.fabric = fabric_for(group, device=xp.__name__ != "numpy", first=op)
        self.layout = layout_of(group)
        self.check = bool(getattr(backend, "check_args", True))


def array_module(buf):
    """``cupy`` for device arrays, else ``numpy``."""
    if hasattr(buf, "__cuda_array_interface__"):
        import cupy

        return cupy
    import numpy

    return numpy


def context(group, buf, op: str = "") -> Context:
    """The :class:`Context` of a call ``op`` on ``group`` (None: the world group) moving
    ``buf``."""
    from neocomm.world import group_or_world

    group = group_or_world(group)
    return Context(group, group.backend(buf), array_module(buf), op)


def fail(ctx: Context, op: CollectiveOp, problem: Problem | None, signature,
         call=None, where: str | None = None) -> None:
    """Raise on every rank when any rank has a problem or the ranks' calls differ
    (agreement; ``call`` describes this rank's call for the message, ``where`` names
    the group and call, :func:`where_of`), or locally when argument checks are off."""
    if ctx.check:
        agree(ctx.group.comm, op.value, problem, signature, call,
              where_of(ctx.group) if where is None else where)
    elif problem is not None:
        rank = ctx.group.rank
        raise CollectiveArgumentError(f"{op.value}: {problem.message}", op=op.value,
                                      field=problem.field, ranks=(rank,),
                                      per_rank={rank: problem.message})


def where_of(group) -> str:
    """`` on group 'NAME', call #N``: the group and the number of its next call (the same on
    every rank that has made the same calls), for the names of waits."""
    return f" on group {group.name!r}, call #{progress.peek(group)}"


def _symmetric_sig(chosen, fields) -> int:
    """The symmetric buffers a ``symmetric`` call reads (dtype, allocations,
    offsets, sizes) as one number; 0 for any other algorithm. In the agreed
    signature it names a rank whose buffers are not symmetric, or not the same
    slice, before the choice of algorithm that follows from it."""
    if chosen is None or chosen.name != "symmetric" or not isinstance(fields, dict):
        return 0
    return (zlib.crc32(repr(fields.get("sym_check")).encode()) & 0x7FFFFFFF) or 1


def launch(ctx: Context, request: Request, problem: Problem | None, signature, *,
           algo: str | None, chunk_bytes, itemsize: int, fields: dict, result,
           async_op: bool, plan_key=None, plan_bufs=(), call=None):
    """Select, agree, build the :class:`Call` (``fields`` built lazily when it is a
    callable) and run it; returns the handle. A blocking call leaves a plan under
    ``plan_key`` (see :mod:`collectives.plans`)."""
    op = request.op
    chosen, policy = None, None
    if problem is None:
        try:
            chosen = select(request, ctx.fabric, algo)
        except SelectionError as exc:
            problem = Problem("algo", str(exc))
    if problem is None:
        try:
            policy = ChunkPolicy.resolve(ctx.fabric, itemsize, chunk_bytes)
            if getattr(ctx.backend, "in_order_p2p", False):
                policy = ChunkPolicy.whole()
        except (ValueError, TypeError, SettingsError) as exc:
            problem = Problem("chunk_bytes", str(exc))
    index = registry()[op].index(chosen) if chosen is not None else -1
    chunk_sig = 0 if policy is None else policy.intra ^ (policy.inter << 1)
    signature = list(signature) + [("async", int(bool(async_op))),
                                   ("symmetric buffers", _symmetric_sig(chosen, fields)),
                                   ("algo", index), ("chunk", chunk_sig & 0x7FFFFFFF)]
    where = where_of(ctx.group)
    fail(ctx, op, problem, signature, call, where)
    if callable(fields):
        fields = fields()
    call = Call(op, ctx.group, ctx.backend, ctx.xp, ctx.fabric, policy,
                staging_pool(ctx.xp), progress.next_tag(ctx.group), ctx.layout,
                blocking=not async_op, **fields)
    plans.LAST_CHOSEN[op.value] = chosen.name
    if plan_key is not None and not async_op:
        agreement = (ctx.group.comm, op.value, signature) if ctx.check else None
        plans.remember(plan_key, plan_bufs, call, chosen, result, agreement)
    return progress.start(chosen.run(call), result, async_op,
                          f"{op.value} ({chosen.name}){where}")
