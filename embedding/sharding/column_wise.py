"""Column-wise sharding: a table split into column slices, each slice on one rank.

Every slice owner needs every id of the table's features, so the input dist
replicates each feature's ids to each slice's owner (one AlltoAll(v) for
all features, as in table-wise); each owner pools its slice, and the output
dist returns ``B × slice width`` per slice, which the requesting rank
concatenates in column order. Mean pooling is exact per slice. Example,
table A of dim 8 in slices ``[0, 4)`` on rank 0 and ``[4, 8)`` on rank 1::

    every rank sends the ids of A's features to rank 0 and to rank 1
    rank 0 returns pooled columns 0-3, rank 1 columns 4-7
    each rank's output for A: [cols 0-3 from rank 0 | cols 4-7 from rank 1]

It is table-wise sharding over slots (feature × slice), see
:class:`~embedding.sharding.table_wise.SlotWiseSharding`.
"""
from __future__ import annotations

from embedding.sharding.table_wise import SlotWiseSharding, check_column_partition
from embedding.types import ShardingType, TableConfig, TablePlan

__all__ = ["ColumnWiseSharding"]


class ColumnWiseSharding(SlotWiseSharding):
    """Column slices of tables, each slice whole-row on one rank (module doc)."""

    sharding_types = (ShardingType.COLUMN_WISE,)

    def _check_plan(self, table: TableConfig, plan: TablePlan) -> None:
        check_column_partition(table, plan, self.env.size)
