"""Dense column transforms: what a raw numeric column becomes before the model sees it.

Each ``[data] dense`` entry of a Parquet source goes through, in this order:

1. **fill**: a null or NaN becomes ``fill`` (default 0), in the column's raw
   units; the ``<column>_missing`` indicator (when asked for) is 1 there;
2. **clip** (optional ``clip = [lo, hi]``, raw units): ``min(max(x, lo), hi)``;
3. **transform** (``transform``, default ``"standardize"``):

   * ``standardize``: ``(x - mean) / std``, the mean and the (population)
     standard deviation of the training files' values after steps 1-2; a
     column with a single value has std 0 and is taken with std 1 (it becomes 0);
   * ``log``: ``sign(x) * log1p(|x|)``, defined for every finite x, 0 at 0;
   * ``minmax``: ``(x - min) / (max - min)``, the training files' min and max
     after steps 1-2 (training values land in [0, 1]; others may fall outside);
     a column with a single value is refused;
   * ``none``: x as it is.

The statistics come from the scan that builds the vocabularies
(:func:`embedding.data.parquet.scan`): per row group its count, mean, sum of
squared deviations, min and max (:class:`Moments`), merged in row-group
order, so every rank, and a scan on any number of ranks, gets the same
numbers bit for bit. :class:`DenseTransforms` holds one
:class:`DenseStatistics` per dense column; a checkpoint keeps them in its
manifest (``state.dense_transforms``) and prediction and resumption apply
the saved ones. A checkpoint without them (written before dense transforms
existed) means ``none`` for every column: its model was trained on raw values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embedding.data.types import SchemaError

__all__ = ["TRANSFORMS", "DEFAULT_TRANSFORM", "Moments", "DenseStatistics", "DenseTransforms",
           "transform_values", "dense_values"]

#: the ``transform`` values of a dense column, the default first
TRANSFORMS = ("standardize", "log", "minmax", "none")
DEFAULT_TRANSFORM = "standardize"


def dense_values(col, fill: float, pa=None) -> tuple[np.ndarray, np.ndarray]:
    """``(x, missing)``: a dense column's values as float64 with nulls and NaN set to
    ``fill`` (raw units), and where they were."""
    if pa is None:
        import pyarrow as pa
    if pa.types.is_boolean(col.type):
        col = col.cast(pa.float32())
    x = np.array(col.cast(pa.float64()).fill_null(np.nan).to_numpy(), np.float64)
    missing = np.isnan(x)
    x[missing] = fill
    return x, missing


@dataclass(frozen=True)
class Moments:
    """Count, mean, sum of squared deviations (``m2``), min and max of some values.

    :meth:`merge` is Chan et al.'s pairwise update: merging the moments of
    row groups in a fixed order gives the same floats wherever it runs.
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf

    @classmethod
    def of(cls, x: np.ndarray) -> "Moments":
        """The moments of float64 ``x`` (finite values)."""
        if x.size == 0:
            return cls()
        mean = float(x.mean())
        return cls(int(x.size), mean, float(np.square(x - mean).sum()), float(x.min()),
                   float(x.max()))

    def merge(self, other: "Moments") -> "Moments":
        if not other.count:
            return self
        if not self.count:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / n)
        return Moments(n, mean, m2, min(self.minimum, other.minimum),
                       max(self.maximum, other.maximum))

    @property
    def std(self) -> float:
        """The population standard deviation (0 for no values)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


def transform_values(x: np.ndarray, transform: str, clip=None, mean: float = 0.0,
                     std: float = 1.0, minimum: float = 0.0, maximum: float = 1.0) -> np.ndarray:
    """Steps 2-3 of the module doc on filled float64 ``x`` (a new float64 array, or ``x``
    itself for ``none`` without a clip)."""
    if clip is not None:
        x = np.clip(x, clip[0], clip[1])
    if transform == "none":
        return x
    if transform == "log":
        return np.sign(x) * np.log1p(np.abs(x))
    if transform == "standardize":
        return (x - mean) / (std if std > 0 else 1.0)
    if transform == "minmax":
        return (x - minimum) / (maximum - minimum)
    raise ValueError(f"transform: expected one of {list(TRANSFORMS)}, got {transform!r}")


@dataclass(frozen=True)
class DenseStatistics:
    """One dense column's fill, clip and transform, and the training statistics it uses.

    ``count``, ``mean``, ``std``, ``minimum`` and ``maximum`` describe the
    training files' values after fill and clip (raw units).
    """

    column: str
    transform: str = "none"
    clip: tuple[float, float] | None = None
    fill: float = 0.0
    count: int = 0
    mean: float = 0.0
    std: float = 0.0
    minimum: float = 0.0
    maximum: float = 0.0

    def apply(self, x: np.ndarray) -> np.ndarray:
        """The model's values of filled float64 ``x`` (float64)."""
        return transform_values(x, self.transform, self.clip, self.mean, self.std,
                                self.minimum, self.maximum)

    @property
    def identity(self) -> bool:
        return self.transform == "none" and self.clip is None

    def formula(self) -> str:
        """What the model gets, as a formula of the filled raw value ``x``."""
        x = "x" if self.clip is None else f"clip(x, {self.clip[0]:g}, {self.clip[1]:g})"
        if self.transform == "standardize":
            std = self.std if self.std > 0 else 1.0
            return f"({x} - {self.mean:.6g}) / {std:.6g}"
        if self.transform == "minmax":
            return f"({x} - {self.minimum:.6g}) / {self.maximum - self.minimum:.6g}"
        if self.transform == "log":
            return f"sign({x}) * log1p(|{x}|)"
        return x

    def model_range(self) -> tuple[float, float]:
        """The model's values of the training minimum and maximum (every transform is
        monotonic, so the training values lie between them)."""
        lo, hi = self.apply(np.array([self.minimum, self.maximum], np.float64))
        return float(lo), float(hi)

    def to_dict(self) -> dict:
        return {"column": self.column, "transform": self.transform,
                "clip": list(self.clip) if self.clip is not None else None,
                "fill": self.fill, "count": self.count, "mean": self.mean, "std": self.std,
                "min": self.minimum, "max": self.maximum}

    @classmethod
    def from_dict(cls, d: dict) -> "DenseStatistics":
        clip = d.get("clip")
        return cls(str(d["column"]), str(d["transform"]),
                   (float(clip[0]), float(clip[1])) if clip is not None else None,
                   float(d.get("fill", 0.0)), int(d.get("count", 0)), float(d.get("mean", 0.0)),
                   float(d.get("std", 0.0)), float(d.get("min", 0.0)), float(d.get("max", 0.0)))


