"""Local shards whose rows live in host memory, with a device cache in front.

:class:`TieredTables` has the interface of
:class:`~embedding.kernels.fused.FusedTables` for tables whose
:class:`~embedding.types.TableMemory` tier is ``host`` or ``cached``. The
rows and their optimizer state live in a host (NumPy) ``FusedTables``; the
kernels run on a device ``FusedTables`` whose table ``t`` holds the slots of
a :class:`~embedding.kernels.cache.RowCache` (the cache, then the staging
slots of the step). A step runs as:

1. ``lookup(bags)`` (or an earlier ``prefetch(bags)``): the unique rows of
   each table get slots; evicted dirty rows are copied device → host, and
   missing rows (weights and optimizer state) start their way host → device
   through a pinned buffer on a side stream
   (:class:`~embedding.kernels.staging.RowFetcher`); at the lookup they land
   in their slots on the compute stream, the bags' ids are rewritten to
   slots and the unchanged fused kernel pools them;
2. ``backward_update(bags, grad)`` or ``aggregate`` + ``update``: the kernel
   updates the slots; they are marked dirty, the step's rows are unpinned,
   and staging rows go back to the host.

Because rows are moved, never recomputed, and every kernel treats a row the
same under any numbering, training is bitwise equal to training with the
tables in device memory, for any cache size (1 row included) and policy.
That holds for half tables too (:mod:`embedding.precision`): the host rows
and the device slots are in the table's storage dtype and the optimizer
state in its ``state_dtype``, so the copies move the 16-bit patterns (half
the bytes of float32 rows); stochastic rounding hashes a slot's host row
(the work store's ``row_keys``), never the slot, so a row draws the bits it
would in device memory; a ``master`` table's float32 master rows live with
the host rows and travel with the weights (4 bytes more per element each
way).
Steps are finished in the order they were looked up: the backward of a step
drops the older steps still open (their backward was skipped, as in
evaluation), so a later backward of a dropped step raises. ``weight(t)`` and
``state_view(t, name)`` write the cache back, empty it, and return the host
arrays (what checkpoints and ``load_table`` read and write).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Sequence

import numpy as np

from embedding.kernels import compiled
from embedding.kernels.cache import RowCache
from embedding.kernels.fused import FusedTables, adopt_layout
from embedding.kernels.layout import Bags, host_array
from embedding.kernels.staging import Part, RowFetcher
from embedding.optim import row_bytes, state_specs
from embedding.precision import Rounding
from embedding.types import TableMemory
from neocomm.types import is_half

__all__ = ["TieredTables", "CacheStats"]


@dataclasses.dataclass
class CacheStats:
    """Counters since the store was made (or :meth:`TieredTables.take_stats`).

    ``lookups``: distinct rows a step needed, summed over steps; ``hits``: of
    those, rows found in the cache; ``accesses``/``access_hits``: the same
    counting every id a step looks up (a hot row read 100 times in a step
    counts 100 times: the hit rate the planner models);
    ``bytes_in``/``bytes_out``: bytes copied host → device and device → host
    (weights and optimizer state); ``seconds``: time spent placing rows and
    copying them (wall clock).
    """

    lookups: int = 0
    hits: int = 0
    accesses: int = 0
    access_hits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def add(self, other: "CacheStats") -> None:
        """Add ``other``'s counters to these."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        """Share of the ids looked up that were found in the cache."""
        return self.access_hits / self.accesses if self.accesses else 0.0

    @property
    def row_hit_rate(self) -> float:
        """Share of each step's distinct rows that were found in the cache."""
        return self.hits / self.lookups if self.lookups else 0.0


class _Step:
    """One step's rows between its lookup and its update."""

    __slots__ = ("source", "bags", "slots", "fetch")

    def __init__(self, source, bags, slots, fetch):
        self.source = source        # the caller's Bags (or None for ``gather``)
        self.bags = bags            # the same with ids rewritten to slots
        self.slots = slots          # per table: the slots pinned (int64)
        self.fetch = fetch          # its missed rows on their way in (None: landed)


