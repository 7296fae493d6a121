"""Local shards of dynamic tables: any int64 id, rows handed out by a hash map.

:class:`DynamicTables` has the interface of
:class:`~embedding.kernels.fused.FusedTables`; the bags it is given hold ids
(any int64 but the two markers of :mod:`~embedding.kernels.idmap`), not
rows. Like :class:`~embedding.kernels.tiered.TieredTables` it rewrites each
batch's ids to rows of a ``FusedTables`` and runs the unchanged fused
kernels on them:

- ``lookup`` (and ``gather``) find-or-insert the ids in table ``t``'s
  :class:`~embedding.kernels.idmap.IdMap` (on the device with
  ``device="cuda"``); a new id's row gets ``initializer[t](ids)`` weights
  (see :meth:`DynamicTables.set_initializer`; zeros by default) and zero
  optimizer state, also when it evicted another id;
- within :meth:`DynamicTables.reading` (evaluation) ``lookup`` only finds:
  an id the table has not seen reads as a row of zeros (TensorFlow
  Recommenders-Addons' default value) and is not inserted, and no entry's
  count or age moves, so evaluating a model leaves the table as it was;
- ``backward_update``, ``aggregate`` and ``update`` find the ids again
  (an id evicted between its lookup and its backward raises); ``aggregate``
  returns ids ascending, not rows.

Every kernel treats a row the same under any numbering, so training a
dynamic table is bitwise equal to training a fixed table whose rows hold the
same ids' weights. ``weight(t)``/``state_view(t, name)`` are by row;
:meth:`DynamicTables.export` says which id each live row holds.

Half tables (:mod:`embedding.precision`) store their rows in the table's
dtype and the optimizer state in its ``state_dtype``, on the host and on the
device alike. Stochastic rounding hashes the *id* a row holds (the inner
store's ``row_keys`` are the map's ``row_id``), not the row: an id draws
the same bits wherever the map puts it, after an eviction and a reload from
a checkpoint too, and a dynamic table fed ids ``0 .. n-1`` rounds as the
fixed table whose row ``i`` holds id ``i``. A ``master`` table keeps float32
master rows by row; a new id's master row is its stored (rounded) initial
row, as a fixed table's after ``sync_master``; :meth:`DynamicTables.entries`
gives a ``master`` table's float32 master rows as ``weight`` and
:meth:`DynamicTables.load_entries` takes them back as the master copy.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import numpy as np

from embedding.kernels.fused import FusedTables, adopt_layout
from embedding.kernels.idmap import IdMap
from embedding.kernels.layout import Bags, host_array
from embedding.optim import state_specs
from embedding.precision import Rounding
from embedding.types import Eviction

__all__ = ["DynamicTables"]

#: ``initializer(ids) -> [len(ids), dim]`` weights of new ids (NumPy or the store's arrays)
Initializer = Callable[[np.ndarray], object]


class DynamicTables:
    """Dynamic tables of ``rows[t]`` rows (capacity) × ``dims[t]`` (module doc).

    ``eviction[t]``: table ``t``'s :class:`~embedding.types.Eviction`. Other
    arguments (precision included: ``dtype``, ``rounding``, ``seeds``,
    ``state_dtype``) as for ``FusedTables``.
    """

    def __init__(self, rows: Sequence[int], dims: Sequence[int], optimizer,
                 eviction: Sequence[Eviction], dtype: str = "float32", device: str = "cpu",
                 names: Sequence[str] | None = None, threads: int = 1,
                 rounding: Rounding | str | Sequence = Rounding.NEAREST,
                 seeds: Sequence[int] | None = None, state_dtype: str | None = None):
        self.work = FusedTables(rows, dims, optimizer, dtype=dtype, device=device, names=names,
                                threads=threads, rounding=rounding, seeds=seeds,
                                state_dtype=state_dtype)
        adopt_layout(self, self.work, device)
        self.xp = self.work.xp
        eviction = tuple(eviction)
        if len(eviction) != self.num_tables:
            raise ValueError(f"eviction: expected one per table ({self.num_tables}), got "
                             f"{len(eviction)}")
        self.maps = [IdMap(r, e, self.xp) for r, e in zip(self.layout.rows, eviction)]
        self.initializers: list[Initializer | None] = [None] * self.num_tables
        self._moves = 0          # ids evicted or reloaded: looked-up rows stay valid till then
        self._last = None        # (bags, bags by row, evictions) of the last lookup
        self._reading = False    # inside reading(): lookups find, unseen ids read zeros

    def __repr__(self) -> str:
        return (f"DynamicTables({len(self.names)} tables, capacity {self.layout.total_rows} "
                f"rows, {self.dtype.name}, {self.device})")

    @property
    def num_tables(self) -> int:
        return self.layout.num_tables

    @property
    def weights(self):
        return self.work.weights

    @property
    def state(self) -> dict:
        return self.work.state

    def weight(self, t: int):
        """Table ``t``'s ``[capacity, dim]`` weights by row (a view)."""
        return self.work.weight(t)

    def state_view(self, t: int, name: str):
        """Table ``t``'s view of optimizer state ``name`` by row."""
        return self.work.state_view(t, name)

    @property
    def master(self):
        """The flat float32 master rows by row (None without a ``master`` table)."""
        return self.work.master

    def master_weight(self, t: int):
        """Table ``t``'s ``[capacity, dim]`` float32 master rows by row (a view), or None
        when it keeps no master copy."""
        return self.work.master_weight(t)

    def sync_master(self) -> None:
        """Set the master rows of ``master`` tables from the stored rows (after writing
        :meth:`weight` directly)."""
        self.work.sync_master()

    @property
    def step(self) -> int:
        """Updates so far: the stochastic rounding's counter (as ``FusedTables.step``)."""
        return self.work.step

    @step.setter
    def step(self, value: int) -> None:
        self.work.step = int(value)

    def set_initializer(self, t: int, init: Initializer | None) -> None:
        """Weights of table ``t``'s new ids from now on; None: zeros."""
        self.initializers[t] = init

    def export(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)`` of table ``t``'s live entries, ids ascending (NumPy int64)."""
        ids, rows = self.maps[t].entries()
        return host_array(ids), host_array(rows)

    def entries(self, t: int) -> dict:
        """Table ``t``'s live entries as NumPy arrays, ids ascending: ``ids``, ``weight``,
        each optimizer state by name, ``count``, ``last`` and ``tick`` (shape ``[1]``).
        A ``master`` table's ``weight`` is its float32 master rows."""
        ids, rows = self.maps[t].entries()
        m = self.maps[t]
        master = self.master_weight(t)
        w = self.weight(t) if master is None else master
        out = {"ids": host_array(ids), "weight": host_array(w[rows])}
        for spec in state_specs(self.optimizers[t].kind):
            out[spec.name] = host_array(self.state_view(t, spec.name)[rows])
        out["count"] = host_array(m.count[rows])
        out["last"] = host_array(m.last[rows])
        out["tick"] = np.array([m.tick], np.int64)
        return out

    def load_entries(self, t: int, entries: dict) -> None:
        """Replace table ``t``'s entries by ``entries`` (as :meth:`entries` gives them).

        Weights and state of any float dtype are rounded to nearest into storage; a
        ``master`` table takes ``weight`` (as float32) as its master rows."""
        xp = self.xp
        m = self.maps[t]
        self._moves += 1
        rows = m.load(xp.asarray(entries["ids"]), xp.asarray(entries["count"]),
                      xp.asarray(entries["last"]), int(np.max(entries["tick"], initial=0)))
        self.weight(t)[...] = 0
        self.weight(t)[rows] = xp.asarray(entries["weight"], self.dtype)
        master = self.master_weight(t)
        if master is not None:
            master[...] = 0
            master[rows] = xp.asarray(entries["weight"], xp.float32)
        for spec in state_specs(self.optimizers[t].kind):
            view = self.state_view(t, spec.name)
            view[...] = 0
            view[rows] = xp.asarray(entries[spec.name], view.dtype)

    @contextlib.contextmanager
    def reading(self):
        """Lookups within only read (module doc): for evaluation, no backward follows."""
        before, self._reading = self._reading, True
        try:
            yield self
        finally:
            self._reading = before

    # -- kernels ------------------------------------------------------------------------
    def take_kernel_calls(self) -> int:
        """Fused kernel calls on the rows at hand since the last call (each a call of the
        inner store's kernels)."""
        return self.work.take_kernel_calls()

    def prefetch(self, bags: Bags) -> None:
        """Nothing to do: every row is in this store's memory."""

    def gather(self, pairs) -> list:
        """Rows of ids ``ids`` of table ``t`` for each ``(t, ids)`` (new ids are inserted)."""
        return [self.weight(t)[self._acquire(t, self.xp.asarray(ids, self.xp.int64))]
                for t, ids in pairs]

    def lookup(self, bags: Bags, out=None, wire=None):
        """Pooled lookup of every bag (ids inserted as needed, or read as zeros within
        :meth:`reading`), as ``FusedTables.lookup``."""
        if self._reading:
            return self.work.lookup(self._rows_or_zero(bags), out, wire)
        by_row = self._rows_of(bags, insert=True)
        self._last = (bags, by_row, self._moves)
        return self.work.lookup(by_row, out, wire)

    def aggregate(self, bags: Bags, grad_out, wire=None):
        """Per table ``(ids, grads)`` of the bags' summed gradients, ids ascending (``wire`` as
        in ``FusedTables.aggregate``)."""
        out = []
        by_row = self._looked_up(bags)
        for t, (rows, g) in enumerate(self.work.aggregate(by_row, grad_out, wire)):
            ids = self.maps[t].row_id[self.xp.asarray(rows)]
            order = self.xp.argsort(ids, kind="stable")
            out.append((ids[order], g[order]))
        return out

    def update(self, sparse, unique: bool = True, row_terms=None) -> None:
        """Optimizer step on per-table ``(ids, grads)``, as ``FusedTables.update``."""
        mapped = [(self._find(t, ids), g) for t, (ids, g) in enumerate(sparse)]
        self._key_rows()
        self.work.update(mapped, unique, row_terms)

    def backward_update(self, bags: Bags, grad_out, wire=None) -> None:
        """Fused backward + optimizer on the rows of the bags' ids (``wire`` as in
        ``FusedTables.backward_update``)."""
        by_row = self._looked_up(bags)
        self._key_rows()
        self.work.backward_update(by_row, grad_out, wire)

    # -- internals ------------------------------------------------------------------------
    def _key_rows(self) -> None:
        """Before an update: stochastic rounding hashes the id each row holds (module doc)."""
        if Rounding.STOCHASTIC in self.rounding:
            ids = [m.row_id for m in self.maps]
            self.work.row_keys = ids[0] if len(ids) == 1 else self.xp.concatenate(ids)

    def _looked_up(self, bags: Bags) -> Bags:
        """``bags`` by row for its backward: the last lookup's when no id moved since, else
        found again (ValueError if an id is gone)."""
        last = self._last
        if last is not None and last[0] is bags and last[2] == self._moves:
            return last[1]
        return self._rows_of(bags)

    def _by_table(self, bags: Bags, rows_of, every_table: bool = False):
        """``(ids, rows)`` of the bags' indices, ``rows_of(t, ids)`` giving table ``t``'s;
        ``every_table`` calls it for a table the bags do not read too."""
        bags.check(self.layout)
        xp = self.xp
        idx = xp.asarray(bags.indices, xp.int64)
        table_of = bags.table_of_ids()
        rows = xp.empty_like(idx)
        for t in range(self.num_tables):
            sel = np.flatnonzero(table_of == t)
            if sel.size or every_table:
                sel = xp.asarray(sel)
                rows[sel] = rows_of(t, idx[sel])
        return idx, rows

    def _rows_of(self, bags: Bags, insert: bool = False) -> Bags:
        """``bags`` with ids rewritten to rows (inserted, or found: ValueError if absent)."""
        # a lookup ticks every table's map, read or not: ``last`` counts lookups
        _, rows = self._by_table(bags, self._acquire if insert else self._find,
                                 every_table=insert)
        return dataclasses.replace(bags, indices=rows)

    def _rows_or_zero(self, bags: Bags) -> Bags:
        """``bags`` by row where the ids are found; an absent id points at row 0 with weight 0,
        which reads as a zero row under sum, mean (it still counts in the bag's length) and
        max pooling alike."""
        xp = self.xp
        idx, rows = self._by_table(bags, lambda t, ids: self.maps[t].find(ids))
        absent = rows < 0
        if not bool(absent.any()):
            return dataclasses.replace(bags, indices=rows)
        cdt = self.compute_dtype
        weights = (xp.ones(idx.shape, cdt) if bags.weights is None
                   else xp.array(bags.weights, cdt))
        weights[absent] = 0
        rows[absent] = 0
        return dataclasses.replace(bags, indices=rows, weights=weights)

    def _acquire(self, t: int, ids):
        got = self.maps[t].acquire(ids)
        self._moves += int(got.evicted_ids.size)
        if int(got.new_rows.size):
            init = self.initializers[t]
            w = self.weight(t)
            if init is None:
                w[got.new_rows] = 0
            else:
                w[got.new_rows] = self.xp.asarray(init(host_array(got.new_ids)), self.dtype)
            master = self.master_weight(t)
            if master is not None:  # the stored row's value, as sync_master gives it
                master[got.new_rows] = w[got.new_rows].astype(self.xp.float32)
            for spec in state_specs(self.optimizers[t].kind):
                self.state_view(t, spec.name)[got.new_rows] = 0
        return got.rows

    def _find(self, t: int, ids):
        xp = self.xp
        ids = xp.asarray(ids, xp.int64)
        rows = self.maps[t].find(ids)
        lost = xp.flatnonzero(rows < 0)
        if lost.size:
            shown = host_array(ids[lost[:5]]).tolist()
            raise ValueError(f"ids of {self.names[t]}: {shown} are not "
                             f"in the table (evicted since their lookup? a capacity too small "
                             f"for the steps in flight)")
        return rows

