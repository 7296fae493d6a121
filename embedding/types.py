"""Vocabulary of the embedding layer: tables, optimizers, sharding plans, the batch error.

Plans are plain data (frozen dataclasses) with JSON round-trips, so a plan
written by ``neocomm plan`` can be read by ``neocomm train`` and stored in a
checkpoint manifest.
"""
from __future__ import annotations

import enum
import functools
import json
from dataclasses import asdict, dataclass, field

import numpy as np

from embedding.errors import BatchError  # re-exported: the vocabulary names it
from embedding.precision import Rounding, compute_dtype, storage_dtype
from neocomm.types import is_half
from topology.numbers import positive_arg  # re-exported: the planner's and tables' check

__all__ = ["Rounding", "Pooling", "OptimizerKind", "OptimizerConfig", "TableConfig",
           "ShardingType", "Shard", "Tier", "CachePolicy", "Eviction", "TableMemory", "TablePlan",
           "ShardingPlan", "PackMember", "PackedTable", "IdPolicy", "BatchError", "enum_arg",
           "positive_arg",
           "check_pooling", "cyclic_shards", "check_dynamic"]


def enum_arg(cls: type[enum.Enum], value, name: str):
    """``value`` as a member of ``cls`` (a member or its value); ValueError naming the
    argument ``name``, the accepted values and the value as given otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}: expected one of {[m.value for m in cls]}, "
                         f"got {value!r:.80}") from None



class Pooling(enum.Enum):
    """How the rows of one bag are combined."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"      # per column; the gradient goes to the first row holding the maximum


class OptimizerKind(enum.Enum):
    """Sparse optimizers of the fused backward."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of a sparse optimizer (learning rate is per step, unitless)."""

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self):
        if not isinstance(self.kind, OptimizerKind):
            object.__setattr__(self, "kind", enum_arg(OptimizerKind, self.kind, "kind"))
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")


