"""Plans: the one way a collective call runs.

A call is checked (:mod:`collectives.validate`), agreed across its group
(:mod:`neocomm.agree`: a bad argument anywhere raises on every rank), its
algorithm and chunking selected, and the result is a :class:`Plan`: the
algorithm, its prepared :class:`~collectives.algorithms.Call` without
buffers, the call's agreement, and how the result is made of the buffers.
The group keeps the plan in its :class:`~collectives.state.PlanCache`
under the call's layout — operation, options, dtype and sizes, never the
identity of an array — and every later call of that layout runs it:
blocking or ``async_op=True`` (the same plan, with a handle), on the same
buffers or on new ones of the same layout (checked on the spot: kind,
contiguity, writability, overlap), with a ``recvbuf`` or with one the plan
allocates. Every public collective enters through :func:`call`, which
replays the kept plan or builds one. A prepared collective
(:mod:`collectives.persistent`) is a plan the user holds. A plan's ``algo``
names the algorithm it runs: the one a call of its layout gets.

With argument checks on (``NEOCOMM_CHECK_ARGS``, per group:
:attr:`~collectives.state.GroupState.check`), a run still agrees the
call's signature across the group — one Allreduce of eight integers on a
vector built with the plan — so a rank whose call differs (and so runs
another plan, or builds one) raises together with the others instead of
meeting a different collective. Inside a step that every rank agreed
already (:class:`~collectives.control.StepControl`: a training loop's step
of an unchanged shape) calls run without their own agreement, except the
AlltoAllv's, which also agrees the sizes its algorithm is chosen for. Work a plan already proved is skipped: the
recv counts of an AlltoAllv are checked against the senders only when some
rank's call is new (see :class:`VPlan`).

Plans hold weak references to the buffers they last ran on, never the
buffers: a run binds the buffers it is given to a copy of the prepared
Call. The plan of a call on symmetric memory keeps the peers' views of the
shared region and runs only on those buffers; it goes as soon as one of
them is freed, so that the region can go too.
"""
from __future__ import annotations

import copy
import weakref
import zlib
from time import monotonic as _now

from neocomm.agree import Agreement, Problem
from neocomm.config import SettingsError
from neocomm.errors import CollectiveArgumentError
from neocomm.watchdog import Slot

from collectives import progress, settings
from collectives.algorithms import Call, registry
from collectives.chunking import ChunkPolicy, staging_pool
from collectives.select import SelectionError, select
from collectives.state import GroupState, state_of
from collectives.types import CollectiveOp, Request
from collectives.validate import check_buffer, overlapping

from numpy import may_share_memory as _may_share, ndarray as _ndarray

__all__ = ["Plan", "VPlan", "Context", "call", "context", "build", "kept", "remember", "fail",
           "OP_CODES", "MISS", "array_module", "stale", "allocator"]

#: Stable op codes of the collectives layer in agreement signatures.
OP_CODES = {op: 101 + i for i, op in enumerate(CollectiveOp)}

#: What :meth:`Plan.replay` returns when the buffers given need a plan of their own.
MISS = object()


def call(group, key, build, a, b, async_op: bool, *args):
    """The one way a collective call runs (every public collective is this call).

    The plan that group ``group`` keeps under ``key`` (the call's layout; None: a call
    that cannot have one) replays the call on buffers ``a`` and ``b`` (``b`` None: one
    the plan allocates, or a one-buffer call). Otherwise — no plan, or one these
    buffers cannot use — ``build(state, key, a, b, async_op, *args)`` checks, agrees
    and selects the call and returns ``(plan, bufs)``, the plan kept under ``key`` when
    it suits later calls (:func:`kept`), and the plan runs once on ``bufs`` without
    agreeing again. Returns what the call returns (or a handle whose ``wait()`` does).
    """
    state = state_of(group)
    if key is not None:
        plan = state.plans.get(key)
        if plan is not None:
            out = plan.replay(a, b, async_op)
            if out is not MISS:
                return out
    plan, bufs = build(state, key, a, b, async_op, *args)
    return plan.first(bufs, async_op)


def kept(state: GroupState, key, plan: "Plan", bufs: tuple, a, b) -> tuple:
    """``(plan, bufs)``, the plan kept under ``key`` when it runs on the caller's own
    buffers ``a`` and ``b`` (not on a copy made apart, nor on one view standing for two)."""
    if key is not None and bufs[0] is a and (b is None or bufs[-1] is b):
        remember(state, key, plan)
    return plan, bufs


def array_module(buf):
    """``cupy`` for device arrays, else ``numpy``."""
    if hasattr(buf, "__cuda_array_interface__"):
        import cupy

        return cupy
    import numpy

    return numpy


