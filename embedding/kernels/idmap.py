"""An open-addressing hash map from int64 ids to the rows of one dynamic table.

:class:`IdMap` keeps ``capacity`` rows and a power-of-two array of
``num_slots >= 2 * capacity`` hash slots (linear probing from
``splitmix64(id) & (num_slots - 1)``, the hash of
:attr:`~embedding.types.IdPolicy.HASH`). A slot holds an id and its row, or
one of two markers: :data:`EMPTY` (never used: a probe stops there) and
:data:`TOMB` (an evicted id's slot: a probe walks on, an insert may reuse
it). Both markers are reserved: they are not valid ids. When live entries
and tombstones fill three quarters of the slots, the slots are rebuilt.

:meth:`IdMap.acquire` is the find-or-insert of one batch: its distinct ids
are probed; ids not found take free rows in ascending id order (row ``size``,
``size + 1`` …), and when the rows run out, rows of entries that the batch
does not read are evicted (least ``count`` or oldest ``last``, ties to the
smaller id) and handed to the new ids. Inserting resolves two new ids that
probe to the same slot by giving it to the one given first (the smaller id in
``acquire``): no atomics, so the slots come out the same on every device.

The code is the same for NumPy and CuPy arrays (``xp``); only the probe
differs: a vectorised NumPy loop (:func:`probe_numpy`) or the raw CUDA kernel
``id_probe`` (:data:`PROBE_SOURCE`, one thread per id, read-only), so the
id → row lookup of a device store stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding.jagged import hash_ids
from embedding.types import Eviction, enum_arg

__all__ = ["IdMap", "Acquired", "EMPTY", "TOMB", "RESERVED", "slots_for", "probe_numpy",
           "probe_cuda", "PROBE_SOURCE"]

#: Marker of a slot never used (the smallest int64; not a valid id).
EMPTY = np.int64(np.iinfo(np.int64).min)
#: Marker of a slot whose id was evicted (the smallest int64 + 1; not a valid id).
TOMB = np.int64(np.iinfo(np.int64).min + 1)
#: The ids a dynamic table refuses.
RESERVED = (int(EMPTY), int(TOMB))

PROBE_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

extern "C" __global__ void id_probe(const i64* __restrict__ keys, const i64* __restrict__ ids,
                                    const i64 n, const i64 mask, i64* __restrict__ found,
                                    i64* __restrict__ free_slot) {
    const i64 empty = -9223372036854775807LL - 1LL;
    const i64 tomb = empty + 1LL;
    const i64 stride = (i64)blockDim.x * (i64)gridDim.x;
    for (i64 i = (i64)blockIdx.x * (i64)blockDim.x + (i64)threadIdx.x; i < n; i += stride) {
        const i64 id = ids[i];
        u64 x = (u64)id;
        x ^= x >> 30;
        x *= 0xBF58476D1CE4E5B9ULL;
        x ^= x >> 27;
        x *= 0x94D049BB133111EBULL;
        x ^= x >> 31;
        i64 p = (i64)(x & (u64)mask);
        i64 f = -1;
        i64 fr = -1;
        for (i64 step = 0; step <= mask; ++step) {
            const i64 k = keys[p];
            if (k == id) {
                f = p;
                break;
            }
            if ((k == empty || k == tomb) && fr < 0) fr = p;
            if (k == empty) break;
            p = (p + 1) & mask;
        }
        found[i] = f;
        free_slot[i] = fr;
    }
}
"""

_MODULES: dict = {}
_BLOCK = 256
_MAX_BLOCKS = 1024


def slots_for(capacity: int) -> int:
    """Hash slots of a map of ``capacity`` rows: the power of two >= ``2 * capacity`` (>= 8)."""
    n = 8
    while n < 2 * int(capacity):
        n *= 2
    return n