class Eviction(enum.Enum):
    """Which entry a full dynamic table drops for a new id.

    ``COUNT``: the least used (fewest ids looked up since it was inserted);
    ``AGE``: the least recently used (oldest last lookup). Ties go to the
    smaller id.
    """

    COUNT = "count"
    AGE = "age"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: ``num_rows`` × ``dim`` of ``dtype``, read by ``features``.

    ``dtype`` is the storage dtype of the rows (:data:`embedding.precision.STORAGE_DTYPES`:
    float32, float16, bfloat16, float64). A half table is computed in float32 and
    ``rounding`` says how an update's float32 row goes back into storage
    (:class:`~embedding.precision.Rounding`: ``nearest``, ``stochastic`` with the
    random bits of ``rounding_seed``, or ``master``: a float32 master copy).
    ``state_dtype`` is the dtype of the optimizer's float state (None: the compute
    dtype, float32 for a half table).

    A fixed table (``dynamic=False``) reads ids in ``[0, num_rows)`` as rows.
    A dynamic table (``dynamic=True``) reads any int64 id except the two
    reserved markers (:data:`embedding.kernels.idmap.RESERVED`): each new id
    gets a row of its own through a hash map, and ``num_rows`` is the
    table's capacity in rows (in total, over all its shards); when the rows
    are all taken, a new id evicts an entry chosen by ``eviction``.
    """

    name: str
    num_rows: int
    dim: int
    pooling: Pooling = Pooling.SUM
    features: tuple[str, ...] = ()
    dtype: str = "float32"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dynamic: bool = False
    eviction: Eviction = Eviction.COUNT
    rounding: Rounding = Rounding.NEAREST
    rounding_seed: int = 0
    state_dtype: str | None = None

    def __post_init__(self):
        if not self.name:
            raise ValueError(f"name: a table needs a non-empty name, got {self.name!r}")
        self._check_precision()
        if int(self.num_rows) <= 0:
            if self.dynamic:
                raise ValueError(f"num_rows of dynamic table {self.name!r}: expected a "
                                 f"capacity >= 1 rows, got {self.num_rows}")
            raise ValueError(f"num_rows of table {self.name!r}: expected > 0, got {self.num_rows}")
        if not isinstance(self.dynamic, (bool, np.bool_)):
            raise TypeError(f"dynamic of table {self.name!r}: expected a bool, got "
                            f"{self.dynamic!r}")
        if not isinstance(self.eviction, Eviction):
            object.__setattr__(self, "eviction", enum_arg(Eviction, self.eviction,
                                                          f"eviction of table {self.name!r}"))
        if int(self.dim) <= 0:
            raise ValueError(f"dim of table {self.name!r}: expected > 0, got {self.dim}")
        if not isinstance(self.pooling, Pooling):
            object.__setattr__(self, "pooling", enum_arg(Pooling, self.pooling,
                                                         f"pooling of table {self.name!r}"))
        if not self.features:
            object.__setattr__(self, "features", (self.name,))
        else:
            object.__setattr__(self, "features", tuple(self.features))
        if isinstance(self.optimizer, dict):
            object.__setattr__(self, "optimizer", OptimizerConfig(**self.optimizer))

    def _check_precision(self) -> None:
        """Validate (and normalise) ``dtype``, ``rounding``, ``rounding_seed``, ``state_dtype``."""
        where = f"of table {self.name!r}"
        dt = storage_dtype(self.dtype, f"dtype {where}")
        object.__setattr__(self, "dtype", dt.name)
        if not isinstance(self.rounding, Rounding):
            object.__setattr__(self, "rounding", enum_arg(Rounding, self.rounding,
                                                          f"rounding {where}"))
        if self.rounding is not Rounding.NEAREST and not is_half(dt):
            raise ValueError(f"rounding {where}: {self.rounding.value!r} rounding applies to "
                             f"float16 and bfloat16 storage; dtype {dt.name} rounds to nearest")
        seed = self.rounding_seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"rounding_seed {where}: expected an int >= 0, got {seed!r}")
        if self.state_dtype is not None:
            sdt = storage_dtype(self.state_dtype, f"state_dtype {where}")
            object.__setattr__(self, "state_dtype", sdt.name)

    @functools.cached_property
    def optimizer_state_dtype(self) -> str:
        """The dtype of the optimizer's float state: ``state_dtype``, or the compute dtype
        (worked out once: a table config is immutable)."""
        return self.state_dtype or compute_dtype(storage_dtype(self.dtype)).name

    @property
    def bytes_per_element(self) -> int:
        return storage_dtype(self.dtype).itemsize

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights alone (no optimizer state)."""
        return self.num_rows * self.dim * self.bytes_per_element

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pooling"] = self.pooling.value
        d["features"] = list(self.features)
        d["optimizer"]["kind"] = self.optimizer.kind.value
        d["rounding"] = self.rounding.value
        for key, default in (("rounding", "nearest"), ("rounding_seed", 0),
                             ("state_dtype", None)):
            if d[key] == default:  # a full-precision table reads as it did before half tables
                del d[key]
        if self.dynamic:
            d["eviction"] = self.eviction.value
        else:  # a fixed table reads as it did before dynamic tables existed
            del d["dynamic"], d["eviction"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TableConfig":
        d = dict(d)
        opt = dict(d.pop("optimizer", {}) or {})
        return cls(optimizer=OptimizerConfig(**opt), **d)


class ShardingType(enum.Enum):
    """How one table is split across ranks."""

    TABLE_WISE = "table_wise"            # whole table on one rank
    ROW_WISE = "row_wise"                # row blocks on every rank of the group
    COLUMN_WISE = "column_wise"          # column slices, each on one rank
    DATA_PARALLEL = "data_parallel"      # replicated on every rank
    TABLE_ROW_WISE = "table_row_wise"    # one node, row-wise within the node
    TABLE_COLUMN_WISE = "table_column_wise"  # column slices on the ranks of one node
    CYCLIC_ROW_WISE = "cyclic_row_wise"  # row r on rank r mod N of the group, local row r // N


#: Shardings that split a bag's ids across ranks and add the ranks' partial pools: they
#: pool by sum or mean only (a maximum would need every rank's partial maximum and its
#: position in the bag for the gradient).
_PARTIAL_POOLS = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE,
                  ShardingType.CYCLIC_ROW_WISE)