def allocator(xp, n: int, dtype=None):
    """How a run without a receive buffer makes one: ``n`` elements of ``xp``, of
    ``dtype`` or the dtype of the buffer it is given."""

    def alloc(a):
        return xp.empty(n, dtype=a.dtype if dtype is None else dtype)

    return alloc


class Context:
    """The group state, backend, array module, fabric and layout of one call being built."""

    __slots__ = ("state", "group", "backend", "xp", "fabric", "layout", "check")

    def __init__(self, state: GroupState, backend, xp, op: str = ""):
        from collectives.fabric import fabric_for

        self.state, self.group, self.backend, self.xp = state, state.group, backend, xp
        self.fabric = fabric_for(state.group, device=xp.__name__ != "numpy", first=op)
        self.layout = state.layout
        self.check = state.check


def context(group, buf, op: str = "", state: GroupState | None = None) -> Context:
    """The :class:`Context` of a call ``op`` on ``group`` (None: the world group) moving
    ``buf``."""
    state = state_of(group) if state is None else state
    return Context(state, state.group.backend(buf), array_module(buf), op)


def _agreement(op: str, signature, call, group) -> Agreement:
    """The :class:`Agreement` of a call on ``group``; the stall watchdog names its wait
    after the group and the call's number."""
    return Agreement(op, signature, call, f" on group {group.name!r}", state_of(group).peek)


def fail(ctx: Context, op: CollectiveOp, problem: Problem | None, signature,
         call=None) -> None:
    """Raise on every rank when any rank has a problem or the ranks' calls differ
    (agreement; ``call`` describes this rank's call for the message), or locally when
    argument checks are off."""
    if ctx.check:
        _agreement(op.value, signature, call, ctx.group).run(ctx.group.comm, problem)
    elif problem is not None:
        _raise_here(ctx.group.rank, op.value, problem)


def _raise_here(rank: int, op: str, problem: Problem) -> None:
    raise CollectiveArgumentError(f"{op}: {problem.message}", op=op, field=problem.field,
                                  ranks=(rank,), per_rank={rank: problem.message})


def _symmetric_sig(chosen, fields) -> int:
    """The symmetric buffers a ``symmetric`` call reads (dtype, allocations,
    offsets, sizes) as one number; 0 for any other algorithm. In the agreed
    signature it names a rank whose buffers are not symmetric, or not the same
    slice, before the choice of algorithm that follows from it."""
    if chosen is None or chosen.name != "symmetric" or not isinstance(fields, dict):
        return 0
    return (zlib.crc32(repr(fields.get("sym_check")).encode()) & 0x7FFFFFFF) or 1


def _choose(ctx: Context, request: Request, algo, chunk_bytes, itemsize: int):
    """``(algorithm, chunk policy, problem)`` of ``request`` on this call's fabric."""
    try:
        chosen = select(request, ctx.fabric, algo)
    except SelectionError as exc:
        return None, None, Problem("algo", str(exc))
    try:
        policy = ChunkPolicy.resolve(ctx.fabric, itemsize, chunk_bytes)
        if getattr(ctx.backend, "in_order_p2p", False):
            policy = ChunkPolicy.whole()
    except (ValueError, TypeError, SettingsError) as exc:
        return chosen, None, Problem("chunk_bytes", str(exc))
    return chosen, policy, None


def _agreements(op: str, signature, call, group) -> tuple:
    """The blocking and the asynchronous call's :class:`Agreement` (MPI never matches a
    blocking collective with a non-blocking one, so they must differ)."""
    return tuple(_agreement(op, list(signature) + [("async", a)], call, group)
                 for a in (0, 1))


def build(ctx: Context, request: Request, problem: Problem | None, signature, *,
          algo: str | None, chunk_bytes, itemsize: int, fields, bufs: tuple, result_at,
          async_op: bool, call=None, alloc=None, extra=(), agreements=None,
          kind=None, **more) -> "Plan":
    """Select and agree a validated call and return its :class:`Plan` (raising on every
    rank when any rank's call is bad or differs). ``fields`` are the
    :class:`~collectives.algorithms.Call`'s (a callable: made once the call is agreed),
    ``bufs`` the buffers as the user passed them (the allocated ``recvbuf`` included),
    ``result_at`` the index of the result among them, ``alloc(sendbuf)`` how a run
    without a ``recvbuf`` makes one. A call agreed already passes its ``agreements``
    (and ``kind``, the plan class, with its own arguments)."""
    op = request.op
    chosen, policy = None, None
    if problem is None:
        chosen, policy, problem = _choose(ctx, request, algo, chunk_bytes, itemsize)
    index = registry()[op].index(chosen) if chosen is not None else -1
    chunk_sig = 0 if policy is None else policy.intra ^ (policy.inter << 1)
    signature = list(signature) + [("symmetric buffers", _symmetric_sig(chosen, fields)),
                                   ("algo", index), ("chunk", chunk_sig & 0x7FFFFFFF)]
    if agreements is None:
        agreements = _agreements(op.value, signature, call, ctx.group)
        if ctx.check and not ctx.state.trust.on:
            agreements[int(bool(async_op))].run(ctx.group.comm, problem)
    if problem is not None:
        _raise_here(ctx.group.rank, op.value, problem)
    if callable(fields):
        fields = fields()
    made = Call(op, ctx.group, ctx.backend, ctx.xp, ctx.fabric, policy,
                staging_pool(ctx.xp), 0, ctx.layout, blocking=not async_op, **fields)
    return (kind or Plan)(ctx.state, made, chosen, bufs, result_at, agreements, alloc, extra,
                          **more)


