"""Data-parallel sharding: every rank holds a full replica of the table.

Forward has no communication: each rank pools its own batch from its
replica. Backward: each rank sums its batch's gradients per row, then one
AllReduce over the group adds them — for all data-parallel tables at once,
as one buffer of ``[rows × dim]`` gradients followed by ``rows`` touched
flags — and every rank applies the same optimizer step to the rows any rank
touched, so the replicas stay equal. The AllReduce is dense: this suits the
small tables a planner makes data-parallel.
"""
from __future__ import annotations

from typing import Sequence

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags
from embedding.sharding.base import (LocalShard, Pending, ShardingEnv, ShardingStrategy,
                                     collectives_api)
from embedding.sharding.qcomm import QComms
from embedding.types import Shard, ShardingType, TableConfig, TablePlan

__all__ = ["DataParallelSharding"]


class DataParallelSharding(ShardingStrategy):
    """Replicated tables (module doc)."""

    sharding_types = (ShardingType.DATA_PARALLEL,)

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        super().__init__(tables, plans, env, qcomms)
        for t, p in zip(self.tables, self.plans):
            ranks = sorted(s.rank for s in p.shards)
            if ranks != list(range(env.size)):
                raise ValueError(f"plan of table {t.name!r} (data_parallel): expected one "
                                 f"replica on each of ranks 0..{env.size - 1}, got ranks {ranks}")
            for s in p.shards:
                if (s.row_offset, s.num_rows, s.col_offset, s.num_cols) != (0, t.num_rows, 0,
                                                                               t.dim):
                    raise ValueError(f"plan of table {t.name!r} (data_parallel): replica on "
                                     f"rank {s.rank} must be the whole table")
        self.fused = env.fused([t.num_rows for t in self.tables], [t.dim for t in self.tables],
                               [t.optimizer for t in self.tables], [t.name for t in self.tables],
                               configs=self.tables)
        tindex = {t.name: i for i, t in enumerate(self.tables)}
        self._slot_table = tuple(tindex[f.table] for f in self.features)

    def local_shards(self) -> list[LocalShard]:
        return [LocalShard(t.name, Shard(self.env.rank, 0, t.num_rows, 0, t.dim), self.fused, i)
                for i, t in enumerate(self.tables)]

    def input_dist(self, kjt: KeyedJagged) -> Pending:
        sub = kjt.select(self.feature_names)
        bags = Bags(sub.values, sub.offsets, self._slot_table,
                    tuple(f.col for f in self.features), batch_size=sub.batch_size,
                    out_dim=self.out_dim, weights=sub.weights,
                    **Bags.pooling_flags(f.pooling for f in self.features))
        return Pending.done(bags)

    def forward(self, batch) -> Pending:
        return Pending.done((self.fused.lookup(batch), batch))

    def backward(self, ctx, grad) -> Pending:
        env = self.env
        xp = env.xp
        lay = self.fused.layout
        sparse = self.fused.aggregate(ctx, grad)
        buf = xp.zeros(lay.total_elements + lay.total_rows, env.dtype)
        flags = buf[lay.total_elements:]
        for t, (rows, g) in enumerate(sparse):
            if len(rows) == 0:
                continue
            off = lay.weight_offsets[t]
            dense = buf[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t], lay.dims[t])
            r = xp.asarray(rows)
            dense[r] = g
            flags[lay.row_base[t] + r] = 1
        h = collectives_api(self.env).all_reduce(buf, group=env.group, async_op=True)

        def finish(total):
            out = []
            for t in range(lay.num_tables):
                base = lay.row_base[t]
                rows = xp.flatnonzero(total[lay.total_elements + base:
                                            lay.total_elements + base + lay.rows[t]])
                off = lay.weight_offsets[t]
                dense = total[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                           lay.dims[t])
                out.append((rows, dense[rows]))
            self.fused.update(out)
            return None

        return Pending((h,), finish)
