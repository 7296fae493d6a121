"""The pieces of one training step: timed embedding stages and the dense gradient AllReduce.

:class:`EmbeddingStages` drives a
:class:`~embedding.collection.ShardedEmbeddingCollection` with a timer, so
that each of its stages is timed on its own: waiting for the input dist, the
local lookup, waiting for the output dist, and the backward (reverse output
dist + fused sparse optimizer). The input dist is started by the collection
(:meth:`~embedding.collection.ShardedEmbeddingCollection.input_dist`),
which checks the ids on every rank first.

:class:`GradSync` AllReduces the dense gradients through
:mod:`collectives`: with ``overlap`` one asynchronous AllReduce per gradient
bucket, started from the bucket-completion hook while the backward pass
goes on, else one blocking AllReduce of the whole buffer after it. With a
16-bit ``wire`` (``[comms] dense``) each bucket is rounded to fp16 or bf16
(times the loss scale for fp16), summed in 16 bits and widened back into
the gradients; ``sent`` counts the bytes of the buffers passed to the AllReduce.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from embedding.train.types import Phase

__all__ = ["PhaseTimer", "EmbeddingStages", "GradSync", "finite", "symmetric_grads"]


class PhaseTimer:
    """Wall-clock seconds per :class:`~embedding.train.types.Phase`, summed until :meth:`reset`."""

    def __init__(self):
        self.seconds = {p: 0.0 for p in Phase}

    @contextmanager
    def __call__(self, phase: Phase):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def add(self, phase: Phase, seconds: float) -> None:
        self.seconds[phase] += seconds

    def reset(self) -> dict[Phase, float]:
        """The sums so far, then zero them."""
        out = dict(self.seconds)
        self.seconds = {p: 0.0 for p in Phase}
        return out


class EmbeddingStages:
    """A collection's forward and backward with each stage timed (module doc).

    ``forward(dist, timer)`` takes the
    :class:`~embedding.collection.DistributedBatch` of :meth:`start` and
    returns ``(pooled [B, out_dim], ctx)``; ``backward(grad, ctx, timer)``
    applies ``d loss / d pooled``.
    """

    _PHASES = {"input_dist": Phase.INPUT_DIST, "lookup": Phase.LOOKUP,
               "output_dist": Phase.OUTPUT_DIST, "backward": Phase.EMB_BACKWARD}

    def __init__(self, collection):
        self.coll = collection
        self.out_dim = collection.out_dim

    def start(self, kjt):
        """Check ``kjt`` on every rank and start its input dist (returns at once)."""
        return self.coll.input_dist(kjt)

    def forward(self, dist, timer: PhaseTimer, grad: bool = True):
        return self.coll.forward_with_context(dist, timer=lambda s: timer(self._PHASES[s]),
                                              grad=grad)

    def backward(self, grad, ctx, timer: PhaseTimer) -> None:
        grad = self.coll.xp.asarray(grad).reshape(ctx[1], self.out_dim)
        self.coll.backward(grad, ctx, timer=lambda s: timer(self._PHASES[s]))


def symmetric_grads(group, xp):
    """The dense gradients' allocator: symmetric memory when ``group`` (several
    ranks, host arrays) lies within one node, so that their AllReduce can read
    the peers' gradients in place (:mod:`collectives.symmetric`); else None."""
    if xp is not np or group.size < 2 or group.num_nodes != 1:
        return None
    from collectives import symmetric

    return lambda numel, dtype: symmetric.zeros(numel, dtype, group=group)


class GradSync:
    """Sums the dense gradients over ``group`` and divides by its size (module doc)."""

    def __init__(self, model, group, overlap: bool = True, wire=None):
        self.model = model
        self.group = group
        self.overlap = bool(overlap)
        self.size = int(group.size)
        #: the :class:`~embedding.sharding.qcomm.Wire` of the AllReduce (None: as they are)
        self.wire = None if wire is None or wire.identity else wire
        #: bytes of the buffers passed to the AllReduce since the last :meth:`take_sent`
        self.sent = 0
        self._handles: list = []  # (handle, wire buffer or None, gradient view)

    def take_sent(self) -> int:
        """:attr:`sent`, then zero it."""
        out, self.sent = self.sent, 0
        return out

    def _start(self, grad, async_op: bool):
        import collectives

        buf = grad if self.wire is None else self.wire.encode(grad)
        self.sent += int(buf.nbytes)
        h = collectives.all_reduce(buf, group=self.group, async_op=async_op)
        return h, (None if buf is grad else buf), grad  # h: the handle, or the result

    def hook(self):
        """The bucket hook for ``model.backward`` (None without overlap)."""
        if not self.overlap or self.size == 1:
            return None

        def on_bucket(bucket, grad):
            self._handles.append(self._start(grad, True))

        return on_bucket

    def finish(self, timer: PhaseTimer) -> None:
        """Wait for (or run) the AllReduce; the gradients become the mean over ranks."""
        grads = self.model.flat_grads
        with timer(Phase.GRAD_SYNC):
            if self.size > 1:
                if not self.overlap:  # one blocking call over the whole gradient
                    out, buf, _ = self._start(grads, False)
                    if buf is not None:
                        grads[...] = self.wire.decode(out)
                self._complete()
        if self.size > 1:
            grads *= grads.dtype.type(1.0 / self.size)

    def _complete(self) -> None:
        handles, self._handles = self._handles, []
        for h, buf, grad in handles:
            out = h.wait()
            if buf is not None:
                grad[...] = self.wire.decode(buf if out is None else out)

    def drain(self) -> None:
        """Complete whatever is in flight (on the way out after an error)."""
        self._complete()


def finite(x) -> bool:
    """True when every element of ``x`` is finite (NumPy or CuPy)."""
    from embedding.dense._xp import array_module

    return bool(array_module(x).isfinite(x).all())
