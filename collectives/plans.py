"""Plans: the prepared form of a repeated blocking collective call.

Training loops call the same collective on the same buffers step after
step. The first blocking call leaves a plan keyed by the operation, group,
options and the identity of the buffers; the next identical call checks
that the buffers are still the same arrays with the same sizes and runs the
plan: no validation, selection or chunk planning again. With argument
checks on (``NEOCOMM_CHECK_ARGS``), the plan still agrees its signature
across the group first — the same one small all-reduce the unplanned call
makes — so a rank whose arguments changed (and so has no plan) and a rank
that runs its plan stay in step, and a mismatch raises on every rank. Plans hold weak references only, never
keep buffers alive, and are skipped while an asynchronous operation of
this process is outstanding (it must be driven by the waits).
"""
from __future__ import annotations

import weakref

from neocomm.agree import agree

from collectives import progress, settings

__all__ = ["Plan", "lookup", "remember", "clear"]

_LIMIT = 256


class Plan:
    """A prepared call: its :class:`~collectives.algorithms.Call`, algorithm and
    result, and optionally a direct callable (``fast``) for native calls."""

    __slots__ = ("refs", "sizes", "snap", "call", "algo", "result", "fast", "seq", "what",
                 "agreement")

    def __init__(self, bufs, call, algo, result, fast, agreement=None):
        self.refs = tuple(weakref.ref(b) for b in bufs)
        self.sizes = tuple(b.size for b in bufs)
        self.snap = settings.current()
        self.call, self.algo, self.result, self.fast = call, algo, result, fast
        self.seq = progress.counter(call.group)
        self.what = f"{call.op.value} ({algo.name})"
        self.agreement = agreement  # (comm, op name, signature) when checks are on

    def run(self):
        """Run the call again (blocking) and return its result."""
        if self.agreement is not None:
            comm, op, signature = self.agreement
            agree(comm, op, None, signature)
        seq = next(self.seq)  # every call numbers its group's operations, fast or not
        LAST_CHOSEN[self.call.op] = self.algo.name
        if self.fast is not None:
            self.fast()
        else:
            call = self.call
            call.tag = progress.tag_of(seq)
            progress.start(self.algo.run(call), None, False, self.what)
        return self.result


_PLANS: dict = {}

#: op -> name of the algorithm its last call ran (read by the benchmark harness).
LAST_CHOSEN: dict = {}


def lookup(key, bufs) -> Plan | None:
    """The plan of ``key`` when it still applies to ``bufs``, else None."""
    plan = _PLANS.get(key)
    if plan is None or progress._ACTIVE or plan.snap is not settings._SNAPSHOT:
        return None
    refs, sizes = plan.refs, plan.sizes
    for i, buf in enumerate(bufs):
        if refs[i]() is not buf or buf.size != sizes[i]:
            return None
    return plan


def remember(key, bufs, call, algo, result, agreement=None) -> None:
    """Keep a plan for ``key`` (the buffers must support weak references)."""
    try:
        fast = algo.fast(call) if hasattr(algo, "fast") else None
        plan = Plan(bufs, call, algo, result, fast, agreement)
    except TypeError:  # a buffer without weak-reference support: no plan
        return
    if len(_PLANS) >= _LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


def clear() -> None:
    """Forget every plan."""
    _PLANS.clear()
