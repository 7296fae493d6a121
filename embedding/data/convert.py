"""Conversion of data files to Parquet: Criteo text, delimited text (CSV/TSV), neocomm binary.

Each converter reads a list of input files in order into one Parquet file and
returns the number of records written:

* :func:`criteo_to_parquet`: Criteo text (or ``.gz``) to columns ``label``
  (int8 0/1), ``I1..I13`` (int64, null when empty) and ``C1..C26`` (string,
  null when empty): raw values, not hashed; a categorical is written as its 8
  hex digits in lower case (as in the Criteo release);
* :func:`delimited_to_parquet`: CSV/TSV (or ``.gz``) with or without a header
  row; named columns split into lists;
* :func:`binary_to_parquet`: neocomm's binary layout (already preprocessed:
  dense float32, ids as rows of their tables) to ``label``, dense and one
  column per sparse feature.

Memory stays bounded: the inputs are read a chunk at a time and written a row
group at a time. The output appears only when complete: it is written to a
temporary name in the output's directory and renamed at the end; on an error
the temporary file is removed. A missing, empty or malformed input raises
:class:`~embedding.data.types.DataFormatError` naming the file (and the line or
column where known). pyarrow is imported on first use.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets

import numpy as np

from embedding.data.types import (DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES,
                                  CommitOnExit, DataFormatError)

__all__ = ["DEFAULT_ROW_GROUP_SIZE", "criteo_to_parquet", "delimited_to_parquet",
           "binary_to_parquet"]

#: Records per Parquet row group written (and held in memory before it is written):
#: 131072 Criteo records are about 55 MB of Arrow columns.
DEFAULT_ROW_GROUP_SIZE = 1 << 17
_CHUNK_LINES = 1 << 16     # Criteo text lines parsed at a time
_CHUNK_RECORDS = 1 << 16   # binary records read at a time
_BLOCK_BYTES = 1 << 20     # CSV bytes parsed at a time (types are inferred from the first block)
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)
_HEX_SHIFTS = np.arange(28, -1, -4, dtype=np.uint32)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"writing Parquet needs pyarrow (pip install pyarrow): {exc}") from exc
    return pyarrow


def _check_row_group_size(row_group_size) -> int:
    if isinstance(row_group_size, bool) or not isinstance(row_group_size, int) \
            or row_group_size <= 0:
        raise ValueError(f"row_group_size: expected a positive int (records), got "
                         f"{row_group_size!r}")
    return row_group_size


def _input_paths(inputs, output) -> list[str]:
    """The input paths in order, each an existing non-empty file that is not ``output``."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise ValueError("inputs: expected at least one input file, got none")
    out = os.path.realpath(os.fspath(output))
    for p in paths:
        if not os.path.exists(p):
            raise DataFormatError("no such file", path=p)
        if not os.path.isfile(p):
            raise DataFormatError("not a regular file", path=p)
        if os.path.getsize(p) == 0:
            raise DataFormatError("the file is empty", path=p)
        if os.path.realpath(p) == out:
            raise ValueError(f"output: expected a file other than the inputs, got {output}")
    return paths


