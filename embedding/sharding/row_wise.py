"""Row-wise sharding: each table split into row blocks, one block per rank.

Input dist: every id is bucketized by the block that holds its row and sent
to that block's owner as a block-local row (one AlltoAll(v) for every
feature: per destination ``[lengths of every feature × B | ids]``). Each
rank pools the ids it received with *sum* pooling — partial sums, since a
bag's ids may live on several ranks. Output dist: one ReduceScatter adds
the partial sums, rank ``g`` receiving the rows of its own batch; mean
pooling then divides by the full bag lengths, known to the requesting rank.
Example, 2 ranks, table A rows ``[0, 5)`` on rank 0 and ``[5, 10)`` on rank 1,
rank 0's bag ``[2, 7]``::

    rank 0 sends id 2 to itself and id 7 (local row 2) to rank 1
    rank 0 pools row 2, rank 1 pools its row 2 (global 7), for rank 0's bag
    ReduceScatter: rank 0 receives A[2] + A[7]

Backward: the gradient of each rank's batch (mean columns scaled by
``1/length``) is AllGathered, since every rank holds partial sums of every
batch; each rank then updates its own rows. Blocks may be uneven, and a
rank may hold no rows of a table.

Where a row lives is the one thing a subclass changes (:meth:`RowWiseSharding._layout`,
a :data:`Route` per table): cyclic row-wise
(:mod:`~embedding.sharding.cyclic_row_wise`) runs the same steps with rows dealt
round-robin over the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from embedding.jagged import JaggedFeature, KeyedJagged
from embedding.kernels import Bags
from embedding.kernels.segments import stable_argsort
from embedding.sharding.base import (LocalShard, Pending, ShardingEnv, ShardingStrategy,
                                     collectives_api, pack_jagged, unpack_jagged)
from embedding.sharding.qcomm import QComms
from embedding.types import Pooling, Shard, ShardingType, TableConfig, TablePlan

__all__ = ["RowWiseSharding", "Route", "RowBlocks", "check_row_partition", "bucketize",
           "mean_scale"]

#: Where the rows of one table live: ``route(ids) -> (dest, local)``, for int64 table rows
#: ``ids``, the destination index holding each row and its row within that destination's
#: shard (both int64, the shape of ``ids``).
Route = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, eq=False)
class RowBlocks:
    """The :data:`Route` of contiguous row blocks: block ``j`` starts at table row
    ``starts[j]`` (ascending, ``starts[0] == 0``) and is held by destination ``dest[j]``.

    >>> RowBlocks(np.array([0, 5]), np.array([1, 0]))(np.array([2, 7]))
    (array([1, 0]), array([2, 2]))
    """

    starts: np.ndarray
    dest: np.ndarray

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blk = np.searchsorted(self.starts, ids, side="right") - 1
        return self.dest[blk], ids - self.starts[blk]


def check_row_partition(table: TableConfig, plan: TablePlan, ranks: Sequence[int]
                        ) -> list[Shard]:
    """The shards sorted by row; ValueError unless they tile the rows, full width, on ``ranks``."""
    if not plan.shards:
        raise ValueError(f"plan of table {table.name!r}: no shards")
    shards = sorted(plan.shards, key=lambda s: s.row_offset)
    at, seen = 0, set()
    allowed = set(ranks)
    for s in shards:
        if s.rank not in allowed:
            raise ValueError(f"plan of table {table.name!r} ({plan.sharding.value}): shard on "
                             f"rank {s.rank}, expected one of {sorted(allowed)}")
        if s.rank in seen:
            raise ValueError(f"plan of table {table.name!r} ({plan.sharding.value}): two row "
                             f"blocks on rank {s.rank}")
        seen.add(s.rank)
        if s.col_offset != 0 or s.num_cols != table.dim:
            raise ValueError(f"plan of table {table.name!r} ({plan.sharding.value}): row "
                             f"blocks must span all {table.dim} columns, got columns "
                             f"[{s.col_offset}, {s.col_offset + s.num_cols})")
        if s.row_offset != at or s.num_rows < 0:
            raise ValueError(f"plan of table {table.name!r}: row blocks must tile [0, "
                             f"{table.num_rows}) in order, got a block at rows "
                             f"[{s.row_offset}, {s.row_offset + s.num_rows}) after row {at}")
        at += s.num_rows
    if at != table.num_rows:
        raise ValueError(f"plan of table {table.name!r}: row blocks cover {at} of "
                         f"{table.num_rows} rows")
    return shards


def bucketize(feats: Sequence[JaggedFeature], routes: Sequence[Route], num_dest: int,
              batch: int):
    """Route every id to the destination holding its row.

    ``routes[f]`` maps the ids of feature ``f``'s table to destination
    indices in ``[0, num_dest)`` and rows local to that destination's shard
    (a :class:`RowBlocks`, or the cyclic route of
    :mod:`~embedding.sharding.cyclic_row_wise`). Returns ``(lengths
    [num_dest, F, B], local_ids, weights_or_None, counts [num_dest])`` with
    ids grouped by destination, then feature, then bag, as shard-local rows.
    """
    nf = len(feats)
    sizes = [f.values.size for f in feats]
    total = int(sum(sizes))
    dest = np.empty(total, np.int64)
    local = np.empty(total, np.int64)
    key = np.empty(total, np.int64)
    at = 0
    for fi, (f, route) in enumerate(zip(feats, routes)):
        v = f.values
        n = v.size
        dest[at:at + n], local[at:at + n] = route(v)
        key[at:at + n] = fi * batch + np.repeat(np.arange(batch, dtype=np.int64), f.lengths)
        at += n
    order = stable_argsort(dest, max(num_dest - 1, 0))
    key += dest * (nf * batch)
    lengths = np.bincount(key, minlength=num_dest * nf * batch).reshape(num_dest, nf, batch)
    counts = np.bincount(dest, minlength=num_dest).astype(np.int64)
    weights = None
    if feats and feats[0].weights is not None:
        weights = np.concatenate([f.weights for f in feats])[order]
    return lengths, local[order], weights, counts


def mean_scale(features, kjt_lengths: dict, batch: int, dtype, xp=np):
    """Per-column ``1/length`` factors (ones for sum features), ``[B, out_dim]``, or None."""
    means = [f for f in features if f.pooling is Pooling.MEAN]
    if not means:
        return None
    out_dim = sum(f.dim for f in features)
    scale = np.ones((batch, out_dim), dtype)
    for f in means:
        inv = np.dtype(dtype).type(1) / np.maximum(kjt_lengths[f.name], 1).astype(dtype)
        scale[:, f.col:f.col + f.dim] = inv[:, None]
    return xp.asarray(scale)


class RowWiseSharding(ShardingStrategy):
    """Row blocks of tables over every rank of the group (module doc)."""

    sharding_types = (ShardingType.ROW_WISE,)
    reducing_forward = True

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        super().__init__(tables, plans, env, qcomms)
        self._routes: list[Route] = []   # per table: id -> (rank, local row)
        local = []
        for t, p in zip(self.tables, self.plans):
            route, mine = self._layout(t, p)
            self._routes.append(route)
            local.append(mine)
        self._local = local
        self.fused = env.fused([s.num_rows for s in local], [t.dim for t in self.tables],
                               [t.optimizer for t in self.tables],
                               [t.name for t in self.tables],
                               [p.memory for p in self.plans],
                               [t.eviction if t.dynamic else None for t in self.tables],
                               configs=self.tables)
        tindex = {t.name: i for i, t in enumerate(self.tables)}
        self._feature_table = [tindex[f.table] for f in self.features]

    def _layout(self, table: TableConfig, plan: TablePlan) -> tuple[Route, Shard]:
        """The route of ``table``'s ids to group ranks and this rank's shard of it (no rows
        when it holds none); ValueError naming the table when ``plan`` does not fit."""
        env = self.env
        shards = check_row_partition(table, plan, range(env.size))
        route = RowBlocks(np.array([s.row_offset for s in shards], np.int64),
                          np.array([s.rank for s in shards], np.int64))
        mine = [s for s in shards if s.rank == env.rank]
        return route, (mine[0] if mine else Shard(env.rank, 0, 0, 0, table.dim))

    def local_shards(self) -> list[LocalShard]:
        return [LocalShard(t.name, s, self.fused, i)
                for i, (t, s) in enumerate(zip(self.tables, self._local)) if s.num_rows > 0]

    def input_dist(self, kjt: KeyedJagged) -> Pending:
        c = collectives_api(self.env)
        env = self.env
        b = kjt.batch_size
        feats = [kjt.feature(f.name) for f in self.features]
        routes = [self._routes[ti] for ti in self._feature_table]
        lengths, ids, weights, counts = bucketize(feats, routes, env.size, b)
        parts = [[(lengths[r].reshape(-1), ids[sum(counts[:r]):sum(counts[:r + 1])])]
                 for r in range(env.size)]
        buf, send_counts = pack_jagged(parts)
        h = c.all_to_all_v(buf, send_counts, group=env.group, async_op=True)
        hw = None
        if weights is not None:
            hw = c.all_to_all_v(weights.astype(np.float64), counts, group=env.group,
                                async_op=True)
        own_lengths = {f.name: feats[i].lengths for i, f in enumerate(self.features)}

        def finish(res, wres):
            recv, rcounts = res
            head = np.full(env.size, len(self.features) * b, np.int64)
            lens, values = unpack_jagged(recv, rcounts, head)
            offsets = np.zeros(lens.size + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            bags = Bags(values, offsets, tuple(self._feature_table),
                        tuple(f.col for f in self.features), (False,) * len(self.features),
                        b, self.out_dim, env.size, None if wres is None else wres[0])
            return bags, own_lengths

        return Pending((h, hw), finish)

    def forward(self, batch) -> Pending:
        env = self.env
        bags, own_lengths = batch
        b = bags.batch_size
        wire = self.forward_wire  # fp16/bf16 partial sums add up in 16 bits
        partial = self.fused.lookup(bags, wire=wire)  # written in the wire format
        h = self.send("forward", "reduce_scatter", partial.reshape(-1), group=env.group,
                      async_op=True)
        scale = mean_scale(self.features, own_lengths, b, env.dtype, env.xp)

        def finish(res):
            out = wire.decode(res).reshape(b, self.out_dim)
            if scale is not None:
                out *= scale
            return out, (bags, scale)

        return Pending((h,), finish)

    def backward(self, ctx, grad) -> Pending:
        env = self.env
        bags, scale = ctx
        g = env.xp.ascontiguousarray(grad, dtype=env.dtype)
        if scale is not None:
            g = g * scale
        wire = self.backward_wire
        h = self.send("backward", "all_gather", wire.encode(g.reshape(-1)), group=env.group,
                      async_op=True)

        def finish(res):
            # the gathered gradients feed the kernel as received, decoded as they are read
            self.fused.backward_update(bags, res.reshape(bags.out_rows, self.out_dim),
                                       wire=wire)

        return Pending((h,), finish)
