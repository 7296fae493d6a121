"""A data set described by its columns: the label, dense features and named sparse features.

This is what ``[data]`` of a training config says about a Parquet source::

    [data]
    source = "parquet"
    path = ["train.parquet"]
    eval_path = ["valid.parquet", "test.parquet"]
    label = "clicked"
    dense = ["age", "hour", {column = "income", fill = -1.0, indicator = true},
             {column = "price", clip = [0.0, 1e6], transform = "log"}]

    [[data.sparse]]
    name = "genres"          # the feature's name in logs, plans and checkpoints
    column = "genres"        # default: the name
    table = "genres"         # default: the name; features naming one table share it
    pooling = "mean"         # sum (default), mean or max

A sparse feature's values (integers of any width or strings, one per row or
a list per row) become table rows by ``encoding``:

* ``vocabulary`` (the default): the distinct values of the training data,
  most frequent first, are rows 1, 2, ...; row 0 is reserved for values the
  training data did not have (or had fewer than ``min_count`` times, or
  past the first ``rows - 1`` when ``rows`` caps the table). The table size
  comes from the data.
* ``hash``: row ``stable_hash(value) % rows`` (``rows`` is required); see
  :func:`embedding.data.parquet.stable_hash`.

A null value (or a null list) is an empty bag; null elements of a list are
skipped. Dense columns take ``fill`` (default 0, raw units) where they are
null or NaN, with an extra 0/1 column ``<column>_missing`` after them when
``indicator`` is set; then the optional ``clip = [lo, hi]`` (raw units) and
``transform`` (``standardize`` by default, ``log``, ``minmax`` or ``none``;
see :mod:`embedding.data.transforms`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from embedding.data.transforms import DEFAULT_TRANSFORM, TRANSFORMS
from embedding.data.types import SchemaError

__all__ = ["DenseColumn", "SparseFeature", "DataSchema", "SchemaError", "ENCODINGS",
           "POOLINGS", "dense_columns", "sparse_features"]

ENCODINGS = ("vocabulary", "hash")
POOLINGS = ("sum", "mean", "max")


@dataclass(frozen=True)
class DenseColumn:
    """A numeric column as one dense feature: ``fill`` where null or NaN (raw units), a
    missing flag, then ``clip`` (raw units, or None) and ``transform``."""

    column: str
    fill: float = 0.0
    indicator: bool = False
    transform: str = DEFAULT_TRANSFORM
    clip: tuple[float, float] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The dense features it makes: the column, then ``<column>_missing`` with the flag."""
        return (self.column, f"{self.column}_missing") if self.indicator else (self.column,)

    def to_config(self):
        if (self.fill == 0.0 and not self.indicator and self.transform == DEFAULT_TRANSFORM
                and self.clip is None):
            return self.column
        out = {"column": self.column, "fill": self.fill, "indicator": self.indicator}
        if self.transform != DEFAULT_TRANSFORM:
            out["transform"] = self.transform
        if self.clip is not None:
            out["clip"] = list(self.clip)
        return out


@dataclass(frozen=True)
class SparseFeature:
    """A column of ids (or lists of ids) read through table ``table``."""

    name: str
    column: str = ""
    table: str = ""
    pooling: str = "sum"
    encoding: str = "vocabulary"
    rows: int = 0
    min_count: int = 1
    multi_valued: bool | None = None  # None: whatever the column holds

    def __post_init__(self):
        if not self.column:
            object.__setattr__(self, "column", self.name)
        if not self.table:
            object.__setattr__(self, "table", self.name)

    def to_config(self) -> dict:
        out = {"name": self.name, "column": self.column, "table": self.table,
               "pooling": self.pooling, "encoding": self.encoding}
        if self.rows:
            out["rows"] = self.rows
        if self.min_count != 1:
            out["min_count"] = self.min_count
        if self.multi_valued is not None:
            out["multi_valued"] = self.multi_valued
        return out