def check_pooling(table: str, pooling: Pooling, sharding: ShardingType) -> None:
    """ValueError, naming the table, when ``sharding`` cannot pool by ``pooling``."""
    if pooling is Pooling.MAX and sharding in _PARTIAL_POOLS:
        ok = [s.value for s in ShardingType if s not in _PARTIAL_POOLS]
        raise ValueError(f"sharding of table {table!r}: {sharding.value} adds partial pools "
                         f"across ranks and cannot pool by max; a max-pooled table is sharded "
                         f"{', '.join(ok)}")


@dataclass(frozen=True)
class Shard:
    """Rows ``row_offset + i * row_stride`` (``i < num_rows``) × columns ``[col_offset,
    col_offset + num_cols)`` of a table, held on ``rank``.

    Local row ``i`` of the shard is table row ``row_offset + i * row_stride``. A
    contiguous shard has ``row_stride`` 1 (rows ``[row_offset, row_offset + num_rows)``);
    only cyclic row-wise shards are strided (:func:`cyclic_shards`).
    """

    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    row_stride: int = 1

    def __post_init__(self):
        st = self.row_stride
        if isinstance(st, bool) or not isinstance(st, (int, np.integer)) or st < 1:
            raise ValueError(f"row_stride: expected an int >= 1, got {st!r}")

    @property
    def row_slice(self) -> slice:
        """The shard's rows as a slice of the table's row axis (a step for a strided shard)."""
        return slice(self.row_offset, self.row_offset + self.num_rows * self.row_stride,
                     self.row_stride)

    @property
    def col_slice(self) -> slice:
        """The shard's columns as a slice of the table's column axis."""
        return slice(self.col_offset, self.col_offset + self.num_cols)

    def rows(self) -> np.ndarray:
        """The table rows of the shard's local rows, in local order (int64)."""
        return self.row_offset + np.arange(self.num_rows, dtype=np.int64) * self.row_stride


