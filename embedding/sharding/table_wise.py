"""Table-wise sharding: each table lives whole on one rank.

Input dist: every rank sends, to each owner, the lengths and ids of the
features whose tables that owner holds — one AlltoAll(v) for all of them
(lengths and ids packed in one int64 buffer, per-id weights in a second
buffer when the batch is weighted). Example, 2 ranks, table A on rank 0,
table B on rank 1, features a (of A) and b (of B)::

    rank 0 sends: to 0 [len a0 | ids a0]   to 1 [len b0 | ids b0]
    rank 1 sends: to 0 [len a1 | ids a1]   to 1 [len b1 | ids b1]
    rank 0 gets [a0 | a1] and pools A for both batches; rank 1 pools B.

Output dist: one AlltoAll(v) of pooled rows, ``B × dims of owner r`` from
owner r; backward sends the gradient columns back the same way.

The machinery is written over *slots* — one feature read through one
shard — so column-wise sharding (a table split into column slices, each
slice a slot of its own) reuses it unchanged; see
:mod:`embedding.sharding.column_wise`. With ``dedup`` the ids of each
slot are made unique before the AlltoAll, the owners return the rows of
the unique ids instead of pooled bags, and the requesting rank pools them
(see :mod:`embedding.sharding.dedup`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags
from embedding.sharding.base import (LocalShard, Pending, ShardingEnv, ShardingStrategy,
                                     collectives_api, pack_jagged, unpack_jagged)
from embedding.sharding.qcomm import QComms
from embedding.sharding.dedup import DedupPlan
from embedding.types import OptimizerKind, Shard, ShardingType, TableConfig, TablePlan

__all__ = ["TableWiseSharding", "SlotWiseSharding", "check_column_partition", "dealt_chunk"]


@dataclass(frozen=True)
class _Slot:
    feature: int      # index into strategy.features
    table: int        # index into strategy.tables
    shard: Shard
    local_table: int  # index into the owner's FusedTables (meaningful on the owner)


def check_column_partition(table: TableConfig, plan: TablePlan, size: int) -> None:
    """ValueError unless ``plan``'s shards hold all rows and partition the columns."""
    if not plan.shards:
        raise ValueError(f"plan of table {table.name!r}: no shards")
    cols = sorted(plan.shards, key=lambda s: s.col_offset)
    at = 0
    for s in cols:
        if not 0 <= s.rank < size:
            raise ValueError(f"plan of table {table.name!r}: shard rank {s.rank} is outside "
                             f"the group of {size} ranks")
        if s.row_offset != 0 or s.num_rows != table.num_rows:
            raise ValueError(f"plan of table {table.name!r} ({plan.sharding.value}): each shard "
                             f"must hold all {table.num_rows} rows, got rows [{s.row_offset}, "
                             f"{s.row_offset + s.num_rows})")
        if s.col_offset != at or s.num_cols <= 0:
            raise ValueError(f"plan of table {table.name!r}: column shards must tile [0, "
                             f"{table.dim}) without gaps or overlap, got a shard at columns "
                             f"[{s.col_offset}, {s.col_offset + s.num_cols}) after column {at}")
        at += s.num_cols
    if at != table.dim:
        raise ValueError(f"plan of table {table.name!r}: column shards cover {at} of "
                         f"{table.dim} columns")


#: bytes of gradient rows the host's backward reorders at a time (in a core's cache)
HOST_BAND_BYTES = 256 << 10


def dealt_chunk(moves, dims_of, out_dim: int) -> int:
    """The chunk width ``q`` when an output of ``out_dim`` columns is the owners' blocks
    (``dims_of[r]`` columns each, all alike) cut into chunks of ``q`` columns and dealt in
    turn: chunk ``k`` of owner ``r`` at output chunk ``k * owners + r``, as round-robin
    placement of equal tables, or equal column slices of every table, gives; else 0.
    ``moves``: :meth:`SlotWiseSharding.owner_moves`."""
    size = len(moves)
    widths = {w for mine in moves for _, _, w in mine}
    if len(widths) != 1 or len(set(int(d) for d in dims_of)) != 1:
        return 0
    q = widths.pop()
    n = int(dims_of[0]) // q
    if n * q != int(dims_of[0]) or n * size * q != out_dim:
        return 0
    dealt = [[(k * q, (k * size + r) * q, q) for k in range(n)] for r in range(size)]
    return q if [list(m) for m in moves] == dealt else 0


