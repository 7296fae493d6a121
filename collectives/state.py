"""What the collectives layer keeps of one process group, owned by the group.

A :class:`GroupState` lives in the group's runtime state
(:meth:`neocomm.group.ProcessGroup.state`) and goes with it: freeing the
group or closing its world releases its plans, fabric model, topology and
transports, and a later call on the group raises, naming it. It holds

- ``check``: whether calls on the group check and agree their arguments
  (``NEOCOMM_CHECK_ARGS`` when the state is made; set it to change it);
- ``layout`` and ``fabrics``: where the ranks live and the priced model of
  the links, per array kind and calibration file;
- ``seq``: the numbers of the group's operations (every rank numbers them
  alike; an operation's tags come from its number);
- ``plans``: the group's :class:`PlanCache`;
- ``progress``: the world's outstanding asynchronous operations;
- ``trust``: per thread, whether the calls of a step that every rank agreed already
  (:class:`collectives.control.StepControl`) skip their own agreement.

Everything that changes after creation is either made under the plan cache's
lock or an atomic step (a dict lookup or insertion, ``next`` on a counter), so calls
from the trainer's threads do not corrupt it; which call runs first on a
group is, as in MPI, the program's to order.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from neocomm import config
from neocomm import world as _world

from collectives.progress import progress_of
from collectives.types import Layout

__all__ = ["GroupState", "PlanCache", "Trust", "state_of"]

_KEY = "collectives"


class PlanCache:
    """A group's plans, by call layout, at most ``limit`` of them (the least recently
    used goes first)."""

    __slots__ = ("limit", "_plans", "_lock")

    def __init__(self, limit: int = 256):
        self.limit = int(limit)
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        """The plan of ``key``, or None (``key`` must be hashable)."""
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile
                pass
        return plan

    def put(self, key, plan) -> None:
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.limit:
                self._plans.popitem(last=False)

    def drop(self, key, plan) -> None:
        """Forget ``plan`` if it is still ``key``'s."""
        with self._lock:
            if self._plans.get(key) is plan:
                del self._plans[key]

    def latest(self, op: str):
        """The plan of operation ``op`` (``"all_to_all"``) that a call of this group ran
        last (the most recently used of its kept plans), or None. Its ``algo`` is the
        algorithm that call ran."""
        with self._lock:
            for plan in reversed(self._plans.values()):
                if getattr(plan, "op", None) == op:
                    return plan
        return None

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class Trust(threading.local):
    """Per thread: ``on`` while a step agreed by every rank runs (see
    :class:`collectives.control.StepControl`)."""

    on = False


class GroupState:
    """The collectives layer's runtime state of one group (see the module docs)."""

    UNKNOWN = object()  # the topology before the group's first collective discovers it

    __slots__ = ("group", "check", "layout", "fabrics", "topology", "seq", "plans",
                 "transports", "progress", "trust", "__weakref__")

    def __init__(self, group):
        self.group = group
        self.check = bool(config.get("CHECK_ARGS"))
        self.layout = Layout.from_nodes(group.nodes)
        self.fabrics: dict = {}
        self.topology = self.UNKNOWN
        self.seq = itertools.count()
        self.plans = PlanCache()
        self.transports: dict = {}
        self.progress = progress_of(group.world)
        self.trust = Trust()

    def peek(self) -> int:
        """The number the group's next operation will get (nothing is taken)."""
        import copy

        return next(copy.copy(self.seq))

    def close(self) -> None:
        self.plans.clear()
        self.fabrics.clear()
        self.transports.clear()
        self.topology = None


def state_of(group) -> GroupState:
    """The :class:`GroupState` of ``group`` (None: the world group); TypeError naming
    what was given when it is no group, GroupGoneError when it was freed."""
    if group is None:
        world = _world._WORLD
        if world is not None and world.gone is None:
            found = world.world._states.get(_KEY)
            if found is not None:
                return found
    group = _world.group_or_world(group)
    found = group._states.get(_KEY)
    return found if found is not None else group.state(_KEY, GroupState)
