"""Plans: the prepared form of a repeated blocking collective call.

Training loops call the same collective on the same buffers step after
step. The first blocking call leaves a plan keyed by the operation, group,
options and the identity of the buffers; the next identical call checks
that the buffers are still the same arrays with the same sizes and replays
the plan (:func:`replay`): no validation, selection or chunk planning again.
With argument checks on (``NEOCOMM_CHECK_ARGS``), the plan still agrees its
signature across the group first — the same one small all-reduce the
unplanned call makes — so a rank whose arguments changed (and so has no
plan) and a rank that runs its plan stay in step, and a mismatch raises on
every rank. A plan is skipped when the settings snapshot or the backend's
argument-check flag changed since it was made, and while an asynchronous
operation of this process is outstanding (it must be driven by the waits).

Plans hold weak references to the buffers only and never keep them alive:
the caller passes the buffers again on every replay, and a plan's
:class:`~collectives.algorithms.Call` holds them only while it runs. The
plan of a call on symmetric memory keeps the peers' views of the shared
region (finding them again costs more than a small collective); it is
forgotten as soon as one of its buffers is freed, so the region is too.
"""
from __future__ import annotations

from time import monotonic as _now
import copy
import weakref

from neocomm.agree import agree
from neocomm.group import ON_RELEASE
from neocomm.watchdog import Slot

from collectives import progress, settings

__all__ = ["Plan", "replay", "remember", "capture", "clear", "LAST_CHOSEN"]

_LIMIT = 256


class Plan:
    """A prepared call: its :class:`~collectives.algorithms.Call` (buffers left out),
    algorithm, how the result is made of the buffers, and optionally a direct
    callable (``fast``, see :meth:`collectives.algorithms.native.Native.fast`)."""

    __slots__ = ("refs", "sizes", "dtypes", "snap", "backend", "checked", "call", "algo", "fast",
                 "seq", "slot", "agreement", "op_name", "algo_name", "result_at",
                 "result_rest", "send_at", "recv_at", "__weakref__")

    def __init__(self, bufs, call, algo, result, fast, agreement=None, key=None):
        # A symmetric call's plan holds views of the shared region: it goes as soon
        # as one of its buffers does, so that the region can go too.
        drop = _dropper(key, self) if getattr(call, "peer_send", None) is not None else None
        self.refs = tuple(weakref.ref(b, drop) for b in bufs)  # TypeError: no plan
        self.sizes = tuple(b.size for b in bufs)
        self.dtypes = tuple(b.dtype for b in bufs)
        self.result_at, self.result_rest = _result_shape(result, bufs)
        self.snap = settings.current()
        self.backend = call.backend
        self.checked = bool(call.backend.check_args)
        call = copy.copy(call)  # the running call keeps its buffers; this copy does not
        self.call, self.algo, self.fast = call, algo, fast
        self.op_name, self.algo_name = call.op.value, algo.name
        # Which of ``bufs`` the Call's flat buffers view: (send, recv) or (buf,).
        self.send_at = 0 if call.sendbuf is not None else None
        self.recv_at = len(bufs) - 1 if call.recvbuf is not None else None
        call.sendbuf = call.recvbuf = None  # the plan must not keep the buffers alive
        self.seq = progress.counter(call.group)
        self.slot = Slot(f"{self.op_name} ({self.algo_name})")
        self.agreement = agreement  # (comm, op name, signature) when checks are on

    def run(self, bufs):
        """Run the call again on ``bufs`` (blocking) and return its result."""
        if self.agreement is not None:
            comm, op, signature = self.agreement
            agree(comm, op, None, signature)
        seq = next(self.seq)  # every call numbers its group's operations, fast or not
        LAST_CHOSEN[self.op_name] = self.algo_name
        fast = self.fast
        if fast is not None:
            slot = self.slot
            slot.since = _now()
            try:
                fast(*bufs)
            finally:
                slot.since = 0.0
        else:
            call, send_at, recv_at = self.call, self.send_at, self.recv_at
            if send_at is not None:
                call.sendbuf = bufs[send_at].reshape(-1)
            if recv_at is not None:  # in place: one view, as the first call had
                call.recvbuf = call.sendbuf if recv_at == send_at else bufs[recv_at].reshape(-1)
            call.tag = progress.tag_of(seq)
            try:
                progress.start(self.algo.run(call), None, False, self.slot.what)
            finally:
                call.sendbuf = call.recvbuf = None
        if self.result_rest is None:
            return bufs[self.result_at]
        return (bufs[self.result_at],) + self.result_rest


