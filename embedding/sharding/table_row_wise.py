"""Table-row-wise sharding: a table on one node, split into row blocks over its ranks.

Hierarchical: table-wise across nodes, row-wise within the node, so the
reduction of partial sums stays inside the node and only finished pooled
rows cross nodes — on the rails (ranks of equal local rank), as ZionEX
wires one NIC per GPU. With ``M`` nodes of ``K`` ranks, rank ``(m, j)``
(node m, local rank j):

1. input dist: one AlltoAll(v) over the group; each id goes to the rank of
   its table's node that holds its row (bucketized as in row-wise);
2. lookup: partial sums for every rank's batch, ``[M*K, B, dims of node m]``;
3. ReduceScatter inside node m: local rank j receives the full sums for the
   batches of ranks ``(m', j)``, m' = 0..M-1 (its rail);
4. AlltoAll(v) on rail j: rank ``(m, j)`` sends ``(m', j)`` its pooled rows.

Backward runs it in reverse: rail AlltoAll(v) of gradients, AllGather inside
the node, fused update of the local rows. Every node must hold the same
number of ranks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags
from embedding.sharding.base import (LocalShard, Pending, ShardingEnv, ShardingStrategy,
                                     collectives_api, pack_jagged, unpack_jagged)
from embedding.sharding.qcomm import QComms
from embedding.sharding.row_wise import RowBlocks, bucketize, check_row_partition, mean_scale
from embedding.types import Shard, ShardingType, TableConfig, TablePlan

__all__ = ["TableRowWiseSharding"]


class TableRowWiseSharding(ShardingStrategy):
    """Row blocks of a table over the ranks of one node (module doc)."""

    sharding_types = (ShardingType.TABLE_ROW_WISE,)
    reducing_forward = True

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        super().__init__(tables, plans, env, qcomms)
        if not env.uniform:
            raise ValueError(f"table_row_wise: every node must hold the same number of ranks, "
                             f"got {[len(n) for n in env.nodes]} ranks per node")
        m_count = len(env.nodes)
        self._table_node = []
        self._blocks = []
        shards_of = []
        for t, p in zip(self.tables, self.plans):
            nodes = {env.node_of[s.rank] for s in p.shards if 0 <= s.rank < env.size}
            if len(nodes) != 1:
                raise ValueError(f"plan of table {t.name!r} (table_row_wise): all row blocks "
                                 f"must be on one node, got nodes {sorted(nodes)}")
            m = nodes.pop()
            shards = check_row_partition(t, p, env.nodes[m])
            self._table_node.append(m)
            self._blocks.append(RowBlocks(np.array([s.row_offset for s in shards], np.int64),
                                          np.array([env.local_of[s.rank] for s in shards],
                                                   np.int64)))
            shards_of.append(shards)
        tindex = {t.name: i for i, t in enumerate(self.tables)}
        # Features of each node's tables, in strategy order, and their columns per node.
        self._node_features = [[fi for fi, f in enumerate(self.features)
                                if self._table_node[tindex[f.table]] == m]
                               for m in range(m_count)]
        self._node_dim = [sum(self.features[fi].dim for fi in fs) for fs in self._node_features]
        me = env.node
        self._my_tables = [ti for ti in range(len(self.tables)) if self._table_node[ti] == me]
        local = []
        for ti in self._my_tables:
            mine = [s for s in shards_of[ti] if s.rank == env.rank]
            local.append(mine[0] if mine else Shard(env.rank, 0, 0, 0, self.tables[ti].dim))
        self._local = local
        self.fused = None
        if self._my_tables:
            self.fused = env.fused([s.num_rows for s in local],
                                   [self.tables[ti].dim for ti in self._my_tables],
                                   [self.tables[ti].optimizer for ti in self._my_tables],
                                   [self.tables[ti].name for ti in self._my_tables],
                                   [self.plans[ti].memory for ti in self._my_tables],
                                   configs=[self.tables[ti] for ti in self._my_tables])
        local_index = {ti: i for i, ti in enumerate(self._my_tables)}
        mine_f = self._node_features[me]
        self._slot_table = tuple(local_index[tindex[self.features[fi].table]] for fi in mine_f)
        cols, c = [], 0
        for fi in mine_f:
            cols.append(c)
            c += self.features[fi].dim
        self._slot_col = tuple(cols)
        self._feature_table = [tindex[f.table] for f in self.features]
        # Hierarchical groups; made here so every rank makes them at the same point.
        self._intra = env.intra()
        self._rail = env.rail()
        k = len(env.nodes[0])
        # Reduce-scatter order: block j' holds the batches of ranks (m', j'), m' in node order.
        self._rs_order = np.array([env.nodes[m][j] for j in range(k) for m in range(m_count)],
                                  np.int64)

    def local_shards(self) -> list[LocalShard]:
        return [LocalShard(self.tables[ti].name, s, self.fused, i)
                for i, (ti, s) in enumerate(zip(self._my_tables, self._local))
                if s.num_rows > 0]

    # -- input dist ---------------------------------------------------------------
    def input_dist(self, kjt: KeyedJagged) -> Pending:
        c = collectives_api(self.env)
        env = self.env
        b = kjt.batch_size
        k = len(env.nodes[0])
        parts = [[] for _ in range(env.size)]
        wparts = [[] for _ in range(env.size)]
        wcounts = np.zeros(env.size, np.int64)
        for m, fis in enumerate(self._node_features):
            if not fis:
                continue
            feats = [kjt.feature(self.features[fi].name) for fi in fis]
            blocks = [self._blocks[self._feature_table[fi]] for fi in fis]
            lengths, ids, weights, counts = bucketize(feats, blocks, k, b)
            ends = np.cumsum(counts)
            for j in range(k):
                r = env.nodes[m][j]
                lo, hi = int(ends[j] - counts[j]), int(ends[j])
                parts[r].append((lengths[j].reshape(-1), ids[lo:hi]))
                if weights is not None:
                    wparts[r].append(weights[lo:hi])
                    wcounts[r] += hi - lo
        buf, send_counts = pack_jagged(parts)
        h = c.all_to_all_v(buf, send_counts, group=env.group, async_op=True)
        hw = None
        if kjt.weights is not None:
            wbuf = np.concatenate([w for ws in wparts for w in ws] or [np.zeros(0)])
            hw = c.all_to_all_v(wbuf.astype(np.float64), wcounts, group=env.group,
                                async_op=True)
        own_lengths = {f.name: kjt.feature(f.name).lengths for f in self.features}
        mine_f = self._node_features[env.node]

        def finish(res, wres):
            recv, rcounts = res
            head = np.full(env.size, len(mine_f) * b, np.int64)
            lens, values = unpack_jagged(recv, rcounts, head)
            offsets = np.zeros(lens.size + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            bags = Bags(values, offsets, self._slot_table, self._slot_col,
                        (False,) * len(mine_f), b, self._node_dim[env.node], env.size,
                        None if wres is None else wres[0])
            return bags, own_lengths

        return Pending((h, hw), finish)

    # -- forward ----------------------------------------------------------------------
    def forward(self, batch) -> Pending:
        env = self.env
        xp = env.xp
        bags, own_lengths = batch
        b = bags.batch_size
        d_me = self._node_dim[env.node]
        m_count = len(env.nodes)
        wire = self.forward_wire  # sums in the wire precision, decoded once at the end
        if self.fused is not None and bags.num_slots:
            partial = self.fused.lookup(bags, wire=wire)  # written in the wire format
        else:
            partial = wire.encode(xp.zeros(bags.out_rows * d_me, env.dtype))
        # fp16/bf16 values: reordering blocks of them commutes with encoding
        ordered = partial.reshape(env.size, b * d_me)[xp.asarray(self._rs_order)]
        summed = self.send("forward", "reduce_scatter", ordered.reshape(-1), group=self._intra)
        # summed: [M, B, d_me], block m' is the batch of rail peer m'.
        recv_counts = np.array([b * d for d in self._node_dim], np.int64)
        h = self.send("forward", "all_to_all_v", summed, np.full(m_count, b * d_me, np.int64),
                      recv_counts=recv_counts, group=self._rail, async_op=True)
        scale = mean_scale(self.features, own_lengths, b, env.dtype, xp)

        def finish(res):
            recv = wire.decode(res[0])
            out = xp.empty((b, self.out_dim), env.dtype)
            at = 0
            for m, fis in enumerate(self._node_features):
                blk = recv[at:at + b * self._node_dim[m]].reshape(b, self._node_dim[m])
                at += b * self._node_dim[m]
                c0 = 0
                for fi in fis:
                    f = self.features[fi]
                    out[:, f.col:f.col + f.dim] = blk[:, c0:c0 + f.dim]
                    c0 += f.dim
            if scale is not None:
                out *= scale
            return out, (bags, scale)

        return Pending((h,), finish)

    # -- backward ---------------------------------------------------------------------
    def backward(self, ctx, grad) -> Pending:
        env = self.env
        xp = env.xp
        bags, scale = ctx
        b = bags.batch_size
        g = xp.asarray(grad, env.dtype)
        if scale is not None:
            g = g * scale
        m_count = len(env.nodes)
        pieces = []
        for m, fis in enumerate(self._node_features):
            blk = xp.empty((b, self._node_dim[m]), env.dtype)
            c0 = 0
            for fi in fis:
                f = self.features[fi]
                blk[:, c0:c0 + f.dim] = g[:, f.col:f.col + f.dim]
                c0 += f.dim
            pieces.append(blk.reshape(-1))
        wire = self.backward_wire  # encoded once, decoded after the node's AllGather
        sendbuf = wire.encode(xp.concatenate(pieces))
        d_me = self._node_dim[env.node]
        recv, _ = self.send("backward", "all_to_all_v", sendbuf,
                            np.array([b * d for d in self._node_dim], np.int64),
                            recv_counts=np.full(m_count, b * d_me, np.int64), group=self._rail)
        h = self.send("backward", "all_gather", recv, group=self._intra, async_op=True)

        def finish(res):
            if self.fused is None or not bags.num_slots:
                return None
            # reordered in the wire format; the kernel decodes the gradients as it reads them
            gathered = res.reshape(env.size, b * d_me)
            by_source = xp.empty_like(gathered)
            by_source[xp.asarray(self._rs_order)] = gathered
            self.fused.backward_update(bags, by_source.reshape(bags.out_rows, d_me), wire=wire)
            return None

        return Pending((h,), finish)
