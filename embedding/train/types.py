"""Vocabulary of the DLRM trainer: its configuration, its phases and its errors.

A :class:`TrainConfig` is plain data (frozen dataclasses, one per TOML
section); :mod:`embedding.train.config` reads it from a TOML file and checks
every key. Units: batch sizes in samples (the *global* batch over all
ranks), intervals in steps, sizes of gradient buckets in KiB.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from embedding.dense.types import DenseOptimizerConfig, DenseOptimizerKind
from embedding.packing import DEFAULT_PACK_ROWS
from embedding.types import OptimizerConfig, OptimizerKind
from neocomm.errors import NeocommError

__all__ = ["DataSource", "Phase", "DataConfig", "TablesConfig", "ModelConfig", "LoopConfig",
           "PlanConfig", "CheckpointConfig", "OutputConfig", "CommsConfig", "TrainConfig",
           "ConfigError", "TrainingError", "DEFAULT_OUT", "cache_rows"]

#: Where outputs go when neither the config nor ``--out`` says (relative to the cwd).
DEFAULT_OUT = "neocomm-out"


class DataSource(enum.Enum):
    """Where training records come from."""

    SYNTHETIC = "synthetic"  # Criteo-shaped records with a planted model (embedding.data)
    CRITEO = "criteo"        # Criteo text files (.gz too), parsed into memory
    BINARY = "binary"        # the checksummed binary format (memory-mapped)
    PARQUET = "parquet"      # Parquet files with named columns (label, dense, [[data.sparse]])


class Phase(enum.Enum):
    """Parts of a training step that are timed separately (see docs/training.md).

    ``INPUT_DIST`` is the part of the id AlltoAll the step waits for (its
    start plus its wait), ``LOOKUP`` the pooled lookup on the local shards
    (and the launch of the output AlltoAll, whose count exchange waits for
    the slowest rank), ``OUTPUT_DIST`` the wait for the pooled rows,
    ``DENSE`` the dense forward and backward, ``SYNC`` the per-step loss and
    health agreement, ``EMB_BACKWARD`` the reverse output dist with the fused
    sparse optimizer, ``GRAD_SYNC`` the part of the dense AllReduce not
    hidden behind other work, ``OPTIMIZER`` the dense optimizer.
    """

    DATA = "data"
    INPUT_DIST = "input_dist"
    LOOKUP = "lookup"
    OUTPUT_DIST = "output_dist"
    DENSE = "dense"
    SYNC = "sync"
    EMB_BACKWARD = "emb_backward"
    GRAD_SYNC = "grad_sync"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the record source and its held-out split.

    ``path`` (and ``eval_path``) are Criteo text files, one binary file, or
    Parquet files and directories. Without ``eval_path`` the last
    ``eval_records`` records of ``path`` are held out; with Parquet, each
    entry of ``eval_path`` is an evaluation set of its own. ``records`` is
    the size of a synthetic training set. ``broadcast`` reads on rank 0 only
    and sends each rank its slice. ``shuffle`` permutes the training records
    each epoch (seeded, the same on resume): ``shuffle_window`` records are
    shuffled together (blocks such as Parquet row groups are shuffled
    first); 0 permutes whole batches only; -1 (default) is 65536 for Parquet
    and 0 for the other sources. ``label``, ``dense`` and ``sparse`` (the
    ``[[data.sparse]]`` tables) name a Parquet source's columns
    (:mod:`embedding.data.schema`).
    """

    source: DataSource = DataSource.SYNTHETIC
    path: tuple[str, ...] = ()
    eval_path: tuple[str, ...] = ()
    records: int = 1 << 22
    eval_records: int = 1 << 15
    shuffle: bool = False
    broadcast: bool = False
    verify: str = "lazy"
    missing: str = "zero"
    zipf_alpha: float = 1.1
    logit_std: float = 1.42
    dense_share: float = 0.3
    shuffle_window: int = -1
    label: str = ""
    dense: tuple = ()
    sparse: tuple = ()

    @property
    def window(self) -> int:
        """The record shuffle's window in records (0: whole batches are shuffled)."""
        if self.shuffle_window >= 0:
            return self.shuffle_window
        return 1 << 16 if self.source is DataSource.PARQUET else 0

    def schema(self):
        """The :class:`~embedding.data.schema.DataSchema` of ``label``, ``dense``, ``sparse``."""
        from embedding.data.schema import DataSchema

        return DataSchema(self.label, tuple(self.dense), tuple(self.sparse))


