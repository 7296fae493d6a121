"""The trainer's data sets: windows, records in memory, reads that fail together, and their bundle.

:class:`TrainData` bundles the training and held-out data sets of a config
(anything with ``num_records`` and ``read(start, stop)``), the table sizes
and feature names; the sources of :mod:`embedding.train.sources` build it.

A rank that fails to read (a corrupt file, a truncated record) must not
leave the others waiting in the next collective: :class:`GuardedDataset`
turns the failure into a *problem* and returns a harmless filler batch, so
the step goes on and every rank stops together at the step's agreement.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding.data import (Batch, DataFormatError, Preprocessor, scale_table_sizes,
                            table_size_preset)
from embedding.data.synthetic import SyntheticDataset
from embedding.data.types import SPARSE_NAMES
from embedding.train.types import ConfigError, TrainConfig

__all__ = ["TrainData", "WindowDataset", "MemoryDataset", "GuardedDataset", "filler_batch",
           "load_criteo_text", "table_sizes_of", "hold_out"]


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
    """Preprocessed records held in memory: dense ``[N, D]``, labels ``[N]``, ids ``[N, F]``
    (one id per feature) or ``[N, F, L]`` (bags of ``L`` ids)."""

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
        dense, labels = self.dense[start:stop], self.labels[start:stop].astype(np.float32)
        if self.ids.ndim == 2:
            return Batch.from_ids(dense, labels, self.ids[start:stop], self.feature_names)
        ids = self.ids[start:stop]
        bag = np.full(stop - start, ids.shape[2], np.int64)
        return Batch(dense, labels, tuple(np.ascontiguousarray(ids[:, f]).reshape(-1)
                                          for f in range(ids.shape[1])),
                     (bag,) * ids.shape[1], self.feature_names)


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


def hold_out(cfg: TrainConfig, train, where: str):
    """``(training, held-out)`` windows of ``train``: its last ``data.eval_records`` records
    held out; ConfigError when that leaves none to train on (``where``: the files, in words)."""
    d = cfg.data
    n = train.num_records
    if d.eval_records >= n:
        raise ConfigError(cfg.source, "data.eval_records", f"holding out {d.eval_records} "
                          f"records leaves none of the {n} records of {where} to train on; "
                          f"lower it or give data.eval_path")
    return WindowDataset(train, 0, n - d.eval_records), WindowDataset(
        train, n - d.eval_records, n)
