"""Vocabulary of the data pipeline: Criteo's shape, encodings and data errors.

The Criteo display-advertising format has one label, ``NUM_DENSE`` integer
features and ``NUM_SPARSE`` categorical features per record. The feature
names and the table cardinalities of MLPerf's DLRM benchmark on Criteo 1TB
(ids capped at 40M) come from :mod:`embedding.presets`, the table sets the
planner and the trainer share.
"""
from __future__ import annotations

import enum

from embedding.presets import CRITEO_1TB_ROWS, CRITEO_FEATURES
from embedding.types import BatchError
from neocomm.errors import NeocommError

__all__ = ["NUM_DENSE", "NUM_SPARSE", "DENSE_NAMES", "SPARSE_NAMES",
           "CRITEO_1TB_TABLE_SIZES", "CategoricalEncoding", "MissingCategorical",
           "DataFormatError", "BatchError", "CommitOnExit"]

#: Integer features per Criteo record (I1..I13).
NUM_DENSE = 13
#: Categorical features per Criteo record (C1..C26).
NUM_SPARSE = 26
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES: tuple[str, ...] = CRITEO_FEATURES

#: Rows of the 26 tables of MLPerf DLRM on Criteo 1TB (ids capped at 40M),
#: in feature order C1..C26: the ``criteo-1tb`` set of :mod:`embedding.presets`.
CRITEO_1TB_TABLE_SIZES: tuple[int, ...] = CRITEO_1TB_ROWS


class CategoricalEncoding(enum.Enum):
    """How a categorical value (8 hex digits) becomes a row of its table."""

    HASH = "hash"              # int(hex, 16) modulo the table size
    VOCABULARY = "vocabulary"  # frequency-ranked vocabulary; 0 is out-of-vocabulary


class MissingCategorical(enum.Enum):
    """What a missing categorical value becomes."""

    ZERO = "zero"    # the value 0, encoded like any other (one id per feature, always)
    EMPTY = "empty"  # an empty bag: length 0 for that feature of that record


class DataFormatError(NeocommError, ValueError):
    """A data file is malformed; ``path`` and ``line`` (text) or ``record`` (binary) say where.

    ``line`` is 1-based, ``record`` 0-based; either is -1 when the fault is
    not tied to one (a bad header, a missing file tail).
    """

    def __init__(self, message: str, *, path: str = "", line: int = -1, record: int = -1):
        where = str(path)
        if line >= 0:
            where += f", line {line}"
        if record >= 0:
            where += f", record {record}"
        super().__init__(f"{where}: {message}" if where else message)
        self.path = str(path)
        self.line = int(line)
        self.record = int(record)


class CommitOnExit:
    """A file writer as a context manager: ``close()`` (it commits the file) when the block
    ends normally, ``abort()`` (it removes the partial file) when it raises."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


class SchemaError(ValueError):
    """A schema entry is wrong; ``key`` is its dotted config key (``data.sparse[1].pooling``)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.reason = message


def pyarrow_module():
    """pyarrow (with its compute and parquet modules), imported at first use."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise DataFormatError(f"reading Parquet needs pyarrow ({exc}); pip install pyarrow")
    return pyarrow
