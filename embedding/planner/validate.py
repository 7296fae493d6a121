"""Check a :class:`~embedding.types.ShardingPlan` against the world and tables it is used with."""
from __future__ import annotations

from typing import Sequence

from embedding.planner.types import PlanMismatchError
from embedding.types import ShardingPlan, TableConfig

__all__ = ["validate_plan"]


def validate_plan(plan: ShardingPlan, world_size: int, *, ranks_per_node: int | None = None,
                  tables: Sequence[TableConfig] | None = None) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` fits this world (and ``tables``).

    Checks: the plan's world size (and ranks per node, when given) equal the
    world's; every shard's rank is in the world; with ``tables``, the plan
    names exactly these tables and the shards of each cover its rows × columns
    (every element once, or once per rank for data-parallel tables).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if plan.world_size != world_size:
        raise PlanMismatchError(f"the plan is for {plan.world_size} ranks, the world has "
                                f"{world_size}", field="world_size",
                                expected=world_size, got=plan.world_size)
    if ranks_per_node is not None and plan.ranks_per_node != ranks_per_node:
        raise PlanMismatchError(f"the plan is for nodes of {plan.ranks_per_node} ranks, the "
                                f"world has nodes of {ranks_per_node}", field="ranks_per_node",
                                expected=ranks_per_node, got=plan.ranks_per_node)
    for tp in plan.tables:
        for s in tp.shards:
            if not 0 <= s.rank < world_size:
                raise PlanMismatchError(f"table {tp.table!r} has a shard on rank {s.rank}, "
                                        f"the world has ranks 0..{world_size - 1}",
                                        field="rank", expected=world_size, got=s.rank)
    if tables is None:
        return
    names = [tp.table for tp in plan.tables]
    want = {t.name: t for t in tables}
    if sorted(names) != sorted(want):
        raise PlanMismatchError(f"the plan's tables {sorted(names)} are not the tables "
                                f"{sorted(want)}", field="tables", expected=sorted(want),
                                got=sorted(names))
    from embedding.types import ShardingType

    for tp in plan.tables:
        t = want[tp.table]
        copies = world_size if tp.sharding is ShardingType.DATA_PARALLEL else 1
        area = sum(s.num_rows * s.num_cols for s in tp.shards)
        inside = all(0 <= s.row_offset and s.row_offset + s.num_rows <= t.num_rows
                     and 0 <= s.col_offset and s.col_offset + s.num_cols <= t.dim
                     for s in tp.shards)
        if not inside or area != copies * t.num_rows * t.dim:
            raise PlanMismatchError(f"the shards of table {tp.table!r} do not cover its "
                                    f"{t.num_rows} x {t.dim} elements {copies} time(s)",
                                    field="shards", expected=copies * t.num_rows * t.dim,
                                    got=area)
