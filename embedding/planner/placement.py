"""Stages three and four of the planner: place the shards of chosen candidates on
ranks with a partitioner, and score the result.

Placement goes from the least to the most freedom: every-rank candidates
(row-wise, cyclic row-wise, data-parallel) first, since their ranks are fixed; then one-node
candidates (hierarchical), partitioned over nodes; then free shards
(table-wise, column slices), partitioned over ranks on top of what is
already there. Each partition minimises the largest per-rank time under the
per-device memory limit (usable memory less what every rank pays anyway);
host-resident shards are then checked against each node's host memory.
"""
from __future__ import annotations

from typing import Sequence

from embedding.planner.estimate import CostModel
from embedding.planner.partition import greedy_partition, karmarkar_karp
from embedding.planner.tiers import host_check
from embedding.planner.types import (Candidate, Hardware, MemoryEstimate, PartitionError,
                                     PartitionMethod, PlacementKind, PlanDoesNotFitError,
                                     PlanReport, RankReport, TableReport, sum_parts)
from embedding.types import Shard, ShardingPlan, TablePlan
from topology.sizes import GIB

__all__ = ["place", "score", "capacity", "PARTITIONERS"]


#: The partitioner of each method (same signature, see :mod:`partition`).
PARTITIONERS = {PartitionMethod.GREEDY: greedy_partition,
                PartitionMethod.KARMARKAR_KARP: karmarkar_karp}


def _shard_label(c: Candidate) -> str:
    return f"{c.describe()} shard" if len(c.shards) > 1 else "table-wise shard"


def _no_room(c: Candidate, needed: float, available: float, where: str) -> PlanDoesNotFitError:
    return PlanDoesNotFitError(
        f"cannot place table {c.table!r}: a {_shard_label(c)} needs {needed / GIB:.2f} GiB, "
        f"{where} has {max(available, 0) / GIB:.2f} GiB free "
        f"(short by {(needed - available) / GIB:.2f} GiB)",
        table=c.table, needed=int(needed), available=int(max(available, 0)))


def capacity(choices: Sequence[Candidate], hardware: Hardware) -> int:
    """Bytes per rank left for shards once every rank's spread buffers are paid."""
    return hardware.usable_memory - sum(c.spread_memory for c in choices)


def place(choices: Sequence[Candidate], hardware: Hardware,
          method: PartitionMethod = PartitionMethod.GREEDY) -> list[tuple[int, ...]]:
    """The rank of every shard of every candidate (``out[i][j]``: shard j of choice i).

    Raises :class:`PlanDoesNotFitError` naming the first table that finds no room in
    device memory, or (``tier`` ``"host"``) the node whose host memory the host-resident
    shards overflow.
    """
    partition = PARTITIONERS[PartitionMethod.parse(method)]
    W, R, N = hardware.world_size, hardware.ranks_per_node, hardware.num_nodes
    cap = capacity(choices, hardware)
    load, used = [0.0] * W, [0.0] * W
    out: list[tuple[int, ...] | None] = [None] * len(choices)
    for i, c in enumerate(choices):
        if c.placement is PlacementKind.EVERY_RANK:
            for r, s in enumerate(c.shards):
                if used[r] + s.memory.total > cap:
                    raise _no_room(c, s.memory.total, cap - used[r], f"rank {r}")
                load[r] += s.seconds
                used[r] += s.memory.total
            out[i] = tuple(range(W))

    node_items = [i for i, c in enumerate(choices) if c.placement is PlacementKind.ONE_NODE]
    if node_items:
        ranks_of = [list(range(n * R, (n + 1) * R)) for n in range(N)]
        try:
            nodes = partition(
                [choices[i].seconds / R for i in node_items], N,
                sizes=[choices[i].max_shard_memory for i in node_items],
                capacity=[cap - max(used[r] for r in rs) for rs in ranks_of],
                preload=[sum(load[r] for r in rs) / R for rs in ranks_of])
        except PartitionError as exc:
            c = choices[node_items[exc.item]]
            raise _no_room(c, exc.needed, exc.available, "the node with the most room") from None
        for i, n in zip(node_items, nodes):
            out[i] = _place_in_node(choices[i], ranks_of[n], load, used, cap)

    free = [(i, j) for i, c in enumerate(choices) if c.placement is PlacementKind.FREE
            for j in range(len(c.shards))]
    if free:
        shards = [choices[i].shards[j] for i, j in free]
        try:
            bins = partition([s.seconds for s in shards], W,
                             sizes=[s.memory.total for s in shards], capacity=cap,
                             preload=load, preload_sizes=used,
                             groups=[i if len(choices[i].shards) > 1 else None
                                     for i, _ in free])
        except PartitionError as exc:
            c = choices[free[exc.item][0]]
            raise _no_room(c, exc.needed, exc.available, "the rank with the most room") from None
        ranks: dict[int, list[int]] = {}
        for (i, j), r in zip(free, bins):
            ranks.setdefault(i, [0] * len(choices[i].shards))[j] = r
        for i, rs in ranks.items():
            out[i] = tuple(rs)
    placed = [tuple(x) for x in out]  # type: ignore[arg-type]
    if any(c.tiered for c in choices):
        host_check(choices, placed, hardware)
    return placed


