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

The stable hash of ``encoding = "hash"`` (:func:`stable_hash`, defined in
:mod:`embedding.data.hashing`): the row is the hash modulo the table's rows.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from embedding.data.batch import Batch
from embedding.data.hashing import hash_ints, hash_strings, stable_hash
from embedding.data.schema import DataSchema, SparseFeature
from embedding.data.transforms import DenseTransforms, Moments, dense_values, transform_values
from embedding.data.types import DataFormatError
from embedding.data.types import pyarrow_module as _pa

__all__ = ["ParquetSource", "ParquetDataset", "Vocabulary", "ColumnStats", "DataStats", "scan",
           "check_label_column", "describe_rows", "table_rows", "stable_hash", "hash_strings",
           "hash_ints"]


# ---------------------------------------------------------------------- the files
def _kind(t) -> str:
    """``int``, ``float``, ``bool``, ``string``, ``list<int>``, ``list<string>``... or ``other``."""
    pa = _pa()
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{_kind(t.value_type)}>"
    return "other"


def _expand(paths: Sequence) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = sorted(q for q in p.iterdir() if q.suffix == ".parquet" and q.is_file())
            if not files:
                raise DataFormatError("a directory with no .parquet files", path=str(p))
            out.extend(files)
        elif p.exists():
            out.append(p)
        else:
            hint = ""
            if p.suffix in (".csv", ".tsv", ".txt", ".gz"):
                hint = " (convert text files with: neocomm data convert FILE -o FILE.parquet)"
            raise DataFormatError(f"no such file or directory{hint}", path=str(p))
    if not out:
        raise DataFormatError("no files given")
    return out


class ParquetSource:
    """Parquet files seen as one sequence of records; checked against ``schema`` when given.

    ``row_groups`` lists ``(file index, row group, first record, records)``.
    """

    def __init__(self, paths, schema: DataSchema | None = None, *, columns=None,
                 label_optional: bool = False):
        pa = _pa()
        import pyarrow.parquet as pq

        self.paths = _expand(paths)
        self.schema = schema
        self.files = []
        self.row_groups: list[tuple[int, int, int, int]] = []
        first_types = None
        total = 0
        for i, p in enumerate(self.paths):
            try:
                f = pq.ParquetFile(p)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataFormatError(f"not a Parquet file ({exc})", path=str(p)) from None
            self.files.append(f)
            types = {name: f.schema_arrow.field(name).type for name in f.schema_arrow.names}
            if f.metadata.num_rows == 0:
                raise DataFormatError("no records (an empty file)", path=str(p))
            if first_types is None:
                first_types = types
                self.arrow_schema = f.schema_arrow
            wanted = (schema.columns() if schema is not None else
                      (list(columns) if columns is not None else list(first_types)))
            if schema is not None and label_optional and schema.label not in first_types:
                wanted = [c for c in wanted if c != schema.label]
            for col in wanted:
                if col not in types:
                    raise DataFormatError(f"no column {col!r}; it has {sorted(types)}",
                                          path=str(p))
                if i and col in first_types and types[col] != first_types[col]:
                    raise DataFormatError(
                        f"column {col!r} is {types[col]}, but {self.paths[0]} has it as "
                        f"{first_types[col]}; every file needs the same types", path=str(p))
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                if n:
                    self.row_groups.append((i, g, total, n))
                    total += n
        self.num_records = total
        self.types = first_types
        #: whether the files have the schema's label (scoring data may not)
        self.has_label = schema is None or schema.label in first_types
        #: the columns a reader decodes: the schema's that the files have
        self.read_columns = (tuple(c for c in schema.columns() if c in first_types)
                             if schema is not None else tuple(wanted))
        if schema is not None:
            self._check_types(schema)
        self.starts = np.array([r[2] for r in self.row_groups] + [total], np.int64)

    def kind(self, column: str) -> str:
        return _kind(self.types[column])

    def _check_types(self, schema: DataSchema) -> None:
        where = str(self.paths[0])
        k = self.kind(schema.label) if self.has_label else "bool"
        if k not in ("bool", "int", "float"):
            raise DataFormatError(f"label column {schema.label!r} is {self.types[schema.label]}; "
                                  f"expected 0/1 integers or booleans", path=where)
        for d in schema.dense:
            k = self.kind(d.column)
            if k not in ("bool", "int", "float"):
                raise DataFormatError(f"dense column {d.column!r} is "
                                      f"{self.types[d.column]}; expected numbers (a "
                                      f"categorical column goes under [[data.sparse]])",
                                      path=where)
        for f in schema.sparse:
            k = self.kind(f.column)
            base = k[5:-1] if k.startswith("list<") else k
            if base not in ("int", "string"):
                raise DataFormatError(f"sparse feature {f.name!r}: column {f.column!r} is "
                                      f"{self.types[f.column]}; expected integers or strings, "
                                      f"or lists of them", path=where)
            if f.multi_valued is False and k.startswith("list<"):
                raise DataFormatError(f"sparse feature {f.name!r}: column {f.column!r} is a "
                                      f"list column ({self.types[f.column]}) but the feature "
                                      f"is declared multi_valued = false", path=where)
            if f.multi_valued is True and not k.startswith("list<"):
                raise DataFormatError(f"sparse feature {f.name!r}: column {f.column!r} is "
                                      f"{self.types[f.column]}, not a list, but the feature is "
                                      f"declared multi_valued = true", path=where)
        for table, feats in schema.tables().items():
            bases = {self.kind(f.column).removeprefix("list<").removesuffix(">")
                     for f in feats}
            if len(bases) > 1:
                kinds = ", ".join(f"{f.column}: {self.kind(f.column)}" for f in feats)
                raise DataFormatError(f"table {table!r} is read by columns of different "
                                      f"value types ({kinds}); "
                                      f"features of one table need one value type", path=where)

    def read_row_group(self, index: int, columns: Iterable[str]):
        """Row group ``index`` (of :attr:`row_groups`) as a pyarrow Table of ``columns``."""
        fi, g, _, _ = self.row_groups[index]
        try:
            return self.files[fi].read_row_group(g, columns=list(columns))
        except Exception as exc:  # pyarrow raises its own kinds for corrupt pages
            raise DataFormatError(f"row group {g} cannot be read ({exc})",
                                  path=str(self.paths[fi])) from None

    def locate(self, record: int) -> int:
        """Index (into :attr:`row_groups`) of the row group holding ``record``."""
        return int(np.searchsorted(self.starts, record, side="right")) - 1

    def where(self, index: int) -> str:
        """``FILE, row group G`` of row group ``index`` (for messages)."""
        fi, g, _, _ = self.row_groups[index]
        return f"{self.paths[fi]}, row group {g}"

    def describe(self) -> str:
        names = ", ".join(str(p) for p in self.paths[:3])
        more = f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else ""
        return f"{names}{more}"


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
