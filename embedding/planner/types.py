"""Vocabulary of the sharding planner: workload, hardware, candidates, reports, errors.

Units: memory in bytes, times in seconds, bandwidths in bytes per second,
batch sizes in samples (the global batch of one training step).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from collectives.types import CollectiveOp, FabricModel
from embedding.types import ShardingPlan, ShardingType, enum_arg
from neocomm.errors import NeocommError

__all__ = ["PlacementKind", "PartitionMethod", "Workload", "TableConstraints", "Hardware",
           "MemoryEstimate", "ShardEstimate", "Candidate", "RankReport", "TableReport",
           "PlanReport", "PlanError", "PlanDoesNotFitError", "PlanMismatchError",
           "PartitionError", "STEP_PARTS", "sum_parts"]

#: The parts of a training step, in step order (the trainer's timed phases: see
#: :class:`embedding.train.types.Phase`).
STEP_PARTS = ("input_dist", "lookup", "output_dist", "dense", "sync", "emb_backward",
              "grad_sync", "optimizer")


def sum_parts(items) -> tuple[tuple[str, float], ...]:
    """``(part, seconds)`` pairs added up per part, in step order (:data:`STEP_PARTS`)."""
    out: dict[str, float] = {}
    for part, secs in items:
        out[part] = out.get(part, 0.0) + secs
    return tuple((p, out[p]) for p in STEP_PARTS if p in out)


class PlacementKind(enum.Enum):
    """Which ranks the shards of one candidate may take."""

    FREE = "free"              # each shard on any rank, shards of one table on distinct ranks
    EVERY_RANK = "every_rank"  # shard i on rank i of the world (row-wise, data-parallel)
    ONE_NODE = "one_node"      # all shards on distinct ranks of one node (hierarchical)


class PartitionMethod(enum.Enum):
    """How shards are assigned to ranks."""

    GREEDY = "greedy"                  # longest processing time first
    KARMARKAR_KARP = "karmarkar_karp"  # multi-way largest differencing

    @classmethod
    def parse(cls, value: "PartitionMethod | str") -> "PartitionMethod":
        """Accept a PartitionMethod, its value, or ``"kk"``; ValueError otherwise."""
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower().replace("-", "_")
        if key == "kk":
            return cls.KARMARKAR_KARP
        for method in cls:
            if key == method.value:
                return method
        raise ValueError(f"method: expected one of {[m.value for m in cls] + ['kk']}, "
                         f"got {value!r}")


def _positive(name: str, value, kind=(int, float)) -> None:
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What one training step asks of the tables.

    ``batch_size`` is the global batch (samples per step over all ranks);
    ``ids_per_sample`` the mean number of ids one sample looks up in a table
    (its pooling factor; 1 for one-hot features), overridden per table by
    :class:`TableConstraints`; ``id_bytes`` the width of one id on the wire
    and in the lookup buffers (8: int64).
    """

    batch_size: int = 65536
    ids_per_sample: float = 1.0
    id_bytes: int = 8

    def __post_init__(self):
        _positive("batch_size", self.batch_size, int)
        _positive("ids_per_sample", self.ids_per_sample)
        _positive("id_bytes", self.id_bytes, int)


@dataclass(frozen=True)
class TableConstraints:
    """Per-table planner inputs that are not part of :class:`~embedding.types.TableConfig`.

    ``ids_per_sample`` overrides the workload's pooling factor; ``shardings``
    limits the candidates to these types (empty: any); ``column_slices``
    fixes the number of column slices of column-wise candidates (0: any that
    divides the dimension).
    """

    ids_per_sample: float | None = None
    shardings: tuple[ShardingType, ...] = ()
    column_slices: int = 0

    def __post_init__(self):
        if self.ids_per_sample is not None:
            _positive("ids_per_sample", self.ids_per_sample)
        object.__setattr__(self, "shardings",
                           tuple(enum_arg(ShardingType, s, f"shardings[{i}]")
                                 for i, s in enumerate(self.shardings)))
        if isinstance(self.column_slices, bool) or not isinstance(self.column_slices, int) \
                or self.column_slices < 0:
            raise ValueError(f"column_slices: expected an int >= 0, got {self.column_slices!r}")


