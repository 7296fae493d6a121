"""Reader and preprocessing of the Criteo display-advertising text format.

A record is one line of ``1 + 13 + 26`` tab-separated fields: the label
(``0`` or ``1``), 13 integer features (possibly negative) and 26 categorical
features of 8 hexadecimal digits. Any feature may be empty (missing).

Preprocessing, as in the DLRM reference:

* integers: ``log(1 + max(x, 0))`` as float32; a missing integer is 0;
* categoricals: ``int(hex, 16) % table_size`` (:attr:`CategoricalEncoding.HASH`)
  or a frequency-ranked :class:`Vocabulary` that maps the ``table_size - 1``
  most frequent values of a feature to rows ``1 .. table_size - 1`` and every
  other value to row 0 (:attr:`CategoricalEncoding.VOCABULARY`). A missing
  categorical is the value 0 or an empty bag (:class:`MissingCategorical`).

Plain and gzip-compressed (``.gz``) files are read. Parsing is vectorised
per chunk of lines; a malformed line raises :class:`DataFormatError` naming
the file and the 1-based line.
"""
from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from embedding.data.batch import Batch
from embedding.data.types import (NUM_DENSE, NUM_SPARSE, SPARSE_NAMES, CategoricalEncoding,
                                  DataFormatError, MissingCategorical)
from embedding.types import enum_arg

__all__ = ["RawRecords", "parse_lines", "iter_raw_chunks", "preprocess_dense",
           "Vocabulary", "Preprocessor", "read_criteo_text"]

