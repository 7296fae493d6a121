"""The planner: enumerate candidates, choose one per table, place, score.

Choice starts from each table's cheapest candidate (least time summed over
ranks). If the shards do not fit, the table with the largest shard moves to a
more spread candidate until they do. Then a local search lowers the step time:
it looks at the tables on the slowest rank, heaviest first, and tries each of
their candidates (the same one included: a move to another rank), keeping a
change that lowers the slowest rank's time (or, at equal time, evens the
ranks out). Last, the chosen candidates are placed from scratch by every
partitioner asked for; the best of those, the search's own placement and
the plain table-wise plan (when every table fits whole) is returned.

With a host tier (``Hardware.host_memory`` > 0) the candidates include the
tiered variants of :mod:`~embedding.planner.tiers`. When no further spread
in device memory makes the shards fit, the table to move is the one whose
move into host memory (or to a smaller cache) costs the least time per byte
of device memory it frees; after placement the caches grow into the device
memory their ranks have left.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import numpy as np

from embedding.planner.enumerate import enumerate_candidates
from embedding.planner.estimate import CostModel
from embedding.planner.placement import place, score
from embedding.planner.tiers import TierModel, grow_caches, hit_model_line, no_fit_error
from embedding.planner.types import (Candidate, Hardware, PartitionMethod, PlacementKind,
                                     PlanDoesNotFitError, PlanMismatchError, PlanReport,
                                     TableConstraints, Workload)
from embedding.types import ShardingPlan, ShardingType, TableConfig
from topology.sizes import GIB

__all__ = ["plan_sharding", "baseline_plan", "candidates_of", "evaluate_plan"]

_COLUMN_SLICED = (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)

_log = logging.getLogger(__name__)
_TOL = 1e-9


def candidates_of(tables: Sequence[TableConfig], hardware: Hardware, workload: Workload,
                  constraints: Mapping[str, TableConstraints] | None = None,
                  cost: CostModel | None = None) -> list[list[Candidate]]:
    """The candidates of every table (stage one); checks the table names."""
    if not tables:
        raise ValueError("tables: expected at least one table, got none")
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tables: names must be unique, repeated: {dup}")
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - set(names))
    if unknown:
        raise ValueError(f"constraints: tables {unknown} are not in the table list")
    cost = cost or CostModel(hardware)
    return [enumerate_candidates(t, hardware, workload, cost, constraints.get(t.name))
            for t in tables]


def _total(c: Candidate, world: int) -> float:
    return c.seconds + c.spread_seconds * world


class _State:
    """An incremental placement: per-rank time and memory, one candidate per table."""

    def __init__(self, cands: list[list[Candidate]], hw: Hardware):
        self.cands, self.hw = cands, hw
        W = hw.world_size
        self.load = np.zeros(W)
        self.used = np.zeros(W)
        self.choice = [0] * len(cands)
        self.ranks: list[tuple[int, ...]] = [()] * len(cands)
        self.spread_s = 0.0
        self.spread_m = 0
        self.host = np.zeros(hw.num_nodes)

    def cap(self) -> float:
        return self.hw.usable_memory - self.spread_m

    def candidate(self, t: int) -> Candidate:
        return self.cands[t][self.choice[t]]

    def _apply(self, c: Candidate, ranks, sign: float) -> None:
        for s, r in zip(c.shards, ranks):
            self.load[r] += sign * s.seconds
            self.used[r] += sign * s.memory.total
            self.host[r // self.hw.ranks_per_node] += sign * s.memory.host
        self.spread_s += sign * c.spread_seconds
        self.spread_m += int(sign) * c.spread_memory

    def set(self, t: int, k: int, ranks) -> None:
        self.choice[t], self.ranks[t] = k, tuple(ranks)
        self._apply(self.cands[t][k], ranks, +1.0)

    def remove(self, t: int) -> None:
        self._apply(self.candidate(t), self.ranks[t], -1.0)

    def fit(self, c: Candidate):
        """Ranks for ``c`` on top of the current loads, or None when it does not fit
        (device memory per rank, host memory per node)."""
        ranks = self._fit(c)
        if ranks is None or not c.tiered:
            return ranks
        host = self.host.copy()
        for s, r in zip(c.shards, ranks):
            host[r // self.hw.ranks_per_node] += s.memory.host
        return ranks if host.max() <= self.hw.host_memory else None

    def _fit(self, c: Candidate):
        cap = self.cap() - c.spread_memory
        if self.used.max(initial=0.0) > cap:
            return None
        if c.placement is PlacementKind.EVERY_RANK:
            mem = np.array([s.memory.total for s in c.shards])
            return tuple(range(len(c.shards))) if np.all(self.used + mem <= cap) else None
        order = sorted(range(len(c.shards)), key=lambda j: -c.shards[j].seconds)
        if c.placement is PlacementKind.FREE:
            taken = np.zeros(len(self.load), dtype=bool)
            out = [0] * len(c.shards)
            load, used = self.load.copy(), self.used.copy()
            for j in order:
                s = c.shards[j]
                ok = (used + s.memory.total <= cap) & ~taken
                if not ok.any():
                    return None
                r = int(np.argmin(np.where(ok, load, np.inf)))
                out[j], taken[r] = r, True
                load[r] += s.seconds
                used[r] += s.memory.total
            return tuple(out)
        R = self.hw.ranks_per_node
        k = len(order)
        by_load = np.argsort(self.load.reshape(-1, R), axis=1, kind="stable")[:, :k]
        base = np.arange(0, len(self.load), R)[:, None] + by_load
        secs = np.array([c.shards[j].seconds for j in order])
        mem = np.array([c.shards[j].memory.total for j in order])
        ok = np.all(self.used[base] + mem <= cap, axis=1)
        if not ok.any():
            return None
        peak = np.where(ok, (self.load[base] + secs).max(axis=1), np.inf)
        n = int(np.argmin(peak))
        out = [0] * k
        for pos, j in enumerate(order):
            out[j] = int(base[n, pos])
        return tuple(out)

    def objective(self) -> tuple[float, int, float]:
        """(slowest rank's time, ranks that slow, sum of squared times)."""
        v = self.load + self.spread_s
        top = float(v.max())
        return top, int(np.count_nonzero(v >= top * (1 - _TOL))), float(np.dot(v, v))


def _better(new: tuple[float, int, float], old: tuple[float, int, float]) -> bool:
    """Lexicographic: a lower maximum, else fewer ranks at it, else more even."""
    if new[0] < old[0] * (1 - _TOL):
        return True
    if new[0] > old[0] * (1 + _TOL):
        return False
    if new[1] != old[1]:
        return new[1] < old[1]
    return new[2] < old[2] * (1 - _TOL)


def _fit_memory(cands, choice, hw) -> list[tuple[int, ...]]:
    """Spread the tables with the largest shards until a greedy placement fits; when no
    device candidate is smaller, move the table that costs least time per byte of device
    memory freed into host memory (or to a smaller cache)."""
    W = hw.world_size
    while True:
        chosen = [cs[k] for cs, k in zip(cands, choice)]
        try:
            return place(chosen, hw, PartitionMethod.GREEDY)
        except PlanDoesNotFitError as exc:
            error = exc
        if error.tier == "host":  # more rows in host memory cannot help: spread them
            best = _spread_host(cands, choice, W)
            if best is None:
                raise no_fit_error(cands, hw, error) from None
            choice[best[1]] = best[2]
            continue
        best = None
        for t, (cs, k) in enumerate(zip(cands, choice)):
            if cs[k].tiered:
                continue
            current = cs[k].max_shard_memory
            smaller = [j for j, c in enumerate(cs) if c.max_shard_memory < current
                       and not c.tiered]
            if smaller and (best is None or current > best[0]):
                j = min(smaller, key=lambda j: (_total(cs[j], W), j))
                best = (current, t, j)
        if best is None:
            best = _cheapest_move(cands, choice, W)
        if best is None:
            if hw.host_memory:
                raise no_fit_error(cands, hw, error) from None
            need = sum(c.max_shard_memory * len(c.shards) + c.spread_memory * W
                       for c in chosen)
            have = hw.usable_memory * W
            total = (f"; in all the tables need at least {need / GIB:.2f} GiB, "
                     f"{W} ranks have {have / GIB:.2f} GiB usable"
                     if need > have else "")
            raise PlanDoesNotFitError(error.message + total, table=error.table,
                                      needed=error.needed, available=error.available,
                                      device_short=max(0, need - have)) from None
        choice[best[1]] = best[2]


def _spread_host(cands, choice, W):
    """``(host bytes, table, candidate)``: the host-resident table with the largest shard in
    host memory, moved to its host-resident candidate of smallest largest shard (more
    ranks, and so more nodes' host memory, hold it) among those that take no more device
    memory; None when no such move shrinks it. A move shrinks a table's largest host
    shard and grows no device bytes, and :func:`_cheapest_move` lowers device bytes, so
    the two together come to an end."""
    best = None
    for t, (cs, k) in enumerate(zip(cands, choice)):
        if not cs[k].tiered:
            continue
        current = max(s.memory.host for s in cs[k].shards)
        device = cs[k].device_bytes + cs[k].spread_memory * W
        smaller = [j for j, c in enumerate(cs)
                   if c.tiered and max(s.memory.host for s in c.shards) < current
                   and c.device_bytes + c.spread_memory * W <= device]
        if smaller and (best is None or current > best[0]):
            j = min(smaller, key=lambda j: (max(s.memory.host for s in cands[t][j].shards),
                                            j))
            best = (current, t, j)
    return best


def _cheapest_move(cands, choice, W):
    """``(ratio, table, candidate)`` of the move into host memory (a tiered candidate)
    with less device memory in all that adds the least time per byte freed; None when
    there is none. Each move lowers a table's device bytes, so moves come to an end."""
    best = None
    for t, (cs, k) in enumerate(zip(cands, choice)):
        cur = cs[k]
        here = cur.device_bytes + cur.spread_memory * W
        for j, c in enumerate(cs):
            freed = here - (c.device_bytes + c.spread_memory * W)
            if freed <= 0 or not c.tiered:
                continue
            ratio = (_total(c, W) - _total(cur, W)) / freed
            if best is None or ratio < best[0]:
                best = (ratio, t, j)
    return best


def _search(state: _State, max_rounds: int) -> int:
    """Local search on the slowest rank; returns the number of changes made."""
    changes = 0
    for _ in range(max_rounds):
        old = state.objective()
        r = int(np.argmax(state.load))
        on_r = []
        for t, ranks in enumerate(state.ranks):
            c = state.candidate(t)
            share = sum(s.seconds for s, x in zip(c.shards, ranks) if x == r)
            if share > 0:
                on_r.append((share, t))
        on_r.sort(reverse=True)
        moved = False
        for _, t in on_r[:8]:
            k0, ranks0 = state.choice[t], state.ranks[t]
            state.remove(t)
            best = None
            for k, c in enumerate(state.cands[t]):
                ranks = state.fit(c)
                if ranks is None:
                    continue
                state.set(t, k, ranks)
                obj = state.objective()
                if _better(obj, old) and (best is None or _better(obj, best[0])):
                    best = (obj, k, ranks)
                state.remove(t)
            if best is not None:
                state.set(t, best[1], best[2])
                changes += 1
                moved = True
                break
            state.set(t, k0, ranks0)
        if not moved:
            break
    return changes


def plan_sharding(tables: Sequence[TableConfig], hardware: Hardware,
                  workload: Workload | None = None, *,
                  constraints: Mapping[str, TableConstraints] | None = None,
                  methods: Sequence[PartitionMethod | str] = (PartitionMethod.GREEDY,
                                                              PartitionMethod.KARMARKAR_KARP),
                  search: bool = True, pack_rows: int | None = None) -> PlanReport:
    """Plan the sharding of ``tables`` on ``hardware`` for ``workload``.

    ``methods`` are the partitioners tried for the final placement; with
    ``search`` False the planner stops after fitting memory (no local search).
    ``pack_rows`` (rows; None or 0: no packing) packs tables of at most that many rows
    that share dim, dtype, optimizer, pooling, rounding and constraints
    (:func:`~embedding.packing.choose_packs`) and plans each packed table as one table
    whose ids per sample are its members' together; the plan records the packing.
    Raises :class:`PlanDoesNotFitError` naming a table and how much it is
    short by when no placement fits, ValueError on bad arguments.
    """
    if pack_rows:
        return _plan_packed(tables, hardware, workload, constraints, methods, search,
                            pack_rows)
    workload = workload or Workload()
    methods = [PartitionMethod.parse(m) for m in methods]
    if not methods:
        raise ValueError("methods: expected at least one partition method, got none")
    cost = CostModel(hardware)
    cands = candidates_of(tables, hardware, workload, constraints, cost)
    W = hardware.world_size
    choice = [min(range(len(cs)), key=lambda k: (_total(cs[k], W), len(cs[k].shards), k))
              for cs in cands]
    ranks = _fit_memory(cands, choice, hardware)
    state = _State(cands, hardware)
    for t, (k, rs) in enumerate(zip(choice, ranks)):
        state.set(t, k, rs)
    changes = _search(state, 4 * len(tables) + 16) if search else 0
    _log.info("local search made %d changes", changes)
    chosen = [state.candidate(t) for t in range(len(tables))]
    results = [(chosen, PartitionMethod.GREEDY, "search", list(state.ranks))]
    alternatives = []
    for method in methods:
        try:
            results.append((chosen, method, method.value, place(chosen, hardware, method)))
        except PlanDoesNotFitError as exc:
            _log.info("%s placement does not fit: %s", method.value, exc)
            alternatives.append((method.value, None))
    whole = [next((c for c in cs if c.sharding is ShardingType.TABLE_WISE and not c.tiered),
                  None)
             for cs in cands]
    if all(c is not None for c in whole):  # the plain table-wise plan competes too
        try:
            results.append((whole, PartitionMethod.GREEDY, "table-wise",
                            place(whole, hardware, PartitionMethod.GREEDY)))
        except PlanDoesNotFitError:
            alternatives.append(("table-wise", None))
    if hardware.host_memory and any(c.tiered for c in chosen):
        results = _grown(results, tables, hardware, workload, constraints)
    hits = hit_model_line(chosen, workload)
    scored = [(score(ch, rs, hardware, cost, m, hit_model=hits), label)
              for ch, m, label, rs in results]
    alternatives = tuple([(label, rep.step_seconds) for rep, label in scored] + alternatives)
    best, _ = min(scored, key=lambda x: (x[0].step_seconds, x[0].max_memory))
    return dataclasses.replace(best, alternatives=alternatives)


def _plan_packed(tables, hardware, workload, constraints, methods, search, pack_rows):
    """:func:`plan_sharding` of ``tables`` with the small ones packed (``pack_rows``)."""
    from embedding.packing import choose_packs, packed_tables

    given = dict(constraints or {})
    ids = (workload or Workload()).ids_per_sample

    def rest(name):  # what a packed table's members must share besides their kind
        c = given.get(name)
        return None if c is None else dataclasses.replace(c, ids_per_sample=None)

    packs = choose_packs(tables, pack_rows, group_by=rest)
    cons = dict(given)
    for p in packs:
        base = rest(p.tables[0]) or TableConstraints()
        cons[p.name] = dataclasses.replace(base, ids_per_sample=sum(
            (given[m].ids_per_sample if m in given and given[m].ids_per_sample else ids)
            for m in p.tables))
        for m in p.tables:
            cons.pop(m, None)
    report = plan_sharding(packed_tables(tables, packs), hardware, workload,
                           constraints=cons or None, methods=methods, search=search)
    return dataclasses.replace(report, plan=dataclasses.replace(report.plan, packs=packs))


def _grown(results, tables, hardware, workload, constraints):
    """``results`` with the caches of their cached tables grown into the device memory left
    (:func:`~embedding.planner.tiers.grow_caches`)."""
    constraints = constraints or {}
    models = {t.name: TierModel(t, hardware, workload, constraints.get(t.name))
              for t in tables}
    return [(grow_caches(chosen, ranks, hardware, models), method, label, ranks)
            for chosen, method, label, ranks in results]


def baseline_plan(tables: Sequence[TableConfig], hardware: Hardware,
                  workload: Workload | None = None, *,
                  constraints: Mapping[str, TableConstraints] | None = None) -> PlanReport:
    """Every table whole on one rank, placed by plain greedy (largest time first
    onto the least-loaded rank with room): the reference the planner is compared to.
    Only the pooling factors of ``constraints`` are used; every table stays in device
    memory."""
    workload = workload or Workload()
    hardware = dataclasses.replace(hardware, host_memory=0)  # every table in device memory
    cost = CostModel(hardware)
    pooling = {k: c.ids_per_sample for k, c in (constraints or {}).items()}
    only_tw = {t.name: TableConstraints(ids_per_sample=pooling.get(t.name),
                                        shardings=(ShardingType.TABLE_WISE,)) for t in tables}
    cands = candidates_of(tables, hardware, workload, only_tw, cost)
    chosen = [cs[0] for cs in cands]
    return score(chosen, place(chosen, hardware, PartitionMethod.GREEDY), hardware, cost,
                 PartitionMethod.GREEDY)


def evaluate_plan(plan: ShardingPlan, tables: Sequence[TableConfig], hardware: Hardware,
                  workload: Workload | None = None, *,
                  constraints: Mapping[str, TableConstraints] | None = None) -> PlanReport:
    """The report of a given ``plan`` (e.g. a plan file) on ``hardware``: its tables priced
    as the planner prices them, on the plan's ranks and in the plan's memory tiers.

    :class:`PlanMismatchError` when the plan does not fit the hardware's world or the
    tables (:func:`validate_plan`) or has a shard the planner would not cut (a row or
    column block of other bounds), naming the table.
    """
    from embedding.planner.validate import validate_plan

    from embedding.packing import packed_tables

    validate_plan(plan, hardware.world_size, ranks_per_node=hardware.ranks_per_node,
                  tables=tables)
    tables = packed_tables(tables, plan)  # a packed table is priced as one
    workload = workload or Workload()
    cost = CostModel(hardware)
    by_name = {tp.table: tp for tp in plan.tables}
    chosen, ranks = [], []
    for table in tables:
        tp = by_name[table.name]
        given = constraints.get(table.name) if constraints else None
        k = len({s.col_offset for s in tp.shards})
        only = dataclasses.replace(given or TableConstraints(), shardings=(tp.sharding,),
                                   column_slices=k if tp.sharding in _COLUMN_SLICED else 0)
        cand = next((c.device or c for c in candidates_of([table], hardware, workload,
                                                          {table.name: only}, cost)[0]
                     if c.sharding is tp.sharding and len(c.shards) == len(tp.shards)), None)
        if cand is not None and tp.memory.tiered:
            cand = dataclasses.replace(
                TierModel(table, hardware, workload, only).variant(cand, tp.memory.cache_rows),
                memory=tp.memory)
        blocks = {}
        for s in tp.shards:
            blocks.setdefault((s.row_offset, s.num_rows, s.row_stride, s.col_offset,
                               s.num_cols), []).append(s.rank)
        picked = []
        for s in (cand.shards if cand is not None else ()):
            owners = blocks.get((s.row_offset, s.num_rows, s.row_stride, s.col_offset,
                                 s.num_cols))
            if not owners:
                break
            picked.append(owners.pop(0))
        if cand is None or len(picked) != len(tp.shards):
            raise PlanMismatchError(f"the shards of table {table.name!r} are not blocks the "
                                    f"planner cuts for {tp.sharding.value} on "
                                    f"{hardware.world_size} ranks (rows split evenly, equal "
                                    f"column slices)", field="shards", got=table.name)
        chosen.append(cand)
        ranks.append(tuple(picked))
    return score(chosen, ranks, hardware, cost)
