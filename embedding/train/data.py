"""The trainer's data: training and held-out sets, their tables, and reads that fail together.

:func:`open_data` turns a :class:`~embedding.train.types.TrainConfig` into a
:class:`TrainData`: the training and held-out data sets (anything with
``num_records`` and ``read(start, stop)``), the table sizes and feature
names. Synthetic data holds out the records after the training records;
files hold out ``eval_path`` or their last ``eval_records`` records.

A rank that fails to read (a corrupt file, a truncated record) must not
leave the others waiting in the next collective: :class:`GuardedDataset`
turns the failure into a *problem* and returns a harmless filler batch, so
the step goes on and every rank stops together at the step's agreement.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from embedding.data import (Batch, BinaryDataset, DataFormatError, Preprocessor,
                            SyntheticConfig, SyntheticDataset, scale_table_sizes,
                            table_size_preset)
from embedding.data.types import NUM_SPARSE, SPARSE_NAMES
from embedding.train.types import ConfigError, DataSource, TrainConfig

__all__ = ["TrainData", "open_data", "WindowDataset", "MemoryDataset", "GuardedDataset",
           "filler_batch", "load_criteo_text"]

_log = logging.getLogger(__name__)


class WindowDataset:
    """Records ``[start, stop)`` of ``dataset``, renumbered from 0."""

    def __init__(self, dataset, start: int, stop: int):
        if not 0 <= start <= stop <= dataset.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= "
                             f"{dataset.num_records}, got {start}, {stop}")
        self.dataset, self.start = dataset, int(start)
        self.num_records = int(stop) - int(start)
        self.feature_names = tuple(getattr(dataset, "feature_names", ()))

    def read(self, start: int, stop: int) -> Batch:
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.num_records}, "
                             f"got {start}, {stop}")
        return self.dataset.read(self.start + start, self.start + stop)

    def read_records(self, records) -> Batch:
        from embedding.data.reader import take

        return take(self.dataset, np.asarray(records, np.int64) + self.start)


class MemoryDataset:
    """Preprocessed records held in memory: dense ``[N, D]``, labels ``[N]``, ids ``[N, F]``."""

    def __init__(self, dense, labels, ids, feature_names=()):
        self.dense = np.ascontiguousarray(dense, np.float32)
        self.labels = np.asarray(labels)
        self.ids = np.asarray(ids, np.int64)
        self.num_records = int(self.labels.shape[0])
        self.feature_names = tuple(feature_names)

    def read(self, start: int, stop: int) -> Batch:
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.num_records}, "
                             f"got {start}, {stop}")
        return Batch.from_ids(self.dense[start:stop], self.labels[start:stop].astype(np.float32),
                              self.ids[start:stop], self.feature_names)


def load_criteo_text(paths, table_sizes, missing: str = "zero") -> MemoryDataset:
    """Parse Criteo text files (in order) into memory, ids hashed into ``table_sizes``."""
    from embedding.data.criteo import iter_raw_chunks

    pre = Preprocessor(table_sizes, missing=missing)
    parts = [pre(raw) for path in paths for raw in iter_raw_chunks(path)]
    if not parts:
        raise DataFormatError("no records", path=", ".join(map(str, paths)))
    dense, labels, ids = (np.concatenate(x) for x in zip(*parts))
    return MemoryDataset(dense, labels, ids, SPARSE_NAMES)


def filler_batch(size: int, num_dense: int, feature_names) -> Batch:
    """``size`` records of zeros (every id 0): what a rank trains on while it reports a problem."""
    return Batch.from_ids(np.zeros((size, num_dense), np.float32), np.zeros(size, np.float32),
                          np.zeros((size, len(feature_names)), np.int64), feature_names)


class GuardedDataset:
    """``dataset`` whose failed reads become :attr:`problems` instead of exceptions.

    A read that raises :class:`~embedding.data.types.DataFormatError`,
    ``OSError`` or ``ValueError`` returns :func:`filler_batch` and appends
    the error to :attr:`problems`; the trainer takes them (:meth:`take`)
    into the agreement of the step that would train on the batch.
    """

    def __init__(self, dataset, num_dense: int, feature_names):
        self.dataset = dataset
        self.num_records = dataset.num_records
        self.num_dense = int(num_dense)
        self.feature_names = tuple(feature_names)
        self.problems: list[Exception] = []

    def read(self, start: int, stop: int) -> Batch:
        try:
            return self.dataset.read(start, stop)
        except (DataFormatError, OSError, ValueError) as exc:
            self.problems.append(exc)
            return filler_batch(stop - start, self.num_dense, self.feature_names)

    def read_records(self, records) -> Batch:
        from embedding.data.reader import take

        try:
            return take(self.dataset, records)
        except (DataFormatError, OSError, ValueError) as exc:
            self.problems.append(exc)
            return filler_batch(len(records), self.num_dense, self.feature_names)

    def blocks(self):
        """The data set's blocks, or None (then a shuffle cuts its own)."""
        blocks = getattr(self.dataset, "blocks", None)
        return blocks() if blocks is not None else None

    def take(self) -> Exception | None:
        """The first problem since the last call (None when there was none)."""
        if not self.problems:
            return None
        first, self.problems = self.problems[0], []
        return first