class Plan:
    """A checked, agreed and selected collective call, run again and again.

    ``op`` names the collective, ``algo`` its algorithm. :meth:`replay` runs it on
    the buffers of a new call of the same layout; :meth:`run` on buffers already
    proved (a prepared collective's).
    """

    __slots__ = ("op", "algo", "_algo", "state", "_call", "fast", "afast", "_agree", "_result_at",
                 "_extra", "_alloc", "_refs", "_kinds", "_check", "_version", "slot", "_sym",
                 "_send_at", "_recv_at", "key", "__weakref__")

    def __init__(self, state: GroupState, call: Call, algo, bufs: tuple, result_at: int,
                 agreements: tuple, alloc=None, extra=()):
        self.op, self.algo, self._algo, self.state = call.op.value, algo.name, algo, state
        self._agree = agreements
        self._result_at, self._extra, self._alloc = result_at, tuple(extra), alloc
        self._check, self._version = state.check, settings.version()
        self._sym = getattr(call, "peer_send", None) is not None
        self.key = None
        # The MPI backend's direct calls of a native call on host buffers, blocking and not
        # (made while the Call still holds its buffers), else None.
        direct = hasattr(algo, "fast")
        self.fast = algo.fast(call) if direct else None
        self.afast = algo.fast(call, blocking=False) if direct else None
        self.slot = Slot(f"{self.op} ({self.algo}) on group {state.group.name!r}",
                         lambda: state.peek() - 1)
        # Which of ``bufs`` the Call's flat buffers view: (send, recv) or (buf,).
        self._send_at = 0 if call.sendbuf is not None else None
        self._recv_at = len(bufs) - 1 if call.recvbuf is not None else None
        template = copy.copy(call)
        template.sendbuf = template.recvbuf = None  # the plan must not keep the buffers alive
        self._call = template
        self._kinds = tuple((b.dtype, b.size, i == self._recv_at or len(bufs) == 1)
                            for i, b in enumerate(bufs))
        drop = self._dropper() if self._sym else None
        self._refs = [weakref.ref(b, drop) for b in bufs]

    # -- runs ----------------------------------------------------------------------
    def replay(self, a, b=None, async_op: bool = False):
        """Run on the buffers of a new call of this plan's layout (``b`` None: the
        plan allocates the receive buffer) and return what the call returns, or
        :data:`MISS` when these buffers need a plan of their own (nothing ran)."""
        bufs = self.accept(a, b)
        return MISS if bufs is MISS else self.run(*bufs, async_op=async_op)

    def accept(self, a, b=None):
        """The buffers this plan runs on for a call given ``a`` and ``b`` (``b`` None: one
        the plan allocates), proved and remembered, or :data:`MISS` when they need a
        plan of their own."""
        state = self.state
        if self._check is not state.check or self._version != settings.VERSION:
            return MISS
        refs = self._refs
        if not refs:  # a rank with no part in the call (a OneToMany's outsider)
            return ()
        if a is None:  # a buffer the plan allocates (a OneToMany's receiver without one)
            if self._alloc is None or len(refs) != 1:
                return MISS
            a = self._alloc(None)
            self._refs = [weakref.ref(a)]
            return (a,)
        if refs[0]() is not a and not self._prove(0, a):
            return MISS
        if len(refs) == 1:
            return (a,)
        if b is None:  # memory of its own: nothing to check
            b = self._alloc(a)
            if refs[0]() is not a:
                self._refs = [weakref.ref(a), refs[1]]
        elif refs[1]() is not b or refs[0]() is not a:
            if refs[1]() is not b and not self._prove(1, b):
                return MISS
            if not self._rebind(a, b):
                return MISS
        return (a, b)

    def run(self, *bufs, async_op: bool = False):
        """Run on ``bufs`` (already proved for this plan) and return the result: the
        result buffer, or a handle whose ``wait()`` returns it."""
        state = self.state
        if self._check and not state.trust.on:
            self._agree[1 if async_op else 0].run(state.group.comm)
        return self._start(bufs, next(state.seq), async_op)

    def first(self, bufs: tuple, async_op: bool = False):
        """Run a plan just built, whose call :func:`build` agreed already (agreeing it
        again would meet the next call of a rank that ran its plan: one agreement per
        call, whichever path it takes)."""
        return self._start(bufs, next(self.state.seq), async_op)

    def _start(self, bufs, seq: int, async_op: bool):
        at = self._result_at
        result = None if at is None else bufs[at]
        if self._extra:
            result = (result,) + self._extra
        if async_op:
            afast = self.afast
            if afast is not None:
                return progress.RequestHandle(afast(*bufs), result, self.slot,
                                              self.state.progress.active, bufs)
        else:
            fast = self.fast
            if fast is not None and not self.state.progress.active:
                slot = self.slot
                slot.since = _now()
                try:
                    fast(*bufs)
                finally:
                    slot.since = 0.0
                return result
        call = copy.copy(self._call)
        send_at, recv_at = self._send_at, self._recv_at
        if send_at is not None:
            call.sendbuf = bufs[send_at].reshape(-1)
        if recv_at is not None:  # in place: one view, as the first call had
            call.recvbuf = call.sendbuf if recv_at == send_at else bufs[recv_at].reshape(-1)
        return self._drive(call, seq, result, async_op)

    def _drive(self, call: Call, seq: int, result, async_op: bool):
        """Run the algorithm on ``call`` as operation ``seq`` of the group: to the end, or
        behind the handle it returns."""
        call.tag, call.blocking = progress.tag_of(seq), not async_op
        handle = progress.start(self._algo.run(call), result, async_op, self.slot.what,
                                self.state.progress)
        return handle if async_op else result

    # -- new buffers -------------------------------------------------------------------
    def _prove(self, i: int, buf) -> bool:
        """Whether ``buf`` may stand where this plan's buffer ``i`` stood: the same
        dtype and size, a valid array of the plan's kind (never for a symmetric plan)."""
        if self._sym:
            return False
        dtype, size, writes = self._kinds[i]
        try:
            if buf.dtype != dtype or buf.size != size:
                return False
        except AttributeError:
            return False
        return check_buffer("buf", buf, device=self._call.backend.device, writable=writes,
                            reducible=self._call.reduce_op is not None) is None

    def _rebind(self, a, b) -> bool:
        """Remember ``(a, b)`` as the buffers last run on, when they are memory of their
        own (False: the call needs its own plan — an in-place call, or buffers that
        overlap in part, whose checks say why)."""
        if a is b or (type(a) is not _ndarray or type(b) is not _ndarray
                      or _may_share(a, b)) and overlapping(a, b):
            return False
        self._refs = [weakref.ref(a), weakref.ref(b)]
        return True

    def _dropper(self):
        """A weak-reference callback that forgets this plan from its group's cache."""
        me = weakref.ref(self)

        def drop(_):
            plan = me()
            if plan is not None and plan.key is not None:
                plan.state.plans.drop(plan.key, plan)

        return drop

    def __repr__(self) -> str:
        return f"<Plan {self.op} ({self.algo}) on group {self.state.group.name!r}>"


