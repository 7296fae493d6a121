"""Parquet input: named columns read by row groups and encoded into the trainer's batches.

:class:`ParquetSource` is one file, a list of files or a directory of
``*.parquet`` files, seen as one sequence of records (files in the order
given, a directory's in name order). Opening it checks what can be checked
before anything is trained: every path exists and is a Parquet file with
records, every column the :class:`~embedding.data.schema.DataSchema` names
is there with a type it can take, and every file has the types of the
first.

:func:`scan` reads the columns once and returns :class:`DataStats`: per
column its type, null share, distinct values and list lengths, the label's
values (a label that is not 0/1 is refused here), the vocabulary of
every table with ``encoding = "vocabulary"`` (:class:`Vocabulary`), and the
statistics of the dense columns' transforms
(:class:`~embedding.data.transforms.DenseTransforms`).

:class:`ParquetDataset` reads ``[start, stop)`` of the records as a
:class:`~embedding.data.batch.Batch`: it decodes only the row groups the
range touches and keeps the last few decoded (``cache_row_groups``), so
memory is bounded by a few row groups whatever the file size.

:class:`ParquetSource` (:mod:`embedding.data.parquet_files`), :func:`scan` and its
statistics (:mod:`embedding.data.parquet_scan`) are re-exported here.

The stable hash of ``encoding = "hash"`` (:func:`stable_hash`, defined in
:mod:`embedding.data.hashing`): the row is the hash modulo the table's rows.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from embedding.data.batch import Batch
from embedding.data.hashing import hash_ints, hash_strings, stable_hash
from embedding.data.parquet_files import ParquetSource
from embedding.data.parquet_scan import (ColumnStats, DataStats, Vocabulary, _flat,
                                         _label_positives, check_label_column, scan)
from embedding.data.schema import DataSchema, SparseFeature
from embedding.data.transforms import DenseTransforms, dense_values
from embedding.data.types import pyarrow_module as _pa

__all__ = ["ParquetSource", "ParquetDataset", "Vocabulary", "ColumnStats", "DataStats", "scan",
           "check_label_column", "describe_rows", "table_rows", "stable_hash", "hash_strings",
           "hash_ints"]


# -------------------------------------------------------------------- the data set
class ParquetDataset:
    """Records of ``source`` as batches of ``schema``'s features (a reader's data set).

    ``vocabularies`` maps each ``encoding = "vocabulary"`` table to its
    :class:`Vocabulary` (from :func:`scan` of the *training* data; an
    evaluation set uses the training vocabularies). ``table_rows`` are the
    tables' sizes; a hashed id is taken modulo its table's.
    """

    def __init__(self, source: ParquetSource, schema: DataSchema, vocabularies: dict,
                 table_rows: dict, *, cache_row_groups: int = 4, check_labels: bool = True,
                 dense: DenseTransforms | None = None):
        self.source = source
        if dense is not None and [c.column for c in dense.columns] != [
                d.column for d in schema.dense]:
            raise ValueError(f"dense: statistics of columns {[c.column for c in dense.columns]}"
                             f", the schema's dense columns are "
                             f"{[d.column for d in schema.dense]}")
        #: the dense columns' transforms (None: the values as they are, after fill)
        self.dense = dense
        self._version = dense.version if dense is not None else 0
        self.schema = schema
        self.vocabularies = dict(vocabularies)
        self.table_rows = dict(table_rows)
        self.num_records = source.num_records
        self.feature_names = schema.feature_names
        self.num_dense = schema.num_dense
        self.cache_row_groups = max(1, int(cache_row_groups))
        self.check_labels = bool(check_labels)
        self._cache: OrderedDict[int, Batch] = OrderedDict()
        for table, feats in schema.tables().items():
            if feats[0].encoding == "vocabulary" and table not in self.vocabularies:
                raise ValueError(f"vocabularies: no vocabulary for table {table!r}")

    def read(self, start: int, stop: int) -> Batch:
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.num_records}, "
                             f"got {start}, {stop}")
        if start == stop:
            return self._encode_empty()
        parts = []
        i = self.source.locate(start)
        pos = start
        while pos < stop:
            _, _, first, n = self.source.row_groups[i]
            chunk = self._row_group(i)
            a, b = pos - first, min(stop, first + n) - first
            parts.append(chunk if (a, b) == (0, n) else chunk.slice(a, b))
            pos = first + b
            i += 1
        return parts[0] if len(parts) == 1 else Batch.concat(parts)

    def blocks(self) -> list[tuple[int, int]]:
        """``(first record, records)`` of every row group: what a shuffle permutes whole."""
        return [(first, n) for _, _, first, n in self.source.row_groups]

    def read_records(self, records) -> Batch:
        """Records ``records`` (any order), each row group decoded once; the cache grows to
        the row groups one call touches (a shuffle window's)."""
        records = np.asarray(records, np.int64)
        if records.size == 0:
            return self._encode_empty()
        if records.min() < 0 or records.max() >= self.num_records:
            raise ValueError(f"records: expected indices in [0, {self.num_records})")
        starts = self.source.starts
        group = np.searchsorted(starts, records, side="right") - 1
        order = np.argsort(group, kind="stable")  # records row group by row group
        needed, first = np.unique(group[order], return_index=True)
        self.cache_row_groups = max(self.cache_row_groups, needed.size)
        ends = np.append(first[1:], order.size)
        parts = [self._row_group(int(g)).take(records[order[a:b]] - starts[g])
                 for g, a, b in zip(needed, first, ends)]
        whole = parts[0] if len(parts) == 1 else Batch.concat(parts)
        where = np.empty(records.size, np.int64)  # where each asked record lies in whole
        where[order] = np.arange(records.size)
        return whole.take(where)

    def _row_group(self, index: int) -> Batch:
        if self.dense is not None and self.dense.version != self._version:
            self._cache.clear()  # new statistics (a checkpoint's): decode again
            self._version = self.dense.version
        hit = self._cache.get(index)
        if hit is not None:
            self._cache.move_to_end(index)
            return hit
        table = self.source.read_row_group(index, self.source.read_columns)
        batch = self.encode(table, index=index)
        self._cache[index] = batch
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return batch

    def _encode_empty(self) -> Batch:
        f = len(self.schema.sparse)
        return Batch(np.zeros((0, self.num_dense), np.float32), np.zeros(0, np.float32),
                     tuple(np.zeros(0, np.int64) for _ in range(f)),
                     tuple(np.zeros(0, np.int32) for _ in range(f)), self.feature_names)

    def encode(self, table, *, index: int = -1) -> Batch:
        """A pyarrow Table with the schema's columns as a :class:`Batch`."""
        pa = _pa()

        s = self.schema
        n = table.num_rows
        if s.label in table.column_names:
            col = table.column(s.label)
            if self.check_labels:
                _label_positives(col, self.source, index)
            labels = np.asarray(col.cast(pa.float32()).fill_null(0).to_numpy(), np.float32)
        else:  # scoring data without labels
            labels = np.zeros(n, np.float32)
        dense = np.zeros((n, s.num_dense), np.float32)
        j = 0
        stats = self.dense.columns if self.dense is not None else (None,) * len(s.dense)
        for d, st in zip(s.dense, stats):
            x, missing = dense_values(table.column(d.column), d.fill, pa)
            dense[:, j] = x if st is None else st.apply(x)
            j += 1
            if d.indicator:
                dense[:, j] = missing
                j += 1
        values, lengths = [], []
        for f in s.sparse:
            vals, lens = _flat(table.column(f.column), pa)
            values.append(self._rows(f, vals))
            lengths.append(lens)
        return Batch(dense, labels, tuple(values), tuple(lengths), self.feature_names)

    def _rows(self, f: SparseFeature, vals) -> np.ndarray:
        if f.encoding == "hash":
            return (stable_hash(vals) % np.uint64(self.table_rows[f.table])).astype(np.int64)
        return self.vocabularies[f.table].lookup(vals)


def table_rows(schema: DataSchema, vocabularies: dict) -> dict[str, int]:
    """Rows of each table: its vocabulary's (values + the reserved row) or a hash's ``rows``.

    KeyError names a vocabulary table that ``vocabularies`` lacks.
    """
    rows = {}
    for table, feats in schema.tables().items():
        if feats[0].encoding == "hash":
            rows[table] = feats[0].rows
        elif table in vocabularies:
            rows[table] = vocabularies[table].num_rows
        else:
            raise KeyError(f"no vocabulary for table {table!r}")
    return rows


def describe_rows(dataset: ParquetDataset, start: int, stop: int) -> list[str]:
    """Rows ``[start, stop)`` as lines: the label, the dense features as the model gets them
    (``raw -> model value`` where a transform changes them), each sparse feature's raw values
    and the table rows they become."""
    src, schema = dataset.source, dataset.schema
    batch = dataset.read(start, stop)
    raw: dict[str, list] = {c: [] for c in src.read_columns}
    pos = start
    while pos < stop:  # the raw values of the same rows, row group by row group
        i = src.locate(pos)
        _, _, first, n = src.row_groups[i]
        b = min(stop, first + n)
        t = src.read_row_group(i, src.read_columns).slice(pos - first, b - pos)
        for c in raw:
            raw[c].extend(t.column(c).to_pylist())
        pos = b
    offsets = [batch.offsets(f) for f in range(batch.num_sparse)]
    lines = []
    stats = dataset.dense.columns if dataset.dense is not None else (None,) * len(schema.dense)
    for r in range(stop - start):
        label = f"{raw[schema.label][r]!r}" if src.has_label else "(none)"
        shown, j = [], 0
        for d, st in zip(schema.dense, stats):  # raw value -> the model's, where they differ
            value = raw[d.column][r]
            if st is None or st.identity:
                shown.append(f"{d.column}={batch.dense[r, j]:g}")
            else:
                shown.append(f"{d.column}={value!r} -> {batch.dense[r, j]:g}")
            if d.indicator:
                shown.append(f"{d.column}_missing={batch.dense[r, j + 1]:g}")
            j += 1 + d.indicator
        dense = ", ".join(shown)
        lines.append(f"row {start + r}: label {label}" + (f"; dense {dense}" if dense else ""))
        for f, feat in enumerate(schema.sparse):
            ids = batch.values[f][offsets[f][r]:offsets[f][r + 1]].tolist()
            lines.append(f"    {feat.name}: {raw[feat.column][r]!r} -> rows {ids} "
                         f"(table {feat.table}, {feat.encoding}, {feat.pooling})")
    return lines
