"""Stage one of the planner: the candidate shardings of one table, with their estimates.

Candidates (``B`` global batch, ``L`` ids per sample, ``W`` ranks, ``R``
ranks per node, ``k`` column slices):

========================  ==========  ==========================================
sharding                  placement   shards
========================  ==========  ==========================================
table-wise                free        1: the whole table
column-wise ×k            free        k column slices of ``dim / k``, distinct ranks
row-wise                  every rank  W row blocks
cyclic row-wise           every rank  W row sets: row r on rank r mod W
data-parallel             every rank  W replicas
table-row-wise            one node    R row blocks on the ranks of one node
table-column-wise ×k      one node    k column slices on ranks of one node
========================  ==========  ==========================================

``k`` runs over the divisors of ``dim`` in ``2..W`` (``2..R`` within a node)
whose slices are at least ``min_column_dim`` wide, or is the table's fixed
``column_slices``. Hierarchical candidates are offered when there is more
than one node. A table whose table-wise shard does not fit one device is
offered row-wise, cyclic row-wise and table-row-wise only: it is split by rows,
never placed whole.

Cyclic row-wise is priced as row-wise: its shards hold the same number of rows
rank by rank, and the planner models every row of a table as equally likely
to be looked up, so both spread the lookups alike. (Under skewed ids cyclic
spreads them evenly where contiguous blocks load the rank of the hot rows;
the planner has no measure of skew.) It follows row-wise in the candidate
list, so at equal cost the planner keeps contiguous row-wise; ask for cyclic
with a table's ``shardings``.

With a host tier (``Hardware.host_memory`` > 0) every candidate but the
data-parallel one also comes with its rows in host memory, cached or not
(:mod:`~embedding.planner.tiers`); those are offered whatever the size of
the table, as long as each shard fits a node's host memory.
"""
from __future__ import annotations

from collectives.types import CollectiveOp
from embedding.planner.estimate import CostModel, Scope, shard_memory, touch_bytes_per_id
from embedding.planner.estimate import itemsize as _itemsize
from embedding.planner.tiers import TierModel
from embedding.planner.types import (Candidate, Hardware, PlacementKind, PlanDoesNotFitError,
                                     ShardEstimate, TableConstraints, Workload, sum_parts)
from embedding.types import Pooling, ShardingType, TableConfig, check_pooling, cyclic_shards
from topology.sizes import GIB

__all__ = ["enumerate_candidates", "row_blocks", "column_splits"]

_A2A, _RS, _AG, _AR = (CollectiveOp.ALL_TO_ALL, CollectiveOp.REDUCE_SCATTER,
                       CollectiveOp.ALL_GATHER, CollectiveOp.ALL_REDUCE)
_W, _N = Scope.WORLD, Scope.NODE
_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.CYCLIC_ROW_WISE)


def row_blocks(num_rows: int, parts: int) -> list[tuple[int, int]]:
    """``(offset, rows)`` of ``parts`` contiguous blocks, sizes differing by at most one.

    >>> row_blocks(10, 4)
    [(0, 3), (3, 3), (6, 2), (8, 2)]
    """
    base, extra = divmod(int(num_rows), int(parts))
    out, offset = [], 0
    for i in range(parts):
        rows = base + (1 if i < extra else 0)
        out.append((offset, rows))
        offset += rows
    return out


