"""Read a table list for the planner from a TOML or JSON file.

The file holds one list, ``tables``, of entries with these keys (TOML)::

    [[tables]]
    name = "user_id"          # required, unique
    num_rows = 40000000       # required, > 0
    dim = 128                 # required, > 0
    dtype = "float32"         # float32 | float16 | bfloat16 | float64
    pooling = "sum"           # sum | mean | max (max: not row-wise)
    features = ["user_id"]    # features that read the table (default: its name)
    ids_per_sample = 1.0      # mean ids per sample (default: the workload's)
    sharding = ["row_wise"]   # allowed shardings, one string or a list (default: any)
    column_slices = 4         # fixed number of column slices (default: any)
    zipf_exponent = 1.2       # ids follow Zipf(s) over the rows (default: the workload's)
    hit_rate = 0.9            # or: a measured device cache hit rate (not with zipf_exponent)
    [tables.optimizer]
    kind = "rowwise_adagrad"  # sgd | rowwise_adagrad | adam
    lr = 0.01

JSON is the same structure: ``{"tables": [{"name": ..., ...}, ...]}``.
Unknown keys and values of the wrong type raise :class:`TableFileError`
naming the file and the key.
"""
from __future__ import annotations

import json
import os

from embedding.planner.estimate import DTYPES
from embedding.planner.types import TableConstraints
from embedding.types import OptimizerKind, Pooling, ShardingType, TableConfig

__all__ = ["load_tables", "parse_tables", "preset_tables", "TableFileError"]


class TableFileError(ValueError):
    """A table file is malformed; ``path`` is the file, ``key`` the offending key."""

    def __init__(self, path: str, key: str, message: str):
        super().__init__(f"{path}: {key}: {message}" if key else f"{path}: {message}")
        self.path, self.key = path, key

    def __reduce__(self):
        return (TableFileError, (self.path, self.key, str(self).split(": ", 2)[-1]))


_NUMBER = (int, float)
_TABLE_KEYS = {"name": str, "num_rows": int, "dim": int, "dtype": str, "pooling": str,
               "features": list, "optimizer": dict, "ids_per_sample": _NUMBER,
               "sharding": (str, list), "column_slices": int, "zipf_exponent": _NUMBER,
               "hit_rate": _NUMBER}
_REQUIRED = ("name", "num_rows", "dim")
_OPTIMIZER_KEYS = {"kind": str, "lr": _NUMBER, "eps": _NUMBER, "beta1": _NUMBER,
                   "beta2": _NUMBER}
_CHOICES = {"dtype": list(DTYPES), "pooling": [p.value for p in Pooling],
            "kind": [k.value for k in OptimizerKind]}
_SHARDINGS = [s.value for s in ShardingType]


def _type_name(kind) -> str:
    if kind is _NUMBER:
        return "a number"
    if isinstance(kind, tuple):
        return " or ".join(_type_name(k) for k in kind)
    return {str: "a string", int: "an int", list: "a list", dict: "a table"}[kind]


def _check(path: str, key: str, value, kind) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TableFileError(path, key, f"expected {_type_name(kind)}, got "
                             f"{type(value).__name__} {value!r}")


def _choice(path: str, key: str, value: str, choices) -> None:
    if value not in choices:
        raise TableFileError(path, key, f"expected one of {list(choices)}, got {value!r}")