class SlotWiseSharding(ShardingStrategy):
    """Slots (feature × shard) owned by single ranks; shared by TW, CW and TWCW."""

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        super().__init__(tables, plans, env, qcomms)
        for t, p in zip(self.tables, self.plans):
            self._check_plan(t, p)
        # Local shards, in table order then column order.
        local = []
        for ti, p in enumerate(self.plans):
            for sh in sorted(p.shards, key=lambda s: s.col_offset):
                if sh.rank == env.rank:
                    local.append((ti, sh))
        self._local_index = {(ti, sh): i for i, (ti, sh) in enumerate(local)}
        self.fused = env.fused([sh.num_rows for _, sh in local], [sh.num_cols for _, sh in local],
                               [self.tables[ti].optimizer for ti, _ in local],
                               [f"{self.tables[ti].name}[{sh.col_offset}:"
                                f"{sh.col_offset + sh.num_cols}]" for ti, sh in local],
                               [self.plans[ti].memory for ti, _ in local],
                               [self.tables[ti].eviction if self.tables[ti].dynamic else None
                                for ti, _ in local],
                               configs=[self.tables[ti] for ti, _ in local]
                               ) if local else None
        self._local = local
        table_index = {t.name: i for i, t in enumerate(self.tables)}
        slots = []
        for fi, f in enumerate(self.features):
            ti = table_index[f.table]
            for sh in sorted(self.plans[ti].shards, key=lambda s: s.col_offset):
                slots.append(_Slot(fi, ti, sh, self._local_index.get((ti, sh), -1)))
        self.slots = tuple(slots)
        size = env.size
        self._by_owner = [[i for i, s in enumerate(slots) if s.shard.rank == r]
                          for r in range(size)]
        self._dims_of = np.array([sum(slots[i].shard.num_cols for i in self._by_owner[r])
                                  for r in range(size)], np.int64)
        self._moves = self.owner_moves([f.col for f in self.features])
        self._dealt = dealt_chunk(self._moves, self._dims_of, self.out_dim)
        mine = self._by_owner[env.rank]
        cols, c = [], 0
        for i in mine:
            cols.append(c)
            c += slots[i].shard.num_cols
        self._local_cols = tuple(cols)
        self._local_dim = c
        # Every owner returns the same width: the output dist is a plain AlltoAll.
        self._uniform = bool(np.all(self._dims_of == self._dims_of[0]))
        # Row-wise AdaGrad over column slices: the accumulator of a row sees the whole row's
        # gradient, so the owners of a table's slices exchange per-row sums of squares.
        self._sq_tables = [ti for ti, (t, p) in enumerate(zip(self.tables, self.plans))
                           if len(p.shards) > 1
                           and t.optimizer.kind is OptimizerKind.ROWWISE_ADAGRAD]
        self._dedup = None
        if env.dedup:
            self._dedup = DedupPlan(self)

    # -- plan -------------------------------------------------------------------
    def _check_plan(self, table: TableConfig, plan: TablePlan) -> None:
        check_column_partition(table, plan, self.env.size)
        if len(plan.shards) != 1:
            raise ValueError(f"plan of table {table.name!r} (table_wise): expected one shard, "
                             f"got {len(plan.shards)}")

    def local_shards(self) -> list[LocalShard]:
        return [LocalShard(self.tables[ti].name, sh, self.fused, i)
                for i, (ti, sh) in enumerate(self._local)]

    # -- input dist -------------------------------------------------------------
    def input_dist(self, kjt: KeyedJagged) -> Pending:
        if self._dedup is not None:
            return self._dedup.input_dist(kjt)
        c = collectives_api(self.env)
        feats = [kjt.feature(f.name) for f in self.features]
        parts = [[(feats[self.slots[i].feature].lengths, feats[self.slots[i].feature].values)
                  for i in self._by_owner[r]] for r in range(self.env.size)]
        buf, counts = pack_jagged(parts)
        h_ids = c.all_to_all_v(buf, counts, group=self.env.group, async_op=True)
        h_w = None
        if kjt.weights is not None:
            wparts = [feats[self.slots[i].feature].weights for r in range(self.env.size)
                      for i in self._by_owner[r]]
            wbuf = (np.concatenate(wparts) if wparts else np.zeros(0)).astype(np.float64)
            wcounts = np.array([sum(len(feats[self.slots[i].feature].values)
                                    for i in self._by_owner[r]) for r in range(self.env.size)],
                               np.int64)
            h_w = c.all_to_all_v(wbuf, wcounts, group=self.env.group, async_op=True)
        batch = kjt.batch_size

        def finish(ids_res, w_res):
            recv, rcounts = ids_res
            n_local = len(self._by_owner[self.env.rank])
            head = np.full(self.env.size, n_local * batch, np.int64)
            lengths, values = unpack_jagged(recv, rcounts, head)
            offsets = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            weights = None if w_res is None else w_res[0]
            return self._bags(values, offsets, weights, batch, self.env.size)

        return Pending((h_ids, h_w), finish)

    def _bags(self, values, offsets, weights, batch: int, groups: int) -> Bags | None:
        mine = self._by_owner[self.env.rank]
        if not mine:
            return Bags(np.zeros(0, np.int64), np.zeros(1, np.int64), (), (), (), batch, 0,
                        groups)
        return Bags(values, offsets, tuple(self.slots[i].local_table for i in mine),
                    self._local_cols, batch_size=batch, out_dim=self._local_dim,
                    num_groups=groups, weights=weights,
                    **Bags.pooling_flags(self.features[self.slots[i].feature].pooling
                                         for i in mine))

    # -- forward ------------------------------------------------------------------
    def forward(self, batch) -> Pending:
        if self._dedup is not None:
            return self._dedup.forward(batch)
        xp = self.env.xp
        bags: Bags = batch
        b = bags.batch_size
        size = self.env.size
        wire = self.forward_wire
        if self.fused is not None and bags.num_slots:
            # the send buffer is the pooled rows, written in the wire format by the kernel
            buf = self.fused.lookup(bags, wire=wire).reshape(-1)
        else:
            buf = wire.encode(xp.zeros(0, self.env.dtype))
        if self._uniform:  # equal blocks: a plain AlltoAll, no count exchange
            h = self.send("forward", "all_to_all", buf, group=self.env.group, async_op=True)
        else:
            h = self.send("forward", "all_to_all_v", buf,
                          wire.count(np.full(size, b * self._local_dim, np.int64)),
                          recv_counts=wire.count(self._dims_of * b), group=self.env.group,
                          async_op=True)

        def finish(res):
            recv = res if self._uniform else res[0]
            return self._assemble(wire.decode(recv), b), bags

        return Pending((h,), finish)

    def owner_moves(self, col_of) -> list[list[tuple[int, int, int]]]:
        """Per owner rank: ``(column in the owner's block, column in a layout, width)``
        of each of its slots, where feature ``f`` starts at column ``col_of[f]`` of the layout
        (slots adjacent on both sides merged into one move)."""
        moves = []
        for r in range(self.env.size):
            c0, mine = 0, []
            for i in self._by_owner[r]:
                s = self.slots[i]
                dst, w = col_of[s.feature] + s.shard.col_offset, s.shard.num_cols
                if mine and mine[-1][0] + mine[-1][2] == c0 and mine[-1][1] + mine[-1][2] == dst:
                    mine[-1] = (mine[-1][0], mine[-1][1], mine[-1][2] + w)  # one wider copy
                else:
                    mine.append((c0, dst, w))
                c0 += w
            moves.append(mine)
        return moves

    def _owner_blocks(self, flat, b: int):
        """``(block [B, dims of owner], column moves)`` for each owner, as views of
        the packed ``flat`` (owner order)."""
        start = 0
        for r, moves in enumerate(self._moves):
            d_r = int(self._dims_of[r])
            yield flat[start:start + b * d_r].reshape(b, d_r), moves
            start += b * d_r

    def _dealt_views(self, flat, out, b: int):
        """``(owners' blocks, output)`` as ``[owner, B, chunks, chunk]`` and ``[B, chunks,
        owner, chunk]`` views when the output deals the owners' chunks in turn
        (:func:`dealt_chunk`)."""
        q, size = self._dealt, self.env.size
        n = int(self._dims_of[0]) // q
        return flat.reshape(size, b, n, q), out.reshape(b, n, size, q)

    def _assemble(self, recv, b: int):
        """``[B, out_dim]`` from the per-owner blocks ``[B, dims of owner]``."""
        out = self.env.xp.empty((b, self.out_dim), self.env.dtype)
        if self._dealt:   # one copy in the output's order
            blocks, dealt = self._dealt_views(recv, out, b)
            dealt[...] = blocks.transpose(1, 2, 0, 3)
            return out
        for blk, moves in self._owner_blocks(recv, b):
            for c0, dst, w in moves:
                out[:, dst:dst + w] = blk[:, c0:c0 + w]
        return out

    def _split_grad(self, grad, b: int):
        """Send buffer of gradient columns for each owner (inverse of :meth:`_assemble`)."""
        buf = self.env.xp.empty(int(self._dims_of.sum()) * b, self.env.dtype)
        if self._dealt:
            blocks, dealt = self._dealt_views(buf, grad, b)
            # on the host, a band of rows at a time: each owner's pass over the band reads
            # it from the cache (1.2 ms against 1.6 for 2,048 rows of 1,664 float32)
            band = b if self.env.device != "cpu" else max(1, HOST_BAND_BYTES // max(
                1, self.out_dim * grad.itemsize))
            for i in range(0, b, band):
                blocks[:, i:i + band] = dealt[i:i + band].transpose(2, 0, 1, 3)
            return buf
        for blk, moves in self._owner_blocks(buf, b):
            for c0, src, w in moves:
                blk[:, c0:c0 + w] = grad[:, src:src + w]
        return buf

    # -- backward -------------------------------------------------------------------
    def backward(self, ctx, grad) -> Pending:
        if self._dedup is not None:
            return self._dedup.backward(ctx, grad)
        bags: Bags = ctx
        b = bags.batch_size
        wire = self.backward_wire
        buf = wire.encode(self._split_grad(grad, b))
        size = self.env.size
        if self._uniform:
            h = self.send("backward", "all_to_all", buf, group=self.env.group, async_op=True)
        else:
            h = self.send("backward", "all_to_all_v", buf, self._dims_of * b,
                          recv_counts=np.full(size, b * self._local_dim, np.int64),
                          group=self.env.group, async_op=True)

        def finish(res):
            # the received gradients feed the kernels as they are: decoded as they are read
            recv = res if self._uniform else res[0]
            if self._sq_tables:
                sparse = None
                if self.fused is not None and bags.num_slots:
                    sparse = self.fused.aggregate(
                        bags, recv.reshape(bags.out_rows, self._local_dim), wire=wire)
                self.apply_sparse(sparse)
            elif self.fused is not None and bags.num_slots:
                self.fused.backward_update(bags, recv.reshape(bags.out_rows, self._local_dim),
                                           wire=wire)

        return Pending((h,), finish)

    def apply_sparse(self, sparse) -> None:
        """Optimizer step on per-local-shard ``(rows, grads)`` (unique rows; None: no shards).

        Collective when a row-wise AdaGrad table is column-sliced: every rank
        takes part in the exchange of per-row sums of squares between the
        owners of its slices, so each slice adds the whole row's
        ``mean(g * g)`` to its accumulator, in the same order on every owner.
        """
        if not self._sq_tables:
            if sparse is not None:
                self.fused.update(sparse)
            return
        env = self.env
        xp = env.xp
        c = collectives_api(self.env)
        sparse = list(sparse) if sparse is not None else []
        for k, (rows, g) in enumerate(sparse):  # same sorted rows on every owner of a table
            order = xp.argsort(xp.asarray(rows))
            sparse[k] = (xp.asarray(rows)[order], g[order])
        mine = {ti: [(sh, self._local_index[(ti, sh)]) for sh in
                     sorted(self.plans[ti].shards, key=lambda s: s.col_offset)
                     if sh.rank == env.rank] for ti in self._sq_tables}
        partial = {k: (g * g).sum(axis=1) for k, (_, g) in enumerate(sparse)}
        send, send_counts = [], np.zeros(env.size, np.int64)
        recv_counts = np.zeros(env.size, np.int64)
        for r in range(env.size):
            if r == env.rank:
                continue
            for ti in self._sq_tables:
                if not mine[ti]:
                    continue
                theirs = [sh for sh in self.plans[ti].shards if sh.rank == r]
                if not theirs:
                    continue
                n = len(sparse[mine[ti][0][1]][0])
                for _, k in mine[ti]:
                    send.append(partial[k])
                    send_counts[r] += n
                recv_counts[r] += n * len(theirs)
        buf = xp.concatenate(send) if send else xp.zeros(0, env.dtype)
        recv, _ = c.all_to_all_v(xp.ascontiguousarray(buf, dtype=env.dtype), send_counts,
                                 recv_counts=recv_counts, group=env.group)
        got: dict = {}
        at = 0
        for r in range(env.size):
            if r == env.rank:
                continue
            for ti in self._sq_tables:
                if not mine[ti]:
                    continue
                theirs = sorted((sh for sh in self.plans[ti].shards if sh.rank == r),
                                key=lambda s: s.col_offset)
                n = len(sparse[mine[ti][0][1]][0])
                for sh in theirs:
                    got[(ti, sh)] = recv[at:at + n]
                    at += n
        terms = [None] * len(sparse)
        for ti, owned in mine.items():
            if not owned:
                continue
            local = {sh: partial[k] for sh, k in owned}
            total = None
            for sh in sorted(self.plans[ti].shards, key=lambda s: s.col_offset):
                part = local[sh] if sh in local else got[(ti, sh)]
                total = part.copy() if total is None else total + part
            term = total / env.dtype.type(self.tables[ti].dim)
            for _, k in owned:
                terms[k] = term
        if sparse:
            self.fused.update(sparse, row_terms=terms)


class TableWiseSharding(SlotWiseSharding):
    """Whole tables on single ranks (module doc)."""

    sharding_types = (ShardingType.TABLE_WISE,)