@dataclass(frozen=True)
class Hardware:
    """The machines a plan is for.

    ``world_size`` ranks in nodes of ``ranks_per_node``, one device per rank
    with ``device_memory`` bytes of which the fraction ``reserve`` is kept for
    the dense model, activations and the runtime. ``fabric`` prices the
    collectives (:func:`collectives.cost.estimate`); its shape is replaced by
    this hardware's shape. ``memory_bandwidth`` (bytes/s, reads plus writes)
    is the device memory throughput: lookups stream at it, and when it is
    given (> 0) the fabric's local copy and reduction throughputs become half
    and a third of it (a copy reads and writes each byte, a reduction reads
    two arrays and writes one); 0 keeps the fabric's figures and streams
    lookups at twice its copy throughput. ``min_column_dim`` is the narrowest
    column slice the planner proposes (elements).
    """

    world_size: int
    ranks_per_node: int
    device_memory: int
    fabric: FabricModel = field(default_factory=FabricModel)
    reserve: float = 0.0
    min_column_dim: int = 32
    memory_bandwidth: float = 0.0

    def __post_init__(self):
        for name in ("world_size", "ranks_per_node", "device_memory", "min_column_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node: expected a divisor of world_size "
                             f"{self.world_size}, got {self.ranks_per_node}")
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"reserve: expected a fraction in [0, 1), got {self.reserve!r}")
        if not self.memory_bandwidth >= 0:
            raise ValueError(f"memory_bandwidth: expected bytes/s >= 0, "
                             f"got {self.memory_bandwidth!r}")
        fabric = self.fabric.with_shape(self.ranks_per_node, self.num_nodes)
        if self.memory_bandwidth:
            fabric = replace(fabric, copy_bandwidth=self.memory_bandwidth / 2.0,
                             reduce_bandwidth=self.memory_bandwidth / 3.0)
        object.__setattr__(self, "fabric", fabric)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def usable_memory(self) -> int:
        """Bytes per device the embedding shards may take."""
        return int(self.device_memory * (1.0 - self.reserve))

    @property
    def lookup_rate(self) -> float:
        """Bytes/s of device memory traffic lookups stream at."""
        return self.memory_bandwidth or 2.0 * self.fabric.copy_bandwidth

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one shard (or one rank) holds: weights, optimizer state, lookup buffers."""

    weights: int = 0
    optimizer: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.buffers

    def __add__(self, other: "MemoryEstimate") -> "MemoryEstimate":
        return MemoryEstimate(self.weights + other.weights, self.optimizer + other.optimizer,
                              self.buffers + other.buffers)


@dataclass(frozen=True)
class ShardEstimate:
    """One shard of a candidate before placement: its block, memory and per-step time.

    ``lookup_seconds`` is the embedding lookup and fused update on the rank
    holding the shard, ``comm_seconds`` that rank's share of the collectives
    the shard causes (input ids, pooled outputs and their gradients, dense
    gradient all-reduce). ``parts`` splits the same time by the training step's
    parts (:data:`STEP_PARTS`): ``input_dist`` (ids), ``lookup`` (the forward
    read), ``output_dist`` (pooled rows), ``emb_backward`` (their gradients and the
    fused update), ``grad_sync`` (a data-parallel table's gradient AllReduce).
    ``row_stride``: the step between the shard's rows (1 but for cyclic row-wise,
    as in :class:`~embedding.types.Shard`).
    """

    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    memory: MemoryEstimate
    lookup_seconds: float = 0.0
    comm_seconds: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()
    row_stride: int = 1

    @property
    def seconds(self) -> float:
        return self.lookup_seconds + self.comm_seconds


@dataclass(frozen=True)
class Candidate:
    """One way to shard one table: its type, the shards and where they may go.

    ``spread_seconds`` and ``spread_memory`` are paid by every rank whatever
    the placement (each rank sends its own samples' ids and receives its own
    samples' pooled rows). ``collectives`` lists the ``(op, scope)`` pairs the
    candidate's traffic travels in, so their latency is paid once per step.
    """

    table: str
    sharding: ShardingType
    placement: PlacementKind
    shards: tuple[ShardEstimate, ...]
    spread_seconds: float = 0.0
    spread_memory: int = 0
    collectives: tuple[tuple[CollectiveOp, str], ...] = ()
    spread_parts: tuple[tuple[str, float], ...] = ()

    @property
    def seconds(self) -> float:
        """Time of all shards added up (the load this candidate puts on the job)."""
        return sum(s.seconds for s in self.shards)

    @property
    def max_shard_memory(self) -> int:
        return max(s.memory.total for s in self.shards)

    @property
    def max_shard_seconds(self) -> float:
        return max(s.seconds for s in self.shards)

    @property
    def column_slices(self) -> int:
        return len({s.col_offset for s in self.shards})

    def describe(self) -> str:
        """``"column_wise x4"``-style label."""
        k = self.column_slices
        return self.sharding.value + (f" x{k}" if k > 1 else "")


@dataclass(frozen=True)
class RankReport:
    """Estimated load of one rank under a plan; ``parts`` the bandwidth and lookup time of
    each training-step part (:data:`STEP_PARTS`; collective latencies not included);
    ``lookup_seconds`` the part of them that is the rank's own lookups and fused updates
    (the rest moves bytes between ranks)."""

    rank: int
    memory: MemoryEstimate
    seconds: float
    shards: int
    parts: tuple[tuple[str, float], ...] = ()
    lookup_seconds: float = 0.0


@dataclass(frozen=True)
class TableReport:
    """One table's chosen sharding and what it costs."""

    table: str
    sharding: ShardingType
    label: str
    ranks: tuple[int, ...]
    memory: int
    seconds: float


@dataclass(frozen=True)
class PlanReport:
    """A plan with its per-rank estimates.

    ``imbalance`` is max over mean of the per-rank estimated time,
    ``memory_imbalance`` the same for memory; ``step_seconds`` the largest
    per-rank time (the step waits for the slowest rank). ``alternatives``
    maps each partition method tried to its step time (None: did not fit).
    """

    plan: ShardingPlan
    method: PartitionMethod | None
    ranks: tuple[RankReport, ...]
    tables: tuple[TableReport, ...]
    usable_memory: int
    alternatives: tuple[tuple[str, float | None], ...] = ()

    @property
    def step_seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    @property
    def imbalance(self) -> float:
        mean = sum(r.seconds for r in self.ranks) / len(self.ranks)
        return self.step_seconds / mean if mean > 0 else 1.0

    @property
    def memory_imbalance(self) -> float:
        totals = [r.memory.total for r in self.ranks]
        mean = sum(totals) / len(totals)
        return max(totals) / mean if mean > 0 else 1.0

    @property
    def max_memory(self) -> int:
        return max(r.memory.total for r in self.ranks)


class PlanError(NeocommError, ValueError):
    """The planner was given something it cannot plan."""


class PlanDoesNotFitError(PlanError):
    """No placement fits the devices' memory.

    ``table`` names the table that could not be placed, ``needed`` the bytes
    its smallest shard needs on one rank, ``available`` the most free bytes
    any eligible rank had, ``short`` the difference.
    """

    def __init__(self, message: str, *, table: str = "", needed: int = 0,
                 available: int = 0):
        super().__init__(message)
        self.table = table
        self.needed = int(needed)
        self.available = int(available)

    @property
    def short(self) -> int:
        return max(0, self.needed - self.available)


class PlanMismatchError(PlanError):
    """A plan does not match the world (or tables) it is loaded into; ``field`` names what."""

    def __init__(self, message: str, *, field: str = "", expected=None, got=None):
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.got = got


class PartitionError(ValueError):
    """An item fits in no bin: ``item`` is its index, ``needed`` its size and
    ``available`` the most room any allowed bin had."""

    def __init__(self, message: str, *, item: int = -1, needed: float = 0.0,
                 available: float = 0.0):
        super().__init__(message)
        self.item = item
        self.needed = needed
        self.available = available

    def __reduce__(self):
        return (_rebuild_partition_error, (self.args[0], self.item, self.needed, self.available))


def _rebuild_partition_error(message, item, needed, available):
    return PartitionError(message, item=item, needed=needed, available=available)