@dataclass(frozen=True)
class DataSchema:
    """The label column, the dense columns and the sparse features, in this order."""

    label: str
    dense: tuple[DenseColumn, ...] = ()
    sparse: tuple[SparseFeature, ...] = field(default_factory=tuple)

    # ------------------------------------------------------------------ names
    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.sparse)

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(n for d in self.dense for n in d.names)

    @property
    def num_dense(self) -> int:
        return len(self.dense_names)

    def columns(self) -> tuple[str, ...]:
        """Every column the schema reads, once each, label first."""
        seen: dict[str, None] = {self.label: None}
        for d in self.dense:
            seen.setdefault(d.column)
        for f in self.sparse:
            seen.setdefault(f.column)
        return tuple(seen)

    def tables(self) -> dict[str, tuple[SparseFeature, ...]]:
        """Table name -> the features reading it, in the order tables are first named."""
        out: dict[str, list[SparseFeature]] = {}
        for f in self.sparse:
            out.setdefault(f.table, []).append(f)
        return {t: tuple(fs) for t, fs in out.items()}

    def to_config(self) -> dict:
        return {"label": self.label, "dense": [d.to_config() for d in self.dense],
                "sparse": [f.to_config() for f in self.sparse]}

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_config(cls, label: str, dense: Any = (), sparse: Any = ()) -> "DataSchema":
        """The schema of ``[data]``'s ``label``, ``dense`` and ``[[data.sparse]]`` (checked).

        Raises :class:`SchemaError` naming the key (``data.sparse[0].pooling``).
        """
        if not isinstance(label, str) or not label:
            raise SchemaError("data.label", f"expected the label's column name, got {label!r}")
        feats = sparse_features(sparse)
        if not feats:
            raise SchemaError("data.sparse", "expected at least one [[data.sparse]] feature")
        schema = cls(label, dense_columns(dense), feats)
        schema.check()
        return schema

    def check(self) -> None:
        """SchemaError for entries that contradict each other (names, columns, shared tables)."""
        names: dict[str, int] = {}
        for i, f in enumerate(self.sparse):
            if f.name in names:
                raise SchemaError(f"data.sparse[{i}].name", f"{f.name!r} is also the name of "
                                  f"data.sparse[{names[f.name]}]; feature names are unique")
            names[f.name] = i
        dense_cols = {}
        for i, d in enumerate(self.dense):
            if d.column in dense_cols:
                raise SchemaError(f"data.dense[{i}]", f"column {d.column!r} is listed twice")
            if d.column == self.label:
                raise SchemaError(f"data.dense[{i}]", f"{d.column!r} is the label column")
            dense_cols[d.column] = i
        for i, f in enumerate(self.sparse):
            if f.column == self.label:
                raise SchemaError(f"data.sparse[{i}].column", f"{f.column!r} is the label column")
        for table, feats in self.tables().items():
            first = feats[0]
            for f in feats[1:]:
                i = self.sparse.index(f)
                for key in ("pooling", "encoding", "rows", "min_count"):
                    if getattr(f, key) != getattr(first, key):
                        raise SchemaError(
                            f"data.sparse[{i}].{key}", f"feature {f.name!r} shares table "
                            f"{table!r} with {first.name!r}, which has {key} = "
                            f"{getattr(first, key)!r}, this one {getattr(f, key)!r}; features "
                            f"of one table need the same {key}")


def dense_columns(dense) -> tuple[DenseColumn, ...]:
    """``[data] dense``: column names, or tables ``{column, fill, indicator, transform,
    clip}`` (checked)."""
    if isinstance(dense, (str, Mapping)) or not isinstance(dense, (list, tuple)):
        raise SchemaError("data.dense", f"expected a list of column names (or tables "
                          f"with column, fill, indicator, transform, clip), got {dense!r}")
    return tuple(d if isinstance(d, DenseColumn) else _dense(i, d) for i, d in enumerate(dense))


def sparse_features(sparse) -> tuple[SparseFeature, ...]:
    """``[[data.sparse]]``: one table per feature (checked; may be empty here)."""
    if isinstance(sparse, (str, Mapping)) or not isinstance(sparse, (list, tuple)):
        raise SchemaError("data.sparse", f"expected [[data.sparse]] tables, got {sparse!r}")
    return tuple(s if isinstance(s, SparseFeature) else _sparse(i, s)
                 for i, s in enumerate(sparse))


_DENSE_KEYS = {"column", "fill", "indicator", "transform", "clip"}
_SPARSE_KEYS = {"name", "column", "table", "pooling", "encoding", "rows", "min_count",
                "multi_valued"}


