"""Parquet files seen as one sequence of records: :class:`ParquetSource`.

A source is one file, a list of files or a directory of ``*.parquet`` files
(files in the order given, a directory's in name order). Opening it checks
what can be checked before anything is trained: every path exists and is a
Parquet file with records, every column the
:class:`~embedding.data.schema.DataSchema` names is there with a type it can
take, and every file has the types of the first. (:mod:`embedding.data.parquet`
re-exports it.)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from embedding.data.schema import DataSchema
from embedding.data.types import DataFormatError
from embedding.data.types import pyarrow_module as _pa

__all__ = ["ParquetSource"]


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
