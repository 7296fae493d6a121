"""One (rank-local or global) batch: dense features, labels and jagged sparse ids.

The sparse ids are kept per feature as ``(values, lengths)``: ``lengths[f]``
is an int32 array ``[B]`` (ids of feature ``f`` in each record) and
``values[f]`` the int64 ids of all records of the batch, concatenated in
record order. Criteo has one id per feature per record, so ``lengths`` is all
ones unless missing values are encoded as empty bags.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding.data.types import NUM_SPARSE, SPARSE_NAMES, BatchError

__all__ = ["Batch", "shard_bounds"]

_PACK_MAGIC = 0x4E43_4241_5443_4831  # "NCBATCH1"
_PACK_VERSION = 1


def shard_bounds(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch that ``rank`` of ``world_size`` takes.

    The global batch must split evenly, so every rank's loss has the same
    weight in a data-parallel mean; ValueError otherwise.
    """
    if world_size <= 0:
        raise ValueError(f"world_size: expected > 0, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < {world_size}, got {rank}")
    if global_batch_size <= 0 or global_batch_size % world_size:
        raise ValueError(f"global_batch_size: expected a positive multiple of world_size "
                         f"{world_size}, got {global_batch_size}")
    local = global_batch_size // world_size
    return rank * local, (rank + 1) * local