class TieredTables:
    """Host-resident tables with a device cache, in place of ``FusedTables`` (module doc).

    ``memory[t]`` is table ``t``'s :class:`~embedding.types.TableMemory`
    (``host`` or ``cached``); its cache is ``min(cache_rows, rows[t])`` rows.
    Other arguments (precision included: ``dtype``, ``rounding``, ``seeds``,
    ``state_dtype``) as for ``FusedTables``.
    """

    def __init__(self, rows: Sequence[int], dims: Sequence[int], optimizer,
                 memory: Sequence[TableMemory], dtype: str = "float32", device: str = "cpu",
                 names: Sequence[str] | None = None, threads: int = 1,
                 rounding: Rounding | str | Sequence = Rounding.NEAREST,
                 seeds: Sequence[int] | None = None, state_dtype: str | None = None):
        self.host = FusedTables(rows, dims, optimizer, dtype=dtype, device="cpu", names=names,
                                threads=threads, rounding=rounding, seeds=seeds,
                                state_dtype=state_dtype)
        adopt_layout(self, self.host, device)
        memory = tuple(memory)
        if len(memory) != self.layout.num_tables:
            raise ValueError(f"memory: expected one TableMemory per table "
                             f"({self.layout.num_tables}), got {len(memory)}")
        for name, m in zip(self.names, memory):
            if not m.tiered:
                raise ValueError(f"memory of {name}: TieredTables holds host and cached "
                                 f"tables, got tier {m.tier.value!r}")
        self.memory = memory
        self.caches = [RowCache(r, min(m.cache_rows, r), m.policy, m.admit_after)
                       for r, m in zip(self.layout.rows, memory)]
        self.stats = CacheStats()
        self._steps: deque[_Step] = deque()
        self._prefetched: dict[int, _Step] = {}
        self._row_bytes = [row_bytes(c.kind, d, self.dtype, self.state_dtype)
                           + (4 * d if r is Rounding.MASTER else 0)
                           for c, d, r in zip(self.optimizers, self.layout.dims, self.rounding)]
        self.work = self._device_tables()
        self.xp = self.work.xp
        self._fetcher = RowFetcher(self.xp)

    def __repr__(self) -> str:
        tiers = "/".join(sorted({m.tier.value for m in self.memory}))
        return (f"TieredTables({len(self.names)} tables, {self.layout.total_rows} rows, "
                f"{self.dtype.name}, {tiers}, {self.device})")

    @property
    def num_tables(self) -> int:
        return self.layout.num_tables

    # -- host views (checkpoints, init, load) --------------------------------------------
    def weight(self, t: int):
        """Table ``t``'s host ``[rows, dim]`` weights, after the cache is written back."""
        self.flush()
        return self.host.weight(t)

    def state_view(self, t: int, name: str):
        """Table ``t``'s host view of optimizer state ``name``, after a write-back."""
        self.flush()
        return self.host.state_view(t, name)

    @property
    def weights(self):
        """The flat host weights of every table (as ``FusedTables.weights``), written back."""
        self.flush()
        return self.host.weights

    @property
    def state(self) -> dict:
        """The host optimizer state arrays (as ``FusedTables.state``), written back."""
        self.flush()
        return self.host.state

    @property
    def master(self):
        """The flat host float32 master rows (as ``FusedTables.master``; None without a
        ``master`` table), written back."""
        if self.host.master is None:
            return None
        self.flush()
        return self.host.master

    def master_weight(self, t: int):
        """Table ``t``'s host ``[rows, dim]`` float32 master rows (None: no master copy),
        after a write-back."""
        self.flush()
        return self.host.master_weight(t)

    def sync_master(self) -> None:
        """Set the host master rows of ``master`` tables from the host weights (after
        writing the weights directly), after a write-back."""
        self.flush()
        self.host.sync_master()

    @property
    def step(self) -> int:
        """Updates so far: the stochastic rounding's counter (as ``FusedTables.step``)."""
        return self.work.step

    @step.setter
    def step(self, value: int) -> None:
        self.work.step = int(value)

    def flush(self) -> None:
        """Write every dirty cached row back to the host and empty the caches.

        Emptying them keeps the host the only copy, so that whoever writes the
        host arrays next (a checkpoint load) is not shadowed by a stale row.
        Steps still open (looked up, not updated) are dropped first, as a
        skipped backward is: a later backward of one raises.
        """
        self.drop_steps()
        for step in self._prefetched.values():
            self._close(step, newest=True)
        self._prefetched.clear()
        for t, cache in enumerate(self.caches):
            self._copy_out(t, *cache.drain())

    def take_stats(self) -> CacheStats:
        """The counters so far; they restart at zero."""
        out, self.stats = self.stats, CacheStats()
        return out

    # -- the step ------------------------------------------------------------------------
    def take_kernel_calls(self) -> int:
        """Fused kernel calls on the rows at hand since the last call (each a call of the
        inner store's kernels)."""
        return self.work.take_kernel_calls()

    def prefetch(self, bags: Bags) -> None:
        """Bring the rows of ``bags`` in now, ahead of its ``lookup`` (module doc)."""
        if id(bags) not in self._prefetched:
            self._prefetched[id(bags)] = self._acquire(bags)

    def lookup(self, bags: Bags, out=None, wire=None):
        """Pooled lookup of every bag, as ``FusedTables.lookup`` (``wire`` included); the step
        stays open."""
        step = self._prefetched.pop(id(bags), None) or self._acquire(bags)
        self._land(step)
        self._steps.append(step)
        return self.work.lookup(step.bags, out, wire)

    def gather(self, pairs) -> list:
        """Rows ``ids`` of table ``t`` for each ``(t, ids)``; opens a step like ``lookup``."""
        per = [[] for _ in range(self.num_tables)]
        for t, ids in pairs:
            per[t].append(np.asarray(ids, np.int64))
        uniq = [compiled.unique(np.concatenate(p))[::2] if p else
                (np.zeros(0, np.int64), np.zeros(0, np.int64)) for p in per]
        step = self._open(None, [u for u, _ in uniq], [c for _, c in uniq])
        self._land(step)
        self._steps.append(step)
        out = []
        for t, ids in pairs:
            cache = self.caches[t]
            w = self.work.weight(t)
            out.append(w[self.xp.asarray(cache.row_slot[np.asarray(ids, np.int64)])])
        return out

    def aggregate(self, bags: Bags, grad_out, wire=None):
        """Per table ``(rows, grads)`` of the bags' summed gradients, rows ascending (``wire``
        as in ``FusedTables.aggregate``)."""
        step = self._current(bags)
        out = []
        for t, (slots, g) in enumerate(self.work.aggregate(step.bags, grad_out, wire)):
            s = host_array(slots)
            rows = self.caches[t].slot_row[s]
            order = np.argsort(rows, kind="stable")
            out.append((self.xp.asarray(rows[order]), g[self.xp.asarray(order)]))
        return out

    def update(self, sparse, unique: bool = True, row_terms=None) -> None:
        """Optimizer step on per-table ``(rows, grads)`` of the oldest open step; closes it."""
        step = self._current(None)
        mapped = []
        for t, (rows, g) in enumerate(sparse):
            r = host_array(rows).astype(np.int64, copy=False)
            slots = self.caches[t].row_slot[r] if r.size else np.zeros(0, np.int64)
            if np.any(slots < 0):
                raise ValueError(f"sparse: rows of {self.names[t]} that the step did not "
                                 f"look up: {r[slots < 0][:5].tolist()}")
            mapped.append((self.xp.asarray(slots), g))
            self.caches[t].mark_dirty(slots)
        self._key_rows()
        self.work.update(mapped, unique, row_terms)
        self._close(step)

    def backward_update(self, bags: Bags, grad_out, wire=None) -> None:
        """Fused backward + optimizer on the rows of the oldest open step; closes it (``wire``
        as in ``FusedTables.backward_update``)."""
        step = self._current(bags)
        self._key_rows()
        self.work.backward_update(step.bags, grad_out, wire)
        for t, slots in enumerate(step.slots):
            self.caches[t].mark_dirty(slots)
        self._close(step)

    def open_steps(self) -> int:
        """Steps looked up (or gathered) and not yet updated."""
        return len(self._steps)

    def drop_steps(self, keep: int = 0) -> None:
        """Close the open steps after the first ``keep`` without an update (forward only)."""
        while len(self._steps) > keep:
            self._close(self._steps.pop(), newest=True)

    # -- internals -------------------------------------------------------------------------
    def _acquire(self, bags: Bags) -> _Step:
        bags.check(self.layout)
        idx = host_array(bags.indices).astype(np.int64, copy=False)
        table_of = bags.table_of_ids()
        inverse, unique, counts = [None] * self.num_tables, [], []
        for t in range(self.num_tables):
            mask = table_of == t
            ids = idx[mask]
            if ids.size and (ids.min() < 0 or ids.max() >= self.layout.rows[t]):
                bad = ids[(ids < 0) | (ids >= self.layout.rows[t])][0]
                raise ValueError(f"bags: id {int(bad)} of {self.names[t]} is outside "
                                 f"[0, {self.layout.rows[t]})")
            u, inv, n = compiled.unique(ids)
            unique.append(u)
            counts.append(n)
            inverse[t] = (mask, inv)
        step = self._open(bags, unique, counts)
        new = np.empty_like(idx)
        for t, (mask, inv) in enumerate(inverse):
            if inv.size:
                new[mask] = self.caches[t].row_slot[unique[t]][inv]
        step.bags = dataclasses.replace(bags, indices=self.xp.asarray(new) if
                                        self.device == "cuda" else new)
        return step

    def _open(self, source, unique: list, counts: list) -> _Step:
        # rows a prefetched step fetched are resident before they land: a step that finds
        # them must see them, so pending fetches land first
        for pending in self._prefetched.values():
            self._land(pending)
        t0 = time.perf_counter()
        grown, decided = False, []
        for t, rows in enumerate(unique):
            got, g = self.caches[t].acquire(rows)
            decided.append(got)
            grown |= g
        if grown:
            old = self.work
            self.work = self._device_tables(old)
            self.work.kernel_calls += old.kernel_calls  # the step's calls so far still count
        slots, parts = [], []
        for t, got in enumerate(decided):
            self._copy_out(t, got.evict_rows, got.evict_slots)
            parts += self._parts_in(t, got.fetch_rows, got.fetch_slots)
            self.stats.lookups += int(got.rows.size)
            self.stats.hits += got.hits
            self.stats.accesses += int(counts[t].sum())
            self.stats.access_hits += int(counts[t][got.hit].sum())
            slots.append(got.slots)
        fetch = self._fetcher.start(parts)
        self.stats.seconds += time.perf_counter() - t0
        return _Step(source, None, slots, fetch)

    def _land(self, step: _Step) -> None:
        """The step's fetched rows into their slots, on the current stream (once)."""
        if step.fetch is not None:
            t0 = time.perf_counter()
            self._fetcher.land(step.fetch, self._work_array)
            step.fetch = None
            self.stats.seconds += time.perf_counter() - t0

    def _work_array(self, key):
        t, name = key
        return _moved(self.work, t)[name]

    def _key_rows(self) -> None:
        """Before an update: the work store's stochastic rounding hashes each slot's host
        row (a free slot's -1 is never updated)."""
        if Rounding.STOCHASTIC in self.rounding:
            keys = np.concatenate([c.slot_row for c in self.caches])
            self.work.row_keys = self.xp.asarray(keys)

    def _current(self, bags) -> _Step:
        """The step ``bags`` opened (the oldest open step for ``None``); older steps, whose
        backward was skipped, are dropped."""
        if bags is None:
            if not self._steps:
                raise ValueError("update: no lookup of a host-resident table is open")
            return self._steps[0]
        k = next((i for i, s in enumerate(self._steps) if s.source is bags), None)
        if k is None:
            raise ValueError("backward: these bags are not an open step's; host-resident "
                             "tables finish steps in the order they were looked up (a step "
                             "whose backward is skipped is dropped at a later step's)")
        for _ in range(k):
            self._close(self._steps[0])
        return self._steps[0]

    def _close(self, step: _Step, newest: bool = False) -> None:
        self._land(step)  # a prefetched step dropped unread: its slots hold its rows
        t0 = time.perf_counter()
        if not newest:
            self._steps.popleft()
        for t, slots in enumerate(step.slots):
            self._copy_out(t, *self.caches[t].release(slots))
        self.stats.seconds += time.perf_counter() - t0

    def _device_tables(self, old: FusedTables | None = None) -> FusedTables:
        work = FusedTables([c.slots for c in self.caches], self.layout.dims, self.optimizers,
                           dtype=self.dtype.name, device=self.device, names=self.names,
                           threads=self.threads, rounding=self.rounding, seeds=self.seeds,
                           state_dtype=self.state_dtype.name)
        if old is not None:  # more staging slots: the existing slots keep their rows
            work.step = old.step
            for t in range(self.num_tables):
                n = old.layout.rows[t]
                new = _moved(work, t)
                for key, arr in _moved(old, t).items():
                    new[key][:n] = arr
        return work

    def _parts_in(self, t: int, rows: np.ndarray, slots: np.ndarray) -> list[Part]:
        """Table ``t``'s weights and optimizer state of ``rows``, bound for ``slots``."""
        if not rows.size:
            return []
        self.stats.bytes_in += int(rows.size) * self._row_bytes[t]
        return [Part((t, key), arr, rows, slots) for key, arr in _moved(self.host, t).items()]

    def _copy_out(self, t: int, rows: np.ndarray, slots: np.ndarray) -> None:
        if not rows.size:
            return
        s = self.xp.asarray(slots)
        work = _moved(self.work, t)
        for key, arr in _moved(self.host, t).items():
            arr[rows] = host_array(work[key][s])
        self.stats.bytes_out += int(rows.size) * self._row_bytes[t]


def _moved(store: FusedTables, t: int) -> dict:
    """What moves of table ``t``'s rows between host and device: ``weight``, each optimizer
    state by name and, for a ``master`` table, ``master`` (its float32 master rows); views
    of ``store``'s arrays, half ones as their ``uint16`` bits."""
    out = {"weight": _bits(store.weight(t))}
    for spec in state_specs(store.optimizers[t].kind):
        out[spec.name] = _bits(store.state_view(t, spec.name))
    master = store.master_weight(t)
    if master is not None:
        out["master"] = master
    return out


def _bits(arr):
    """``arr``, or its raw ``uint16`` bits (a view) when it is float16 or bfloat16."""
    return arr.view(np.uint16) if is_half(arr.dtype) else arr

