"""Sharding strategies: one module per :class:`~embedding.types.ShardingType`.

Each strategy implements :class:`~embedding.sharding.base.ShardingStrategy`
(input dist → lookup → output dist → backward) over ``collectives``;
:data:`STRATEGIES` maps a sharding type to its class, so adding a sharding
is adding a module and one entry here.
"""
from embedding.sharding.base import Pending, ShardingEnv, ShardingStrategy
from embedding.sharding.column_wise import ColumnWiseSharding
from embedding.sharding.cyclic_row_wise import CyclicRowWiseSharding
from embedding.sharding.data_parallel import DataParallelSharding
from embedding.sharding.row_wise import RowWiseSharding
from embedding.sharding.table_column_wise import TableColumnWiseSharding
from embedding.sharding.table_row_wise import TableRowWiseSharding
from embedding.sharding.table_wise import TableWiseSharding
from embedding.types import ShardingType

__all__ = ["STRATEGIES", "ShardingStrategy", "ShardingEnv", "Pending", "TableWiseSharding",
           "RowWiseSharding", "ColumnWiseSharding", "DataParallelSharding",
           "TableRowWiseSharding", "TableColumnWiseSharding", "CyclicRowWiseSharding"]

#: The strategy class of each sharding type, in the order a collection runs them.
STRATEGIES: dict[ShardingType, type[ShardingStrategy]] = {
    ShardingType.DATA_PARALLEL: DataParallelSharding,
    ShardingType.TABLE_WISE: TableWiseSharding,
    ShardingType.COLUMN_WISE: ColumnWiseSharding,
    ShardingType.TABLE_COLUMN_WISE: TableColumnWiseSharding,
    ShardingType.ROW_WISE: RowWiseSharding,
    ShardingType.TABLE_ROW_WISE: TableRowWiseSharding,
    ShardingType.CYCLIC_ROW_WISE: CyclicRowWiseSharding,
}
