"""A training loop's control plane: one agreement per step instead of one per call.

Every collective call agrees its arguments with the other ranks before it
moves data (:mod:`collectives.plan`), so that a rank whose call differs
raises with the others instead of meeting another collective. A training
step makes the same calls step after step: the input distribution's
AlltoAllv, the embeddings' AlltoAlls forward and backward, the gradient
AllReduces. What decides their layout is the step's shape (batch size,
features, dense inputs): when every rank agrees on it, and it is the shape
of the step before, every call of the step runs the plan the earlier step
made, without an agreement of its own::

    control = StepControl(group, "training step")
    for batch in batches:
        with control.step(batch_size=b, features=f):
            ...  # the step's collectives: plans replayed, no per-call agreement

:meth:`StepControl.step` is one Allreduce of eight integers (the shape's
signature, and whether any rank's shape is new). A shape that differs across
ranks raises :class:`~neocomm.errors.CollectiveArgumentError` on every rank,
naming the field and every rank's shape. A step whose shape is new on some
rank runs its calls checked and agreed, building their plans; the next step
of that shape trusts them. An AlltoAllv still agrees per call: its sizes,
which change with the data, choose its algorithm.

Trust is per thread: another thread's calls on the group keep their own
agreement. With argument checks off (``NEOCOMM_CHECK_ARGS=0``) nothing is
agreed, and a step is only a scope.
"""
from __future__ import annotations

from contextlib import contextmanager

from neocomm.agree import Agreement

from collectives.state import state_of

__all__ = ["StepControl"]


class StepControl:
    """The steps of one loop on ``group`` (None: the world group); ``what`` names them
    in messages. ``checked`` and ``trusted`` count the steps run each way."""

    def __init__(self, group=None, what: str = "training step"):
        self.state = state_of(group)
        self.what = what
        self.checked = 0
        self.trusted = 0
        self._last = None
        self._agreements: dict = {}

    def _agreement(self, shape: tuple) -> Agreement:
        found = self._agreements.get(shape)
        if found is None:
            if len(self._agreements) > 64:  # shapes seen long ago
                self._agreements.clear()
            group = self.state.group
            found = self._agreements[shape] = Agreement(
                self.what, list(shape), None, f" on group {group.name!r}", self.state.peek)
        return found

    @contextmanager
    def step(self, **shape: int):
        """Run one step of this ``shape`` (named integers: ``batch_size=512``); yields
        True when its calls skip their own agreement (every rank ran the step before
        with this shape), False when they are checked."""
        state = self.state
        if not state.check:
            self.checked += 1
            yield False
            return
        key = tuple((name, int(value)) for name, value in shape.items())
        out = self._agreement(key).run(state.group.comm, fresh=int(key != self._last))
        self._last = key
        trusted = not out[3]
        trust = state.trust
        before = trust.on
        trust.on = trusted
        if trusted:
            self.trusted += 1
        else:
            self.checked += 1
        try:
            yield trusted
        finally:
            trust.on = before