def _dense(i: int, d) -> DenseColumn:
    key = f"data.dense[{i}]"
    if isinstance(d, str):
        if not d:
            raise SchemaError(key, "expected a column name, got ''")
        return DenseColumn(d)
    if not isinstance(d, Mapping):
        raise SchemaError(key, f"expected a column name or a table with column, fill, "
                          f"indicator, transform, clip, got {d!r}")
    unknown = sorted(set(d) - _DENSE_KEYS)
    if unknown:
        raise SchemaError(f"{key}.{unknown[0]}", f"unknown key; expected one of "
                          f"{sorted(_DENSE_KEYS)}")
    column = d.get("column")
    if not isinstance(column, str) or not column:
        raise SchemaError(f"{key}.column", f"expected a column name, got {column!r}")
    fill = d.get("fill", 0.0)
    if (isinstance(fill, bool) or not isinstance(fill, (int, float))
            or not math.isfinite(fill)):
        raise SchemaError(f"{key}.fill", f"expected a finite number (raw units), got {fill!r}")
    indicator = d.get("indicator", False)
    if not isinstance(indicator, bool):
        raise SchemaError(f"{key}.indicator", f"expected true or false, got {indicator!r}")
    transform = d.get("transform", DEFAULT_TRANSFORM)
    if transform not in TRANSFORMS:
        raise SchemaError(f"{key}.transform", f"expected one of {list(TRANSFORMS)}, "
                          f"got {transform!r}")
    clip = d.get("clip")
    if clip is not None:
        ok = (isinstance(clip, (list, tuple)) and len(clip) == 2
              and all(not isinstance(v, bool) and isinstance(v, (int, float))
                      and math.isfinite(v) for v in clip))
        if not ok:
            raise SchemaError(f"{key}.clip", f"expected [lo, hi], two finite numbers (raw "
                              f"units), got {clip!r}")
        if not clip[0] < clip[1]:
            raise SchemaError(f"{key}.clip", f"expected [lo, hi] with lo < hi, got {clip!r}")
        clip = (float(clip[0]), float(clip[1]))
    return DenseColumn(column, float(fill), indicator, transform, clip)


def _sparse(i: int, s) -> SparseFeature:
    key = f"data.sparse[{i}]"
    if not isinstance(s, Mapping):
        raise SchemaError(key, f"expected a table with name, column, table, pooling, got {s!r}")
    unknown = sorted(set(s) - _SPARSE_KEYS)
    if unknown:
        raise SchemaError(f"{key}.{unknown[0]}", f"unknown key; expected one of "
                          f"{sorted(_SPARSE_KEYS)}")
    name = s.get("name", s.get("column"))
    if not isinstance(name, str) or not name:
        raise SchemaError(f"{key}.name", f"expected a feature name, got {name!r}")
    out = {"name": name}
    for k in ("column", "table"):
        v = s.get(k, name)
        if not isinstance(v, str) or not v:
            raise SchemaError(f"{key}.{k}", f"expected a name, got {v!r}")
        out[k] = v
    for k, choices in (("pooling", POOLINGS), ("encoding", ENCODINGS)):
        v = s.get(k, choices[0])
        if v not in choices:
            raise SchemaError(f"{key}.{k}", f"expected one of {list(choices)}, got {v!r}")
        out[k] = v
    for k, least in (("rows", 0), ("min_count", 1)):
        v = s.get(k, least if k == "min_count" else 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise SchemaError(f"{key}.{k}", f"expected an int >= {least}, got {v!r}")
        out[k] = v
    if out["encoding"] == "hash" and out["rows"] < 1:
        raise SchemaError(f"{key}.rows", "required with encoding = \"hash\": the number of "
                          "rows the values are hashed into")
    if out["encoding"] == "vocabulary" and out["rows"] == 1:
        raise SchemaError(f"{key}.rows", "1 leaves no row beside the reserved row 0 for "
                          "unknown values; expected >= 2 (or 0: as many as the data has)")
    mv = s.get("multi_valued")
    if mv is not None and not isinstance(mv, bool):
        raise SchemaError(f"{key}.multi_valued", f"expected true or false, got {mv!r}")
    out["multi_valued"] = mv
    return SparseFeature(**out)