_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_HEX = np.full(256, -1, np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


@dataclass(frozen=True, eq=False)
class RawRecords:
    """A parsed chunk of text records before preprocessing.

    ``ints`` int64 ``[N, 13]`` (0 where missing), ``cats`` uint32 ``[N, 26]``
    (the hex values, 0 where missing) with their ``*_missing`` masks;
    ``first_line`` is the 1-based line number of record 0.
    """

    labels: np.ndarray
    ints: np.ndarray
    int_missing: np.ndarray
    cats: np.ndarray
    cat_missing: np.ndarray
    path: str = ""
    first_line: int = 1

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def parse_lines(lines: list[bytes], path: str = "", first_line: int = 1) -> RawRecords:
    """Parse raw text lines (bytes, newline optional) into :class:`RawRecords`."""
    rows = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
    for i, row in enumerate(rows):
        if len(row) != _FIELDS:
            hint = " (a truncated last line?)" if i == len(rows) - 1 else ""
            raise DataFormatError(f"expected {_FIELDS} tab-separated fields, got {len(row)}"
                                  f"{hint}", path=path, line=first_line + i)
    n = len(rows)
    cols = list(zip(*rows)) if n else [()] * _FIELDS
    label_col = np.array(cols[0], dtype="S2") if n else np.zeros(0, "S2")
    labels = np.zeros(n, np.uint8)
    labels[label_col == b"1"] = 1
    bad = (label_col != b"0") & (label_col != b"1")
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataFormatError(f"label {rows[i][0]!r} is not 0 or 1", path=path,
                              line=first_line + i)
    ints = np.zeros((n, NUM_DENSE), np.int64)
    int_missing = np.zeros((n, NUM_DENSE), bool)
    for j in range(NUM_DENSE):
        col = np.array(cols[1 + j]) if n else np.zeros(0, "S1")
        miss = col == b""
        int_missing[:, j] = miss
        try:
            ints[:, j] = np.where(miss, b"0", col).astype(np.int64)
        except (ValueError, OverflowError):
            i = _first_bad_int(cols[1 + j])
            raise DataFormatError(f"integer feature I{j + 1} {cols[1 + j][i]!r} is not an "
                                  f"integer", path=path, line=first_line + i) from None
    cats = np.zeros((n, NUM_SPARSE), np.uint32)
    cat_missing = np.zeros((n, NUM_SPARSE), bool)
    for j in range(NUM_SPARSE):
        col = np.array(cols[1 + NUM_DENSE + j]) if n else np.zeros(0, "S8")
        if col.dtype.itemsize > 8:
            i = int(np.flatnonzero(np.char.str_len(col) > 8)[0])
            raise DataFormatError(f"categorical feature C{j + 1} {rows[i][1 + NUM_DENSE + j]!r} "
                                  f"is not 8 hex digits", path=path, line=first_line + i)
        digits = _HEX[col.astype("S8").view(np.uint8).reshape(n, 8)]
        miss = col == b""
        ok = (digits >= 0).all(axis=1) | miss
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise DataFormatError(f"categorical feature C{j + 1} {rows[i][1 + NUM_DENSE + j]!r} "
                                  f"is not 8 hex digits", path=path, line=first_line + i)
        digits = np.where(miss[:, None], 0, digits).astype(np.uint32)
        shifts = np.arange(28, -1, -4, dtype=np.uint32)
        cats[:, j] = (digits << shifts).sum(axis=1, dtype=np.uint32)
        cat_missing[:, j] = miss
    return RawRecords(labels, ints, int_missing, cats, cat_missing, str(path), first_line)


def _first_bad_int(col) -> int:
    for i, v in enumerate(col):
        if v == b"":
            continue
        try:
            x = int(v)
        except ValueError:
            return i
        if not -(1 << 63) <= x < (1 << 63):
            return i
    return 0


def _open(path):
    path = os.fspath(path)
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_raw_chunks(path, chunk_lines: int = 1 << 16) -> Iterator[RawRecords]:
    """Parse a text file chunk by chunk (``chunk_lines`` records at a time)."""
    if chunk_lines <= 0:
        raise ValueError(f"chunk_lines: expected > 0, got {chunk_lines}")
    line_no = 1
    with _open(path) as f:
        while True:
            lines = []
            try:
                for line in f:
                    lines.append(line)
                    if len(lines) == chunk_lines:
                        break
            except (EOFError, OSError, zlib.error) as exc:  # a cut or corrupt .gz stream
                raise DataFormatError(f"cannot decompress past this line: {exc}", path=path,
                                      line=line_no + len(lines)) from None
            if not lines:
                return
            yield parse_lines(lines, str(path), line_no)
            line_no += len(lines)


def preprocess_dense(ints: np.ndarray, missing: np.ndarray | None = None) -> np.ndarray:
    """``log(1 + max(x, 0))`` as float32; missing integers become 0."""
    x = np.maximum(np.asarray(ints, np.int64), 0)
    if missing is not None:
        x = np.where(missing, 0, x)
    return np.log1p(x.astype(np.float64)).astype(np.float32)


class Vocabulary:
    """Per-feature maps from categorical values to rows, most frequent first.

    For feature ``f`` the ``table_sizes[f] - 1`` most frequent values (ties
    broken by the smaller value; values seen fewer than ``min_count`` times
    left out) get rows ``1 ..``; row 0 is out-of-vocabulary. Saved as a
    ``.npz`` of integer arrays, read back without pickle.
    """

    def __init__(self, keys: list[np.ndarray], rows: list[np.ndarray], table_sizes):
        if not len(keys) == len(rows) == len(table_sizes):
            raise ValueError(f"keys/rows/table_sizes: expected one per feature, got "
                             f"{len(keys)}, {len(rows)}, {len(table_sizes)}")
        self.table_sizes = tuple(int(s) for s in table_sizes)
        self.keys = [np.asarray(k, np.uint32) for k in keys]
        self.rows = [np.asarray(r, np.int64) for r in rows]
        for f, (k, r) in enumerate(zip(self.keys, self.rows)):
            if k.shape != r.shape:
                raise ValueError(f"keys[{f}]: expected sorted unique keys matching rows, got "
                                 f"shape {k.shape} for rows[{f}] of shape {r.shape}")
            if k.size and np.any(np.diff(k.astype(np.int64)) <= 0):
                i = int(np.flatnonzero(np.diff(k.astype(np.int64)) <= 0)[0]) + 1
                raise ValueError(f"keys[{f}]: expected sorted unique keys matching rows, got "
                                 f"{int(k[i])} after {int(k[i - 1])} at index {i}")
            if r.size and (r.min() < 1 or r.max() >= self.table_sizes[f]):
                i = int(np.flatnonzero((r < 1) | (r >= self.table_sizes[f]))[0])
                raise ValueError(f"rows[{f}]: expected rows in [1, {self.table_sizes[f]}), got "
                                 f"{int(r[i])} at index {i}")

    @classmethod
    def build(cls, chunks: Iterable[RawRecords], table_sizes, min_count: int = 1) -> "Vocabulary":
        """Count every feature's values over ``chunks`` and keep the most frequent."""
        if len(table_sizes) != NUM_SPARSE:
            raise ValueError(f"table_sizes: expected {NUM_SPARSE} sizes, got {len(table_sizes)}")
        uniq = [np.zeros(0, np.uint32)] * NUM_SPARSE
        counts = [np.zeros(0, np.int64)] * NUM_SPARSE
        for chunk in chunks:
            for f in range(NUM_SPARSE):
                v = chunk.cats[~chunk.cat_missing[:, f], f]
                u, c = np.unique(v, return_counts=True)
                allu = np.concatenate([uniq[f], u])
                allc = np.concatenate([counts[f], c])
                uniq[f], inv = np.unique(allu, return_inverse=True)
                counts[f] = np.bincount(inv, weights=allc, minlength=uniq[f].size).astype(np.int64)
        keys, rows = [], []
        for f in range(NUM_SPARSE):
            keep = counts[f] >= min_count
            u, c = uniq[f][keep], counts[f][keep]
            order = np.lexsort((u, -c))[: max(int(table_sizes[f]) - 1, 0)]
            k = u[order]
            r = np.arange(1, k.size + 1, dtype=np.int64)
            srt = np.argsort(k)
            keys.append(k[srt])
            rows.append(r[srt])
        return cls(keys, rows, table_sizes)

    def encode(self, cats: np.ndarray, feature: int) -> np.ndarray:
        """Rows of the values ``cats`` of ``feature`` (0 for out-of-vocabulary)."""
        k = self.keys[feature]
        if k.size == 0:
            return np.zeros(cats.shape, np.int64)
        idx = np.minimum(np.searchsorted(k, cats), k.size - 1)
        return np.where(k[idx] == cats, self.rows[feature][idx], 0)

    def save(self, path) -> None:
        """Write to ``path`` (``.npz``, no pickle)."""
        arrays = {"table_sizes": np.asarray(self.table_sizes, np.int64)}
        for f in range(len(self.keys)):
            arrays[f"keys_{f}"] = self.keys[f]
            arrays[f"rows_{f}"] = self.rows[f]
        with open(path, "wb") as fh:
            np.savez(fh, **arrays)

    @classmethod
    def load(cls, path) -> "Vocabulary":
        """Read a vocabulary written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as z:
            sizes = z["table_sizes"]
            return cls([z[f"keys_{f}"] for f in range(len(sizes))],
                       [z[f"rows_{f}"] for f in range(len(sizes))], sizes)


class Preprocessor:
    """Turns :class:`RawRecords` into model inputs for tables of ``table_sizes`` rows."""

    def __init__(self, table_sizes, encoding=CategoricalEncoding.HASH,
                 vocabulary: Vocabulary | None = None, missing=MissingCategorical.ZERO):
        sizes = tuple(int(s) for s in table_sizes)
        if len(sizes) != NUM_SPARSE or min(sizes) <= 0:
            raise ValueError(f"table_sizes: expected {NUM_SPARSE} positive sizes, got {sizes}")
        self.table_sizes = sizes
        self.encoding = enum_arg(CategoricalEncoding, encoding, "encoding")
        self.missing = enum_arg(MissingCategorical, missing, "missing")
        if self.encoding is CategoricalEncoding.VOCABULARY:
            if vocabulary is None:
                raise ValueError("vocabulary: the vocabulary encoding needs a Vocabulary, "
                                 "got None")
            if vocabulary.table_sizes != sizes:
                raise ValueError(f"vocabulary: built for table sizes {vocabulary.table_sizes}, "
                                 f"got table_sizes {sizes}")
        self.vocabulary = vocabulary

    def encode_ids(self, raw: RawRecords) -> np.ndarray:
        """Rows ``[N, 26]`` int64; -1 marks an empty bag (a missing value under ``EMPTY``)."""
        ids = np.empty(raw.cats.shape, np.int64)
        for f in range(NUM_SPARSE):
            if self.encoding is CategoricalEncoding.HASH:
                ids[:, f] = raw.cats[:, f].astype(np.int64) % self.table_sizes[f]
            else:
                ids[:, f] = self.vocabulary.encode(raw.cats[:, f], f)
        if self.missing is MissingCategorical.EMPTY:
            ids[raw.cat_missing] = -1
        elif self.encoding is CategoricalEncoding.VOCABULARY:
            ids[raw.cat_missing] = 0
        return ids

    def __call__(self, raw: RawRecords) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense [N, 13] float32, labels [N] uint8, ids [N, 26] int64)``."""
        return preprocess_dense(raw.ints, raw.int_missing), raw.labels, self.encode_ids(raw)


def read_criteo_text(paths, batch_size: int, preprocessor: Preprocessor,
                     drop_last: bool = False) -> Iterator[Batch]:
    """Stream preprocessed batches of ``batch_size`` records from text files in order."""
    if batch_size <= 0:
        raise ValueError(f"batch_size: expected > 0, got {batch_size}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    held = 0
    for path in paths:
        for raw in iter_raw_chunks(path, max(batch_size, 1 << 14)):
            pending.append(preprocessor(raw))
            held += len(raw)
            while held >= batch_size:
                dense, labels, ids = (np.concatenate(p) for p in zip(*pending))
                yield Batch.from_ids(dense[:batch_size], labels[:batch_size],
                                     ids[:batch_size], SPARSE_NAMES)
                pending = [(dense[batch_size:], labels[batch_size:], ids[batch_size:])]
                held -= batch_size
    if held and not drop_last:
        dense, labels, ids = (np.concatenate(p) for p in zip(*pending))
        yield Batch.from_ids(dense, labels, ids, SPARSE_NAMES)
