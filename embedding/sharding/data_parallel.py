"""Data-parallel sharding: every rank holds a full replica of the table.

Forward has no communication: each rank pools its own batch from its
replica. Backward: each rank sums its batch's gradients per row, then one
AllReduce over the group adds them — for all data-parallel tables at once,
as one buffer of ``[rows × dim]`` gradients followed by ``rows`` touched
flags — and every rank applies the same optimizer step to the rows any rank
touched, so the replicas stay equal. The AllReduce is dense: this suits the
small tables a planner makes data-parallel.

The AllReduce travels in the ``dense`` precision of the strategy's
:class:`~embedding.sharding.qcomm.QComms` (the dense model's, as TorchRec's DDP
syncs data-parallel tables): with fp16 or bf16 the gradients are rounded (fp16:
times ``dense_loss_scale``) and summed in 16 bits, and the flags travel in the
same buffer unscaled: 0 or 1 per rank, their 16-bit sum is exact up to 2048
ranks (fp16) or 256 (bf16) and, a sum of non-negative values, nonzero exactly
where some rank touched the row at any size. An fp16 sum that overflows is
agreed and raised on every rank before any replica changes. The buffer's bytes
are counted as ``"dense"`` in :attr:`~embedding.sharding.base.ShardingEnv.sent`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags
from embedding.sharding.base import LocalShard, Pending, ShardingEnv, ShardingStrategy
from embedding.sharding.qcomm import FP16_MAX, CommPrecision, QComms, Wire
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
        #: the touched-row flags' codec: the precision of :attr:`dense_wire`, never scaled
        self._flag_wire = Wire(self.qcomms.dense, env.xp, env.dtype, key="qcomms.dense")
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
        wire = self.dense_wire
        n = lay.total_elements
        sparse = self.fused.aggregate(ctx, grad)
        buf = xp.zeros(n + lay.total_rows, env.dtype)
        flags = buf[n:]
        for t, (rows, g) in enumerate(sparse):
            if len(rows) == 0:
                continue
            off = lay.weight_offsets[t]
            dense = buf[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t], lay.dims[t])
            r = xp.asarray(rows)
            dense[r] = g
            flags[lay.row_base[t] + r] = 1
        peak = 0.0  # the largest gradient this rank sends (fp16 is checked)
        if wire.precision is CommPrecision.FP16 and n:
            peak = float(xp.abs(buf[:n]).max())
        if not wire.identity:
            buf = self._encode(buf, n)
        h = self.send("dense", "all_reduce", buf, group=env.group, async_op=True)

        def finish(total):
            total = buf if total is None else total
            if wire.identity:
                values, marks = total[:n], total[n:]
            else:  # 16-bit flags: nonzero bits exactly where a rank touched the row
                values, marks = wire.decode(total[:n]), total[n:].view(np.uint16)
                if wire.precision is CommPrecision.FP16:
                    self._check_fp16(values, peak)
            out = []
            for t in range(lay.num_tables):
                base = lay.row_base[t]
                rows = xp.flatnonzero(marks[base:base + lay.rows[t]])
                off = lay.weight_offsets[t]
                dense = values[off:off + lay.rows[t] * lay.dims[t]].reshape(lay.rows[t],
                                                                            lay.dims[t])
                out.append((rows, dense[rows]))
            self.fused.update(out)
            return None

        return Pending((h,), finish)

    def _encode(self, buf, n: int):
        """The 16-bit wire buffer of ``buf``: its first ``n`` values through
        :attr:`dense_wire` (loss-scaled for fp16), then the row flags, unscaled."""
        wire = self.dense_wire
        out = self.env.xp.empty(buf.size, np.uint16)
        with np.errstate(over="ignore"):  # an overflow is reported after the sum
            out[:n] = wire.encode(buf[:n]).view(np.uint16)
        out[n:] = self._flag_wire.encode(buf[n:]).view(np.uint16)
        return out.view(wire.dtype)

    def _check_fp16(self, values, peak: float) -> None:
        """Raise on every rank, before any update, when the fp16 sum of the gradients (or a
        rank's own scaled gradients) overflowed fp16 (agreed across the group)."""
        from neocomm.agree import Problem, agree

        scale = self.dense_wire.scale or 1.0
        problem = None
        if not peak * scale <= FP16_MAX or not bool(self.env.xp.isfinite(values).all()):
            names = [t.name for t in self.tables]
            key = "dense_loss_scale" if self.dense_wire.scale is not None else "dense"
            size = self.env.size
            if peak * scale <= FP16_MAX:  # this rank's fit: the sum overflowed
                what, below = f"and their sum over {size} rank(s) overflows", size * peak
            else:
                what, below = "beyond", peak
            problem = Problem("grad", f"qcomms.{key}: fp16 gradients of data-parallel tables "
                              f"{names} scaled by {scale:g} reach {peak * scale:.6g} on this "
                              f"rank, {what} fp16's largest value {FP16_MAX:g}; use a loss "
                              f"scale below {FP16_MAX / below if below else FP16_MAX:.6g}, or "
                              f"dense \"bf16\" or \"fp32\" (the trainer's comms.loss_scale "
                              f"and comms.dense)")
        agree(self.env.group, "data-parallel gradients", problem)