def _dropper(key, plan):
    """A weak-reference callback that forgets ``plan`` (if it is still ``key``'s)."""
    ref = weakref.ref(plan)

    def drop(_):
        found = ref()
        if found is not None and _PLANS.get(key) is found:
            del _PLANS[key]

    return drop


def _result_shape(result, bufs):
    """``(index, rest)``: the result is ``bufs[index]`` (rest None) or the tuple
    ``(bufs[index],) + rest``; TypeError when it is neither (no plan)."""
    for i, buf in enumerate(bufs):
        if result is buf:
            return i, None
    if isinstance(result, tuple) and result:
        for i, buf in enumerate(bufs):
            if result[0] is buf:
                return i, tuple(result[1:])
    raise TypeError("plans: the result is not one of the buffers")


_PLANS: dict = {}
_OPS = progress._ACTIVE  # this process's outstanding asynchronous operations (one list)

#: op value (``"all_to_all"``) -> name of the algorithm its last call ran (read by
#: the benchmark harness).
LAST_CHOSEN: dict = {}


def replay(key, a, b=None):
    """Run the plan of ``key`` on the buffers ``a`` (and ``b``, for a two-buffer
    call) when it still applies and return the result (never None); None when
    there is none (then nothing ran).

    This is the plan's checks and :meth:`Plan.run` in one frame: it is the
    whole per-call cost of a repeated native call."""
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an argument that cannot be a key (a bad group): the call says why
        return None
    if (plan is None or _OPS or plan.snap is not settings._SNAPSHOT
            or plan.backend.check_args is not plan.checked):
        return None
    refs, sizes, dtypes = plan.refs, plan.sizes, plan.dtypes
    if refs[0]() is not a or a.size != sizes[0] or a.dtype is not dtypes[0]:
        return None  # (the same array with its dtype or size changed: a fresh call)
    if b is not None and (refs[1]() is not b or b.size != sizes[1] or b.dtype is not dtypes[1]):
        return None
    fast = plan.fast
    if fast is None or plan.agreement is not None:
        return plan.run((a,) if b is None else (a, b))
    next(plan.seq)  # every call numbers its group's operations, fast or not
    LAST_CHOSEN[plan.op_name] = plan.algo_name
    slot = plan.slot
    slot.since = _now()
    try:
        if b is None:
            fast(a)
        else:
            fast(a, b)
    finally:
        slot.since = 0.0
    if plan.result_rest is None:
        return b if plan.result_at else a
    return (b if plan.result_at else a,) + plan.result_rest


def remember(key, bufs, call, algo, result, agreement=None) -> None:
    """Keep a plan for ``key`` (the buffers must support weak references).

    Called by a blocking call once it is validated, agreed and selected, just
    before it starts; under :func:`capture` it hands the call over instead."""
    if _capturing:
        raise _Captured(bufs, call, algo, result)
    # A checked AlltoAll(v) exchanges its counts before the agreement; its plan would
    # skip that exchange on one rank while another rank (without a plan) runs it.
    if agreement is not None and call.op.value == "all_to_all_v":
        return
    try:
        fast = algo.fast(call) if hasattr(algo, "fast") else None
        plan = Plan(bufs, call, algo, result, fast, agreement, key)
    except TypeError:  # a buffer without weak-reference support: no plan
        return
    if len(_PLANS) >= _LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


class _Captured(Exception):
    """Carries a validated call out of the API function (see :func:`capture`)."""

    def __init__(self, bufs, call, algo, result):
        super().__init__("captured")
        self.bufs, self.call, self.algo, self.result = bufs, call, algo, result


_capturing = False


def capture(fn, *args, **kwargs):
    """Validate, agree and select the blocking call ``fn(*args, **kwargs)`` of
    :mod:`collectives.api` without running it; return ``(bufs, call, algorithm,
    result)``: what it would have run (the prepared collectives use this).

    Bad arguments raise as from the call itself (on every rank when argument
    checks are on). The call must be one that leaves a plan (blocking, with
    its buffers given), else RuntimeError after it ran.
    """
    global _PLANS, _capturing
    saved, _PLANS, _capturing = _PLANS, {}, True  # no implicit plan may answer it
    try:
        fn(*args, **kwargs)
    except _Captured as got:
        return got.bufs, got.call, got.algo, got.result
    finally:
        _PLANS, _capturing = saved, False
    raise RuntimeError(f"plans.capture: {getattr(fn, '__name__', fn)} ran instead of "
                       f"being prepared")


def clear() -> None:
    """Forget every plan."""
    _PLANS.clear()


ON_RELEASE.append(lambda group: clear())  # a freed group's plans hold its communicator