@dataclass(frozen=True)
class TrainData:
    """Training and held-out data sets and the tables their features read.

    ``planted`` is the synthetic data set behind the held-out records (for
    the planted model's AUC) and ``eval_offset`` where they start in it;
    None for files. ``table_sizes`` has one entry per feature: the rows of
    the table it reads; ``feature_tables`` names that table (default: the
    feature's own) and ``feature_pooling`` its pooling (default: the
    config's ``tables.pooling``). ``eval_sets`` are the named evaluation
    sets (default: ``eval`` alone, as ``held-out``); ``vocabularies`` the
    Parquet tables' :class:`~embedding.data.parquet.Vocabulary` by table;
    ``dense_transforms`` the Parquet dense columns'
    :class:`~embedding.data.transforms.DenseTransforms`, shared by every
    data set here (a resumption puts a checkpoint's in place).
    """

    train: object
    eval: object
    table_sizes: tuple[int, ...]
    feature_names: tuple[str, ...]
    num_dense: int
    planted: SyntheticDataset | None = None
    eval_offset: int = 0
    feature_tables: tuple[str, ...] = ()
    feature_pooling: tuple[str, ...] = ()
    eval_sets: tuple = ()
    vocabularies: dict | None = None
    ids_per_sample: dict | None = None  # table -> mean ids per record, where the data says
    dense_transforms: object = None  # DenseTransforms of a Parquet source's dense columns

    @property
    def evaluation_sets(self) -> tuple[tuple[str, object], ...]:
        """``(name, data set)`` of every evaluation set, the first being :attr:`eval`."""
        return tuple(self.eval_sets) or (("held-out", self.eval),)


def table_sizes_of(cfg: TrainConfig) -> tuple[int, ...]:
    """Rows per table from ``[tables]`` (explicit rows, else the preset), capped."""
    t = cfg.tables
    sizes = tuple(t.rows) if t.rows else table_size_preset(t.preset)
    if t.cap:
        sizes = scale_table_sizes(sizes, cap=t.cap, min_rows=1)
    return sizes


def open_data(cfg: TrainConfig, group=None) -> TrainData:
    """The data sets of ``cfg`` (ConfigError for a misfit config, DataFormatError for bad files).

    With ``group`` (every rank calls it) the ranks share the work of a Parquet
    source's scan (:func:`open_parquet`)."""
    d = cfg.data
    path = cfg.source
    if d.source is DataSource.PARQUET:
        return open_parquet(cfg, group=group)
    if d.source is DataSource.SYNTHETIC:
        sizes = table_sizes_of(cfg)
        syn = SyntheticConfig(table_sizes=sizes, seed=cfg.train.seed, zipf_alpha=d.zipf_alpha,
                              logit_std=d.logit_std, dense_share=d.dense_share)
        full = SyntheticDataset(syn, d.records + d.eval_records)
        return TrainData(WindowDataset(full, 0, d.records),
                         WindowDataset(full, d.records, d.records + d.eval_records), sizes,
                         tuple(syn.feature_names), syn.num_dense, full, d.records)
    if d.source is DataSource.CRITEO:
        sizes = table_sizes_of(cfg)
        if len(sizes) != NUM_SPARSE:
            raise ConfigError(path, "tables.rows", f"Criteo text has {NUM_SPARSE} categorical "
                              f"features; expected {NUM_SPARSE} tables, got {len(sizes)}")
        train = load_criteo_text(d.path, sizes, d.missing)
        held = load_criteo_text(d.eval_path, sizes, d.missing) if d.eval_path else None
        names, num_dense = SPARSE_NAMES, train.dense.shape[1]
    else:
        train = BinaryDataset(d.path[0], verify=d.verify)
        held = BinaryDataset(d.eval_path[0], verify=d.verify) if d.eval_path else None
        sizes = _binary_sizes(cfg, train, held)
        names = train.feature_names or tuple(f"f{i}" for i in range(train.num_sparse))
        num_dense = train.num_dense
    if held is None:
        n = train.num_records
        if d.eval_records >= n:
            raise ConfigError(path, "data.eval_records", f"holding out {d.eval_records} records "
                              f"leaves none of the {n} records of {', '.join(d.path)} to train "
                              f"on; lower it or give data.eval_path")
        train, held = WindowDataset(train, 0, n - d.eval_records), WindowDataset(
            train, n - d.eval_records, n)
    return TrainData(train, held, tuple(sizes), tuple(names), int(num_dense))