def _entry(path: str, where: str, raw) -> tuple[TableConfig, TableConstraints | None]:
    if not isinstance(raw, dict):
        raise TableFileError(path, where, f"expected a table, got {type(raw).__name__}")
    for key in raw:
        if key not in _TABLE_KEYS:
            raise TableFileError(path, f"{where}.{key}", f"unknown key; expected one of "
                                 f"{sorted(_TABLE_KEYS)}")
    for key in _REQUIRED:
        if key not in raw:
            raise TableFileError(path, f"{where}.{key}", "missing (required)")
    for key, value in raw.items():
        _check(path, f"{where}.{key}", value, _TABLE_KEYS[key])
    for key in ("dtype", "pooling"):
        if key in raw:
            _choice(path, f"{where}.{key}", raw[key], _CHOICES[key])
    for i, f in enumerate(raw.get("features", [])):
        _check(path, f"{where}.features[{i}]", f, str)
    opt = dict(raw.get("optimizer", {}))
    for key, value in opt.items():
        if key not in _OPTIMIZER_KEYS:
            raise TableFileError(path, f"{where}.optimizer.{key}", f"unknown key; expected "
                                 f"one of {sorted(_OPTIMIZER_KEYS)}")
        _check(path, f"{where}.optimizer.{key}", value, _OPTIMIZER_KEYS[key])
    if "kind" in opt:
        _choice(path, f"{where}.optimizer.kind", opt["kind"], _CHOICES["kind"])
    shardings = raw.get("sharding", [])
    shardings = [shardings] if isinstance(shardings, str) else shardings
    for i, s in enumerate(shardings):
        _check(path, f"{where}.sharding[{i}]", s, str)
        _choice(path, f"{where}.sharding[{i}]", s, _SHARDINGS)
    fields = {k: v for k, v in raw.items() if k in ("name", "num_rows", "dim", "dtype",
                                                     "pooling", "features")}
    try:
        table = TableConfig(optimizer=opt, **fields)
        constraints = None
        if any(k in raw for k in ("ids_per_sample", "sharding", "column_slices",
                                  "zipf_exponent", "hit_rate")):
            constraints = TableConstraints(ids_per_sample=raw.get("ids_per_sample"),
                                           shardings=tuple(shardings),
                                           column_slices=raw.get("column_slices", 0),
                                           zipf_exponent=raw.get("zipf_exponent"),
                                           hit_rate=raw.get("hit_rate"))
    except ValueError as exc:
        raise TableFileError(path, where, str(exc)) from None
    return table, constraints


def parse_tables(data, path: str = "<tables>") -> tuple[list[TableConfig],
                                                         dict[str, TableConstraints]]:
    """Tables and per-table constraints from the decoded content of a table file."""
    if not isinstance(data, dict):
        raise TableFileError(path, "", f"expected a document with a 'tables' list, got "
                             f"{type(data).__name__}")
    for key in data:
        if key != "tables":
            raise TableFileError(path, key, "unknown key; expected 'tables'")
    if "tables" not in data:
        raise TableFileError(path, "tables", "missing (required)")
    _check(path, "tables", data["tables"], list)
    if not data["tables"]:
        raise TableFileError(path, "tables", "expected at least one table")
    tables, constraints, seen = [], {}, set()
    for i, raw in enumerate(data["tables"]):
        table, cons = _entry(path, f"tables[{i}]", raw)
        if table.name in seen:
            raise TableFileError(path, f"tables[{i}].name", f"{table.name!r} is repeated")
        seen.add(table.name)
        tables.append(table)
        if cons is not None:
            constraints[table.name] = cons
    return tables, constraints


def load_tables(path: str | os.PathLike) -> tuple[list[TableConfig],
                                                  dict[str, TableConstraints]]:
    """Tables and per-table constraints from a ``.toml`` or ``.json`` file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise TableFileError(path, "", f"cannot read: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise TableFileError(path, "", f"not valid JSON: {exc}") from None
    elif path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            import tomli as tomllib
        try:
            data = tomllib.loads(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise TableFileError(path, "", f"not valid TOML: {exc}") from None
    else:
        raise TableFileError(path, "", "expected a .toml or .json file")
    return parse_tables(data, path)


def preset_tables(name: str, *, dim: int | None = None
                  ) -> tuple[list[TableConfig], dict[str, TableConstraints]]:
    """Tables and per-table pooling of a named set (:func:`embedding.presets.preset`),
    every table ``dim`` wide when given (the trainer's ``model.embedding_dim``)."""
    from embedding.presets import table_set

    chosen = table_set(name)
    return chosen.tables(dim), {t: TableConstraints(ids_per_sample=p)
                                for t, p in chosen.pooling().items()}