def cyclic_shards(num_rows: int, dim: int, size: int) -> tuple[Shard, ...]:
    """The shards of a cyclic row-wise table of ``num_rows`` × ``dim`` on ``size`` ranks.

    Rank ``k`` holds rows ``k, k + size, k + 2 * size …``: ``Shard(k, row_offset=k,
    num_rows=ceil((num_rows - k) / size), col_offset=0, num_cols=dim, row_stride=size)``
    (no rows when ``k >= num_rows``).

    >>> [s.num_rows for s in cyclic_shards(10, 4, 4)]
    [3, 3, 2, 2]
    """
    n, size = int(num_rows), int(size)
    if size < 1:
        raise ValueError(f"size: expected a group of >= 1 ranks, got {size}")
    return tuple(Shard(k, k, max(0, -(-(n - k) // size)), 0, int(dim), size)
                 for k in range(size))


class Tier(enum.Enum):
    """Where a table's rows live.

    ``DEVICE``: in the memory of the rank's array backend (GPU memory with
    ``device="cuda"``). ``HOST``: in host memory; each step's rows are copied
    to the device, updated there and written back. ``CACHED``: in host memory
    with a device cache of ``cache_rows`` rows per shard in front.
    """

    DEVICE = "device"
    HOST = "host"
    CACHED = "cached"


class CachePolicy(enum.Enum):
    """Which cached row a miss evicts: least recently used, or least frequently used."""

    LRU = "lru"
    LFU = "lfu"


@dataclass(frozen=True)
class TableMemory:
    """The memory tier of one table's shards and, for ``CACHED``, their device cache.

    ``cache_rows``: rows of the device cache of each shard (``CACHED`` only;
    a shard with fewer rows caches them all). ``policy``: eviction order.
    ``admit_after``: a missed row enters the cache on its ``admit_after``-th
    access (1: at once); until then it is staged for its step only.
    """

    tier: Tier = Tier.DEVICE
    cache_rows: int = 0
    policy: CachePolicy = CachePolicy.LRU
    admit_after: int = 1

    def __post_init__(self):
        if not isinstance(self.tier, Tier):
            object.__setattr__(self, "tier", enum_arg(Tier, self.tier, "tier"))
        if not isinstance(self.policy, CachePolicy):
            object.__setattr__(self, "policy", enum_arg(CachePolicy, self.policy, "policy"))

    @property
    def tiered(self) -> bool:
        """Rows live in host memory (``HOST`` or ``CACHED``)."""
        return self.tier is not Tier.DEVICE

    def check(self, table: str, num_rows: int | None = None) -> None:
        """ValueError naming ``table`` and the setting when the settings do not fit together."""
        rows = self.cache_rows
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 0:
            raise ValueError(f"cache_rows of table {table!r}: expected a row count >= 0, got "
                             f"{rows!r}")
        if self.tier is Tier.CACHED and rows < 1:
            raise ValueError(f"cache_rows of table {table!r}: a cached table needs a cache of "
                             f"at least 1 row, got {rows}")
        if self.tier is not Tier.CACHED and rows:
            raise ValueError(f"cache_rows of table {table!r}: only a cached table has a cache; "
                             f"tier {self.tier.value!r} got cache_rows={rows}")
        if num_rows is not None and rows > num_rows:
            raise ValueError(f"cache_rows of table {table!r}: the cache ({rows} rows) is larger "
                             f"than the table ({num_rows} rows)")
        a = self.admit_after
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or a < 1:
            raise ValueError(f"admit_after of table {table!r}: expected an access count >= 1, "
                             f"got {a!r}")


@dataclass(frozen=True)
class TablePlan:
    """Where the shards of one table live, and in which memory tier."""

    table: str
    sharding: ShardingType
    shards: tuple[Shard, ...]
    memory: TableMemory = TableMemory()

    def __post_init__(self):
        if not isinstance(self.sharding, ShardingType):
            object.__setattr__(self, "sharding", enum_arg(ShardingType, self.sharding,
                                                          f"sharding of table {self.table!r}"))
        object.__setattr__(self, "shards", tuple(
            s if isinstance(s, Shard) else Shard(**s) for s in self.shards))
        if self.sharding is not ShardingType.CYCLIC_ROW_WISE:
            for s in self.shards:
                if s.row_stride != 1:
                    raise ValueError(f"row_stride of a shard of table {self.table!r}: only "
                                     f"{ShardingType.CYCLIC_ROW_WISE.value} shards are "
                                     f"strided, got row_stride={s.row_stride} on rank "
                                     f"{s.rank} ({self.sharding.value})")
        if isinstance(self.memory, dict):
            try:
                object.__setattr__(self, "memory", TableMemory(**self.memory))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"memory of table {self.table!r}: {exc}") from None
        if not isinstance(self.memory, TableMemory):
            raise TypeError(f"memory of table {self.table!r}: expected a TableMemory, got "
                            f"{type(self.memory).__name__}")
        self.memory.check(self.table)
        if self.memory.tiered and self.sharding is ShardingType.DATA_PARALLEL:
            raise ValueError(f"tier of table {self.table!r}: a data-parallel table is "
                             f"replicated in device memory on every rank; tier "
                             f"{self.memory.tier.value!r} needs a table-, row- or column-wise "
                             f"sharding")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({s.rank for s in self.shards}))


@dataclass(frozen=True)
class PackMember:
    """One table of a packed table: its rows are rows ``[row_offset, row_offset + num_rows)``
    of the packed table (an id ``i`` of the member reads packed row ``row_offset + i``)."""

    table: str
    row_offset: int
    num_rows: int


@dataclass(frozen=True)
class PackedTable:
    """Tables of one dim, dtype, optimizer and pooling stored as one physical table ``name``.

    ``members`` lie end to end in order: member ``k`` starts at the sum of the rows of
    the members before it. The plan places the packed table like any other (one
    :class:`TablePlan` named ``name``); each member's features keep their own pooled
    output columns.
    """

    name: str
    members: tuple[PackMember, ...]

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name of a packed table: expected a non-empty name, got "
                             f"{self.name!r}")
        object.__setattr__(self, "members", tuple(
            m if isinstance(m, PackMember) else PackMember(**m) for m in self.members))
        if not self.members:
            raise ValueError(f"members of packed table {self.name!r}: expected at least one "
                             f"table, got none")
        seen, offset = set(), 0
        for m in self.members:
            if m.table in seen:
                raise ValueError(f"members of packed table {self.name!r}: table {m.table!r} "
                                 f"is listed twice")
            seen.add(m.table)
            if isinstance(m.num_rows, bool) or int(m.num_rows) < 1:
                raise ValueError(f"num_rows of member {m.table!r} of packed table "
                                 f"{self.name!r}: expected >= 1, got {m.num_rows!r}")
            if m.row_offset != offset:
                raise ValueError(f"row_offset of member {m.table!r} of packed table "
                                 f"{self.name!r}: expected {offset} (the rows of the members "
                                 f"before it), got {m.row_offset!r}")
            offset += int(m.num_rows)

    @property
    def num_rows(self) -> int:
        """Rows of the packed table: the members' rows together."""
        return sum(m.num_rows for m in self.members)

    @property
    def tables(self) -> tuple[str, ...]:
        return tuple(m.table for m in self.members)

    def member(self, table: str) -> PackMember:
        for m in self.members:
            if m.table == table:
                return m
        raise KeyError(f"table {table!r} is not a member of packed table {self.name!r}")

    def parts(self, shard: Shard) -> list[tuple[PackMember, slice, Shard]]:
        """How a shard of the packed table splits over the members: ``(member, local rows,
        member shard)`` for each member it holds rows of, where ``local rows`` (a slice of
        the shard's local rows) are the member shard's rows, the same columns and stride.

        >>> p = PackedTable("p", (PackMember("a", 0, 3), PackMember("b", 3, 4)))
        >>> [(m.table, sl, s.row_offset, s.num_rows) for m, sl, s in p.parts(
        ...     Shard(0, 2, 3, 0, 8))]
        [('a', slice(0, 1, None), 2, 1), ('b', slice(1, 3, None), 0, 2)]
        """
        out = []
        r0, st, n = shard.row_offset, shard.row_stride, shard.num_rows
        for m in self.members:
            lo, hi = m.row_offset, m.row_offset + m.num_rows
            i0 = max(0, -(-(lo - r0) // st))
            i1 = min(n, max(0, -(-(hi - r0) // st)))
            if i1 > i0:
                out.append((m, slice(i0, i1), Shard(shard.rank, r0 + i0 * st - lo, i1 - i0,
                                                    shard.col_offset, shard.num_cols, st)))
        return out


@dataclass(frozen=True)
class ShardingPlan:
    """A sharding of every table onto ``world_size`` ranks in nodes of ``ranks_per_node``.

    ``tables`` has one entry per physical table: a table on its own, or a
    :class:`PackedTable` of ``packs`` (by its name) standing for its members.
    """

    world_size: int
    ranks_per_node: int
    tables: tuple[TablePlan, ...]
    packs: tuple[PackedTable, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tables", tuple(
            t if isinstance(t, TablePlan) else TablePlan(**t) for t in self.tables))
        object.__setattr__(self, "packs", tuple(
            p if isinstance(p, PackedTable) else PackedTable(**p) for p in self.packs))
        planned = {t.table for t in self.tables}
        seen: dict[str, str] = {}
        for p in self.packs:
            if p.name not in planned:
                raise ValueError(f"packs: packed table {p.name!r} has no entry in the plan's "
                                 f"tables")
            if p.name in seen.values():
                raise ValueError(f"packs: packed table {p.name!r} is listed twice")
            for m in p.members:
                if m.table in seen:
                    raise ValueError(f"packs: table {m.table!r} is a member of packed tables "
                                     f"{seen[m.table]!r} and {p.name!r}")
                if m.table in planned:
                    raise ValueError(f"packs: table {m.table!r} is a member of packed table "
                                     f"{p.name!r} and has a plan entry of its own")
                seen[m.table] = p.name

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.table == name:
                return t
        raise KeyError(f"table {name!r} is not in the plan")

    def pack_of(self, table: str) -> PackedTable | None:
        """The packed table ``table`` is a member of (None: it is not packed)."""
        for p in self.packs:
            if table in p.tables:
                return p
        return None

    def logical_tables(self) -> tuple[str, ...]:
        """The names of the model's tables the plan covers: packed ones by their members."""
        packs = {p.name: p for p in self.packs}
        return tuple(n for t in self.tables
                     for n in (packs[t.table].tables if t.table in packs else (t.table,)))

    def to_json(self) -> str:
        """The plan as JSON; a contiguous shard leaves out its ``row_stride`` (1), and a plan
        without packed tables its ``packs``, so such plans read as they did before."""
        def enc(o):
            if isinstance(o, enum.Enum):
                return o.value
            raise TypeError(type(o))

        d = asdict(self)
        for t in d["tables"]:
            for s in t["shards"]:
                if s["row_stride"] == 1:
                    del s["row_stride"]
        if not d["packs"]:
            del d["packs"]
        return json.dumps(d, default=enc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        d = json.loads(text)
        return cls(world_size=d["world_size"], ranks_per_node=d["ranks_per_node"],
                   tables=tuple(TablePlan(**t) for t in d["tables"]),
                   packs=tuple(PackedTable(**p) for p in d.get("packs") or ()))


#: Shardings a dynamic table may have: each id lives whole on one rank.
DYNAMIC_SHARDINGS = (ShardingType.TABLE_WISE, ShardingType.CYCLIC_ROW_WISE)


def check_dynamic(table: TableConfig, plan: TablePlan) -> None:
    """ValueError, naming the table and the value, when dynamic ``table`` cannot take ``plan``:
    a sharding other than table-wise or cyclic row-wise, or a host or cached memory tier."""
    if not table.dynamic:
        return
    if plan.sharding not in DYNAMIC_SHARDINGS:
        raise ValueError(f"sharding of table {table.name!r}: a dynamic table is sharded "
                         f"{' or '.join(s.value for s in DYNAMIC_SHARDINGS)}, got "
                         f"{plan.sharding.value!r}")
    if plan.memory.tiered:
        raise ValueError(f"tier of table {table.name!r}: a dynamic table lives in device "
                         f"memory (host and cached tiers are not supported with it yet), got "
                         f"{plan.memory.tier.value!r}")


class IdPolicy(enum.Enum):
    """What a table does with ids outside ``[0, num_rows)``.

    ``ERROR`` rejects them (the error names the feature and the id);
    ``MODULO`` maps id to ``id mod num_rows`` (floored, so negative ids land in
    range too); ``HASH`` maps id to ``splitmix64(id) mod num_rows`` — for raw
    64-bit categorical ids, where a plain modulo would alias neighbouring ids.
    The mapping is applied to every id, in range or not, so it is a pure
    function of the id.
    """

    ERROR = "error"
    MODULO = "modulo"
    HASH = "hash"