class _ParquetOutput(CommitOnExit):
    """Tables of one schema to a temporary Parquet file in row groups; renamed on close.

    A context manager: leaving it by an exception removes the temporary file.
    """

    def __init__(self, output, schema, row_group_size: int):
        pa = _pyarrow()
        self.path = os.fspath(output)
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise ValueError(f"output: the directory {directory} does not exist")
        self.tmp = os.path.join(directory, f".{os.path.basename(self.path)}."
                                           f"{secrets.token_hex(4)}.tmp")
        self.schema = schema
        self.row_group_size = row_group_size
        self.num_records = 0
        self._pending = []
        self._held = 0
        self._writer = pa.parquet.ParquetWriter(self.tmp, schema)

    def write(self, table) -> None:
        """Append ``table`` (the output's schema); whole row groups are written as they fill."""
        self._pending.append(table)
        self._held += table.num_rows
        self.num_records += table.num_rows
        while self._held >= self.row_group_size:
            self._flush(self.row_group_size)

    def _flush(self, n: int) -> None:
        import pyarrow as pa

        table = pa.concat_tables(self._pending)
        self._writer.write_table(table.slice(0, n), row_group_size=n)
        self._pending = [table.slice(n)]
        self._held -= n

    def close(self) -> None:
        """Write the last row group, close, fsync and rename into place."""
        if self._held:
            self._flush(self._held)
        self._pending = []
        self._writer.close()
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Drop the partial file."""
        try:
            self._writer.close()
        except Exception:  # the file is dropped anyway; the original error matters
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------- Criteo text


def _criteo_schema(pa):
    return pa.schema([("label", pa.int8())] + [(n, pa.int64()) for n in DENSE_NAMES]
                     + [(n, pa.string()) for n in SPARSE_NAMES])


def _hex_strings(pa, values: np.ndarray, missing: np.ndarray):
    """A string array of ``values`` (uint32) as 8 lower-case hex digits, null where ``missing``."""
    n = values.shape[0]
    digits = _HEX_DIGITS[(values[:, None] >> _HEX_SHIFTS) & 0xF]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    nulls = int(missing.sum())
    valid = pa.py_buffer(np.packbits(~missing, bitorder="little")) if nulls else None
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(digits.tobytes()),
                                       valid, nulls)


def _criteo_table(pa, raw, schema):
    cols = [pa.array(raw.labels.astype(np.int8))]
    cols += [pa.array(raw.ints[:, j], pa.int64(), mask=raw.int_missing[:, j])
             for j in range(NUM_DENSE)]
    cols += [_hex_strings(pa, raw.cats[:, j], raw.cat_missing[:, j]) for j in range(NUM_SPARSE)]
    return pa.Table.from_arrays(cols, schema=schema)


def criteo_to_parquet(inputs, output, *, row_group_size: int = DEFAULT_ROW_GROUP_SIZE) -> int:
    """Convert Criteo text files (plain or ``.gz``, in order) to one Parquet file; the record count.

    Columns: ``label`` int8 (0/1), ``I1..I13`` int64 and ``C1..C26`` string
    (the 8 hex digits, lower case), each null where the text field is empty.
    DataFormatError names the file (and the 1-based line) of a missing, empty
    or malformed input.
    """
    from embedding.data.criteo import iter_raw_chunks

    pa = _pyarrow()
    _check_row_group_size(row_group_size)
    paths = _input_paths(inputs, output)
    schema = _criteo_schema(pa)
    with _ParquetOutput(output, schema, row_group_size) as out:
        for path in paths:
            before = out.num_records
            for raw in iter_raw_chunks(path, min(row_group_size, _CHUNK_LINES)):
                out.write(_criteo_table(pa, raw, schema))
            if out.num_records == before:
                raise DataFormatError("holds no records", path=path)
        return out.num_records


# ---------------------------------------------------------------------------- CSV / TSV


class _CsvFile:
    """One delimited file opened for streaming; pyarrow's errors become DataFormatError."""

    def __init__(self, path, *, delimiter, header, names, list_separator, block_size):
        self.path = path
        self.delimiter = delimiter
        self.header = header
        self.names = names          # the columns of the first file (None while probing it)
        self.list_separator = list_separator
        self.block_size = block_size
        self._bad_rows = []

    def _on_invalid_row(self, row):
        self._bad_rows.append(row)
        return "error"

    def open(self, column_types=None, include=None):
        """A streaming reader (its first block already parsed)."""
        import pyarrow.csv as csv

        read = csv.ReadOptions(block_size=self.block_size, use_threads=False,
                               autogenerate_column_names=not self.header and self.names is None,
                               column_names=None if self.header else self.names)
        parse = csv.ParseOptions(delimiter=self.delimiter, invalid_row_handler=self._on_invalid_row)
        convert = csv.ConvertOptions(column_types=column_types or {}, null_values=[""],
                                     strings_can_be_null=True, include_columns=include or [])
        with self._errors():
            return csv.open_csv(self.path, read_options=read, parse_options=parse,
                                convert_options=convert)

    def batches(self, reader):
        """The record batches of ``reader``."""
        with self._errors():
            yield from reader

    @contextlib.contextmanager
    def _errors(self):
        import pyarrow as pa

        try:
            yield
        except (pa.ArrowException, OSError) as exc:
            if self._bad_rows:
                row = self._bad_rows[0]
                raise DataFormatError(f"expected {row.expected_columns} "
                                      f"{_sep_name(self.delimiter)}-separated fields, got "
                                      f"{row.actual_columns}", path=self.path,
                                      line=-1 if row.number is None else row.number) from None
            text = str(exc)
            m = re.search(r"In CSV column #(\d+): (?:Row #(\d+): )?CSV conversion error to "
                          r"(\S+): (.*)", text)
            if m and self.names is not None and int(m.group(1)) < len(self.names):
                raise DataFormatError(f"column {self.names[int(m.group(1))]!r}: {m.group(4)} "
                                      f"for {m.group(3)} (column types are inferred from the "
                                      "first block of the first file; a later value must fit)",
                                      path=self.path,
                                      line=int(m.group(2)) if m.group(2) else -1) from None
            raise DataFormatError(text, path=self.path) from None


