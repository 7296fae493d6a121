"""Rows from host memory to the device: gathered into pinned memory, copied on a side stream.

:class:`RowFetcher` moves the rows a step of
:class:`~embedding.kernels.tiered.TieredTables` misses. ``start(parts)``
gathers each part's rows (weights or one optimizer state array of one
table) into one pinned host buffer and queues a single asynchronous copy of
it into a fresh device buffer on the fetcher's own stream, recording an
event; it returns at once. ``land(fetch, arrays)``, called on the compute
stream just before the rows are needed, makes that stream wait for the
event and scatters each part into its slots (a device-to-device copy). So
the host-to-device copy of batch i+1's rows runs while the device works on
batch i, and the compute stream never touches the buffer the copy writes
until the copy is done.

The pinned buffer is reused: before it is refilled, the host waits for the
previous copy out of it (copies from pinned memory read it asynchronously).
A device buffer outlives its fetch: CuPy's memory pool returns a freed block
to the arena of the stream that allocated it (the side stream) at once, with
no synchronisation, so the next ``start`` could get the same block and copy
into it while the compute stream's scatter out of it is still queued.
``land`` therefore records an event after the scatter and keeps the buffer;
the next ``start`` makes the side stream wait for those events before it
lets the buffers go and allocates, so a reused block is written only after
every scatter out of it has run (the host never blocks on the compute
stream).
On NumPy (``device="cpu"``) ``land`` copies the rows straight from the host
arrays: a fetched row is in use by its step alone, so its host copy does not
change between ``start`` and ``land``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RowFetcher", "Part", "Fetch"]

_ALIGN = 16  # bytes: every part starts aligned in the staging buffers


@dataclass(frozen=True)
class Part:
    """Rows ``rows`` of host array ``source`` (``[n]`` or ``[n, d]``) bound for ``slots``
    of the device array named ``key`` (the store resolves it at landing)."""

    key: object
    source: np.ndarray
    rows: np.ndarray
    slots: np.ndarray


@dataclass
class Fetch:
    """A fetch in flight: its device buffer, event and where each part lies in it (on
    NumPy: the parts themselves, copied at landing)."""

    event: object
    buffer: object
    parts: list      # (key, slots, offset, dtype, shape), or the Parts on NumPy


class RowFetcher:
    """Host → device row copies for one store (module doc); ``xp`` is NumPy or CuPy."""

    def __init__(self, xp):
        self.xp = xp
        self._device = xp is not np
        self._pinned: np.ndarray | None = None
        self._pinned_mem = None
        self._last = None  # event of the last copy out of the pinned buffer
        self._stream = xp.cuda.Stream(non_blocking=True) if self._device else None
        #: (event after the scatter, device buffer) of each fetch landed since the last start
        self._landed: list = []

    def start(self, parts: list[Part]) -> Fetch | None:
        """Gather and queue the copy of ``parts`` (None when there is nothing to move)."""
        parts = [p for p in parts if p.rows.size]
        if not parts:
            return None
        if not self._device:
            return Fetch(None, None, parts)
        layout, total = [], 0
        for p in parts:
            shape = (int(p.rows.size),) + p.source.shape[1:]
            nbytes = int(np.prod(shape)) * p.source.dtype.itemsize
            layout.append((p, total, shape))
            total += -(-nbytes // _ALIGN) * _ALIGN
        host = self._host_buffer(total)
        for p, off, shape in layout:
            view = host[off:off + int(np.prod(shape)) * p.source.dtype.itemsize]
            np.take(p.source, p.rows, axis=0, out=view.view(p.source.dtype).reshape(shape))
        placed = [(p.key, p.slots, off, p.source.dtype, shape) for p, off, shape in layout]
        xp = self.xp
        for done, _ in self._landed:  # reused blocks are written after the scatters read them
            self._stream.wait_event(done)
        self._landed.clear()          # the buffers go back to the side stream's pool arena
        with self._stream:
            buf = xp.empty(total, np.uint8)
            buf.set(host[:total], stream=self._stream)
            event = self._stream.record()
        self._last = event
        return Fetch(event, buf, placed)

    def land(self, fetch: Fetch | None, target) -> None:
        """Scatter ``fetch``'s parts into ``target(key)[slots]`` on the current stream; the
        device buffer is kept until the side stream has waited for the scatter (module doc)."""
        if fetch is None:
            return
        xp = self.xp
        if not self._device:
            for p in fetch.parts:
                target(p.key)[p.slots] = p.source[p.rows]
            return
        xp.cuda.get_current_stream().wait_event(fetch.event)
        for key, slots, off, dtype, shape in fetch.parts:
            n = int(np.prod(shape)) * dtype.itemsize
            rows = fetch.buffer[off:off + n].view(dtype).reshape(shape)
            target(key)[xp.asarray(slots)] = rows
        self._landed.append((xp.cuda.get_current_stream().record(), fetch.buffer))

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        """The pinned buffer, at least ``nbytes``, free to refill."""
        if self._last is not None:
            self._last.synchronize()  # the previous copy has read it
            self._last = None
        if self._pinned is None or self._pinned.size < nbytes:
            size = max(nbytes, 2 * (0 if self._pinned is None else self._pinned.size), 1 << 16)
            self._pinned_mem = self.xp.cuda.alloc_pinned_memory(size)
            self._pinned = np.frombuffer(self._pinned_mem, np.uint8, size)
        return self._pinned
