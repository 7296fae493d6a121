"""What every sharding strategy shares: its environment, its contract, its helpers.

A strategy owns the local shards of the tables placed with its
:class:`~embedding.types.ShardingType` and runs four steps per batch, each
returning a :class:`Pending` whose ``wait()`` finishes it:

1. ``input_dist(kjt)``: send each id to the rank(s) that hold its row;
2. ``forward(batch)``: pooled lookup on the local shards, then the output
   dist that brings every sample's pooled rows back to the sample's rank;
   ``wait()`` gives ``(pooled [B, out_dim], ctx)``;
3. ``backward(ctx, grad)``: reverse the output dist, then the fused
   backward + sparse optimizer on the local shards.

Every cross-rank step is a call into :mod:`collectives` (``async_op=True``).
Ids travel on the host (NumPy); pooled rows and gradients live where the
shards live (NumPy, or CuPy with ``device="cuda"``). The output dist and its
reverse move pooled rows and gradients in the precisions of the strategy's
:class:`~embedding.sharding.qcomm.QComms` (:attr:`ShardingStrategy.forward_wire`,
:attr:`ShardingStrategy.backward_wire`); data-parallel tables AllReduce their
gradients in its ``dense`` precision (:attr:`ShardingStrategy.dense_wire`), and
:meth:`ShardingStrategy.send` counts the bytes of every buffer they pass to a
collective (:attr:`ShardingEnv.sent`).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np

from embedding.jagged import KeyedJagged
from embedding.kernels import Bags, FusedTables
from embedding.sharding.qcomm import CommPrecision, QComms, Wire
from embedding.types import (Pooling, Shard, ShardingType, TableConfig, TablePlan,
                             check_pooling)

__all__ = ["ShardingEnv", "ShardingStrategy", "Pending", "FeatureSpec", "LocalShard",
           "collectives_api", "pack_jagged", "unpack_jagged", "SENT_KINDS"]

#: What :attr:`ShardingEnv.sent` counts: pooled rows, their gradients, and the gradients
#: of data-parallel tables (AllReduced in the ``dense`` precision).
SENT_KINDS = ("forward", "backward", "dense")


def collectives_api(env: "ShardingEnv | None" = None):
    """The :mod:`collectives` module (its dense collectives: all_to_all_v, reduce_scatter …);
    given ``env``, a view of it that counts each call in ``env``'s
    :attr:`~ShardingEnv.collective_calls`."""
    import collectives

    return collectives if env is None else _Counted(collectives, env)


class _Counted:
    """The functions of a module, each call counted in ``env.collective_calls``."""

    __slots__ = ("_module", "_env")

    def __init__(self, module, env: "ShardingEnv"):
        self._module = module
        self._env = env

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        env = self._env

        def counted(*args, **kwargs):
            env.collective_calls += 1
            return fn(*args, **kwargs)

        return counted


class Pending:
    """A step in flight: ``wait()`` waits for its collectives, then finishes it (once)."""

    __slots__ = ("_handles", "_finish", "_done", "_result")

    def __init__(self, handles: Sequence, finish: Callable):
        self._handles = tuple(handles)
        self._finish = finish
        self._done = False
        self._result = None

    @classmethod
    def done(cls, result) -> "Pending":
        p = cls((), lambda: result)
        return p

    def wait(self):
        if not self._done:
            results = [h.wait() if h is not None else None for h in self._handles]
            self._result = self._finish(*results)
            self._done = True
            self._handles = ()
        return self._result


@dataclass(frozen=True)
class FeatureSpec:
    """One output feature of a strategy: read through ``table``, ``dim`` columns from ``col``."""

    name: str
    table: str
    dim: int
    pooling: Pooling
    col: int


@dataclass(frozen=True)
class LocalShard:
    """A shard held by this rank: where it lives in ``tables`` (index ``index``)."""

    table: str
    shard: Shard
    tables: FusedTables
    index: int

    @property
    def weight(self):
        return self.tables.weight(self.index)


class ShardingEnv:
    """The process group a collection runs on, its node layout, and kernel options.

    Shard ranks of a plan are ranks of ``group``. ``intra`` (the ranks of
    this rank's node) and ``rail`` (this local rank on every node) are made
    on first use: taken from the world when ``group`` is the world group,
    else split from ``group`` — a collective step, which every rank reaches
    at the same point because strategies are built in plan order.
    """

    def __init__(self, group, *, device: str = "cpu", dtype: str = "float32",
                 threads: int = 1, dedup: bool = False):
        self.group = group
        self.rank = int(group.rank)
        self.size = int(group.size)
        self.nodes: tuple[tuple[int, ...], ...] = tuple(tuple(n) for n in group.nodes)
        self.node_of = [0] * self.size
        self.local_of = [0] * self.size
        for m, members in enumerate(self.nodes):
            for j, r in enumerate(members):
                self.node_of[r] = m
                self.local_of[r] = j
        self.device = device
        self.dtype = np.dtype(dtype)
        self.threads = int(threads)
        self.dedup = bool(dedup)
        self._intra = None
        self._rail = None
        #: bytes of the pooled-row (``"forward"``), gradient (``"backward"``) and
        #: data-parallel gradient (``"dense"``) buffers this rank passed to collectives,
        #: summed since the last :meth:`take_sent`
        self.sent = dict.fromkeys(SENT_KINDS, 0)
        #: calls this rank's strategies made into :mod:`collectives` (blocking or not),
        #: since the last :meth:`take_collective_calls`
        self.collective_calls = 0

    def take_collective_calls(self) -> int:
        """:attr:`collective_calls` so far, then zero it."""
        n, self.collective_calls = self.collective_calls, 0
        return n

    def take_sent(self) -> dict[str, int]:
        """:attr:`sent` so far, then zero it."""
        out, self.sent = self.sent, dict.fromkeys(SENT_KINDS, 0)
        return out

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def local_rank(self) -> int:
        return self.local_of[self.rank]

    @property
    def uniform(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    def intra(self):
        """The group of this node's ranks (group order = local rank)."""
        if self._intra is None:
            self._intra = self._subgroup("intra_node", [list(n) for n in self.nodes])
        return self._intra

    def rail(self):
        """The group of the ranks with this local rank, one per node (group order = node)."""
        if self._rail is None:
            if not self.uniform:
                raise ValueError(f"nodes: rails need the same number of ranks on every node, "
                                 f"got {[len(n) for n in self.nodes]}")
            k = len(self.nodes[0])
            self._rail = self._subgroup("rail", [[n[j] for n in self.nodes] for j in range(k)])
        return self._rail

    def _subgroup(self, attr: str, partition: list[list[int]]):
        world = getattr(self.group, "world", None)
        mine = next(p for p in partition if self.rank in p)
        if world is not None and getattr(self.group.kind, "value", None) == "world":
            sub = getattr(world, attr)
            if tuple(sub.ranks) == tuple(self.group.ranks[r] for r in mine):
                return sub
        found = None
        for ranks in partition:  # collective: every rank walks the same partition
            sub = self.group.split(ranks, name=f"{self.group.name}/{attr}{ranks}")
            if sub is not None:
                found = sub
        return found

    def fused(self, rows, dims, optimizers, names, memory=None, eviction=None, configs=None):
        """The store of a strategy's local shards: ``FusedTables`` in device memory,
        :class:`~embedding.kernels.tiered.TieredTables` when ``memory`` (one
        :class:`~embedding.types.TableMemory` per table) puts them in host memory, or
        :class:`~embedding.kernels.dynamic.DynamicTables` when ``eviction`` (one
        :class:`~embedding.types.Eviction` per table, None for a fixed table) says they
        are dynamic (a strategy's tables are all dynamic or all fixed).

        ``configs`` (one :class:`~embedding.types.TableConfig` per local table) gives
        the storage precision, in any of the three stores: every table of one store has
        the same ``dtype`` and optimizer state dtype (the collection groups them so);
        without it the store holds ``self.dtype``."""
        kw = _precision(configs, self.dtype)
        if eviction is not None and any(e is not None for e in eviction):
            from embedding.kernels.dynamic import DynamicTables

            if any(e is None for e in eviction):
                raise ValueError(f"eviction: a store holds dynamic tables only or fixed "
                                 f"tables only, got {list(eviction)} for {list(names)}")
            return DynamicTables(rows, dims, optimizers, eviction, device=self.device,
                                 names=names, threads=self.threads, **kw)
        if memory is not None and any(m.tiered for m in memory):
            from embedding.kernels.tiered import TieredTables

            return TieredTables(rows, dims, optimizers, memory, device=self.device,
                                names=names, threads=self.threads, **kw)
        return FusedTables(rows, dims, optimizers, device=self.device, names=names,
                           threads=self.threads, **kw)

    @property
    def xp(self):
        if self.device == "cuda":
            import cupy

            return cupy
        return np


def _precision(configs, dtype) -> dict:
    """The store's precision arguments (``dtype``, ``state_dtype``, ``rounding``, ``seeds``
    of ``FusedTables``) for the local tables ``configs`` (None: ``dtype``)."""
    if not configs:
        return {"dtype": np.dtype(dtype).name}
    kinds = {(c.dtype, c.optimizer_state_dtype) for c in configs}
    if len(kinds) != 1:
        raise ValueError(f"configs: one store holds tables of one dtype and state dtype, got "
                         f"{sorted(kinds)} for {[c.name for c in configs]}")
    dt, sdt = kinds.pop()
    return {"dtype": dt, "state_dtype": sdt, "rounding": [c.rounding for c in configs],
            "seeds": [c.rounding_seed for c in configs]}


class ShardingStrategy(abc.ABC):
    """One sharding type's tables: their local shards and the four steps (module doc).

    ``tables``/``plans`` are the tables of this type in collection order.
    ``features`` lists this strategy's output features in collection order;
    its outputs are ``[B, out_dim]`` with feature ``f`` at columns
    ``[f.col, f.col + f.dim)``.
    """

    sharding_types: ClassVar[tuple[ShardingType, ...]] = ()
    #: True when the forward output dist sums partial pools (a ReduceScatter)
    reducing_forward: ClassVar[bool] = False

    def __init__(self, tables: Sequence[TableConfig], plans: Sequence[TablePlan],
                 env: ShardingEnv, qcomms: QComms | None = None):
        self.tables = tuple(tables)
        self.plans = tuple(plans)
        self.env = env
        self.qcomms = qcomms if qcomms is not None else QComms()
        if not isinstance(self.qcomms, QComms):
            raise TypeError(f"qcomms: expected a QComms, got {type(self.qcomms).__name__}")
        if self.reducing_forward and self.qcomms.forward is CommPrecision.INT8:
            names = ", ".join(repr(t.name) for t in self.tables)
            kind = self.plans[0].sharding.value if self.plans else "row_wise"
            raise ValueError(f"qcomms.forward: table {names} ({kind}) sums partial pools in a "
                             f"ReduceScatter, which cannot take 'int8'; it takes fp32, fp16, "
                             f"bf16")
        # int8 rows: the widest width dividing every column block the strategy moves
        row = math.gcd(*[t.dim for t in self.tables],
                       *[s.num_cols for p in self.plans for s in p.shards])
        if self.qcomms.forward is CommPrecision.INT8 and row < 3:
            names = ", ".join(repr(t.name) for t in self.tables)
            raise ValueError(f"qcomms.forward: int8 rows of table {names} would be {row} "
                             f"value(s) wide (the greatest common divisor of the column "
                             f"widths moved), {row + 8} bytes for {4 * row} in fp32; int8 "
                             f"needs a common width of at least 3 columns: use fp16 or bf16")
        #: the codec of the output dist (pooled rows) and of its reverse (gradients)
        self.forward_wire = Wire(self.qcomms.forward, env.xp, env.dtype, row=row,
                                 key="qcomms.forward")
        self.backward_wire = Wire(self.qcomms.backward, env.xp, env.dtype,
                                  scale=self.qcomms.backward_loss_scale, key="qcomms.backward")
        #: the codec of the gradient AllReduce of data-parallel tables
        self.dense_wire = Wire(self.qcomms.dense, env.xp, env.dtype,
                               scale=self.qcomms.dense_loss_scale, key="qcomms.dense")
        feats, col = [], 0
        for t, p in zip(self.tables, self.plans):
            check_pooling(t.name, t.pooling, p.sharding)
            for f in t.features:
                feats.append(FeatureSpec(f, t.name, t.dim, t.pooling, col))
                col += t.dim
        self.features: tuple[FeatureSpec, ...] = tuple(feats)
        self.out_dim = col

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    def send(self, direction: str, op: str, buf, *args, **kwargs):
        """``collectives.<op>(buf, ...)``, counting ``buf``'s bytes as sent in
        ``direction`` (``"forward"``: pooled rows, ``"backward"``: their gradients,
        ``"dense"``: the gradients of data-parallel tables)."""
        self.env.sent[direction] += int(buf.nbytes)
        return getattr(collectives_api(self.env), op)(buf, *args, **kwargs)

    @abc.abstractmethod
    def input_dist(self, kjt: KeyedJagged) -> Pending:
        """Start sending the ids of ``kjt`` (this strategy's features) to their shards."""

    @abc.abstractmethod
    def forward(self, batch) -> Pending:
        """Lookup + output dist of a distributed batch; ``wait()`` → ``(pooled, ctx)``."""

    @abc.abstractmethod
    def backward(self, ctx, grad) -> Pending:
        """Reverse output dist + fused backward/optimizer; ``wait()`` → None."""

    @abc.abstractmethod
    def local_shards(self) -> list[LocalShard]:
        """The shards this rank holds."""

    def bags_of(self, batch) -> Bags | None:
        """The bags this rank's shards will look up for a distributed ``batch`` (None: no
        lookup of bags, e.g. with deduplication the owners gather rows instead)."""
        if isinstance(batch, Bags):
            return batch
        if isinstance(batch, tuple) and batch and isinstance(batch[0], Bags):
            return batch[0]
        return None


# -- jagged packing ------------------------------------------------------------
def pack_jagged(parts: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]]
                ) -> tuple[np.ndarray, np.ndarray]:
    """One int64 send buffer for an AlltoAll(v) of jagged ids, and its counts.

    ``parts[r]`` lists ``(lengths, values)`` per slot for destination ``r``;
    its block is ``[lengths of every slot..., values of every slot...]``.
    """
    pieces, counts = [], np.zeros(len(parts), np.int64)
    for r, slots in enumerate(parts):
        for ln, _ in slots:
            pieces.append(ln)
        for _, v in slots:
            pieces.append(v)
        counts[r] = sum(len(ln) + len(v) for ln, v in slots)
    buf = np.concatenate(pieces).astype(np.int64, copy=False) if pieces else np.zeros(0, np.int64)
    return buf, counts


def unpack_jagged(recv: np.ndarray, counts: np.ndarray, head: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_jagged` on the receiving side.

    Block ``g`` of ``recv`` (``counts[g]`` elements) starts with ``head[g]``
    lengths. Returns ``(lengths, values)``, each the concatenation over
    blocks in source order.
    """
    ends = np.cumsum(np.asarray(counts, np.int64)).tolist()
    starts = [0, *ends[:-1]]
    mids = [s + int(h) for s, h in zip(starts, head)]

    def joined(spans):   # one copy of a few slices (one block per source rank)
        pieces = [recv[a:b] for a, b in spans]
        return np.concatenate(pieces) if pieces else recv[:0].copy()
    return joined(zip(starts, mids)), joined(zip(mids, ends))


def displacements(counts) -> np.ndarray:
    """Exclusive prefix sums of ``counts``."""
    counts = np.asarray(counts, np.int64)
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out
