"""Deduplication of ids before the input AlltoAll.

With deduplication a rank sends each distinct id of a slot (feature ×
shard) once, keeps the inverse index, and asks the owner for *rows*
instead of pooled bags; it then pools the returned rows itself through the
inverse index (the fused lookup, run over the received rows as if they were
tables). The backward mirrors it: the requesting rank sums the gradient of
each distinct id (the fused aggregation over the same bags) and sends one
gradient row per distinct id; the owner sums the rows of every requester
and applies the optimizer.

Per slot and batch, without dedup the owner returns ``B`` pooled rows; with
dedup it returns ``U`` rows, ``U`` the number of distinct ids. It pays
when ids repeat heavily within a batch (``U < B``, e.g. hot items, or
long bags of a small table); for uniformly drawn ids of a large table with
one id per bag it moves slightly more (``U ≈ B`` plus an inverse index kept
locally), so it is an option, off by default.
"""
from __future__ import annotations

import numpy as np

from embedding.kernels import Bags, TableLayout, kernel_module
from embedding.kernels.segments import stable_argsort
from embedding.sharding.base import (Pending, ShardingStrategy, collectives_api, pack_jagged,
                                     unpack_jagged)

__all__ = ["unique_inverse", "DedupPlan"]


def unique_inverse(values: np.ndarray, max_key: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``(unique, inverse)`` with ``unique[inverse] == values``; unique ascending.

    Non-negative integer ``values`` only (``<= max_key``); radix-sorted.
    """
    values = np.asarray(values, np.int64)
    n = values.size
    if n == 0:
        return values.copy(), np.zeros(0, np.int64)
    order = stable_argsort(values, max_key)
    sv = values[order]
    flag = np.empty(n, bool)
    flag[0] = True
    np.not_equal(sv[1:], sv[:-1], out=flag[1:])
    inverse = np.empty(n, np.int64)
    inverse[order] = np.cumsum(flag) - 1
    return sv[flag], inverse


class _Request:
    """What a requesting rank keeps between input dist and backward."""

    __slots__ = ("inverse", "lengths", "weights", "unique_counts", "batch", "bags", "layout")

    def __init__(self, inverse, lengths, weights, unique_counts, batch):
        self.inverse = inverse
        self.lengths = lengths
        self.weights = weights
        self.unique_counts = unique_counts
        self.batch = batch
        self.bags = None
        self.layout = None


class _Owned:
    """What an owning rank keeps: the distinct ids each source asked for, per local slot."""

    __slots__ = ("ids", "counts")

    def __init__(self, ids, counts):
        self.ids = ids          # ids[g][k]: ids of local slot k requested by source g
        self.counts = counts    # counts[g]: number of ids from source g (all slots)


class DedupPlan:
    """The dedup variant of a slot-wise strategy's input dist, forward and backward.

    ``strategy`` is the :class:`~embedding.sharding.table_wise.SlotWiseSharding`
    that owns the plan (its slots, fused tables and kernels are used).
    """

    def __init__(self, strategy: ShardingStrategy):
        self.s = strategy

    # -- input dist ---------------------------------------------------------------
    def input_dist(self, kjt) -> Pending:
        s = self.s
        env = s.env
        c = collectives_api(s.env)
        feats = [kjt.feature(f.name) for f in s.features]
        parts, inverse, lengths, weights, ucounts = [], [], [], [], []
        uniq_cache: dict[int, tuple] = {}
        for r in range(env.size):
            dest = []
            for i in s._by_owner[r]:
                slot = s.slots[i]
                f = feats[slot.feature]
                if slot.feature not in uniq_cache:
                    uniq_cache[slot.feature] = unique_inverse(
                        f.values, s.tables[slot.table].num_rows - 1)
                u, inv = uniq_cache[slot.feature]
                dest.append((np.array([u.size], np.int64), u))
                inverse.append(inv)
                lengths.append(f.lengths)
                weights.append(f.weights)
                ucounts.append(u.size)
            parts.append(dest)
        buf, counts = pack_jagged(parts)
        h = c.all_to_all_v(buf, counts, group=env.group, async_op=True)
        req = _Request(inverse, lengths, None if kjt.weights is None else weights,
                       np.asarray(ucounts, np.int64), kjt.batch_size)

        def finish(res):
            recv, rcounts = res
            mine = len(s._by_owner[env.rank])
            head = np.full(env.size, mine, np.int64)
            per_slot, ids = unpack_jagged(recv, rcounts, head)
            owned_ids, at = [], 0
            per_slot = per_slot.reshape(env.size, mine)
            for g in range(env.size):
                row = []
                for k in range(mine):
                    n = int(per_slot[g, k])
                    row.append(ids[at:at + n])
                    at += n
                owned_ids.append(row)
            return req, _Owned(owned_ids, per_slot)

        return Pending((h,), finish)

    # -- forward --------------------------------------------------------------------
    def forward(self, batch) -> Pending:
        s = self.s
        env = s.env
        xp = env.xp
        req, owned = batch
        mine = s._by_owner[env.rank]
        send_counts = np.zeros(env.size, np.int64)
        pairs = [(s.slots[i].local_table, owned.ids[g][k])
                 for g in range(env.size) for k, i in enumerate(mine)]
        blocks = [rows.reshape(-1) for rows in s.fused.gather(pairs)] if pairs else []
        for n, block in enumerate(blocks):
            send_counts[n // len(mine)] += block.size
        sendbuf = xp.concatenate(blocks) if blocks else xp.zeros(0, env.dtype)
        order = [i for r in range(env.size) for i in s._by_owner[r]]
        dims = [s.slots[i].shard.num_cols for i in order]
        recv_counts = np.zeros(env.size, np.int64)
        k = 0
        for r in range(env.size):
            for _ in s._by_owner[r]:
                recv_counts[r] += int(req.unique_counts[k]) * dims[k]
                k += 1
        wire = s.forward_wire  # rows of unique ids, coded like pooled rows
        h = s.send("forward", "all_to_all_v", wire.encode(sendbuf), wire.count(send_counts),
                   recv_counts=wire.count(recv_counts), group=env.group, async_op=True)

        def finish(res):
            rows = wire.decode(res[0])
            layout = TableLayout(tuple(int(u) for u in req.unique_counts), tuple(dims))
            lens = np.concatenate(req.lengths) if req.lengths else np.zeros(0, np.int64)
            offsets = np.zeros(lens.size + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            bags = Bags(np.concatenate(req.inverse) if req.inverse else np.zeros(0, np.int64),
                        offsets, tuple(range(len(order))),
                        tuple(s.features[s.slots[i].feature].col + s.slots[i].shard.col_offset
                              for i in order),
                        batch_size=req.batch, out_dim=s.out_dim,
                        weights=None if req.weights is None else np.concatenate(req.weights),
                        **Bags.pooling_flags(s.features[s.slots[i].feature].pooling
                                             for i in order))
            req.bags, req.layout = bags, layout
            ops = kernel_module(env.device)
            if not order:
                return xp.zeros((req.batch, s.out_dim), env.dtype), (req, owned, rows)
            out = ops.pooled_lookup(layout, rows, bags)
            return out, (req, owned, rows)

        return Pending((h,), finish)

    # -- backward ---------------------------------------------------------------------
    def backward(self, ctx, grad) -> Pending:
        s = self.s
        env = s.env
        xp = env.xp
        req, owned, rows = ctx
        layout = req.layout
        if layout.num_tables:
            ops = kernel_module(env.device)
            sparse = ops.aggregate_grads(layout, req.bags, xp.asarray(grad, env.dtype),
                                         weights=rows)
        else:
            sparse = []
        gbuf = xp.zeros(layout.total_elements, env.dtype)
        for t, (pos, g) in enumerate(sparse):
            off = layout.weight_offsets[t]
            d = layout.dims[t]
            dense = gbuf[off:off + layout.rows[t] * d].reshape(layout.rows[t], d)
            if len(pos):
                dense[xp.asarray(pos)] = g
        send_counts = np.zeros(env.size, np.int64)
        k = 0
        for r in range(env.size):
            for _ in s._by_owner[r]:
                send_counts[r] += layout.rows[k] * layout.dims[k]
                k += 1
        mine = s._by_owner[env.rank]
        recv_counts = np.array([sum(int(owned.counts[g, k]) * s.slots[i].shard.num_cols
                                    for k, i in enumerate(mine)) for g in range(env.size)],
                               np.int64)
        wire = s.backward_wire
        h = s.send("backward", "all_to_all_v", wire.encode(gbuf), send_counts,
                   recv_counts=recv_counts, group=env.group, async_op=True)

        def finish(res):
            grads = wire.decode(res[0])
            if s.fused is None:
                s.apply_sparse(None)
                return None
            per_table: list[list] = [[] for _ in range(s.fused.num_tables)]
            at = 0
            for g in range(env.size):
                for k, i in enumerate(mine):
                    slot = s.slots[i]
                    ids = owned.ids[g][k]
                    d = slot.shard.num_cols
                    n = ids.size
                    per_table[slot.local_table].append((ids, grads[at:at + n * d].reshape(n, d)))
                    at += n * d
            sparse_local = []
            ops = kernel_module(env.device)
            for t, items in enumerate(per_table):
                if not items:
                    sparse_local.append((np.zeros(0, np.int64),
                                         xp.zeros((0, s.fused.layout.dims[t]), env.dtype)))
                    continue
                rows = np.concatenate([a for a, _ in items])
                g = xp.concatenate([b for _, b in items])
                sparse_local.append(ops.aggregate_rows(rows, g, s.fused.layout.rows[t]))
            s.apply_sparse(sparse_local)
            return None

        return Pending((h,), finish)