def _place_in_node(c: Candidate, ranks: list[int], load: list[float], used: list[float],
                   cap: float) -> tuple[int, ...]:
    """Shards of a one-node candidate on distinct ranks of the node, heaviest
    shard to the least-loaded rank with room."""
    free = set(ranks)
    out = [0] * len(c.shards)
    for j in sorted(range(len(c.shards)), key=lambda j: -c.shards[j].seconds):
        s = c.shards[j]
        fits = [r for r in free if used[r] + s.memory.total <= cap]
        if not fits:
            room = max((cap - used[r] for r in free), default=0.0)
            raise _no_room(c, s.memory.total, room, f"node of ranks {ranks[0]}-{ranks[-1]}")
        r = min(fits, key=lambda r: (load[r], used[r], r))
        free.discard(r)
        out[j] = r
        load[r] += s.seconds
        used[r] += s.memory.total
    return tuple(out)


def score(choices: Sequence[Candidate], ranks: Sequence[Sequence[int]], hardware: Hardware,
          cost: CostModel, method: PartitionMethod | None = None,
          alternatives: tuple = (), hit_model: str = "") -> PlanReport:
    """Per-rank memory and time of a placement, and the :class:`ShardingPlan` it makes.

    A rank's time is the time of its shards, plus what every rank pays for
    every table (its own ids out, its own pooled rows in), plus the latency of
    each collective the plan uses once.
    """
    W = hardware.world_size
    spread_s = sum(c.spread_seconds for c in choices)
    spread_m = sum(c.spread_memory for c in choices)
    ops = {op for c in choices for op in c.collectives}
    fixed = spread_s + sum(cost.latency(op, scope) for op, scope in ops)
    seconds = [fixed] * W
    mem = [MemoryEstimate(buffers=spread_m)] * W
    count = [0] * W
    compute = [0.0] * W
    copies = [0.0] * W
    shared = [item for c in choices for item in c.spread_parts]  # every rank's own traffic
    parts = [list(shared) for _ in range(W)]
    tables, plans = [], []
    for c, rs in zip(choices, ranks):
        shards = []
        for s, r in zip(c.shards, rs):
            seconds[r] += s.seconds
            mem[r] = mem[r] + s.memory
            count[r] += 1
            compute[r] += s.lookup_seconds
            copies[r] += s.host_seconds
            parts[r].extend(s.parts)
            shards.append(Shard(r, s.row_offset, s.num_rows, s.col_offset, s.num_cols,
                                s.row_stride))
        plans.append(TablePlan(c.table, c.sharding, tuple(shards), c.memory))
        tables.append(TableReport(c.table, c.sharding, c.describe(), tuple(sorted(set(rs))),
                                  c.device_bytes, c.seconds, c.memory, c.host_bytes,
                                  c.hit_rate, c.hit_source))
    plan = ShardingPlan(W, hardware.ranks_per_node, tuple(plans))
    per_rank = tuple(RankReport(r, mem[r], seconds[r], count[r], sum_parts(parts[r]),
                                compute[r], copies[r])
                     for r in range(W))
    return PlanReport(plan, method, per_rank, tuple(tables), hardware.usable_memory,
                      tuple(alternatives), hardware.host_memory, hit_model)
