"""Cyclic row-wise sharding: row ``r`` of a table on rank ``r mod N``, as local row ``r // N``.

SOK's ``id mod N`` placement. Every rank of the group (``N`` ranks) holds
one shard of each table: rank ``k`` holds rows ``k, k + N, k + 2N …``
(:func:`~embedding.types.cyclic_shards`), so there is no range table, and
ids that are hot together (small ids of a frequency-sorted vocabulary,
one popular range) are dealt evenly over the ranks instead of landing on
the rank of one contiguous block.

The steps are row-wise's (:mod:`~embedding.sharding.row_wise`); only the
route of an id differs. Input dist: each id goes to rank ``id % N`` as
local row ``id // N`` (one AlltoAll(v) for every feature). Lookup: partial
sum pools of every rank's bags. Output dist: one ReduceScatter of the
partial sums; mean pooling then divides by the bag lengths. Backward: the
gradients of every rank's batch are AllGathered and each rank updates its
own rows. Sum and mean pooling only. Example, 2 ranks, a table of 5 rows,
rank 0's bag ``[2, 3]``::

    rank 0 holds rows 0, 2, 4 (local 0, 1, 2); rank 1 holds rows 1, 3 (local 0, 1)
    rank 0 sends id 2 to itself as local row 1, id 3 to rank 1 as local row 1
    ReduceScatter: rank 0 receives A[2] + A[3]

A dynamic table (``TableConfig.dynamic``) routes an arbitrary int64 id to rank
``splitmix64(id) % N`` and sends the id itself (:class:`HashedIds`): rank
``k``'s shard is a hash map of ``ceil((num_rows - k) / N)`` rows.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from embedding.jagged import hash_ids
from embedding.sharding.row_wise import Route, RowWiseSharding
from embedding.types import Shard, ShardingType, TableConfig, TablePlan, cyclic_shards

__all__ = ["CyclicRowWiseSharding", "CyclicRows", "HashedIds", "check_cyclic_partition"]


@dataclass(frozen=True)
class _Spread:
    """A route over ``size`` destinations (ranks), checked once."""

    size: int

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size: expected a number of ranks >= 1, got {self.size!r}")


@dataclass(frozen=True)
class CyclicRows(_Spread):
    """The route of cyclic rows over ``size`` destinations: id → ``(id % size, id // size)``.

    >>> CyclicRows(4)(np.array([0, 5, 10]))
    (array([0, 1, 2]), array([0, 1, 2]))
    """

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        return ids % self.size, ids // self.size


@dataclass(frozen=True)
class HashedIds(_Spread):
    """The route of a dynamic table's ids over ``size`` destinations: id →
    ``(splitmix64(id) % size, id)`` (the hash of :attr:`~embedding.types.IdPolicy.HASH`);
    the id travels as it is, and the owner's hash map finds its row.

    >>> HashedIds(1)(np.array([7, -3]))
    (array([0, 0]), array([ 7, -3]))
    """

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, np.int64)
        with np.errstate(over="ignore"):
            dest = (hash_ids(ids) % np.uint64(self.size)).astype(np.int64)
        return dest, ids


def check_cyclic_partition(table: TableConfig, plan: TablePlan, size: int
                           ) -> tuple[Shard, ...]:
    """The shards of ``plan`` by rank; ValueError naming the table unless they are the
    cyclic shards of ``table`` on a group of ``size`` ranks (:func:`cyclic_shards`): one
    shard on every rank ``k``, at row offset ``k`` with row stride ``size``, full width."""
    want = cyclic_shards(table.num_rows, table.dim, size)
    kind = ShardingType.CYCLIC_ROW_WISE.value
    ranks = sorted(s.rank for s in plan.shards)
    if ranks != list(range(size)):
        raise ValueError(f"plan of table {table.name!r} ({kind}): expected one shard on each "
                         f"of the {size} ranks of the group, got shards on ranks {ranks}")
    by_rank = {s.rank: s for s in plan.shards}
    for w in want:
        s = by_rank[w.rank]
        if s != w:
            raise ValueError(
                f"plan of table {table.name!r} ({kind}): the shard on rank {w.rank} must hold "
                f"rows {w.rank}, {w.rank} + {size}, … (row_offset={w.row_offset}, "
                f"num_rows={w.num_rows}, row_stride={w.row_stride}) at full width (col_offset"
                f"=0, num_cols={table.dim}); got row_offset={s.row_offset}, num_rows="
                f"{s.num_rows}, row_stride={s.row_stride}, col_offset={s.col_offset}, "
                f"num_cols={s.num_cols}")
    return want


class CyclicRowWiseSharding(RowWiseSharding):
    """Rows of tables dealt round-robin over every rank of the group (module doc)."""

    sharding_types = (ShardingType.CYCLIC_ROW_WISE,)

    def _layout(self, table: TableConfig, plan: TablePlan) -> tuple[Route, Shard]:
        shards = check_cyclic_partition(table, plan, self.env.size)
        route = HashedIds(self.env.size) if table.dynamic else CyclicRows(self.env.size)
        return route, shards[self.env.rank]