def _sep_name(delimiter: str) -> str:
    return {"\t": "tab", ",": "comma"}.get(delimiter, repr(delimiter))


def _list_element_types(pa, files, list_columns) -> dict:
    """``{column: int64 or string}``: int64 when every element of every file parses as an int."""
    import pyarrow.compute as pc

    ints = {c: True for c in list_columns}
    seen = {c: False for c in list_columns}
    for f in files:
        reader = f.open({c: pa.string() for c in list_columns}, include=list(list_columns))
        for batch in f.batches(reader):
            for c in [c for c in list_columns if ints[c]]:
                flat = pc.list_flatten(pc.split_pattern(batch.column(c), f.list_separator))
                seen[c] = seen[c] or len(flat) > 0
                try:
                    pc.cast(flat, pa.int64())
                except pa.ArrowInvalid:
                    ints[c] = False
            if not any(ints.values()):
                return {c: pa.string() for c in list_columns}
    return {c: pa.int64() if ints[c] and seen[c] else pa.string() for c in list_columns}


def delimited_to_parquet(inputs, output, *, delimiter: str = ",", header: bool = True,
                         list_columns=(), list_separator: str = "|",
                         row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
                         block_size: int = _BLOCK_BYTES) -> int:
    """Convert CSV/TSV files (plain or ``.gz``, in order) to one Parquet file; the record count.

    The first row names the columns (``header``), else they are ``c0, c1, ...``;
    every file must have the first file's columns. Column types are inferred
    by pyarrow from the first ``block_size`` bytes of the first file (int64,
    double, bool, timestamps, else string; a column empty there is string);
    an empty cell is null. Each column of ``list_columns`` is split on
    ``list_separator`` into ``list<int64>`` when every element of every file
    parses as an int, else ``list<string>``; an empty cell is an empty list.
    DataFormatError names the file and the column (or line) at fault.
    """
    pa = _pyarrow()
    if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in "\r\n":
        raise ValueError(f"delimiter: expected one character (not a newline), got {delimiter!r}")
    if not isinstance(list_separator, str) or not list_separator:
        raise ValueError(f"list_separator: expected a non-empty string, got {list_separator!r}")
    if isinstance(list_columns, str):
        list_columns = [list_columns]
    list_columns = tuple(dict.fromkeys(list_columns))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int (bytes), got {block_size!r}")
    _check_row_group_size(row_group_size)
    paths = _input_paths(inputs, output)

    def csv_file(path, names):
        return _CsvFile(path, delimiter=delimiter, header=header, names=names,
                        list_separator=list_separator, block_size=block_size)

    inferred = csv_file(paths[0], None).open().schema
    names = [field.name for field in inferred] if header else \
        [f"c{i}" for i in range(len(inferred))]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DataFormatError(f"the header names column(s) {', '.join(map(repr, twice))} more "
                              "than once", path=paths[0])
    for c in list_columns:
        if c not in names:
            raise DataFormatError(f"no column {c!r} to split into a list; the columns are "
                                  f"{', '.join(names)}", path=paths[0])
    files = [csv_file(p, names) for p in paths]
    for f in files[1:] if header else ():
        got = [field.name for field in f.open({n: pa.string() for n in names}).schema]
        if got != names:
            if len(got) != len(names):
                what = f"{len(got)} columns, the first file has {len(names)}"
            else:
                i = next(i for i, (a, b) in enumerate(zip(got, names)) if a != b)
                what = f"column {i + 1} is {got[i]!r}, the first file's is {names[i]!r}"
            raise DataFormatError(f"the header differs from the first file's ({paths[0]}): "
                                  f"{what}", path=f.path)

    column_types = {}
    for name, field in zip(names, inferred):
        null = pa.types.is_null(field.type)
        column_types[name] = pa.string() if null or name in list_columns else field.type
    elements = _list_element_types(pa, files, list_columns) if list_columns else {}
    schema = pa.schema([(n, pa.list_(elements[n]) if n in elements else column_types[n])
                        for n in names])

    with _ParquetOutput(output, schema, row_group_size) as out:
        for f in files:
            before = out.num_records
            for batch in f.batches(f.open(column_types)):
                out.write(pa.Table.from_arrays(
                    [_split(pa, batch.column(i), list_separator, schema.field(i).type)
                     if n in elements else batch.column(i) for i, n in enumerate(names)],
                    schema=schema))
            if out.num_records == before:
                raise DataFormatError("holds no records", path=f.path)
        return out.num_records


