"""Bookkeeping of one host-resident table's device rows: which row sits in which slot.

A :class:`RowCache` numbers the device rows of one table shard as *slots*:
slots ``[0, capacity)`` are the cache, kept across steps and evicted by
policy; slots from ``capacity`` on are *staging* slots, which hold a row for
the steps that use it only (a row that the admission threshold keeps out of
the cache, or one for which every cache slot is taken by rows in use). A
row is *in use* from the lookup that needs it to the update that follows
(a pin count per slot); no row in use is ever evicted or released, so a
step's update always finds the rows its lookup read.

The cache only moves rows: it never changes a value. The store that owns it
copies a row (weights and optimizer state) in when :meth:`acquire` says so
and back when :meth:`acquire` or :meth:`release` says so, which keeps
training with any cache size bitwise equal to training with the table in
device memory. All of it is host-side NumPy bookkeeping, the same for both
array backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding.types import CachePolicy

__all__ = ["RowCache", "Acquired"]

_NONE = -1
_TICK_BITS = 40  # LFU key: access count above, last use below


@dataclass(frozen=True)
class Acquired:
    """What :meth:`RowCache.acquire` decided for a step's unique rows.

    ``slots[i]`` is the slot of ``rows[i]``; ``fetch_rows`` are to be copied
    host → ``fetch_slots``; ``evict_rows`` (dirty rows leaving the cache) are
    to be copied ``evict_slots`` → host *before* the fetch overwrites them.
    ``hit[i]`` says whether ``rows[i]`` was found in the cache; ``hits`` counts them.
    """

    rows: np.ndarray
    slots: np.ndarray
    fetch_rows: np.ndarray
    fetch_slots: np.ndarray
    evict_rows: np.ndarray
    evict_slots: np.ndarray
    hits: int
    hit: np.ndarray


class RowCache:
    """Slots of one table of ``num_rows`` rows with a cache of ``capacity`` slots (module doc).

    ``staging`` is the number of staging slots; it grows when a step needs
    more (``grown`` tells the store to enlarge its device buffer).
    """

    def __init__(self, num_rows: int, capacity: int, policy: CachePolicy = CachePolicy.LRU,
                 admit_after: int = 1):
        self.num_rows = int(num_rows)
        self.capacity = int(capacity)
        self.policy = policy
        self.admit_after = int(admit_after)
        self.staging = 0
        self.row_slot = np.full(self.num_rows, _NONE, np.int64)
        self.slot_row = np.full(self.capacity, _NONE, np.int64)
        self.pins = np.zeros(self.capacity, np.int32)
        self.dirty = np.zeros(self.capacity, bool)
        self.last_use = np.zeros(self.capacity, np.int64)
        counting = policy is CachePolicy.LFU or self.admit_after > 1
        self.counts = np.zeros(self.num_rows, np.int64) if counting else None
        self._tick = 0
        self._filled = 0  # cache slots [_filled, capacity) have never held a row

    @property
    def slots(self) -> int:
        """Cache plus staging slots (the rows of the device buffer)."""
        return self.capacity + self.staging

    def resident(self) -> np.ndarray:
        """Rows in the cache (not staging), ascending."""
        rows = self.slot_row[:self.capacity]
        return np.sort(rows[rows >= 0])

    # -- a step's rows ------------------------------------------------------------
    def acquire(self, rows: np.ndarray) -> tuple[Acquired, bool]:
        """Give each of the unique ``rows`` a slot and pin it; ``(decision, grown)``."""
        rows = np.asarray(rows, np.int64)
        self._tick += 1
        slots = self.row_slot[rows]
        hit = slots >= 0
        in_cache = hit & (slots < self.capacity)
        hits = int(np.count_nonzero(in_cache))
        if self.counts is not None:
            self.counts[rows] += 1
        self.pins[slots[hit]] += 1                 # rows in use are not evicted below
        miss = rows[~hit]
        admit = miss
        if self.admit_after > 1 and miss.size:
            admit = miss[self.counts[miss] >= self.admit_after]
        evict_rows = evict_slots = np.zeros(0, np.int64)
        admitted = np.zeros(0, np.int64)
        if admit.size and self.capacity:
            fresh = self.capacity - self._filled  # never-used slots: no search, no eviction
            if admit.size <= fresh:
                free, n = None, admit.size
            else:
                free = np.flatnonzero(self.pins[:self.capacity] == 0)
                n = min(admit.size, free.size)
            if n:
                if self.policy is CachePolicy.LFU and n < admit.size:
                    # the most used rows enter first when not all fit
                    admit = admit[np.argsort(-self.counts[admit], kind="stable")]
                if free is None:
                    taken = np.arange(self._filled, self._filled + n, dtype=np.int64)
                else:
                    taken = self._victims(free, n)
                self._filled = max(self._filled, int(taken.max()) + 1)
                admitted = admit[:n]
                old = self.slot_row[taken]
                leaving = old >= 0
                dirty = leaving & self.dirty[taken]
                evict_rows, evict_slots = old[dirty], taken[dirty]
                self.row_slot[old[leaving]] = _NONE
                self.slot_row[taken] = admitted
                self.row_slot[admitted] = taken
                self.dirty[taken] = False
                self.pins[taken] = 1
        staged = np.setdiff1d(miss, admitted, assume_unique=True)
        grown = False
        if staged.size:
            grown = self._stage(staged)
        slots = self.row_slot[rows]
        cached = slots[slots < self.capacity]
        self.last_use[cached] = self._tick
        fetch_rows = miss
        return Acquired(rows, slots, fetch_rows, self.row_slot[fetch_rows], evict_rows,
                        evict_slots, hits, in_cache), grown

    def mark_dirty(self, slots: np.ndarray) -> None:
        """The device copies in ``slots`` changed (written back when they leave)."""
        self.dirty[np.asarray(slots, np.int64)] = True

    def release(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unpin ``slots`` (one step's); staging slots that fall free leave.

        Returns ``(rows, slots)`` of the dirty staging rows leaving, to be
        copied back to the host.
        """
        slots = np.asarray(slots, np.int64)   # a step's slots are unique
        self.pins[slots] -= 1
        if np.any(self.pins[slots] < 0):
            raise RuntimeError("row cache: a slot was released more often than acquired")
        stage = slots[slots >= self.capacity]
        gone = stage[self.pins[stage] == 0]   # a step's slots are unique
        rows = self.slot_row[gone]
        back = self.dirty[gone]
        self.row_slot[rows] = _NONE
        self.slot_row[gone] = _NONE
        self.dirty[gone] = False
        return rows[back], gone[back]

    def drain(self) -> tuple[np.ndarray, np.ndarray]:
        """Empty the cache (no row may be in use); ``(rows, slots)`` of the dirty ones."""
        if np.any(self.pins):
            raise RuntimeError("row cache: cannot drain while a step's rows are in use")
        used = np.flatnonzero(self.slot_row >= 0)
        rows = self.slot_row[used]
        back = self.dirty[used]
        self.row_slot[rows] = _NONE
        self.slot_row[used] = _NONE
        self.dirty[used] = False
        self._filled = 0
        return rows[back], used[back]

    # -- internals ------------------------------------------------------------------
    def _victims(self, free: np.ndarray, n: int) -> np.ndarray:
        """``n`` of the unpinned cache slots ``free``: empty ones first, then by policy."""
        key = self.last_use[free].copy()
        if self.policy is CachePolicy.LFU:
            row = self.slot_row[free]
            count = np.where(row >= 0, self.counts[np.maximum(row, 0)], 0)
            key += count << _TICK_BITS
        key[self.slot_row[free] < 0] = -1
        if n < free.size:
            pick = np.argpartition(key, n - 1)[:n]
        else:
            pick = np.arange(free.size)
        return free[pick]

    def _stage(self, rows: np.ndarray) -> bool:
        """Put ``rows`` in free staging slots (pinned), adding slots when too few are free."""
        cap = self.capacity
        free = cap + np.flatnonzero(self.slot_row[cap:] == _NONE)
        grown = False
        if free.size < rows.size:
            need = rows.size - free.size
            extra = max(need, self.staging)  # at least double: a few growths in all
            old = self.slots
            self.staging += extra
            self.slot_row = np.concatenate([self.slot_row, np.full(extra, _NONE, np.int64)])
            self.pins = np.concatenate([self.pins, np.zeros(extra, np.int32)])
            self.dirty = np.concatenate([self.dirty, np.zeros(extra, bool)])
            free = np.concatenate([free, np.arange(old, old + extra, dtype=np.int64)])
            grown = True
        use = free[:rows.size]
        self.slot_row[use] = rows
        self.row_slot[rows] = use
        self.pins[use] = 1
        self.dirty[use] = False
        return grown
