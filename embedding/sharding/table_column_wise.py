"""Table-column-wise sharding: a table's column slices all on the ranks of one node.

Placing every slice of a table inside one node keeps the slices' owners
together: the ids of the table's features travel to one node only, and the
node's ranks share the pooling work of a wide table. The data path is that
of column-wise sharding (one AlltoAll(v) of ids for all features, one of
pooled slices back); the plan check adds that all slices of a table are on
one node of the group. (Node-local aggregation of the slices before they
cross nodes is not done: the returned volume is the same either way.)
"""
from __future__ import annotations

from embedding.sharding.table_wise import SlotWiseSharding, check_column_partition
from embedding.types import ShardingType, TableConfig, TablePlan

__all__ = ["TableColumnWiseSharding"]


class TableColumnWiseSharding(SlotWiseSharding):
    """Column slices of a table on the ranks of one node (module doc)."""

    sharding_types = (ShardingType.TABLE_COLUMN_WISE,)

    def _check_plan(self, table: TableConfig, plan: TablePlan) -> None:
        check_column_partition(table, plan, self.env.size)
        nodes = {self.env.node_of[s.rank] for s in plan.shards}
        if len(nodes) != 1:
            raise ValueError(f"plan of table {table.name!r} (table_column_wise): all column "
                             f"slices must be on one node, got shards on nodes {sorted(nodes)}")