class DenseTransforms:
    """The :class:`DenseStatistics` of a schema's dense columns, in its order.

    The data sets of one training run share one object, so a resumption can
    put a checkpoint's statistics in place (:meth:`load`) for all of them;
    :attr:`version` tells a data set that its decoded cache is stale.
    ``legacy`` marks the inputs of a model trained before dense transforms
    existed (its checkpoints go on recording none, so they stay legacy).
    """

    def __init__(self, columns=(), *, legacy: bool = False):
        self.columns: tuple[DenseStatistics, ...] = tuple(columns)
        self.legacy = bool(legacy)
        self.version = 0

    @classmethod
    def untransformed(cls, schema) -> "DenseTransforms":
        """Every dense column of ``schema`` as it is (no clip, no transform): the inputs of a
        model trained before dense transforms existed (``legacy``)."""
        return cls((DenseStatistics(d.column, "none", None, d.fill) for d in schema.dense),
                   legacy=True)

    @classmethod
    def from_moments(cls, schema, moments: dict) -> "DenseTransforms":
        """The statistics of ``schema``'s dense columns from their merged :class:`Moments`.

        SchemaError (naming ``data.dense[i].transform``) for ``minmax`` on a
        column whose training values are all one value.
        """
        out = []
        for i, d in enumerate(schema.dense):
            m = moments.get(d.column) or Moments()
            lo, hi = (m.minimum, m.maximum) if m.count else (d.fill, d.fill)
            if d.transform == "minmax" and not hi > lo:
                raise SchemaError(f"data.dense[{i}].transform",
                                  f"'minmax' on column {d.column!r}: every training value is "
                                  f"{lo:g} (after fill and clip), so max - min is 0; use "
                                  f"\"standardize\" (a constant becomes 0) or \"none\"")
            out.append(DenseStatistics(d.column, d.transform, d.clip, d.fill, m.count, m.mean,
                                       m.std, lo, hi))
        return cls(out)

    def __len__(self) -> int:
        return len(self.columns)

    def __eq__(self, other) -> bool:
        return isinstance(other, DenseTransforms) and self.columns == other.columns

    @property
    def identity(self) -> bool:
        return all(c.identity for c in self.columns)

    def load(self, other: "DenseTransforms") -> None:
        """Take ``other``'s statistics in place (every data set sharing this object sees them)."""
        if self.columns != other.columns:
            self.columns = other.columns
            self.version += 1
        self.legacy = other.legacy

    def to_state(self) -> list:
        """JSON-ready (the checkpoint manifest's ``state.dense_transforms``)."""
        return [c.to_dict() for c in self.columns]

    @classmethod
    def from_state(cls, state) -> "DenseTransforms":
        return cls(DenseStatistics.from_dict(d) for d in state)