def _set_names(paths) -> list[str]:
    """Names of evaluation sets: each path's stem, made unique (``test``, ``test-2``)."""
    from pathlib import Path

    out: list[str] = []
    for p in paths:
        base = Path(p).stem or str(p)
        name, k = base, 2
        while name in out:
            name, k = f"{base}-{k}", k + 1
        out.append(name)
    return out


def open_parquet(cfg: TrainConfig, vocabularies: dict | None = None,
                 group=None, dense=None) -> TrainData:
    """The Parquet sets of ``cfg``: every file and column checked, the vocabularies built.

    The vocabularies and the dense columns' statistics come from the
    training files (``path``, held-out records included when there is no
    ``eval_path``) unless given (a checkpoint's, for scoring: ``dense`` then
    defaults to the dense columns as they are). Every ``eval_path`` entry is one evaluation
    set, its labels checked before anything is trained. With ``group``
    (every rank calls it), the ranks share the scan of the training files,
    each reading a part of the row groups; errors are agreed.
    """
    from embedding.data.parquet import (ParquetDataset, ParquetSource, check_label_column, scan,
                                        table_rows)
    from embedding.data.schema import SchemaError
    from embedding.data.transforms import DenseTransforms
    from embedding.train.setup import fail_together

    d = cfg.data
    schema = d.schema()
    train_src, exc = None, None
    try:
        train_src = ParquetSource(d.path, schema) if d.path else None
    except (OSError, ValueError) as e:
        exc = e
    shared = group is not None and group.size > 1 and vocabularies is None and d.path
    if shared:
        fail_together(group, "opening the data", exc)  # before the shared scan: all or none
    elif exc is not None:
        raise exc
    ids = None
    if vocabularies is None:
        try:
            stats = scan(train_src, schema, comm=group.comm if shared else None)
        except SchemaError as e:  # a setting the data cannot take (minmax of a constant)
            raise ConfigError(cfg.source, e.key, e.reason) from None
        vocabularies, rows = stats.vocabularies, dict(stats.table_rows)
        dense = stats.dense
        ids = {}
        for f in schema.sparse:  # pooling factors: ids per record, summed over a table's
            c = stats.columns[f.column]
            per = c.mean_length if c.mean_length is not None else 1.0 - c.null_share
            ids[f.table] = ids.get(f.table, 0.0) + per
    else:
        vocabularies = dict(vocabularies)
        dense = dense if dense is not None else DenseTransforms.untransformed(schema)
        try:
            rows = table_rows(schema, vocabularies)
        except KeyError as exc:
            raise ConfigError(cfg.source, "data.sparse", exc.args[0]) from None
    # every label was checked here, before training: the reads need not check them again
    train = (ParquetDataset(train_src, schema, vocabularies, rows, check_labels=False,
                            dense=dense) if train_src is not None else None)
    sets = []
    for name, p in zip(_set_names(d.eval_path), d.eval_path):
        src = ParquetSource(p, schema)
        check_label_column(src, schema.label)
        sets.append((name, ParquetDataset(src, schema, vocabularies, rows,
                                          check_labels=False, dense=dense)))
    if not sets and train is not None:
        n = train.num_records
        if d.eval_records >= n:
            raise ConfigError(cfg.source, "data.eval_records", f"holding out "
                              f"{d.eval_records} records leaves none of the {n} records of "
                              f"{train_src.describe()} to train on; lower it or give "
                              f"data.eval_path")
        sets.append(("held-out", WindowDataset(train, n - d.eval_records, n)))
        train = WindowDataset(train, 0, n - d.eval_records)
    return parquet_data(schema, train, sets, vocabularies, rows, ids, dense)