@dataclass(frozen=True)
class TablesConfig:
    """``[tables]``: one table per sparse feature; rows from ``rows`` or a ``preset``.

    ``cap`` limits every table's rows (0: no limit); ``id_policy`` says what
    ids outside a table do (``error``, ``modulo``, ``hash``).

    Memory tier of the tables with at least ``tier_min_rows`` rows (the
    others, and data-parallel tables, stay in device memory): ``tier``
    ``device``, ``host`` or ``cached``. A cached table's device cache per
    shard is ``cache``: a share of the shard's rows (``"5%"``), a row count
    (``"4096"``) or bytes of rows with their optimizer state (``"64MiB"``);
    ``cache_policy`` ``lru`` or ``lfu``; a row enters the cache on its
    ``admit_after``-th access. A plan file's own tiers win over these.

    ``dynamic``: every table takes any int64 id through a hash map of at most
    its rows (the ``rows``/preset size becomes the capacity), evicting by
    ``eviction`` (``count``: least used, ``age``: least recently used) when
    full; such tables are sharded table-wise or cyclic row-wise and stay in
    device memory.

    Storage precision of every table (:mod:`embedding.precision`): ``dtype``
    (``float32``, ``float16`` or ``bfloat16``; empty: ``model.dtype``); a
    half table computes in float32 and rounds updates by ``rounding``
    (``nearest``, ``stochastic`` with the bits of ``rounding_seed``, or
    ``master``: a float32 master copy); ``state_dtype`` is the sparse
    optimizer's state dtype (empty: float32 for half tables).
    """

    preset: str = "criteo-1tb-1000x"
    rows: tuple[int, ...] = ()
    cap: int = 0
    pooling: str = "sum"
    id_policy: str = "error"
    tier: str = "device"
    tier_min_rows: int = 0
    cache: str = ""
    cache_policy: str = "lru"
    admit_after: int = 1
    dynamic: bool = False
    eviction: str = "count"
    dtype: str = ""
    rounding: str = "nearest"
    rounding_seed: int = 0
    state_dtype: str = ""


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: DLRM's widths; ``bottom_mlp`` ends in ``embedding_dim``, ``top_mlp`` in 1."""

    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 1)
    dtype: str = "float32"


@dataclass(frozen=True)
class LoopConfig:
    """``[train]``: steps, the global batch, intervals and the step's options.

    ``batch_size`` is the global batch, samples per step over all ranks, a multiple of
    the ranks; 0 (the default) is 2048 rounded down to a multiple of the ranks
    (:mod:`embedding.train.batching`). ``eval_batch_size`` 0 is the training batch.

    ``overlap`` starts the input dist of batch i+1 before the dense compute
    of batch i and AllReduces dense gradient buckets from the backward's
    completion hooks; off, each runs after the work it could hide behind.
    ``threads`` is the BLAS and kernel threads of each rank (0: the node's
    cores over its ranks). ``eval_every`` 0 evaluates at the end only.
    ``device`` is where tables, activations and gradients live: ``"cpu"``
    (NumPy, MPI) or ``"cuda"`` (CuPy on the rank's GPU, NCCL).
    """

    steps: int = 500
    batch_size: int = 0
    eval_every: int = 100
    eval_batch_size: int = 0
    log_every: int = 25
    overlap: bool = True
    bucket_kib: int = 1024
    dedup: bool = False
    threads: int = 0
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class PlanConfig:
    """``[plan]``: a plan file, or the planner's target (``fabric``), memory per rank and
    the sharding types it may choose from (``shardings``; empty: any). ``host_memory``:
    host memory per node for host-resident tables (empty: the host's physical memory);
    when given, the planner may also keep tables in host memory behind a device cache.
    ``pack``: the planner packs tables of at most ``pack_rows`` rows that share dim, dtype,
    optimizer and pooling into one table each (:mod:`embedding.packing`; a plan file
    records its own packing)."""

    file: str = ""
    fabric: str = "cpu-host"
    memory: str = ""
    host_memory: str = ""
    shardings: tuple[str, ...] = ()
    pack: bool = False
    pack_rows: int = DEFAULT_PACK_ROWS


@dataclass(frozen=True)
class CheckpointConfig:
    """``[checkpoint]``: where, how often (steps; 0: at the end only), how many to keep.

    ``resume``: ``""`` (start fresh), ``"latest"`` (the newest complete
    checkpoint under ``dir``; an error when there is none), ``"auto"``
    (the newest when there is one) or a checkpoint directory.
    """

    dir: str = ""
    every: int = 0
    keep: int = 3
    resume: str = ""