def column_splits(dim: int, most: int, min_dim: int) -> list[int]:
    """Numbers of equal column slices ``k`` in ``2..most`` that divide ``dim``
    with slices at least ``min_dim`` wide."""
    return [k for k in range(2, int(most) + 1) if dim % k == 0 and dim // k >= min_dim]


class _Builder:
    """Builds the candidates of one table (the formulas of :mod:`estimate`).

    ``P`` is the pooled rows per batch: ``batch_size`` times the features that read
    the table (a packed table's members' features), each a bag of its own.
    """

    def __init__(self, table: TableConfig, hw: Hardware, wl: Workload, cost: CostModel,
                 ids_per_sample: float):
        self.t, self.hw, self.wl, self.cost = table, hw, wl, cost
        self.B, self.L, self.I = float(wl.batch_size), float(ids_per_sample), wl.id_bytes
        self.P = self.B * max(1, len(table.features))
        self.s = _itemsize(table.dtype)
        self.W, self.R = hw.world_size, hw.ranks_per_node

    def _shard(self, rows, row_off, cols, col_off, lookups, buffers, comm,
               row_stride: int = 1) -> ShardEstimate:
        """``comm``: ``(part, op, scope, bytes)`` of each collective the shard's traffic
        travels in, ``part`` the step part it belongs to (:data:`STEP_PARTS`)."""
        mem = shard_memory(self.t, rows, cols, buffers=int(buffers))
        touch = touch_bytes_per_id(self.t, cols)
        look = self.cost.lookup_seconds(lookups * touch)
        priced = [(part, self.cost.seconds(op, scope, n)) for part, op, scope, n in comm]
        read = cols * self.s  # the forward reads the row slice; the rest is the update
        parts = sum_parts([("lookup", self.cost.lookup_seconds(lookups * read)),
                            ("emb_backward", self.cost.lookup_seconds(lookups * (touch - read)))]
                           + priced)
        return ShardEstimate(row_off, rows, col_off, cols, mem, look,
                             sum(t for _, t in priced), parts, row_stride)

    def _spread(self, ids: float, rows: float) -> tuple[float, int, tuple]:
        """What every rank pays: its ``ids`` bytes out, its pooled ``rows`` bytes in (and
        their gradients back): ``(seconds, bytes, parts)``."""
        nbytes = ids + 2 * rows
        parts = sum_parts([("input_dist", self.cost.seconds(_A2A, _W, ids)),
                            ("output_dist", self.cost.seconds(_A2A, _W, rows)),
                            ("emb_backward", self.cost.seconds(_A2A, _W, rows))])
        return self.cost.seconds(_A2A, _W, nbytes), int(nbytes), parts

    def columns(self, k: int, sharding: ShardingType) -> Candidate:
        """Table-wise (k = 1), column-wise or table-column-wise slices."""
        B, L, I, s, d, P = self.B, self.L, self.I, self.s, self.t.dim // k, self.P
        shards = []
        for j in range(k):
            rows_out = [("output_dist", _A2A, _W, P * d * s), ("emb_backward", _A2A, _W, P * d * s)]
            if sharding is ShardingType.TABLE_COLUMN_WISE:
                # ids cross nodes once per node, then are gathered inside it
                comm = [("input_dist", _A2A, _W, B * L * I / k),
                        ("input_dist", _AG, _N, B * L * I)] + rows_out
                ops = ((_A2A, _W), (_AG, _N))
            else:
                comm = [("input_dist", _A2A, _W, B * L * I)] + rows_out
                ops = ((_A2A, _W),)
            shards.append(self._shard(self.t.num_rows, 0, d, j * d, B * L,
                                      B * L * I + 2 * P * d * s, comm))
        fan = 1 if sharding is ShardingType.TABLE_COLUMN_WISE else k
        secs, mem, parts = self._spread(B / self.W * fan * L * I, P / self.W * self.t.dim * s)
        placement = (PlacementKind.ONE_NODE if sharding is ShardingType.TABLE_COLUMN_WISE
                     else PlacementKind.FREE)
        return Candidate(self.t.name, sharding, placement, tuple(shards), secs, mem, ops, parts)

    def rows(self, sharding: ShardingType) -> Candidate:
        """Row-wise or cyclic row-wise over the world, or table-row-wise over one node."""
        B, L, I, s, dim, P = self.B, self.L, self.I, self.s, self.t.dim, self.P
        node = sharding is ShardingType.TABLE_ROW_WISE
        parts = self.R if node else self.W
        if sharding is ShardingType.CYCLIC_ROW_WISE:
            blocks = [(c.row_offset, c.num_rows, c.row_stride)
                      for c in cyclic_shards(self.t.num_rows, dim, parts)]
        else:
            blocks = [(offset, rows, 1) for offset, rows in row_blocks(self.t.num_rows, parts)]
        shards, priced = [], {}  # blocks of as many rows cost alike: price each size once
        for offset, rows, stride in blocks:
            same = priced.get(rows)
            if same is not None:
                shards.append(ShardEstimate(offset, rows, 0, dim, same.memory,
                                            same.lookup_seconds, same.comm_seconds, same.parts,
                                            stride))
                continue
            frac = rows / self.t.num_rows
            if node:  # reduce inside the node, then one all-to-all across nodes
                comm = [("input_dist", _A2A, _W, B * L * I * frac),
                        ("output_dist", _A2A, _W, P * dim * s / parts),
                        ("emb_backward", _A2A, _W, P * dim * s / parts),
                        ("output_dist", _RS, _N, P * dim * s),
                        ("emb_backward", _AG, _N, P * dim * s)]
            else:
                comm = [("input_dist", _A2A, _W, B * L * I * frac),
                        ("output_dist", _RS, _W, P * dim * s),
                        ("emb_backward", _AG, _W, P * dim * s)]
            priced[rows] = self._shard(rows, offset, dim, 0, B * L * frac,
                                       B * L * I * frac + 2 * P * dim * s, comm, stride)
            shards.append(priced[rows])
        if node:
            secs, mem, sp = self._spread(B / self.W * L * I, P / self.W * dim * s)
            ops = ((_A2A, _W), (_RS, _N), (_AG, _N))
            return Candidate(self.t.name, sharding, PlacementKind.ONE_NODE, tuple(shards),
                             secs, mem, ops, sp)
        secs, mem, sp = self._spread(B / self.W * L * I, 0.0)
        return Candidate(self.t.name, sharding, PlacementKind.EVERY_RANK, tuple(shards),
                         secs, mem, ((_A2A, _W), (_RS, _W), (_AG, _W)), sp)

    def data_parallel(self) -> Candidate:
        B, L, I, s, dim, rows = self.B, self.L, self.I, self.s, self.t.dim, self.t.num_rows
        local = B / self.W
        grad = rows * dim * s
        shard = self._shard(rows, 0, dim, 0, local * L, local * L * I
                            + 2 * local * (self.P / B) * dim * s + grad,
                            [("grad_sync", _AR, _W, grad)])
        return Candidate(self.t.name, ShardingType.DATA_PARALLEL, PlacementKind.EVERY_RANK,
                         (shard,) * self.W, 0.0, 0, ((_AR, _W),))


def enumerate_candidates(table: TableConfig, hardware: Hardware, workload: Workload,
                         cost: CostModel,
                         constraints: TableConstraints | None = None) -> list[Candidate]:
    """Every sharding of ``table`` the planner may choose, each shard fitting one device
    (and, for the tiered variants, a node's host memory).

    Raises ValueError when ``constraints`` ask for column slices the dimension
    does not divide into, and :class:`PlanDoesNotFitError` when no candidate's
    shards fit (naming the table and the bytes it is short by; with a host
    tier, ``tier`` ``"host"`` when a node's host memory is smaller than the
    table's smallest host-resident shard).
    """
    c = constraints or TableConstraints()
    hw, dim, name = hardware, table.dim, table.name
    allowed = set(c.shardings) or set(ShardingType)
    explicit = bool(c.shardings)
    if table.pooling is Pooling.MAX:  # never split by rows; an error when nothing else is allowed
        if allowed <= set(_SPLIT):
            check_pooling(name, table.pooling, min(allowed, key=lambda s: s.value))
        allowed -= set(_SPLIT)
    multi_node = hw.num_nodes > 1
    b = _Builder(table, hw, workload, cost, c.ids_per_sample or workload.ids_per_sample)

    def slices(most: int, what: str) -> list[int]:
        if c.column_slices:
            k = c.column_slices
            if dim % k:
                raise ValueError(f"column_slices of table {name!r}: dim {dim} is not divisible "
                                 f"into {k} column slices")
            if k > most:
                raise ValueError(f"column_slices of table {name!r}: {k} slices need {k} "
                                 f"ranks, {what} has {most}")
            return [k] if k > 1 else []
        return column_splits(dim, most, hw.min_column_dim)

    out: list[Candidate] = []
    if ShardingType.TABLE_WISE in allowed:
        out.append(b.columns(1, ShardingType.TABLE_WISE))
    if ShardingType.COLUMN_WISE in allowed:
        ks = slices(hw.world_size, "the world")
        if not ks and explicit and allowed == {ShardingType.COLUMN_WISE}:
            raise ValueError(f"dim of table {name!r}: {dim} is not divisible into column "
                             f"slices of at least {hw.min_column_dim} on "
                             f"{hw.world_size} ranks")
        out += [b.columns(k, ShardingType.COLUMN_WISE) for k in ks]
    if ShardingType.TABLE_COLUMN_WISE in allowed and (multi_node or explicit):
        out += [b.columns(k, ShardingType.TABLE_COLUMN_WISE)
                for k in slices(hw.ranks_per_node, "a node")]
    if ShardingType.ROW_WISE in allowed and hw.world_size > 1 \
            and table.num_rows >= hw.world_size:
        out.append(b.rows(ShardingType.ROW_WISE))
    if ShardingType.CYCLIC_ROW_WISE in allowed and hw.world_size > 1 \
            and table.num_rows >= hw.world_size:
        out.append(b.rows(ShardingType.CYCLIC_ROW_WISE))
    if ShardingType.TABLE_ROW_WISE in allowed and hw.ranks_per_node > 1 \
            and table.num_rows >= hw.ranks_per_node and (multi_node or explicit):
        out.append(b.rows(ShardingType.TABLE_ROW_WISE))
    if ShardingType.DATA_PARALLEL in allowed and hw.world_size > 1:
        out.append(b.data_parallel())
    if not out:
        raise PlanDoesNotFitError(f"table {name!r}: none of the shardings "
                                  f"{sorted(s.value for s in allowed)} applies on "
                                  f"{hw.world_size} ranks in nodes of {hw.ranks_per_node}",
                                  table=name)
    usable = hw.usable_memory
    whole = b.columns(1, ShardingType.TABLE_WISE).max_shard_memory
    # a table too large for one device is split by rows, unless it cannot be (max pooling)
    too_large = whole > usable and bool(allowed & set(_SPLIT))
    fits = [x for x in out if x.max_shard_memory <= usable
            and (not too_large or x.sharding in _SPLIT)]
    if hw.host_memory:
        model = TierModel(table, hw, workload, c)
        tiered = [v for x in out for v in model.variants(x)]
        fits += [v for v in tiered if v.max_shard_memory <= usable]
        spreadable = [x for x in out if x.sharding is not ShardingType.DATA_PARALLEL]
        if not fits and spreadable:
            # the largest shard of the most spread host-resident candidate
            least = min(max(s.memory.host for s in model.variant(x, 0).shards)
                        for x in spreadable)
            if least > hw.host_memory:
                raise PlanDoesNotFitError(
                    f"host memory {hw.host_memory / GIB:.2f} GiB per node is smaller than "
                    f"the smallest host-resident shard of table {name!r} "
                    f"({least / GIB:.2f} GiB), and the table does not fit device memory "
                    f"({usable / GIB:.2f} GiB usable per device)",
                    table=name, needed=least, available=hw.host_memory, tier="host")
    if not fits:
        pool = [x for x in out if not too_large or x.sharding in _SPLIT] or out
        best = min(pool, key=lambda x: x.max_shard_memory)
        need = best.max_shard_memory
        raise PlanDoesNotFitError(
            f"table {name!r} does not fit: its smallest shard ({best.describe()} over "
            f"{len(best.shards)} ranks) needs {need / GIB:.2f} GiB, a device has "
            f"{usable / GIB:.2f} GiB usable (short by {(need - usable) / GIB:.2f} GiB)",
            table=name, needed=need, available=usable)
    return fits
