"""Check a :class:`~embedding.types.ShardingPlan` against the world and tables it is used with."""
from __future__ import annotations

from typing import Sequence

from embedding.planner.types import PlanMismatchError
from embedding.types import (ShardingPlan, ShardingType, TableConfig, cyclic_shards,
                             positive_arg)

__all__ = ["validate_plan"]


def validate_plan(plan: ShardingPlan, world_size: int, *, ranks_per_node: int | None = None,
                  tables: Sequence[TableConfig] | None = None) -> None:
    """Raise :class:`PlanMismatchError` unless ``plan`` fits this world (and ``tables``).

    Checks: the plan's world size (and ranks per node, when given) equal the
    world's; every shard's rank is in the world; with ``tables``, the plan
    names exactly these tables and the shards of each cover its rows × columns
    (every element once, or one whole replica per rank for data-parallel tables;
    cyclic row-wise shards as :func:`~embedding.types.cyclic_shards` lays them out).
    """
    positive_arg("world_size", world_size, int)
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
    from embedding.packing import packed_tables

    try:
        tables = packed_tables(tables, plan)  # a packed table covers its members' rows
    except ValueError as exc:
        raise PlanMismatchError(f"the plan's packed tables do not fit the model: {exc}",
                                field="packs", got=[p.name for p in plan.packs]) from None
    names = [tp.table for tp in plan.tables]
    want = {t.name: t for t in tables}
    if sorted(names) != sorted(want):
        extra, missing = sorted(set(names) - set(want)), sorted(set(want) - set(names))
        diff = "; ".join(part for part in (
            f"it has {extra} that the model does not" if extra else "",
            f"it lacks the model's {missing}" if missing else "") if part)
        raise PlanMismatchError(f"the plan's tables are not the model's: {diff}",
                                field="tables", expected=sorted(want), got=sorted(names))
    for tp in plan.tables:
        problem = _coverage(tp, want[tp.table], world_size)
        if problem:
            raise PlanMismatchError(f"the shards of table {tp.table!r} do not cover its "
                                    f"{want[tp.table].num_rows} x {want[tp.table].dim} "
                                    f"elements: {problem}", field="shards", got=tp.table)


def _coverage(tp, table: TableConfig, world_size: int) -> str | None:
    """Why the shards of ``tp`` do not tile ``table`` (None when they do).

    Data-parallel: one full replica on each of ``world_size`` distinct ranks.
    Cyclic row-wise: on every rank ``k`` the rows ``k, k + world_size, …``
    (:func:`~embedding.types.cyclic_shards`). Otherwise: the column slices
    tile ``[0, dim)`` and, within each slice, the row blocks tile ``[0,
    num_rows)`` — every element exactly once.
    """
    rows, dim = table.num_rows, table.dim
    if tp.sharding is ShardingType.CYCLIC_ROW_WISE:
        ranks = sorted(s.rank for s in tp.shards)
        if ranks != list(range(world_size)):
            return (f"cyclic row-wise needs one shard on each of the {world_size} ranks, got "
                    f"shards on ranks {ranks}")
        mine = {s.rank: s for s in tp.shards}
        for want in cyclic_shards(rows, dim, world_size):
            got = mine[want.rank]
            if got != want:
                return (f"the cyclic row-wise shard on rank {want.rank} must be rows "
                        f"{want.rank}, {want.rank} + {world_size}, … ({want.num_rows} rows, "
                        f"row_offset={want.row_offset}, row_stride={want.row_stride}) at full "
                        f"width, got {got.num_rows} rows, row_offset={got.row_offset}, "
                        f"row_stride={got.row_stride}, columns [{got.col_offset}, "
                        f"{got.col_offset + got.num_cols})")
        return None
    if tp.sharding is ShardingType.DATA_PARALLEL:
        if any((s.row_offset, s.num_rows, s.col_offset, s.num_cols) != (0, rows, 0, dim)
               for s in tp.shards):
            return "a data-parallel shard is not the whole table"
        if sorted(s.rank for s in tp.shards) != list(range(world_size)):
            return "data-parallel replicas are not on every rank once"
        return None
    slices: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s in tp.shards:
        if s.num_rows <= 0 or s.num_cols <= 0:
            return f"an empty shard on rank {s.rank}"
        slices.setdefault((s.col_offset, s.num_cols), []).append((s.row_offset, s.num_rows))
    col = 0
    for (offset, width), blocks in sorted(slices.items()):
        if offset != col:
            return f"columns [{col}, {offset}) are missing or overlap"
        col = offset + width
        row = 0
        for r_off, r_n in sorted(blocks):
            if r_off != row:
                return f"rows [{row}, {r_off}) of columns from {offset} are missing or overlap"
            row = r_off + r_n
        if row != rows:
            return f"rows of columns from {offset} end at {row}, not {rows}"
    if col != dim:
        return f"columns end at {col}, not {dim}"
    return None