def _split(pa, column, separator: str, list_type):
    import pyarrow.compute as pc

    lists = pc.fill_null(pc.split_pattern(column, separator),
                         pa.scalar([], pa.list_(pa.string())))
    if list_type.value_type == pa.string():
        return lists
    return pa.ListArray.from_arrays(lists.offsets, pc.cast(lists.values, pa.int64()))


# ---------------------------------------------------------------------------- binary


def binary_to_parquet(inputs, output, *, row_group_size: int = DEFAULT_ROW_GROUP_SIZE) -> int:
    """Convert neocomm binary files (in order) to one Parquet file; the record count.

    Columns: ``label`` int8, the dense features float32 as stored (already
    preprocessed) named ``I1..I13`` (``dense_0..`` when there are not 13), and
    one column per sparse feature named after the file's feature names: int64
    when every record of every file has exactly one id, else ``list<int64>``
    (a missing value written as an empty bag becomes an empty list). Every
    file must have the first file's shape.
    """
    from embedding.data.binary import BinaryDataset

    pa = _pyarrow()
    _check_row_group_size(row_group_size)
    paths = _input_paths(inputs, output)
    datasets = [BinaryDataset(p) for p in paths]
    first = datasets[0]
    for ds in datasets:
        if (ds.num_dense, ds.num_sparse) != (first.num_dense, first.num_sparse):
            raise DataFormatError(f"{ds.num_dense} dense and {ds.num_sparse} sparse features, "
                                  f"the first file ({first.path}) has {first.num_dense} and "
                                  f"{first.num_sparse}", path=ds.path)
        if ds.num_records == 0:
            raise DataFormatError("holds no records", path=ds.path)
    sparse_names = first.read(0, 0).feature_names
    dense_names = (DENSE_NAMES if first.num_dense == NUM_DENSE
                   else tuple(f"dense_{j}" for j in range(first.num_dense)))
    is_list = np.zeros(first.num_sparse, bool)
    for ds in datasets:
        if ds.empty_bags:
            for a in range(0, ds.num_records, _CHUNK_RECORDS):
                is_list |= (ds.records["ids"][a:a + _CHUNK_RECORDS] < 0).any(axis=0)
    schema = pa.schema([("label", pa.int8())] + [(n, pa.float32()) for n in dense_names]
                       + [(n, pa.list_(pa.int64()) if is_list[f] else pa.int64())
                          for f, n in enumerate(sparse_names)])
    step = min(row_group_size, _CHUNK_RECORDS)
    with _ParquetOutput(output, schema, row_group_size) as out:
        for ds in datasets:
            for a in range(0, ds.num_records, step):
                batch = ds.read(a, min(a + step, ds.num_records))
                cols = [pa.array(batch.labels.astype(np.int8))]
                cols += [pa.array(np.ascontiguousarray(batch.dense[:, j]))
                         for j in range(ds.num_dense)]
                for f in range(ds.num_sparse):
                    values = pa.array(batch.values[f], pa.int64())
                    if is_list[f]:
                        offsets = np.zeros(batch.batch_size + 1, np.int32)
                        np.cumsum(batch.lengths[f], out=offsets[1:])
                        values = pa.ListArray.from_arrays(pa.array(offsets), values)
                    cols.append(values)
                out.write(pa.Table.from_arrays(cols, schema=schema))
        return out.num_records
