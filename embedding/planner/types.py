"""Vocabulary of the sharding planner: workload, hardware, candidates, reports, errors.

Units: memory in bytes, times in seconds, bandwidths in bytes per second,
batch sizes in samples (the global batch of one training step).
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, replace

from collectives.types import CollectiveOp, FabricModel
from embedding.types import ShardingPlan, ShardingType, TableMemory, enum_arg, positive_arg
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


@dataclass(frozen=True)
class Workload:
    """What one training step asks of the tables.

    ``batch_size`` is the global batch (samples per step over all ranks);
    ``ids_per_sample`` the mean number of ids one sample looks up in a table
    (its pooling factor; 1 for one-hot features), overridden per table by
    :class:`TableConstraints`; ``id_bytes`` the width of one id on the wire
    and in the lookup buffers (8: int64). ``zipf_exponent`` is the exponent
    ``s`` of the Zipf law the ids of a table are assumed to follow when its
    constraints give no access statistics (the hit rate of a device cache in
    front of host-resident rows, see :mod:`~embedding.planner.tiers`).
    """

    batch_size: int = 65536
    ids_per_sample: float = 1.0
    id_bytes: int = 8
    zipf_exponent: float = 1.05

    def __post_init__(self):
        positive_arg("batch_size", self.batch_size, int)
        positive_arg("ids_per_sample", self.ids_per_sample)
        positive_arg("id_bytes", self.id_bytes, int)
        positive_arg("zipf_exponent", self.zipf_exponent)


@dataclass(frozen=True)
class TableConstraints:
    """Per-table planner inputs that are not part of :class:`~embedding.types.TableConfig`.

    ``ids_per_sample`` overrides the workload's pooling factor; ``shardings``
    limits the candidates to these types (empty: any); ``column_slices``
    fixes the number of column slices of column-wise candidates (0: any that
    divides the dimension). The access statistics of the table's ids, for the
    hit rate of a device cache in front of its host-resident rows:
    ``hit_rate`` (a measured fraction in [0, 1], used for any cache size, e.g.
    the trainer's cache record) or ``zipf_exponent`` (the ids follow Zipf(s)
    over the rows); neither: the workload's assumed exponent.
    """

    ids_per_sample: float | None = None
    shardings: tuple[ShardingType, ...] = ()
    column_slices: int = 0
    zipf_exponent: float | None = None
    hit_rate: float | None = None

    def __post_init__(self):
        if self.ids_per_sample is not None:
            positive_arg("ids_per_sample", self.ids_per_sample)
        if self.zipf_exponent is not None:
            positive_arg("zipf_exponent", self.zipf_exponent)
        if self.hit_rate is not None:
            h = self.hit_rate
            if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h <= 1.0:
                raise ValueError(f"hit_rate: expected a fraction in [0, 1], got {h!r}")
            if self.zipf_exponent is not None:
                raise ValueError(f"hit_rate: give hit_rate or zipf_exponent, not both (got "
                                 f"{h!r} and {self.zipf_exponent!r})")
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

    ``host_memory`` is the bytes of host memory per node that host-resident
    tables (tiers ``host`` and ``cached``, :class:`~embedding.types.Tier`) may
    take; 0: no host tier, every table stays in device memory.
    ``host_bandwidth`` is the host-to-device (and back) copy throughput of one
    rank, bytes/s, that cache misses and write-backs move at; 0: the fabric's
    copy throughput (:func:`~embedding.planner.hardware.hardware_for` gives
    the target's figure: PCIe for GPUs).
    """

    world_size: int
    ranks_per_node: int
    device_memory: int
    fabric: FabricModel = field(default_factory=FabricModel)
    reserve: float = 0.0
    min_column_dim: int = 32
    memory_bandwidth: float = 0.0
    host_memory: int = 0
    host_bandwidth: float = 0.0

    def __post_init__(self):
        for name in ("world_size", "ranks_per_node", "device_memory", "min_column_dim"):
            positive_arg(name, getattr(self, name), int)
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node: expected a divisor of world_size "
                             f"{self.world_size}, got {self.ranks_per_node}")
        if not 0.0 <= self.reserve < 1.0:
            raise ValueError(f"reserve: expected a fraction in [0, 1), got {self.reserve!r}")
        if not self.memory_bandwidth >= 0:
            raise ValueError(f"memory_bandwidth: expected bytes/s >= 0, "
                             f"got {self.memory_bandwidth!r}")
        if isinstance(self.host_memory, bool) or not isinstance(self.host_memory, int) \
                or self.host_memory < 0:
            raise ValueError(f"host_memory: expected bytes per node >= 0 (0: no host tier), "
                             f"got {self.host_memory!r}")
        if not self.host_bandwidth >= 0:
            raise ValueError(f"host_bandwidth: expected bytes/s >= 0, "
                             f"got {self.host_bandwidth!r}")
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
    def host_rate(self) -> float:
        """Bytes/s one rank copies between host and device memory at (each way)."""
        return self.host_bandwidth or self.fabric.copy_bandwidth

    @property
    def lookup_rate(self) -> float:
        """Bytes/s of device memory traffic lookups stream at."""
        return self.memory_bandwidth or 2.0 * self.fabric.copy_bandwidth

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one shard (or one rank) holds: in device memory its weights, optimizer state
    and lookup buffers (``total``); in host memory ``host`` (the rows and state of a
    host-resident shard, whose ``weights`` and ``optimizer`` are then its device cache)."""

    weights: int = 0
    optimizer: int = 0
    buffers: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        """Bytes of device memory."""
        return self.weights + self.optimizer + self.buffers

    def __add__(self, other: "MemoryEstimate") -> "MemoryEstimate":
        return MemoryEstimate(self.weights + other.weights, self.optimizer + other.optimizer,
                              self.buffers + other.buffers, self.host + other.host)


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
    ``host_seconds`` is the host-to-device copy of the rows a host-resident
    shard misses and the write-back of as many (in ``lookup`` and
    ``emb_backward``).
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
    host_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.lookup_seconds + self.comm_seconds + self.host_seconds


@dataclass(frozen=True)
class Candidate:
    """One way to shard one table: its type, the shards and where they may go.

    ``spread_seconds`` and ``spread_memory`` are paid by every rank whatever
    the placement (each rank sends its own samples' ids and receives its own
    samples' pooled rows). ``collectives`` lists the ``(op, scope)`` pairs the
    candidate's traffic travels in, so their latency is paid once per step.
    ``memory`` is the tier of its shards (and their device cache); ``hit_rate``
    the fraction of a cached shard's lookups its cache serves (0 for ``host``,
    1 in device memory), ``hit_source`` where that figure comes from; ``device``
    the candidate in device memory a tiered one is a variant of (None: this is one).
    The totals over its shards are worked out once (the search asks for them again and
    again): a candidate is immutable.
    """

    table: str
    sharding: ShardingType
    placement: PlacementKind
    shards: tuple[ShardEstimate, ...]
    spread_seconds: float = 0.0
    spread_memory: int = 0
    collectives: tuple[tuple[CollectiveOp, str], ...] = ()
    spread_parts: tuple[tuple[str, float], ...] = ()
    memory: TableMemory = TableMemory()
    hit_rate: float = 1.0
    hit_source: str = ""
    device: "Candidate | None" = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def seconds(self) -> float:
        """Time of all shards added up (the load this candidate puts on the job)."""
        return sum(s.seconds for s in self.shards)

    @functools.cached_property
    def max_shard_memory(self) -> int:
        """Device bytes of the largest shard."""
        return max(s.memory.total for s in self.shards)

    @functools.cached_property
    def device_bytes(self) -> int:
        """Device bytes of all shards."""
        return sum(s.memory.total for s in self.shards)

    @functools.cached_property
    def host_bytes(self) -> int:
        """Host bytes of all shards."""
        return sum(s.memory.host for s in self.shards)

    @functools.cached_property
    def max_shard_seconds(self) -> float:
        return max(s.seconds for s in self.shards)

    @functools.cached_property
    def column_slices(self) -> int:
        return len({s.col_offset for s in self.shards})

    def describe(self) -> str:
        """``"column_wise x4"``-style label."""
        k = self.column_slices
        return self.sharding.value + (f" x{k}" if k > 1 else "")

    @functools.cached_property
    def tiered(self) -> bool:
        """Its rows live in host memory."""
        return self.memory.tiered


@dataclass(frozen=True)
class RankReport:
    """Estimated load of one rank under a plan; ``parts`` the bandwidth and lookup time of
    each training-step part (:data:`STEP_PARTS`; collective latencies not included);
    ``lookup_seconds`` the part of them that is the rank's own lookups and fused updates
    (the rest moves bytes between ranks), ``host_seconds`` the part that copies rows of
    host-resident shards in and back (in ``lookup`` and ``emb_backward``); ``memory.host``
    the host bytes of its shards."""

    rank: int
    memory: MemoryEstimate
    seconds: float
    shards: int
    parts: tuple[tuple[str, float], ...] = ()
    lookup_seconds: float = 0.0
    host_seconds: float = 0.0


@dataclass(frozen=True)
class TableReport:
    """One table's chosen sharding and what it costs: ``memory`` device bytes and
    ``host_memory`` host bytes of all its shards, ``tier`` and ``cache_rows`` (per shard)
    its memory tier, ``hit_rate`` the expected fraction of lookups the device serves and
    ``hit_source`` where that figure comes from."""

    table: str
    sharding: ShardingType
    label: str
    ranks: tuple[int, ...]
    memory: int
    seconds: float
    tier: TableMemory = TableMemory()
    host_memory: int = 0
    hit_rate: float = 1.0
    hit_source: str = ""


@dataclass(frozen=True)
class PlanReport:
    """A plan with its per-rank estimates.

    ``imbalance`` is max over mean of the per-rank estimated time,
    ``memory_imbalance`` the same for memory; ``step_seconds`` the largest
    per-rank time (the step waits for the slowest rank). ``alternatives``
    maps each partition method tried to its step time (None: did not fit).
    ``host_memory`` is the host bytes per node host-resident tables may take
    (0: none), ``hit_model`` says where the cache hit rates come from.
    """

    plan: ShardingPlan
    method: PartitionMethod | None
    ranks: tuple[RankReport, ...]
    tables: tuple[TableReport, ...]
    usable_memory: int
    alternatives: tuple[tuple[str, float | None], ...] = ()
    host_memory: int = 0
    hit_model: str = ""

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

    def node_host_bytes(self, ranks_per_node: int) -> list[int]:
        """Host bytes of each node's host-resident shards."""
        out = [0] * (len(self.ranks) // ranks_per_node)
        for r in self.ranks:
            out[r.rank // ranks_per_node] += r.memory.host
        return out


class PlanError(NeocommError, ValueError):
    """The planner was given something it cannot plan."""


class PlanDoesNotFitError(PlanError):
    """No placement fits the devices' (and the nodes' host) memory.

    ``table`` names the table that could not be placed, ``needed`` the bytes
    its smallest shard needs on one rank, ``available`` the most free bytes
    any eligible rank had, ``short`` the difference. ``tier`` is the memory
    that is short (``"device"`` or ``"host"``); ``device_short`` and
    ``host_short`` are the bytes the whole model is short by in each (0 when
    not computed or not short).
    """

    def __init__(self, message: str, *, table: str = "", needed: int = 0,
                 available: int = 0, tier: str = "device", device_short: int = 0,
                 host_short: int = 0):
        super().__init__(message)
        self.table = table
        self.needed = int(needed)
        self.available = int(available)
        self.tier = tier
        self.device_short = int(device_short)
        self.host_short = int(host_short)

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