def stale(out) -> bool:
    """Whether an agreed vector (:meth:`neocomm.agree.Agreement.run`) says that some rank's
    call is new or that the ranks' plans were made for other sizes: every rank then goes
    on as a new call does, its counts checked again."""
    return bool(out[3] or out[4] != -out[6] or out[5] != -out[7])


def remember(state: GroupState, key, plan: Plan) -> Plan:
    """Keep ``plan`` under ``key`` in the group's cache (``key`` None: not kept)."""
    if key is not None:
        plan.key = key
        state.plans.put(key, plan)
    return plan


class VPlan(Plan):
    """The plan of an AlltoAllv with both counts given, whose counts a first run checked.

    A run agrees the call's signature together with the send sizes the plan was
    selected for (the largest total and block of any rank). When every rank runs
    such a plan and their sizes are equal, nothing else is needed: the counts were
    checked against the senders when the plans were made. Otherwise — some rank's
    call is new, or the ranks' plans were selected for other sizes — every rank
    goes on as a new call does from the agreement on (``resume``): the counts are
    exchanged (checked, with checks on), the sizes agreed now select the algorithm.
    """

    __slots__ = ("sizes", "resume")

    def __init__(self, *args, sizes=(0, 0), resume=None, **kw):
        super().__init__(*args, **kw)
        self.sizes, self.resume = sizes, resume

    def run(self, *bufs, async_op: bool = False):
        state = self.state
        out = self._agree[1 if async_op else 0].run(state.group.comm, sizes=self.sizes)
        if stale(out):
            return self.resume(bufs, out, async_op)
        return self._start(bufs, next(state.seq), async_op)