@dataclass(frozen=True)
class OutputConfig:
    """``[output]``: the output directory (metrics log, checkpoints, plot) and the plot switch."""

    dir: str = DEFAULT_OUT
    plot: bool = False


@dataclass(frozen=True)
class CommsConfig:
    """``[comms]``: the precision each exchange travels in (TorchRec's qcomm codecs).

    ``forward``: pooled embeddings in the output dists (``fp32``, ``fp16``,
    ``bf16``, ``int8`` rows with a float32 scale and bias each);
    ``backward``: their gradients (``fp32``, ``fp16``, ``bf16``); ``dense``:
    the dense gradients' AllReduce and the gradient AllReduce of
    data-parallel embedding tables (``fp32``, ``fp16``, ``bf16``; 16-bit
    sums). ``loss_scale`` (0: none): a static scale of the fp16 exchanges
    of gradients, which multiply before rounding and divide after; a scaled
    gradient beyond fp16's 65504 stops the run naming it.
    """

    forward: str = "fp32"
    backward: str = "fp32"
    dense: str = "fp32"
    loss_scale: float = 0.0

    def qcomms(self):
        """The :class:`~embedding.sharding.qcomm.QComms` of the embedding tables: their
        output dists (``forward``, ``backward``) and the gradient AllReduce of the
        data-parallel ones (``dense``, as the dense model's)."""
        from embedding.sharding.qcomm import QComms

        scale = self.loss_scale if self.loss_scale and self.backward == "fp16" else None
        return QComms(self.forward, self.backward, scale, self.dense, self.dense_scale())

    def dense_scale(self) -> float | None:
        """The loss scale of the dense AllReduce (None: unscaled)."""
        return self.loss_scale if self.loss_scale and self.dense == "fp16" else None


def _sparse_default() -> OptimizerConfig:
    return OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)


def _dense_default() -> DenseOptimizerConfig:
    return DenseOptimizerConfig(DenseOptimizerKind.ADAM, lr=0.002)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; ``source`` names the TOML file it came from."""

    data: DataConfig = field(default_factory=DataConfig)
    tables: TablesConfig = field(default_factory=TablesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sparse_optimizer: OptimizerConfig = field(default_factory=_sparse_default)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=_dense_default)
    train: LoopConfig = field(default_factory=LoopConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    comms: CommsConfig = field(default_factory=CommsConfig)
    source: str = "<defaults>"


class ConfigError(NeocommError, ValueError):
    """A configuration is wrong: ``path`` is its file, ``key`` the dotted key (``train.steps``)."""

    def __init__(self, path: str, key: str, message: str):
        where = f"{path}: " if path else ""
        where += f"{key}: " if key else ""
        super().__init__(where + message)
        self.path = str(path)
        self.key = str(key)
        self.reason = message

    def __reduce__(self):
        return (ConfigError, (self.path, self.key, self.reason))


class TrainingError(NeocommError):
    """Training stopped on every rank: bad data, a non-finite tensor, an unusable checkpoint.

    ``step`` is the step it happened at (-1: before training), ``tensor`` the
    offending tensor or file (``dense``, ``labels``, ``loss`` …), ``ranks``
    the ranks that found it and ``per_rank`` their own messages.
    """

    def __init__(self, message: str, *, step: int = -1, tensor: str = "",
                 ranks: tuple[int, ...] = (), per_rank: dict | None = None):
        super().__init__(message, ranks=ranks)
        self.step = int(step)
        self.tensor = tensor
        self.per_rank = dict(per_rank or {})


def cache_rows(text: str, shard_rows: int, row_bytes: int) -> int:
    """Rows of a device cache of ``text`` (see ``[tables] cache``) for a shard of
    ``shard_rows`` rows of ``row_bytes`` bytes each (with optimizer state); at least 1."""
    import math

    from topology.sizes import parse_size

    s = text.strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise ValueError(f"expected a share in (0%, 100%], got {text!r}")
        return max(1, math.ceil(pct / 100 * shard_rows))
    if s.isdigit():
        if int(s) < 1:
            raise ValueError(f"expected at least 1 row, got {text!r}")
        return int(s)
    try:
        size = parse_size(s)
    except ValueError:
        raise ValueError(f"expected a cache size such as \"5%\", \"4096\" (rows) or "
                         f"\"64MiB\", got {text!r}") from None
    if size < row_bytes:
        raise ValueError(f"{text!r} holds no row of {row_bytes} bytes")
    return size // row_bytes
