"""The sharded embedding collection: tables + a sharding plan + a process group.

:class:`ShardedEmbeddingCollection` builds one strategy per sharding type in
the plan (any mix across tables), owns the local shards and their optimizer
state, and runs a training step for this rank's local batch::

    coll = ShardedEmbeddingCollection(tables, plan, world.world)
    pooled = coll.forward(kjt)          # [B, sum of feature dims]
    ...                                 # dense model, loss, d loss / d pooled
    coll.backward(grad_pooled)          # reverse dists, fused backward + update

Output columns follow the tables' order, and each table's features in
order; :meth:`~ShardedEmbeddingCollection.columns` says where each feature
lands and :meth:`~ShardedEmbeddingCollection.split` cuts the output per
feature. To overlap the input dist of batch i+1 with the compute of batch i::

    nxt = coll.input_dist(kjt_next)     # starts the id AlltoAlls, returns at once
    ...                                 # dense forward/backward of batch i
    pooled = coll.forward(nxt)          # waits for them, then looks up

Input is checked on every rank and the verdict agreed across the group
before any id moves: a bad id on one rank raises the same
:class:`~neocomm.errors.CollectiveArgumentError` (a ValueError) everywhere.

Quantized communication: ``qcomms`` (a
:class:`~embedding.sharding.qcomm.QComms`, or one per table) sets the
precision the pooled rows (forward) and their gradients (backward) cross
ranks in, and (dense) the precision of the data-parallel tables' gradient
AllReduce; tables of one sharding type with different settings get a
strategy each. :meth:`~ShardedEmbeddingCollection.take_sent` counts the
bytes this rank passed to those collectives, and
:meth:`~ShardedEmbeddingCollection.take_calls` the embedding kernel calls and
collective calls.

Packed tables (the plan's ``packs``, :mod:`embedding.packing`): the members of
a packed table are stored, sharded and looked up as one physical table; the
input dist moves each member feature's ids by the member's row offset, and
everything a user sees (pooled columns, :meth:`gather_table`,
:meth:`load_table`, initial weights) stays per member table.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable, ContextManager, Mapping, Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.packing import feature_offsets, packed_tables
from embedding.precision import compute_dtype
from embedding.sharding import STRATEGIES, ShardingEnv
from embedding.sharding.base import LocalShard
from embedding.sharding.qcomm import FP16_MAX, CommPrecision, QComms
from embedding.types import (IdPolicy, ShardingPlan, ShardingType, TableConfig, check_dynamic,
                             enum_arg)
from embedding.weights import assign, dynamic_initializer, init_weights
from neocomm.errors import CollectiveArgumentError
from neocomm.types import is_half

__all__ = ["ShardedEmbeddingCollection", "DistributedBatch", "init_weights", "assign", "STAGES",
           "dynamic_initializer"]

#: The stages of a step, as named to a ``timer``: ``timer(stage)`` is entered around each.
STAGES = ("input_dist", "lookup", "output_dist", "backward")
Timer = Callable[[str], ContextManager]


def _untimed(stage: str) -> ContextManager:
    return contextlib.nullcontext()


class DistributedBatch:
    """The input dist of one batch, in flight; pass it to ``forward``.

    ``wait()`` completes it early (optional: ``forward`` waits anyway). Every
    rank must wait for, or forward, its batches in the same order.
    """

    __slots__ = ("pending", "batch_size", "_used", "_dist")

    def __init__(self, pending, batch_size: int):
        self.pending = pending
        self.batch_size = batch_size
        self._used = False
        self._dist = None

    def wait(self) -> "DistributedBatch":
        """Finish the input dist (ids are on their shards); returns self."""
        if self._dist is None:
            self._dist = [p.wait() for p in self.pending]
        return self


class ShardedEmbeddingCollection:
    """Embedding tables sharded by ``plan`` over ``group`` (module doc).

    ``device``: ``"cpu"`` (NumPy) or ``"cuda"`` (CuPy; pooled output and
    gradients are CuPy arrays). ``dtype``: weight dtype (default: the
    tables' common dtype). ``threads``: threads of the NumPy kernels.
    ``dedup``: send each distinct id of a feature once (table-, column- and
    table-column-wise tables; see :mod:`embedding.sharding.dedup`). ``id_policy``:
    one :class:`~embedding.types.IdPolicy` for every table, or a mapping
    from table name (missing tables: ``ERROR``). ``qcomms``: the output dists'
    precisions and the data-parallel AllReduce's (``dense``), one
    :class:`~embedding.sharding.qcomm.QComms` for every table or a mapping from
    table name (missing tables: fp32). Weights start as
    :func:`init_weights` with ``seed``, independent of the plan.
    """

    def __init__(self, tables: Sequence[TableConfig], plan: ShardingPlan, group=None, *,
                 device: str = "cpu", dtype: str | None = None, threads: int = 1,
                 dedup: bool = False,
                 id_policy: IdPolicy | Mapping[str, IdPolicy] = IdPolicy.ERROR,
                 seed: int = 0, qcomms: QComms | Mapping[str, QComms] | None = None):
        from neocomm.world import group_or_world

        group = group_or_world(group)
        self.tables = tuple(tables)
        if not self.tables:
            raise ValueError("tables: expected at least one table")
        for t in self.tables:
            if not isinstance(t, TableConfig):
                raise TypeError(f"tables: expected TableConfig, got {type(t).__name__}")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"tables: names must be unique, got {names}")
        feats = [f for t in self.tables for f in t.features]
        if len(set(feats)) != len(feats):
            dup = sorted({f for f in feats if feats.count(f) > 1})
            raise ValueError(f"tables: a feature may be read by one table only, got {dup} "
                             f"read by several")
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan: expected a ShardingPlan, got {type(plan).__name__}")
        if plan.world_size != group.size:
            raise ValueError(f"plan: made for {plan.world_size} ranks, the group has "
                             f"{group.size}")
        physical = packed_tables(self.tables, plan)  # packed members as one table each
        phys_names = [t.name for t in physical]
        planned = [p.table for p in plan.tables]
        if sorted(planned) != sorted(phys_names) or len(set(planned)) != len(planned):
            raise ValueError(f"plan: expected one entry per table {sorted(phys_names)}, got "
                             f"{sorted(planned)}")
        #: the tables the strategies store: :attr:`tables` with packed members as one
        self.physical_tables = physical
        self._offsets = feature_offsets(self.tables, plan)
        if dtype is None:  # the compute dtype: float32 for float16 and bfloat16 tables
            dtypes = {compute_dtype(t.dtype).name for t in self.tables}
            if len(dtypes) != 1:
                raise ValueError(f"dtype: tables compute in different dtypes {sorted(dtypes)}; "
                                 f"pass dtype= to choose one")
            dtype = dtypes.pop()
        dtype = np.dtype(dtype).name
        for t in self.tables:
            if is_half(t.dtype) and dtype != "float32":
                raise ValueError(f"dtype: table {t.name!r} stores {t.dtype} and computes in "
                                 f"float32; the collection's dtype must be float32, got "
                                 f"{dtype!r}")
        self.plan = plan
        self.group = group
        self.env = ShardingEnv(group, device=device, dtype=dtype, threads=threads, dedup=dedup)
        self.xp = self.env.xp
        # Collection columns.
        self._cols: dict[str, tuple[int, int]] = {}
        col = 0
        for t in self.tables:
            for f in t.features:
                self._cols[f] = (col, t.dim)
                col += t.dim
        self.out_dim = col
        self.feature_names = tuple(self._cols)
        # Policies and row counts per feature.
        if isinstance(id_policy, (IdPolicy, str)):
            one = enum_arg(IdPolicy, id_policy, "id_policy")
            pol = {t.name: one for t in self.tables}
        else:
            unknown = sorted(set(id_policy) - set(names))
            if unknown:
                raise ValueError(f"id_policy: unknown tables {unknown}")
            pol = {t.name: enum_arg(IdPolicy, id_policy.get(t.name, IdPolicy.ERROR),
                                    f"id_policy[{t.name!r}]") for t in self.tables}
        # dynamic tables take any int64 id (None: no range check, no policy)
        self._rows = {f: None if t.dynamic else t.num_rows for t in self.tables
                      for f in t.features}
        self._policy = {f: pol[t.name] for t in self.tables for f in t.features}
        qc = _qcomms_of(qcomms, names)
        for p in plan.packs:  # a packed table moves its rows in one setting
            kinds = {qc[m] for m in p.tables}
            if len(kinds) != 1:
                raise ValueError(f"qcomms: the members {list(p.tables)} of packed table "
                                 f"{p.name!r} have different settings {sorted(map(str, kinds))}; "
                                 f"a packed table's rows cross ranks in one")
            qc[p.name] = kinds.pop()
        # Strategies, in a fixed order on every rank: one per sharding type, store (tables in
        # device memory, host-resident ones, dynamic ones, each their own store), storage
        # precision and the QComms settings the sharding uses.
        by_type: dict[tuple[ShardingType, str, tuple, QComms], list] = {}
        for t in physical:
            tp = plan.table(t.name)
            if tp.memory.tiered:
                tp.memory.check(t.name, t.num_rows)
            check_dynamic(t, tp)
            if t.dynamic and dedup:
                raise ValueError(f"dedup: dynamic table {t.name!r} does not support "
                                 f"deduplicated input dists yet; got dedup=True")
            store = "dynamic" if t.dynamic else "tiered" if tp.memory.tiered else "device"
            # one store per storage precision (weights and state dtype) and comms setting, in
            # table order; a full-precision table is stored in the collection's dtype
            st = t if is_half(t.dtype) else replace(t, dtype=dtype)
            prec = (st.dtype, st.optimizer_state_dtype)
            q = qc[t.name].used_by(tp.sharding is ShardingType.DATA_PARALLEL)
            by_type.setdefault((tp.sharding, store, prec, q), []).append((st, tp))
        self.strategies = []
        self._maps = []
        for stype, cls in STRATEGIES.items():
            for store in ("device", "tiered", "dynamic"):
                for key in [k for k in by_type if k[:2] == (stype, store)]:  # table order
                    ts, ps = zip(*by_type[key])
                    strat = cls(ts, ps, self.env, key[3])
                    self.strategies.append(strat)
                    self._maps.append([(f.col, self._cols[f.name][0], f.dim)
                                       for f in strat.features])
        # fp16 gradients: the largest loss scale among the strategies that send them
        self._fp16_scales = {s.qcomms.backward_loss_scale or 1.0 for s in self.strategies
                             if s.qcomms.backward is CommPrecision.FP16
                             and s.sharding_types[0] is not ShardingType.DATA_PARALLEL}
        self._identity = (len(self.strategies) == 1
                          and all(a == b for a, b, _ in self._maps[0]))
        self._last_ctx = None
        init_weights(self, seed)

    # -- introspection ---------------------------------------------------------------
    def columns(self) -> dict[str, tuple[int, int]]:
        """``{feature: (first column, dim)}`` in the pooled output."""
        return dict(self._cols)

    def split(self, pooled) -> dict:
        """``{feature: pooled[:, cols]}`` (views)."""
        return {f: pooled[:, c:c + d] for f, (c, d) in self._cols.items()}

    def tiered_stores(self) -> list:
        """The :class:`~embedding.kernels.tiered.TieredTables` of host-resident tables."""
        from embedding.kernels.tiered import TieredTables

        return [s.fused for s in self.strategies
                if isinstance(getattr(s, "fused", None), TieredTables)]

    def take_cache_stats(self):
        """Cache counters of every host-resident table since the last call, summed
        (:class:`~embedding.kernels.tiered.CacheStats`; all zero without such tables)."""
        from embedding.kernels.tiered import CacheStats

        total = CacheStats()
        for store in self.tiered_stores():
            total.add(store.take_stats())
        return total

    def dynamic_stores(self) -> list:
        """The :class:`~embedding.kernels.dynamic.DynamicTables` of dynamic tables."""
        from embedding.kernels.dynamic import DynamicTables

        return [s.fused for s in self.strategies
                if isinstance(getattr(s, "fused", None), DynamicTables)]

    def prefetch(self, batch: "DistributedBatch") -> None:
        """Finish ``batch``'s input dist and bring its host-resident rows in now.

        Call it while the previous batch computes (after its forward, any time
        before its backward): the rows the previous batch reads stay where
        they are, and the forward of ``batch`` then waits on no host copy.
        Without host-resident tables it only waits for the ids.
        """
        if not isinstance(batch, DistributedBatch):
            raise TypeError(f"batch: expected a DistributedBatch, got {type(batch).__name__}")
        dist = batch.wait()._dist
        for strat, d in zip(self.strategies, dist):
            store = getattr(strat, "fused", None)
            bags = strat.bags_of(d)
            if store is not None and bags is not None:
                store.prefetch(bags)

    def take_calls(self) -> dict[str, int]:
        """Embedding kernel calls (``"kernels"``: fused lookups, gradient aggregations,
        updates and fused backward+updates) and collective calls (``"collectives"``: the
        input dists, output dists and their reverses) this rank made since the last call."""
        kernels = 0
        for strat in self.strategies:
            store = getattr(strat, "fused", None)
            if store is not None:
                kernels += store.take_kernel_calls()
        return {"kernels": kernels, "collectives": self.env.take_collective_calls()}

    def take_sent(self) -> dict[str, int]:
        """Bytes of the pooled rows (``"forward"``), their gradients (``"backward"``) and the
        data-parallel tables' gradients (``"dense"``) this rank passed to collectives since
        the last call (each send buffer's ``nbytes``, the block a rank keeps for itself
        included)."""
        return self.env.take_sent()

    def local_shards(self) -> list[LocalShard]:
        """Every shard this rank holds (weights and optimizer state through ``tables``)."""
        return [s for strat in self.strategies for s in strat.local_shards()]

    def load_table(self, name: str, weights) -> None:
        """Set table ``name`` from its full ``[num_rows, dim]`` weights (each rank takes its
        shards' rows and columns)."""
        table = next((t for t in self.tables if t.name == name), None)
        if table is None:
            raise KeyError(f"table {name!r} is not in this collection")
        if table.dynamic:
            raise ValueError(f"name: table {name!r} is dynamic (rows belong to ids as they "
                             f"come); read its entries with DynamicTables.export / entries")
        weights = np.asarray(weights) if self.env.device == "cpu" else weights
        if tuple(weights.shape) != (table.num_rows, table.dim):
            raise ValueError(f"weights of table {name!r}: expected shape "
                             f"{(table.num_rows, table.dim)}, got {tuple(weights.shape)}")
        for s, local, sh in self._member_shards(name):
            assign(s.weight[local], weights[sh.row_slice, sh.col_slice])
        self.sync_masters()

    def set_update_step(self, step: int) -> None:
        """Number every store's next update ``step`` (the stochastic rounding's counter): a
        resume at training step ``step`` rounds as the run it continues would have."""
        for strat in self.strategies:
            store = getattr(strat, "fused", None)
            if store is not None and hasattr(store, "step"):
                store.step = int(step)

    def _member_shards(self, name: str):
        """``(local shard, its local rows, the table's shard)`` of every local shard holding
        rows of table ``name`` (a packed member's rows are part of its packed table's)."""
        pack = self.plan.pack_of(name)
        for s in self.local_shards():
            if pack is None and s.table == name:
                yield s, slice(None), s.shard
            elif pack is not None and s.table == pack.name:
                for m, local, sh in pack.parts(s.shard):
                    if m.table == name:
                        yield s, local, sh

    def sync_masters(self) -> None:
        """Set the float32 master copies of tables with ``master`` rounding from their
        stored rows (after the weights were written directly)."""
        for strat in self.strategies:
            store = getattr(strat, "fused", None)
            if store is not None and getattr(store, "master", None) is not None:
                store.sync_master()

    def gather_table(self, name: str) -> np.ndarray:
        """Table ``name``'s whole ``[num_rows, dim]`` weights, on every rank (collective).

        Each rank contributes the shards it holds (one copy of a replicated
        table); the result is a host (NumPy) array of the collection's dtype.
        """
        table = next((t for t in self.tables if t.name == name), None)
        if table is None:
            raise KeyError(f"table {name!r} is not in this collection")
        if table.dynamic:
            raise ValueError(f"name: table {name!r} is dynamic (rows belong to ids as they "
                             f"come); read its entries with DynamicTables.export / entries")
        mine = []
        for s, local, sh in self._member_shards(name):
            w = s.weight[local]
            mine.append((sh, np.asarray(w) if isinstance(w, np.ndarray) else w.get()))
        pack = self.plan.pack_of(name)
        replicated = self.plan.table(pack.name if pack else name).sharding is \
            ShardingType.DATA_PARALLEL
        if replicated:  # every rank holds it whole: no traffic
            return mine[0][1].copy()
        out = np.empty((table.num_rows, table.dim), self.env.dtype)
        for part in self.env.group.comm.allgather(mine):
            for sh, w in part:
                out[sh.row_slice, sh.col_slice] = w
        return out

    # -- the step --------------------------------------------------------------------
    def check_input(self, kjt: KeyedJagged) -> KeyedJagged:
        """Validate ``kjt`` and apply id policies, agreeing the verdict across the group."""
        from neocomm.agree import Problem, agree

        problem = None
        checked = kjt
        if not isinstance(kjt, KeyedJagged):
            problem = Problem("kjt", f"kjt: expected a KeyedJagged, got {type(kjt).__name__}")
        else:
            try:
                checked = kjt.check_ids(self._rows, self._policy, self._offsets)
            except ValueError as exc:
                problem = Problem("kjt", str(exc))
        ok = isinstance(kjt, KeyedJagged)
        agree(self.group, "embedding input", problem,
              [("batch_size", kjt.batch_size if ok else -1),
               ("weighted", int(kjt.weights is not None) if ok else -1)])
        return checked

    def input_dist(self, kjt: KeyedJagged) -> DistributedBatch:
        """Check ``kjt`` and start sending its ids to their shards (returns at once)."""
        kjt = self.check_input(kjt)
        return DistributedBatch([s.input_dist(kjt) for s in self.strategies], kjt.batch_size)

    def forward(self, batch: KeyedJagged | DistributedBatch):
        """Pooled embeddings of this rank's batch, ``[B, out_dim]``; keeps what backward needs."""
        pooled, ctx = self.forward_with_context(batch)
        self._last_ctx = ctx
        return pooled

    def forward_with_context(self, batch: KeyedJagged | DistributedBatch, *,
                             timer: Timer | None = None, grad: bool = True):
        """``(pooled, ctx)``; pass ``ctx`` to :meth:`backward` (for pipelined use).

        ``timer(stage)``, when given, is entered around the ``input_dist``
        wait, the local ``lookup`` and the ``output_dist`` wait, so a trainer
        can time each stage. ``grad=False`` (evaluation): no backward will
        follow, so host-resident tables release this batch's rows at once, and
        dynamic tables only read (ids they have not seen read as zeros and are not
        inserted).
        """
        timer = timer or _untimed
        if isinstance(batch, KeyedJagged):
            batch = self.input_dist(batch)
        if not isinstance(batch, DistributedBatch):
            raise TypeError(f"batch: expected a KeyedJagged or DistributedBatch, got "
                            f"{type(batch).__name__}")
        if batch._used:
            raise ValueError("batch: this DistributedBatch was already forwarded")
        batch._used = True
        with timer("input_dist"):
            dist = batch.wait()._dist
        stores = [] if grad else [(st, st.open_steps()) for st in self.tiered_stores()]
        with timer("lookup"), contextlib.ExitStack() as reading:
            if not grad:
                for st in self.dynamic_stores():
                    reading.enter_context(st.reading())
            pending = [s.forward(d) for s, d in zip(self.strategies, dist)]
        with timer("output_dist"):
            results = [p.wait() for p in pending]
        for store, before in stores:
            store.drop_steps(keep=before)
        b = batch.batch_size
        if self._identity:
            pooled = results[0][0]
        else:
            pooled = self.xp.empty((b, self.out_dim), self.env.dtype)
            for (part, _), cmap in zip(results, self._maps):
                for src, dst, d in cmap:
                    pooled[:, dst:dst + d] = part[:, src:src + d]
        return pooled, ([ctx for _, ctx in results], b)

    def backward(self, grad, ctx=None, *, timer: Timer | None = None) -> None:
        """Reverse the output dists and apply the optimizers (``grad``: d loss / d pooled).

        ``timer("backward")``, when given, is entered around all of it.
        """
        if ctx is None:
            ctx, self._last_ctx = self._last_ctx, None
            if ctx is None:
                raise ValueError("backward: no forward to take the gradient of")
        ctxs, b = ctx
        grad = self.xp.asarray(grad)
        if tuple(grad.shape) != (b, self.out_dim):
            raise ValueError(f"grad: expected shape {(b, self.out_dim)}, got "
                             f"{tuple(grad.shape)}")
        grad = grad.astype(self.env.dtype, copy=False)
        if self._fp16_scales:
            self._check_fp16(grad)
        with (timer or _untimed)("backward"):
            pending = []
            for strat, sctx, cmap in zip(self.strategies, ctxs, self._maps):
                if self._identity:
                    part = self.xp.ascontiguousarray(grad)
                else:
                    part = self.xp.empty((b, strat.out_dim), self.env.dtype)
                    for src, dst, d in cmap:
                        part[:, src:src + d] = grad[:, dst:dst + d]
                pending.append(strat.backward(sctx, part))
            failed = None
            for p in pending:  # every strategy's collectives finish, even after an error
                try:
                    p.wait()
                except CollectiveArgumentError as exc:  # raised on every rank (agreed)
                    failed = failed or exc
            if failed is not None:
                raise failed


    def _check_fp16(self, grad) -> None:
        """Raise on every rank when a gradient, loss-scaled, would overflow fp16 (agreed
        before any gradient moves)."""
        from neocomm.agree import Problem, agree

        peak = float(self.xp.abs(grad).max()) if grad.size else 0.0
        scale = max(self._fp16_scales)
        problem = None
        if not peak * scale <= FP16_MAX:  # NaN too
            tables = [t.name for s in self.strategies if s.qcomms.backward is
                      CommPrecision.FP16 and (s.qcomms.backward_loss_scale or 1.0) == scale
                      for t in s.tables]
            key = "backward_loss_scale" if scale != 1.0 else "backward"
            problem = Problem("grad", f"qcomms.{key}: fp16 gradients of tables "
                              f"{tables} scaled by {scale:g} reach {peak * scale:.6g}, beyond "
                              f"fp16's largest value {FP16_MAX:g}; use a loss scale below "
                              f"{FP16_MAX / peak if peak else FP16_MAX:.6g}, or backward "
                              f"\"bf16\" or \"fp32\"")
        agree(self.group, "embedding backward", problem)


def _qcomms_of(qcomms, names) -> dict[str, QComms]:
    """One :class:`QComms` per table name from the collection's ``qcomms`` argument."""
    if qcomms is None or isinstance(qcomms, QComms):
        one = qcomms or QComms()
        return {n: one for n in names}
    if not isinstance(qcomms, Mapping):
        raise TypeError(f"qcomms: expected a QComms or a mapping from table name to QComms, "
                        f"got {type(qcomms).__name__}")
    unknown = sorted(set(qcomms) - set(names))
    if unknown:
        raise ValueError(f"qcomms: unknown tables {unknown}; the tables are {list(names)}")
    for name, q in qcomms.items():
        if not isinstance(q, QComms):
            raise TypeError(f"qcomms[{name!r}]: expected a QComms, got {type(q).__name__}")
    return {n: qcomms.get(n, QComms()) for n in names}
