"""One scan of a Parquet source's columns: :func:`scan` and the :class:`DataStats` it returns.

Per column its type, null share, distinct values and list lengths, the
label's values (a label that is not 0/1 is refused here), the vocabulary of
every table with ``encoding = "vocabulary"`` (:class:`Vocabulary`), and the
statistics of the dense columns' transforms
(:class:`~embedding.data.transforms.DenseTransforms`). Several ranks can share
the scan, each reading a part of the row groups. (:mod:`embedding.data.parquet`
re-exports its public names.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from embedding.data.parquet_files import ParquetSource, _kind
from embedding.data.schema import DataSchema, SparseFeature
from embedding.data.transforms import DenseTransforms, Moments, dense_values, transform_values
from embedding.data.types import DataFormatError
from embedding.data.types import pyarrow_module as _pa

__all__ = ["Vocabulary", "ColumnStats", "DataStats", "scan", "check_label_column"]


# --------------------------------------------------------------------- the columns
def _flat(column, pa):
    """``(values, lengths)``: the non-null values of a scalar or list column, and per row
    how many (a null row or list: 0, null elements skipped)."""
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = (pa.concat_arrays(column.chunks) if column.num_chunks else
                  pa.array([], column.type))
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    n = len(column)
    if _kind(column.type).startswith("list<"):
        values = pc.list_flatten(column)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        if values.null_count:
            keep = pc.is_valid(values)
            values = values.filter(keep)
            parents = parents[keep.to_numpy(zero_copy_only=False)]
        lengths = np.bincount(parents, minlength=n).astype(np.int32)
    else:
        if column.null_count:
            keep = pc.is_valid(column)
            values = column.filter(keep)
            lengths = keep.to_numpy(zero_copy_only=False).astype(np.int32)
        else:
            values, lengths = column, np.ones(n, np.int32)
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_integer(values.type):  # any width; uint64 past 2**63 wraps (same hash)
        values = values.cast(pa.int64(), safe=False)
    elif pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        values = values.cast(pa.large_string())
    return values, lengths


@dataclass
class Vocabulary:
    """A table's distinct values, most frequent first: value ``values[i]`` is row ``i + 1``.

    Row 0 is for values not in it. ``counts`` are their training counts.
    """

    table: str
    values: object  # pyarrow array: int64 or large_string
    counts: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.values) + 1

    def lookup(self, values) -> np.ndarray:
        """Rows (int64) of ``values`` (a pyarrow array of the vocabulary's type): 0 if unknown."""
        import pyarrow.compute as pc

        idx = pc.index_in(values, value_set=self.values)
        return np.asarray(idx.fill_null(-1).to_numpy(zero_copy_only=False), np.int64) + 1

    # saved as arrays (checkpoints): int64 values, or UTF-8 bytes and int64 offsets
    def to_arrays(self) -> dict[str, np.ndarray]:
        pa = _pa()
        out = {"counts": np.asarray(self.counts, np.int64)}
        if pa.types.is_integer(self.values.type):
            out["ints"] = np.asarray(self.values.to_numpy(zero_copy_only=False), np.int64)
        else:
            arr = self.values.cast(pa.large_string())
            bufs = arr.buffers()
            off = np.frombuffer(bufs[1], np.int64)[arr.offset:arr.offset + len(arr) + 1]
            data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(
                0, np.uint8)
            out["offsets"] = (off - off[0]).astype(np.int64)
            out["bytes"] = np.ascontiguousarray(data[off[0]:off[-1]])
        return out

    @classmethod
    def from_arrays(cls, table: str, arrays: dict) -> "Vocabulary":
        pa = _pa()
        counts = np.asarray(arrays["counts"], np.int64)
        if "ints" in arrays:
            values = pa.array(np.asarray(arrays["ints"], np.int64), pa.int64())
        else:
            off = np.asarray(arrays["offsets"], np.int64)
            values = pa.Array.from_buffers(pa.large_string(), len(off) - 1,
                                           [None, pa.py_buffer(off.tobytes()),
                                            pa.py_buffer(np.asarray(arrays["bytes"],
                                                                    np.uint8).tobytes())])
        return cls(table, values, counts)


@dataclass
class ColumnStats:
    """One column: its type, records, nulls, distinct values (ints and strings), lengths."""

    column: str
    type: str
    records: int = 0
    nulls: int = 0
    distinct: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    mean_length: float | None = None
    minimum: float | None = None
    maximum: float | None = None

    @property
    def null_share(self) -> float:
        return self.nulls / self.records if self.records else 0.0

    def to_dict(self) -> dict:
        out = {"column": self.column, "type": self.type, "records": self.records,
               "nulls": self.nulls, "null_share": round(self.null_share, 6)}
        for k in ("distinct", "min_length", "max_length", "mean_length", "minimum", "maximum"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass
class DataStats:
    """What :func:`scan` found: per column, the label's counts, the tables' vocabularies."""

    records: int
    columns: dict
    positives: int | None
    vocabularies: dict
    table_rows: dict
    dense: DenseTransforms | None = None  # with a schema: its dense columns' statistics

    def to_dict(self) -> dict:
        out = {"records": self.records, "positives": self.positives,
               "columns": [c.to_dict() for c in self.columns.values()],
               "tables": dict(self.table_rows)}
        if self.dense is not None:
            out["dense"] = [dict(c.to_dict(), formula=c.formula(),
                                 model_range=list(c.model_range()))
                            for c in self.dense.columns]
        return out


class _Counter:
    """Value counts merged across row groups (a pyarrow table of values and counts)."""

    def __init__(self):
        self.parts = []
        self.pending = 0

    def add(self, values) -> None:
        import pyarrow.compute as pc

        if len(values):
            vc = pc.value_counts(values)
            self.parts.append(vc)
            self.pending += len(vc)
            if self.pending > (1 << 22) and len(self.parts) > 1:
                self.parts = [self.merged_struct()]
                self.pending = len(self.parts[0])

    def merged(self):
        pa = _pa()
        if not self.parts:
            return pa.table({"values": pa.array([], pa.int64()),
                             "counts": pa.array([], pa.int64())})
        t = pa.Table.from_arrays([pa.chunked_array([p.field("values") for p in self.parts]),
                                  pa.chunked_array([p.field("counts") for p in self.parts])],
                                 names=["values", "counts"])
        if len(self.parts) > 1:
            t = t.group_by("values").aggregate([("counts", "sum")]).rename_columns(
                ["values", "counts"])
        return t

    def merged_struct(self):
        pa = _pa()
        t = self.merged().combine_chunks()
        return pa.StructArray.from_arrays([t.column("values").chunk(0),
                                           t.column("counts").chunk(0)],
                                          names=["values", "counts"])


def _vocabulary(table: str, feature: SparseFeature, counter: _Counter) -> Vocabulary:
    pa = _pa()
    import pyarrow.compute as pc

    t = counter.merged()
    if feature.min_count > 1:
        t = t.filter(pc.greater_equal(t.column("counts"), feature.min_count))
    order = pc.sort_indices(t, sort_keys=[("counts", "descending"), ("values", "ascending")])
    t = t.take(order)
    if feature.rows:
        t = t.slice(0, feature.rows - 1)
    values = t.column("values")
    values = (pa.concat_arrays(values.chunks) if values.num_chunks else
              pa.array([], values.type))
    counts = np.asarray(t.column("counts").to_numpy(), np.int64)
    return Vocabulary(table, values, counts)


def scan(source: ParquetSource, schema: DataSchema | None = None, *,
         columns: Sequence[str] | None = None, distinct: bool = False,
         comm=None) -> DataStats:
    """Read the columns once: per column stats, the label's check, the vocabularies.

    With ``schema``: its columns, its label checked to be 0/1 (a DataFormatError
    names the file, the row and the value), its tables' rows (a vocabulary's
    size, or ``rows`` of a hashed one). Without: ``columns`` (default all).
    Distinct values are counted for the sparse columns, and with ``distinct``
    (or without a schema) for every integer or string column.

    With a schema, the dense columns' statistics (after fill and clip) are
    taken per row group and merged in row-group order
    (:class:`~embedding.data.transforms.DenseTransforms`); a dense value of
    inf or -inf left after the clip is refused, naming the file and row.

    ``comm`` (an mpi4py communicator) shares the work: rank ``r`` of ``n``
    reads row groups ``r, r + n, ...`` and the ranks exchange their counts,
    so each reads ``1/n`` of the data and every rank gets what one rank's
    scan gives bit for bit (a vocabulary orders by count, then value; the
    dense statistics merge in row-group order). An error in any rank's share
    (the first in file order) is raised on every rank.
    """
    cols = list(schema.columns() if schema is not None else (columns or source.types))
    sparse = {f.column for f in schema.sparse} if schema is not None else set(cols)
    counted = [c for c in cols
               if source.kind(c).removeprefix("list<").removesuffix(">") in ("int", "string")
               and (c in sparse or (distinct and c != schema.label))]
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    part = _ScanPart(source, schema, cols, counted)
    try:
        for index in range(rank, len(source.row_groups), size):
            part.add(index)
    except (DataFormatError, OSError, ValueError) as exc:
        part.error = (index, exc)
    parts = comm.allgather(part.shareable()) if size > 1 else [part.shareable()]
    errors = [p["error"] for p in parts if p["error"] is not None]
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    stats = {c: ColumnStats(c, str(source.types[c])) for c in cols}
    for p in parts:
        for c, s in stats.items():
            _merge_stats(s, p["stats"][c])
    totals = {}
    for c in counted:  # every share's counts of a column merged once
        merged = _Counter()
        merged.parts = [p["counts"][c] for p in parts if p["counts"][c] is not None]
        totals[c] = merged.merged_struct()
    for c, s in stats.items():
        if s.min_length is not None:
            s.mean_length = round(sum(p["sums"].get(c, 0.0) for p in parts) / max(s.records, 1),
                                  4)
        if c in totals:
            s.distinct = len(totals[c])
    positives = sum(p["positives"] for p in parts) if schema is not None else None
    dense = None
    if schema is not None:  # every row group's moments, merged in row-group order
        groups = sorted((g, m) for p in parts for g, m in p["moments"].items())
        merged = {d.column: Moments() for d in schema.dense}
        for _, per_column in groups:
            for c, m in per_column.items():
                merged[c] = merged[c].merge(m)
        dense = DenseTransforms.from_moments(schema, merged)
    vocabularies, table_rows = {}, {}
    if schema is not None:
        for table, feats in schema.tables().items():
            f = feats[0]
            if f.encoding == "hash":
                table_rows[table] = f.rows
                continue
            merged = _Counter()  # the table's columns together (one: as it is)
            merged.parts = [totals[g] for g in dict.fromkeys(x.column for x in feats)]
            vocab = _vocabulary(table, f, merged)
            vocabularies[table] = vocab
            table_rows[table] = vocab.num_rows
    return DataStats(source.num_records, stats, positives, vocabularies, table_rows, dense)


class _ScanPart:
    """One rank's share of a :func:`scan`: stats and value counts of the row groups it read."""

    def __init__(self, source: ParquetSource, schema, cols, counted):
        self.source, self.schema, self.cols = source, schema, cols
        self.stats = {c: ColumnStats(c, str(source.types[c])) for c in cols}
        self.counters = {c: _Counter() for c in counted}
        self.sums: dict[str, float] = {}
        self.moments: dict[int, dict[str, Moments]] = {}  # row group -> dense column -> moments
        self.positives = 0
        self.error = None

    def add(self, index: int) -> None:
        pa = _pa()
        import pyarrow.compute as pc

        source = self.source
        t = source.read_row_group(index, self.cols)
        for c in self.cols:
            col = t.column(c)
            s = self.stats[c]
            n = len(col)
            s.records += n
            s.nulls += col.null_count
            kind = source.kind(c)
            if kind.startswith("list<"):
                lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
                _merge_stats(s, ColumnStats(c, s.type, min_length=int(lens.min()),
                                            max_length=int(lens.max())))
                self.sums[c] = self.sums.get(c, 0.0) + float(lens.sum())
            elif kind in ("int", "float", "bool") and col.null_count < n:
                mm = pc.min_max(col.cast(pa.float64()) if kind == "bool" else col)
                lo, hi = mm["min"].as_py(), mm["max"].as_py()
                if lo is not None:
                    _merge_stats(s, ColumnStats(c, s.type, minimum=float(lo),
                                                maximum=float(hi)))
            if c in self.counters:
                self.counters[c].add(_flat(col, pa)[0])
        if self.schema is not None:
            self.positives += _label_positives(t.column(self.schema.label), source, index)
            moments = {}
            for i, d in enumerate(self.schema.dense):
                x = transform_values(dense_values(t.column(d.column), d.fill, pa)[0],
                                     "none", d.clip)  # fill and clip: what the moments describe
                bad = ~np.isfinite(x)
                if bad.any():
                    row = int(np.flatnonzero(bad)[0])
                    raise DataFormatError(
                        f"dense column {d.column!r}: {x[row]} at row {row} of the row group; "
                        f"the model needs finite numbers (clip it with data.dense[{i}].clip "
                        f"= [lo, hi], or clean the file)", path=source.where(index))
                moments[d.column] = Moments.of(x)
            self.moments[index] = moments

    def shareable(self) -> dict:
        """What the other ranks need (plain data and Arrow arrays: it pickles)."""
        import pickle

        error = self.error
        if error is not None:
            try:
                pickle.loads(pickle.dumps(error[1]))
            except Exception:  # an error that does not travel: its message does
                error = (error[0], DataFormatError(str(error[1])))
        return {"stats": self.stats, "sums": self.sums, "positives": self.positives,
                "error": error, "moments": self.moments,
                "counts": {c: (k.merged_struct() if k.parts else None)
                           for c, k in self.counters.items()}}


def _merge_stats(into: ColumnStats, other: ColumnStats) -> None:
    """Fold ``other``'s lengths and range into ``into`` (records and nulls: when given)."""
    if other is not into and other.records:
        into.records += other.records
        into.nulls += other.nulls
    for key, pick in (("min_length", min), ("max_length", max), ("minimum", min),
                      ("maximum", max)):
        v = getattr(other, key)
        if v is not None:
            cur = getattr(into, key)
            setattr(into, key, v if cur is None else pick(cur, v))


def check_label_column(source: ParquetSource, label: str) -> int:
    """Read ``label`` of every row group: DataFormatError unless 0/1; returns the positives."""
    return sum(_label_positives(source.read_row_group(i, [label]).column(label), source, i)
               for i in range(len(source.row_groups)))


def _label_positives(col, source: ParquetSource, index: int) -> int:
    """Positives in ``col``; DataFormatError at the first null or value other than 0/1."""
    pa = _pa()
    import pyarrow.compute as pc

    if col.null_count:
        row = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
        raise DataFormatError(f"label column: a null label at row {row} of the row group",
                              path=source.where(index))
    if pa.types.is_boolean(col.type):
        return int(pc.sum(col.cast(pa.int64())).as_py() or 0)
    from embedding.dense.checks import check_labels
    from embedding.types import BatchError

    arr = np.asarray(col.to_numpy(), np.float64)
    try:
        check_labels(arr, name="label column")
    except BatchError as exc:  # the file's row and value, as the file holds it
        row = exc.index
        value = col[row].as_py()
        raise DataFormatError(f"label column: {value!r} at row {row} of the row group is not "
                              f"0 or 1", path=source.where(index)) from None
    return int(arr.sum())