@dataclass(frozen=True, eq=False)
class Batch:
    """Dense features ``[B, num_dense]`` float32, labels ``[B]`` float32, per-feature jagged ids."""

    dense: np.ndarray
    labels: np.ndarray
    values: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    feature_names: tuple[str, ...] = ()

    def __post_init__(self):
        dense = np.asarray(self.dense)
        labels = np.asarray(self.labels)
        if dense.ndim != 2:
            raise ValueError(f"dense: expected a 2-D array [B, num_dense], got shape {dense.shape}")
        b = dense.shape[0]
        if labels.shape != (b,):
            raise ValueError(f"labels: expected shape ({b},), got {labels.shape}")
        if len(self.values) != len(self.lengths):
            raise ValueError(f"values/lengths: expected one of each per feature, got "
                             f"{len(self.values)} values and {len(self.lengths)} lengths")
        values = tuple(np.asarray(v) for v in self.values)
        lengths = tuple(np.asarray(n) for n in self.lengths)
        for f, (v, n) in enumerate(zip(values, lengths)):
            if n.shape != (b,):
                raise ValueError(f"lengths[{f}]: expected shape ({b},), got {n.shape}")
            if v.ndim != 1:
                raise ValueError(f"values[{f}]: expected a 1-D array, got shape {v.shape}")
            total = int(n.sum())
            if v.shape[0] != total:
                raise ValueError(f"values[{f}]: lengths sum to {total}, got {v.shape[0]} ids")
        names = tuple(self.feature_names) or _default_names(len(values))
        if len(names) != len(values):
            raise ValueError(f"feature_names: expected {len(values)} names, got {len(names)}")
        object.__setattr__(self, "dense", dense)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "feature_names", names)

    # ------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    @property
    def num_dense(self) -> int:
        return int(self.dense.shape[1])

    @property
    def num_sparse(self) -> int:
        return len(self.values)

    @classmethod
    def from_ids(cls, dense, labels, ids, feature_names=()) -> "Batch":
        """Build from an id matrix ``[B, F]`` where -1 marks a missing id (an empty bag)."""
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids: expected a 2-D array [B, F], got shape {ids.shape}")
        values, lengths = [], []
        for f in range(ids.shape[1]):
            col = ids[:, f]
            present = col >= 0
            if present.all():
                values.append(col.astype(np.int64))
                lengths.append(np.ones(col.shape[0], np.int32))
            else:
                values.append(col[present].astype(np.int64))
                lengths.append(present.astype(np.int32))
        return cls(np.ascontiguousarray(dense, np.float32), np.asarray(labels, np.float32),
                   tuple(values), tuple(lengths), tuple(feature_names))

    def offsets(self, feature: int) -> np.ndarray:
        """Exclusive prefix sum of ``lengths[feature]``: ``[B + 1]`` int64."""
        out = np.zeros(self.batch_size + 1, np.int64)
        np.cumsum(self.lengths[feature], out=out[1:])
        return out

    def slice(self, start: int, stop: int) -> "Batch":
        """Records ``[start, stop)`` as a new batch (views where possible)."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.batch_size}, "
                             f"got {start}, {stop}")
        values, lengths = [], []
        for f in range(self.num_sparse):
            off = self.offsets(f)
            values.append(self.values[f][off[start]:off[stop]])
            lengths.append(self.lengths[f][start:stop])
        return Batch(self.dense[start:stop], self.labels[start:stop], tuple(values),
                     tuple(lengths), self.feature_names)

    def take(self, rows) -> "Batch":
        """Records ``rows`` (any order, repeats allowed) as a new batch."""
        rows = np.asarray(rows, np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.batch_size):
            raise ValueError(f"rows: expected indices in [0, {self.batch_size}), got "
                             f"{int(rows.min())}..{int(rows.max())}")
        values, lengths = [], []
        for f in range(self.num_sparse):
            off = self.offsets(f)
            n = self.lengths[f][rows]
            total = int(n.sum())
            # the ids of row rows[k] are off[rows[k]] + 0..n[k]-1, laid out one row after another
            first = np.repeat(off[rows] - (np.cumsum(n) - n), n)
            values.append(self.values[f][first + np.arange(total)])
            lengths.append(n)
        return Batch(self.dense[rows], self.labels[rows], tuple(values), tuple(lengths),
                     self.feature_names)

    def shard(self, rank: int, world_size: int) -> "Batch":
        """The part of this (global) batch that ``rank`` of ``world_size`` takes."""
        return self.slice(*shard_bounds(self.batch_size, rank, world_size))

    @staticmethod
    def concat(batches: "list[Batch]") -> "Batch":
        """Records of ``batches`` one after the other (same features)."""
        if not batches:
            raise ValueError("batches: expected at least one batch, got none")
        first = batches[0]
        return Batch(np.concatenate([b.dense for b in batches]),
                     np.concatenate([b.labels for b in batches]),
                     tuple(np.concatenate([b.values[f] for b in batches])
                           for f in range(first.num_sparse)),
                     tuple(np.concatenate([b.lengths[f] for b in batches])
                           for f in range(first.num_sparse)),
                     first.feature_names)

    # ------------------------------------------------------------ validation
    def check(self, step: int = -1, table_sizes=None) -> None:
        """Refuse labels outside {0, 1}, non-finite dense features and ids outside their tables.

        Raises :class:`BatchError` (labels, ids) or
        :class:`~embedding.dense.checks.NonFiniteError` (dense), each naming
        ``step`` and the offending tensor.
        """
        from embedding.dense.checks import check_finite, check_labels

        check_labels(self.labels, step=step)
        check_finite(step, dense=self.dense)
        for f, v in enumerate(self.values):
            if v.size == 0:
                continue
            bad = v < 0
            if table_sizes is not None:
                if len(table_sizes) != self.num_sparse:
                    raise ValueError(f"table_sizes: expected {self.num_sparse} sizes, "
                                     f"got {len(table_sizes)}")
                bad |= v >= int(table_sizes[f])
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                limit = f" < {int(table_sizes[f])}" if table_sizes is not None else ""
                raise BatchError(f"values[{f}] ({self.feature_names[f]}): id {int(v[i])} at "
                                 f"position {i} is outside 0 <= id{limit}", step=step,
                                 tensor=f"values[{f}]", index=i)

    # -------------------------------------------------------------- transport
    def pack(self) -> np.ndarray:
        """The batch as one contiguous little-endian uint8 buffer (no pickle).

        Layout: int64 header ``[magic, version, B, num_dense, num_sparse,
        n_values_0 .. n_values_{F-1}]``, then dense float32 ``[B, num_dense]``,
        labels float32 ``[B]``, lengths int32 ``[F, B]``, values int64 of every
        feature concatenated.
        """
        header = np.array([_PACK_MAGIC, _PACK_VERSION, self.batch_size, self.num_dense,
                           self.num_sparse, *(v.shape[0] for v in self.values)], "<i8")
        parts = [header, np.ascontiguousarray(self.dense, "<f4"),
                 np.ascontiguousarray(self.labels, "<f4")]
        parts += [np.ascontiguousarray(n, "<i4") for n in self.lengths]
        parts += [np.ascontiguousarray(v, "<i8") for v in self.values]
        out = np.empty(sum(p.nbytes for p in parts), np.uint8)
        pos = 0
        for p in parts:
            out[pos:pos + p.nbytes] = p.reshape(-1).view(np.uint8)
            pos += p.nbytes
        return out

    @classmethod
    def unpack(cls, buf, feature_names=()) -> "Batch":
        """Inverse of :meth:`pack`; ValueError when ``buf`` is not a packed batch."""
        raw = np.asarray(buf)
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise TypeError(f"buf: expected a 1-D uint8 array, got {raw.dtype} {raw.shape}")
        if raw.nbytes < 40:
            raise ValueError(f"buf: {raw.nbytes} bytes is too short for a packed batch")
        head = raw[:40].view("<i8")
        if int(head[0]) != _PACK_MAGIC or int(head[1]) != _PACK_VERSION:
            raise ValueError("buf: not a packed batch (bad magic or version)")
        b, nd, nf = (int(x) for x in head[2:5])
        hbytes = 8 * (5 + nf)
        counts = raw[:hbytes].view("<i8")[5:].astype(np.int64)
        need = hbytes + 4 * b * nd + 4 * b + 4 * b * nf + 8 * int(counts.sum())
        if raw.nbytes != need:
            raise ValueError(f"buf: header describes {need} bytes, got {raw.nbytes}")
        pos = hbytes

        def take(n, dtype):
            nonlocal pos
            nbytes = n * np.dtype(dtype).itemsize
            arr = raw[pos:pos + nbytes].view(dtype).astype(np.dtype(dtype).newbyteorder("="))
            pos += nbytes
            return arr

        dense = take(b * nd, "<f4").reshape(b, nd)
        labels = take(b, "<f4")
        lengths = tuple(take(b, "<i4") for _ in range(nf))
        values = tuple(take(int(c), "<i8") for c in counts)
        return cls(dense, labels, values, lengths, tuple(feature_names))

    # ------------------------------------------------------------ conversion
    def to_jagged(self):
        """The sparse ids as a :class:`~embedding.jagged.KeyedJagged` (feature-major, int64)."""
        from embedding.jagged import KeyedJagged

        b = self.batch_size
        values = (np.concatenate(self.values) if self.values else np.zeros(0, np.int64))
        lengths = (np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64))
        return KeyedJagged(self.feature_names, values, lengths, batch_size=b)


def _default_names(n: int) -> tuple[str, ...]:
    return SPARSE_NAMES if n == NUM_SPARSE else tuple(f"f{i}" for i in range(n))
