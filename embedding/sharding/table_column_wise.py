"""Table-column-wise sharding: a table's column slices all on the ranks of one node.

Hierarchical, like table-row-wise: table-wise across nodes, column-wise
within the node, and traffic across nodes only on the rails (ranks of equal
local rank), each id and each pooled row crossing nodes once. With ``M``
nodes of ``K`` ranks, rank ``(m, j)``, and ``F_m`` the features of the
tables on node m:

1. rail AlltoAll(v): rank ``(m', j)`` sends the bags of ``F_m`` to ``(m, j)``,
   once per node (not once per slice);
2. intra-node AlltoAll(v): each rank of node m passes what its rail brought
   to every rank of the node, so every slice owner has the bags of ``F_m``
   from every rank;
3. lookup of the local slices for every rank's batch, then an intra-node
   AlltoAll(v) gathers, on local rank j, every slice of the pooled rows of
   the batches of ranks ``(m', j)`` — whole rows, assembled in the node;
4. rail AlltoAll(v): ``(m, j)`` sends ``(m', j)`` its pooled rows of ``F_m``.

Backward runs 4 → 3 in reverse and updates the local slices. Mean pooling
is exact per slice. Row-wise AdaGrad slices share whole-row sums of squares
as in column-wise sharding. Nodes of different sizes (no rails), and
``dedup``, use the column-wise data path (one AlltoAll(v) over the group
each way) instead.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags
from embedding.sharding.base import (Pending, ShardingEnv, collectives_api, displacements,
                                     pack_jagged)
from embedding.sharding.qcomm import QComms
from embedding.sharding.table_wise import SlotWiseSharding, check_column_partition
from embedding.types import ShardingType, TableConfig, TablePlan

__all__ = ["TableColumnWiseSharding"]


class TableColumnWiseSharding(SlotWiseSharding):
    """Column slices of a table on the ranks of one node (module doc)."""

    sharding_types = (ShardingType.TABLE_COLUMN_WISE,)

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        super().__init__(tables, plans, env, qcomms)
        self._hier = env.uniform and not env.dedup
        if not self._hier:
            return
        m_count = len(env.nodes)
        tindex = {t.name: i for i, t in enumerate(self.tables)}
        table_node = [env.node_of[p.shards[0].rank] for p in self.plans]
        self._node_features = [[fi for fi, f in enumerate(self.features)
                                if table_node[tindex[f.table]] == m] for m in range(m_count)]
        self._node_dim = [sum(self.features[fi].dim for fi in fs)
                          for fs in self._node_features]
        self._node_col = {}
        for fs in self._node_features:
            c = 0
            for fi in fs:
                self._node_col[fi] = c
                c += self.features[fi].dim
        self._node_moves = self.owner_moves(self._node_col)
        me = env.node
        self._pos_in_node = {fi: p for p, fi in enumerate(self._node_features[me])}
        self._peers = list(env.nodes[me])  # intra-node ranks, by local rank
        self._intra = env.intra()
        self._rail = env.rail()

    def _check_plan(self, table: TableConfig, plan: TablePlan) -> None:
        check_column_partition(table, plan, self.env.size)
        nodes = {self.env.node_of[s.rank] for s in plan.shards}
        if len(nodes) != 1:
            raise ValueError(f"plan of table {table.name!r} (table_column_wise): all column "
                             f"slices must be on one node, got shards on nodes {sorted(nodes)}")

    # -- input dist ------------------------------------------------------------------
    def input_dist(self, kjt: KeyedJagged) -> Pending:
        if not self._hier:
            return super().input_dist(kjt)
        c = collectives_api(self.env)
        b = kjt.batch_size
        feats = [kjt.feature(f.name) for f in self.features]
        parts = [[(feats[fi].lengths, feats[fi].values) for fi in fs]
                 for fs in self._node_features]
        buf, counts = pack_jagged(parts)
        h = c.all_to_all_v(buf, counts, group=self._rail, async_op=True)
        hw = None
        if kjt.weights is not None:
            wbuf = np.concatenate([feats[fi].weights for fs in self._node_features
                                   for fi in fs] or [np.zeros(0)]).astype(np.float64)
            wcounts = [sum(feats[fi].values.size for fi in fs) for fs in self._node_features]
            hw = c.all_to_all_v(wbuf, np.asarray(wcounts, np.int64), group=self._rail,
                                async_op=True)

        def finish(res, wres):
            return self._spread(res, wres, b)

        return Pending((h, hw), finish)

    def _spread(self, res, wres, b: int) -> Bags:
        """Step 2: share the rail's bags with the node, then lay them out as Bags."""
        env = self.env
        c = collectives_api(self.env)
        k, m_count = len(self._peers), len(env.nodes)
        recv1, rc1 = res
        msg = np.concatenate([np.asarray(rc1, np.int64), recv1])
        recv2, rc2 = c.all_to_all_v(np.tile(msg, k), np.full(k, msg.size, np.int64),
                                    group=self._intra)
        w2 = None
        if wres is not None:
            w1, _ = wres
            w2, wc2 = c.all_to_all_v(np.tile(w1, k), np.full(k, w1.size, np.int64),
                                     group=self._intra)
            wstart = displacements(wc2)
        nf = len(self._node_features[env.node])
        mine = self._by_owner[env.rank]
        pos = [self._pos_in_node[self.slots[i].feature] for i in mine]
        idx_parts, len_parts, w_parts = [], [], []
        start = displacements(rc2)
        for jp in range(k):                      # group g = jp * M + m'
            blk = recv2[start[jp]:start[jp + 1]]
            sub = blk[:m_count]
            sub_start = m_count + displacements(sub)
            wat = wstart[jp] if w2 is not None else 0
            for mp in range(m_count):
                part = blk[sub_start[mp]:sub_start[mp + 1]]
                lens = part[:nf * b].reshape(nf, b)
                ids = part[nf * b:]
                foff = displacements(lens.sum(axis=1))
                for p in pos:
                    len_parts.append(lens[p])
                    idx_parts.append(ids[foff[p]:foff[p + 1]])
                    if w2 is not None:
                        w_parts.append(w2[wat + foff[p]:wat + foff[p + 1]])
                wat += int(foff[-1])
        lengths = np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64)
        offsets = displacements(lengths)
        indices = np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int64)
        weights = (np.concatenate(w_parts) if w_parts else np.zeros(0)) if w2 is not None \
            else None
        if not mine:
            return Bags(np.zeros(0, np.int64), np.zeros(1, np.int64), (), (), (), b, 0,
                        env.size)
        return Bags(indices, offsets, tuple(self.slots[i].local_table for i in mine),
                    self._local_cols, batch_size=b, out_dim=self._local_dim,
                    num_groups=env.size, weights=weights,
                    **Bags.pooling_flags(self.features[self.slots[i].feature].pooling
                                         for i in mine))

    # -- forward -------------------------------------------------------------------------
    def forward(self, batch) -> Pending:
        if not self._hier:
            return super().forward(batch)
        env = self.env
        xp = env.xp
        bags: Bags = batch
        b = bags.batch_size
        k, m_count = len(self._peers), len(env.nodes)
        me = env.node
        widths = [int(self._dims_of[r]) for r in self._peers]
        # Encoded once, by the lookup kernel: the node assembles whole rows from wire units
        # (an int8 row never straddles two slices) and the rail carries them on; decoded at
        # the end.
        wire = self.forward_wire
        u = wire.units
        if self.fused is not None and bags.num_slots:
            sendbuf = self.fused.lookup(bags, wire=wire).reshape(-1)
        else:
            sendbuf = wire.encode(xp.zeros(bags.out_rows * self._local_dim, env.dtype))
        recv3, _ = self.send("forward", "all_to_all_v", sendbuf,
                             wire.count(np.full(k, m_count * b * self._local_dim, np.int64)),
                             recv_counts=wire.count(np.asarray([m_count * b * w for w in widths],
                                                               np.int64)), group=self._intra)
        full = wire.empty((m_count, b, u(self._node_dim[me])))
        at = 0
        for jp, r in enumerate(self._peers):
            n = wire.count(m_count * b * widths[jp])
            blk = recv3[at:at + n].reshape((m_count, b, u(widths[jp])) + wire.tail)
            at += n
            for c0, dst, w in self._node_moves[r]:
                full[:, :, u(dst):u(dst + w)] = blk[:, :, u(c0):u(c0 + w)]
        h = self.send("forward", "all_to_all_v", full.reshape(-1),
                      wire.count(np.full(m_count, b * self._node_dim[me], np.int64)),
                      recv_counts=wire.count(np.asarray([b * d for d in self._node_dim],
                                                        np.int64)),
                      group=self._rail, async_op=True)

        def finish(res):
            recv4 = wire.decode(res[0])
            out = xp.empty((b, self.out_dim), env.dtype)
            at = 0
            for m, fs in enumerate(self._node_features):
                blk = recv4[at:at + b * self._node_dim[m]].reshape(b, self._node_dim[m])
                at += b * self._node_dim[m]
                for fi in fs:
                    f = self.features[fi]
                    src = self._node_col[fi]
                    out[:, f.col:f.col + f.dim] = blk[:, src:src + f.dim]
            return out, bags

        return Pending((h,), finish)

    # -- backward -----------------------------------------------------------------------
    def backward(self, ctx, grad) -> Pending:
        if not self._hier:
            return super().backward(ctx, grad)
        env = self.env
        xp = env.xp
        bags: Bags = ctx
        b = bags.batch_size
        k, m_count = len(self._peers), len(env.nodes)
        me = env.node
        g = xp.asarray(grad, env.dtype)
        wire = self.backward_wire  # encoded once, split in the node as is, decoded at the end
        pieces = []
        for m, fs in enumerate(self._node_features):
            blk = xp.empty((b, self._node_dim[m]), env.dtype)
            for fi in fs:
                f = self.features[fi]
                dst = self._node_col[fi]
                blk[:, dst:dst + f.dim] = g[:, f.col:f.col + f.dim]
            pieces.append(blk.reshape(-1))
        gfull, _ = self.send("backward", "all_to_all_v", wire.encode(xp.concatenate(pieces)),
                             np.asarray([b * d for d in self._node_dim], np.int64),
                             recv_counts=np.full(m_count, b * self._node_dim[me], np.int64),
                             group=self._rail)
        gfull = gfull.reshape(m_count, b, self._node_dim[me])
        widths = [int(self._dims_of[r]) for r in self._peers]
        send = []
        for jp, r in enumerate(self._peers):
            blk = xp.empty((m_count, b, widths[jp]), gfull.dtype)
            for c0, src, w in self._node_moves[r]:
                blk[:, :, c0:c0 + w] = gfull[:, :, src:src + w]
            send.append(blk.reshape(-1))
        h = self.send("backward", "all_to_all_v", xp.concatenate(send),
                      np.asarray([m_count * b * w for w in widths], np.int64),
                      recv_counts=np.full(k, m_count * b * self._local_dim, np.int64),
                      group=self._intra, async_op=True)

        def finish(res):
            # the received gradients feed the kernels as they are: decoded as they are read
            local = res[0].reshape(bags.out_rows, self._local_dim)
            if self._sq_tables:
                sparse = None
                if self.fused is not None and bags.num_slots:
                    sparse = self.fused.aggregate(bags, local, wire=wire)
                self.apply_sparse(sparse)
            elif self.fused is not None and bags.num_slots:
                self.fused.backward_update(bags, local, wire=wire)

        return Pending((h,), finish)