def parquet_data(schema, train, sets, vocabularies: dict, rows: dict,
                 ids_per_sample: dict | None = None, dense=None) -> TrainData:
    """The :class:`TrainData` of a Parquet schema's data sets (``sets``: name, data set)."""
    return TrainData(train, sets[0][1] if sets else None,
                     tuple(int(rows[f.table]) for f in schema.sparse), schema.feature_names,
                     schema.num_dense, feature_tables=tuple(f.table for f in schema.sparse),
                     feature_pooling=tuple(f.pooling for f in schema.sparse),
                     eval_sets=tuple(sets), vocabularies=vocabularies,
                     ids_per_sample=ids_per_sample, dense_transforms=dense)


def _binary_sizes(cfg: TrainConfig, train, held) -> tuple[int, ...]:
    path = cfg.source
    sizes = train.table_sizes
    if held is not None and held.table_sizes != sizes:
        raise ConfigError(path, "data.eval_path", f"{cfg.data.eval_path[0]} has table sizes "
                          f"{list(held.table_sizes)}, {cfg.data.path[0]} has {list(sizes)}")
    if cfg.tables.rows and tuple(cfg.tables.rows) != tuple(sizes):
        raise ConfigError(path, "tables.rows", f"{cfg.data.path[0]} was written for table "
                          f"sizes {list(sizes)}, the config gives {list(cfg.tables.rows)}")
    if cfg.tables.cap and max(sizes) > cfg.tables.cap:
        if cfg.tables.id_policy == "error":
            raise ConfigError(path, "tables.cap", f"capping tables at {cfg.tables.cap} rows "
                              f"leaves ids of {cfg.data.path[0]} out of range; set "
                              f"tables.id_policy = \"modulo\" or \"hash\"")
        sizes = scale_table_sizes(sizes, cap=cfg.tables.cap, min_rows=1)
    return tuple(sizes)


def batches(config, split: str = "train", *, rank: int = 0, world_size: int = 1,
            epochs: int | None = 1, data: TrainData | None = None):
    """Batches of ``config``'s data, read exactly as the trainer reads them: for your own loop.

    ``config`` is a :class:`TrainConfig` or the path of its TOML file.
    ``split`` is ``"train"`` or the name of an evaluation set (a Parquet
    ``eval_path`` file's stem, or ``"held-out"``). Rank ``rank`` of
    ``world_size`` gets its slice of each global batch of
    ``train.batch_size`` (``train.eval_batch_size`` for evaluation sets; 0, the
    default, rounded down to a multiple of ``world_size`` as the trainer does),
    shuffled as ``[data] shuffle`` says; training batches come for
    ``epochs`` epochs (None: forever), the last partial global batch of an
    epoch dropped as in training; an evaluation set comes once, every record
    once, its last global batch possibly smaller. Each item is a
    :class:`~embedding.data.batch.Batch`: ``dense``, ``labels``, and
    ``to_jagged()`` for :meth:`ShardedEmbeddingCollection.forward
    <embedding.collection.ShardedEmbeddingCollection.forward>`. ``data``
    reuses data sets already opened (:func:`open_data`).
    """
    from embedding.data.batch import shard_bounds
    from embedding.data.reader import ShardedReader
    from embedding.train.config import load_config

    from embedding.train.batching import global_batch

    cfg = config if isinstance(config, TrainConfig) else load_config(config)
    shard_bounds(world_size, rank, world_size)  # checks rank and world_size
    data = data if data is not None else open_data(cfg)
    if split == "train":
        if data.train is None:
            raise ValueError("split: this data has no training records")
        gb = global_batch(cfg.train.batch_size, world_size, source=cfg.source)
        reader = ShardedReader(data.train, gb, rank, world_size,
                               shuffle=cfg.data.shuffle, seed=cfg.train.seed,
                               shuffle_window=cfg.data.window)
        epoch = 0
        while epochs is None or epoch < epochs:
            yield from reader
            epoch += 1
        return
    sets = dict(data.evaluation_sets)
    if split not in sets:
        raise ValueError(f"split: expected 'train' or one of the evaluation sets "
                         f"{list(sets)}, got {split!r}")
    ds = sets[split]
    egb = (cfg.train.eval_batch_size or cfg.train.batch_size
           or global_batch(0, world_size))  # (any size: the ranks' slices may differ by one)
    n = ds.num_records
    for first in range(0, n, egb):
        size = min(egb, n - first)
        # the last batch may not split evenly: the first ranks take one record more
        a = rank * (size // world_size) + min(rank, size % world_size)
        b = a + size // world_size + (rank < size % world_size)
        yield ds.read(first + a, first + b)