def probe_numpy(keys: np.ndarray, ids: np.ndarray, mask: int) -> tuple[np.ndarray, np.ndarray]:
    """``(found, free)`` slots of ``ids`` in ``keys`` (``mask = len(keys) - 1``).

    ``found[i]``: the slot holding ``ids[i]`` (-1: absent); ``free[i]``: the
    first EMPTY or TOMB slot on its probe path (where an insert would go).
    """
    ids = np.asarray(ids, np.int64)
    with np.errstate(over="ignore"):
        pos = (hash_ids(ids) & np.uint64(mask)).astype(np.int64)
    found = np.full(ids.size, -1, np.int64)
    free = np.full(ids.size, -1, np.int64)
    active = np.arange(ids.size)
    while active.size:
        p = pos[active]
        k = keys[p]
        hit = k == ids[active]
        empty = k == EMPTY
        take = (empty | (k == TOMB)) & (free[active] < 0)
        free[active[take]] = p[take]
        found[active[hit]] = p[hit]
        active = active[~(hit | empty)]
        pos[active] = (pos[active] + 1) & mask
    return found, free


def probe_cuda(keys, ids, mask: int):
    """:func:`probe_numpy` on CuPy arrays, by the raw kernel ``id_probe`` (one launch)."""
    import cupy as cp

    mod = _MODULES.get("id_probe")
    if mod is None:
        mod = _MODULES["id_probe"] = cp.RawModule(code=PROBE_SOURCE)
    ids = cp.ascontiguousarray(ids, dtype=cp.int64)
    n = int(ids.size)
    found = cp.empty(n, cp.int64)
    free = cp.empty(n, cp.int64)
    if n:
        grid = min(_MAX_BLOCKS, -(-n // _BLOCK))
        mod.get_function("id_probe")((grid,), (_BLOCK,), (keys, ids, np.int64(n),
                                                          np.int64(mask), found, free))
    return found, free


@dataclass
class Acquired:
    """What :meth:`IdMap.acquire` did: ``rows`` of every id given (in order), and the rows
    given to new ids (``new_rows``, holding ``new_ids``) and the ids they evicted."""

    rows: object
    new_rows: object
    new_ids: object
    evicted_ids: object


class IdMap:
    """The id → row map of one dynamic table (or shard) of ``capacity`` rows (module doc).

    ``row_id[r]``: the id in row ``r`` (:data:`EMPTY` while free);
    ``count[r]``: ids looked up in row ``r`` since its id was inserted;
    ``last[r]``: the :attr:`tick` (acquires so far) of its last lookup.
    Rows ``[0, size)`` are taken, the rest free.
    """

    def __init__(self, capacity: int, eviction: Eviction = Eviction.COUNT, xp=np):
        if isinstance(capacity, bool) or int(capacity) < 0:
            raise ValueError(f"capacity: expected >= 0 rows, got {capacity!r}")
        self.capacity = int(capacity)
        self.eviction = enum_arg(Eviction, eviction, "eviction")
        self.xp = xp
        self.num_slots = slots_for(self.capacity)
        self.mask = self.num_slots - 1
        self._probe = probe_numpy if xp is np else probe_cuda
        self.clear()

    def clear(self) -> None:
        """Forget every entry (and the tick)."""
        xp = self.xp
        self.keys = xp.full(self.num_slots, EMPTY, xp.int64)
        self.slot_row = xp.full(self.num_slots, -1, xp.int64)
        self.row_id = xp.full(self.capacity, EMPTY, xp.int64)
        self.count = xp.zeros(self.capacity, xp.int64)
        self.last = xp.zeros(self.capacity, xp.int64)
        self.size = 0
        self.tombs = 0
        self.tick = 0

    def find(self, ids):
        """Row of each id (-1 where absent); nothing changes."""
        xp = self.xp
        ids = xp.asarray(ids, xp.int64)
        found, _ = self._probe(self.keys, ids, self.mask)
        return xp.where(found >= 0, self.slot_row[found], -1)

    def acquire(self, ids) -> Acquired:
        """Find-or-insert of one batch's ids (module doc); counts the lookups, ticks once.

        ValueError when an id is reserved or the batch has more distinct ids
        than the map has rows.
        """
        xp = self.xp
        ids = xp.asarray(ids, xp.int64)
        if xp is np:
            from embedding.kernels import compiled

            uniq, inv, n = compiled.unique(ids)
        else:
            uniq, inv, n = xp.unique(ids, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1)
        if uniq.size and int(uniq[0]) <= RESERVED[1]:
            raise ValueError(f"ids: {int(uniq[0])} is reserved (the markers {list(RESERVED)} "
                             f"are not valid ids of a dynamic table)")
        if uniq.size > self.capacity:
            raise ValueError(f"ids: a batch reads {int(uniq.size)} distinct ids of a table "
                             f"of capacity {self.capacity} rows")
        rows = self.find(uniq)
        missing = xp.flatnonzero(rows < 0)
        m = int(missing.size)
        new_ids = uniq[missing]
        fresh = min(m, self.capacity - self.size)
        new_rows = xp.arange(self.size, self.size + fresh, dtype=xp.int64)
        evicted = xp.zeros(0, xp.int64)
        need = m - fresh
        if need:
            old = self.size
            pinned = xp.zeros(old, bool)
            hit = rows[rows >= 0]
            pinned[hit] = True
            cand = xp.flatnonzero(~pinned)
            key = self.count if self.eviction is Eviction.COUNT else self.last
            by_id = cand[xp.argsort(self.row_id[cand], kind="stable")]
            victims = by_id[xp.argsort(key[by_id], kind="stable")[:need]]
            evicted = self.row_id[victims]
            self._erase(evicted)
            new_rows = xp.concatenate([new_rows, victims.astype(xp.int64)])
        self.size += fresh
        if m:
            if self.size + self.tombs > (3 * self.num_slots) // 4:
                self._rebuild()
            self.row_id[new_rows] = new_ids
            self.count[new_rows] = 0
            self._insert(new_ids, new_rows)
            rows[missing] = new_rows
        self.tick += 1
        self.count[rows] += n
        self.last[rows] = self.tick
        return Acquired(rows[inv], new_rows, new_ids, evicted)

    def entries(self):
        """``(ids, rows)`` of the live entries, ids ascending."""
        xp = self.xp
        live = xp.flatnonzero(self.row_id != EMPTY)
        ids = self.row_id[live]
        order = xp.argsort(ids, kind="stable")
        return ids[order], live[order]

    def load(self, ids, count, last, tick: int):
        """Replace every entry by ``ids`` (distinct, ascending order not needed) with their
        counters; rows ``0 … len(ids) - 1`` in the order given. Returns those rows."""
        xp = self.xp
        ids = xp.asarray(ids, xp.int64)
        if int(ids.size) > self.capacity:
            raise ValueError(f"ids: {int(ids.size)} entries do not fit a map of capacity "
                             f"{self.capacity} rows")
        self.clear()
        rows = xp.arange(int(ids.size), dtype=xp.int64)
        self.row_id[rows] = ids
        self.count[rows] = xp.asarray(count, xp.int64)
        self.last[rows] = xp.asarray(last, xp.int64)
        self.size = int(ids.size)
        self.tick = int(tick)
        self._insert(ids, rows)
        return rows

    # -- slots ------------------------------------------------------------------------
    def _erase(self, ids) -> None:
        found, _ = self._probe(self.keys, ids, self.mask)
        self.keys[found] = TOMB
        self.slot_row[found] = -1
        self.tombs += int(found.size)

    def _rebuild(self) -> None:
        xp = self.xp
        self.keys = xp.full(self.num_slots, EMPTY, xp.int64)
        self.slot_row = xp.full(self.num_slots, -1, xp.int64)
        self.tombs = 0
        live = xp.flatnonzero(self.row_id != EMPTY)
        self._insert(self.row_id[live], live)

    def _insert(self, ids, rows) -> None:
        """Put absent, distinct ``ids`` → ``rows`` into the slots; a contested slot goes to
        the id given first (in rounds: the others probe again)."""
        xp = self.xp
        pending = xp.arange(int(ids.size))
        while pending.size:
            _, free = self._probe(self.keys, ids[pending], self.mask)
            order = xp.argsort(free, kind="stable")
            s = free[order]
            first = xp.ones(s.size, bool)
            first[1:] = s[1:] != s[:-1]
            win = pending[order[first]]
            slots = s[first]
            self.tombs -= int((self.keys[slots] == TOMB).sum())
            self.keys[slots] = ids[win]
            self.slot_row[slots] = rows[win]
            pending = xp.sort(pending[order[~first]])
