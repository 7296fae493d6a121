"""A compact, checksummed, memory-mappable binary format for preprocessed records.

Layout (every integer little-endian; ``D`` dense and ``F`` sparse features)::

    offset      size       field
    0           8          magic  b"NCCRITEO"
    8           4  u32     version (1)
    12          4  u32     header_bytes: offset of record 0, a multiple of 64
    16          8  u64     num_records N
    24          4  u32     num_dense D
    28          4  u32     num_sparse F
    32          4  u32     id_bytes: 4 (int32 ids) or 8 (int64 ids)
    36          4  u32     record_bytes R
    40          4  u32     chunk_records K: records per checksum chunk
    44          4  u32     flags: bit 0 = ids may be -1 (an empty bag: missing value)
    48          8  u64     trailer_offset = header_bytes + N * R
    56          4  u32     header_crc32: zlib.crc32 of bytes [0, 56) then [64, 64 + 8F)
    60          4          reserved, zero
    64          8F u64     table sizes, feature order
    ...                    zero padding up to header_bytes
    header_bytes  N * R    records
    trailer_offset  4 * ceil(N / K)  u32 crc32 of each chunk of K records' bytes

    record (R bytes, R a multiple of id_bytes):
    0           1  u8      label, 0 or 1
    1           3          zero
    4           4D f32     dense features, already preprocessed (log(1 + max(x, 0)))
    align(4 + 4D, id_bytes)  id_bytes * F   ids: row of each feature's table, -1 = empty

Records are read through ``np.memmap`` (no copy of the file, no pickle). The
per-chunk checksums let a reader verify just the chunks it touches
(:attr:`Verify.LAZY`) and name the records of a corrupt chunk. Writers write
to ``<path>.tmp`` and rename on close, so a killed conversion never leaves a
file that looks complete.
"""
from __future__ import annotations

import enum
import os
import struct
import zlib

import numpy as np

from embedding.data.batch import Batch
from embedding.data.types import NUM_DENSE, SPARSE_NAMES, NUM_SPARSE, CommitOnExit, DataFormatError
from embedding.types import enum_arg

__all__ = ["MAGIC", "VERSION", "Verify", "BinaryWriter", "BinaryDataset", "convert_text",
           "write_batches"]

MAGIC = b"NCCRITEO"
VERSION = 1
_FLAG_EMPTY = 1
_HEAD = struct.Struct("<8sIIQIIIIIIQII")  # 64 bytes


class Verify(enum.Enum):
    """How much of a binary file's checksums a reader checks."""

    NONE = "none"  # header and size only
    LAZY = "lazy"  # each chunk the first time a read touches it
    FULL = "full"  # every chunk when the file is opened


def _record_dtype(num_dense: int, num_sparse: int, id_bytes: int) -> np.dtype:
    ids_off = -(-(4 + 4 * num_dense) // id_bytes) * id_bytes
    size = -(-(ids_off + id_bytes * num_sparse) // id_bytes) * id_bytes
    return np.dtype({"names": ["label", "dense", "ids"],
                     "formats": ["u1", ("<f4", (num_dense,)), (f"<i{id_bytes}", (num_sparse,))],
                     "offsets": [0, 4, ids_off], "itemsize": size})


def _header_bytes(num_sparse: int) -> int:
    return -(-(64 + 8 * num_sparse) // 64) * 64


class BinaryWriter(CommitOnExit):
    """Appends preprocessed records to a new binary file; a context manager.

    ``write(dense, labels, ids)`` takes ``[n, D]`` float32, ``[n]`` 0/1 labels
    and ``[n, F]`` rows (-1 for an empty bag when ``empty_bags``). The file
    appears at ``path`` only on :meth:`close`.
    """

    def __init__(self, path, table_sizes, *, num_dense: int = NUM_DENSE,
                 id_bytes: int | None = None, chunk_records: int = 1 << 16,
                 empty_bags: bool = False):
        self.path = os.fspath(path)
        self.table_sizes = tuple(int(s) for s in table_sizes)
        if not self.table_sizes or min(self.table_sizes) <= 0:
            raise ValueError(f"table_sizes: expected positive sizes, got {self.table_sizes}")
        if id_bytes is None:
            id_bytes = 4 if max(self.table_sizes) <= np.iinfo(np.int32).max else 8
        if id_bytes not in (4, 8):
            raise ValueError(f"id_bytes: expected 4 or 8, got {id_bytes}")
        if id_bytes == 4 and max(self.table_sizes) > np.iinfo(np.int32).max:
            raise ValueError("id_bytes: 4-byte ids cannot address a table of "
                             f"{max(self.table_sizes)} rows")
        if chunk_records <= 0:
            raise ValueError(f"chunk_records: expected > 0, got {chunk_records}")
        self.num_dense = int(num_dense)
        self.num_sparse = len(self.table_sizes)
        self.empty_bags = bool(empty_bags)
        self.chunk_records = int(chunk_records)
        self.dtype = _record_dtype(self.num_dense, self.num_sparse, id_bytes)
        self.id_bytes = id_bytes
        self.header_bytes = _header_bytes(self.num_sparse)
        self.num_records = 0
        self._crcs: list[int] = []
        self._crc = 0
        self._in_chunk = 0
        self._tmp = self.path + ".tmp"
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * self.header_bytes)

    def write(self, dense, labels, ids) -> None:
        """Append ``n`` records; ValueError naming the record for bad labels, ids or dense."""
        dense = np.asarray(dense, np.float32)
        labels = np.asarray(labels)
        ids = np.asarray(ids)
        n = labels.shape[0]
        if dense.shape != (n, self.num_dense) or ids.shape != (n, self.num_sparse):
            raise ValueError(f"dense/ids: expected shapes ({n}, {self.num_dense}) and "
                             f"({n}, {self.num_sparse}), got {dense.shape} and {ids.shape}")
        base = self.num_records
        bad = (labels != 0) & (labels != 1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataFormatError(f"label {labels[i]} is not 0 or 1", path=self.path,
                                  record=base + i)
        finite = np.isfinite(dense).all(axis=1)
        if not finite.all():
            i = int(np.flatnonzero(~finite)[0])
            j = int(np.flatnonzero(~np.isfinite(dense[i]))[0])
            raise DataFormatError(f"dense features hold NaN or inf: dense[{i}, {j}] is "
                                  f"{float(dense[i, j])}", path=self.path, record=base + i)
        _check_ids(ids, self.table_sizes, self.empty_bags, self.path, base)
        rec = np.zeros(n, self.dtype)
        rec["label"] = labels
        rec["dense"] = dense
        rec["ids"] = ids
        raw = rec.view(np.uint8).reshape(n, self.dtype.itemsize)
        pos = 0
        while pos < n:
            take = min(n - pos, self.chunk_records - self._in_chunk)
            block = raw[pos:pos + take]
            self._crc = zlib.crc32(block, self._crc)
            self._file.write(block.tobytes())
            self._in_chunk += take
            pos += take
            if self._in_chunk == self.chunk_records:
                self._crcs.append(self._crc)
                self._crc, self._in_chunk = 0, 0
        self.num_records += n

    def write_batch(self, batch: Batch) -> None:
        """Append a :class:`Batch` whose bags hold at most one id each."""
        ids = np.full((batch.batch_size, batch.num_sparse), -1, np.int64)
        for f in range(batch.num_sparse):
            n = batch.lengths[f]
            if n.size and n.max() > 1:
                raise ValueError(f"batch: feature {f} has bags of {int(n.max())} ids; the "
                                 f"binary format holds at most one id per feature")
            ids[n == 1, f] = batch.values[f]
        self.write(batch.dense, batch.labels, ids)

    def close(self) -> None:
        """Write the trailer and the header, fsync and rename into place."""
        if self._file is None:
            return
        if self._in_chunk:
            self._crcs.append(self._crc)
        trailer_offset = self.header_bytes + self.num_records * self.dtype.itemsize
        self._file.write(np.asarray(self._crcs, "<u4").tobytes())
        sizes = np.asarray(self.table_sizes, "<u8").tobytes()
        fields = [MAGIC, VERSION, self.header_bytes, self.num_records, self.num_dense,
                  self.num_sparse, self.id_bytes, self.dtype.itemsize, self.chunk_records,
                  _FLAG_EMPTY if self.empty_bags else 0, trailer_offset]
        head = _HEAD.pack(*fields, 0, 0)
        crc = zlib.crc32(sizes, zlib.crc32(head[:56]))
        self._file.seek(0)
        self._file.write(_HEAD.pack(*fields, crc, 0) + sizes)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the partial file."""
        if self._file is not None:
            self._file.close()
            self._file = None
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass


class BinaryDataset:
    """Random access to the records of a binary file through ``np.memmap``.

    Opening checks the header (magic, version, checksum) and the file size
    (a truncated file names its first incomplete record). ``read(start,
    stop)`` returns records ``[start, stop)`` as a :class:`Batch` after
    verifying the checksums of the chunks it touches (``verify``).
    """

    def __init__(self, path, verify: Verify | str = Verify.LAZY):
        self.path = os.fspath(path)
        self.verify_mode = enum_arg(Verify, verify, "verify")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(64)
            if len(head) < 64:
                raise DataFormatError(f"truncated header: {len(head)} of 64 bytes", path=self.path)
            (magic, version, header_bytes, n, nd, nf, id_bytes, rec_bytes, chunk, flags,
             trailer, crc, _) = _HEAD.unpack(head)
            if magic != MAGIC:
                raise DataFormatError(f"not a neocomm binary data file (magic {magic!r}, "
                                      f"expected {MAGIC!r})", path=self.path)
            if version != VERSION:
                raise DataFormatError(f"format version {version} is not supported (this "
                                      f"reader knows {VERSION})", path=self.path)
            sizes = f.read(8 * nf)
        if len(sizes) < 8 * nf or zlib.crc32(sizes, zlib.crc32(head[:56])) != crc:
            raise DataFormatError("header checksum mismatch (a corrupt or truncated header)",
                                  path=self.path)
        if id_bytes not in (4, 8) or chunk <= 0:
            raise DataFormatError(f"bad header fields id_bytes={id_bytes} chunk={chunk}",
                                  path=self.path)
        self.dtype = _record_dtype(nd, nf, id_bytes)
        if rec_bytes != self.dtype.itemsize or trailer != header_bytes + n * rec_bytes:
            raise DataFormatError("inconsistent header (record size or trailer offset)",
                                  path=self.path)
        self.num_records, self.num_dense, self.num_sparse = int(n), int(nd), int(nf)
        self.table_sizes = tuple(int(s) for s in np.frombuffer(sizes, "<u8"))
        self.chunk_records = int(chunk)
        self.empty_bags = bool(flags & _FLAG_EMPTY)
        self.header_bytes = int(header_bytes)
        num_chunks = -(-self.num_records // self.chunk_records)
        expected = trailer + 4 * num_chunks
        if size < expected:
            complete = max(size - header_bytes, 0) // rec_bytes
            first = min(complete, self.num_records)
            what = (f"record {first} is the first incomplete one" if first < self.num_records
                    else "the checksum trailer is cut")
            raise DataFormatError(f"truncated: the header declares {self.num_records} records "
                                  f"({expected} bytes), the file has {size} bytes; {what}",
                                  path=self.path, record=first if first < n else -1)
        if size > expected:
            raise DataFormatError(f"{size - expected} unexpected bytes after the trailer",
                                  path=self.path)
        self._crcs = np.fromfile(self.path, "<u4", num_chunks, offset=trailer)
        self._verified = np.zeros(num_chunks, bool)
        self.records = (np.memmap(self.path, self.dtype, "r", offset=header_bytes,
                                  shape=(self.num_records,))
                        if self.num_records else np.zeros(0, self.dtype))
        names = SPARSE_NAMES if nf == NUM_SPARSE else ()
        self.feature_names = tuple(names)
        if self.verify_mode is Verify.FULL:
            self.verify()

    def __len__(self) -> int:
        return self.num_records

    def verify(self, start: int = 0, stop: int | None = None) -> None:
        """Check the checksums of the chunks holding records ``[start, stop)``."""
        stop = self.num_records if stop is None else stop
        if stop <= start:
            return
        raw = self.records.view(np.uint8).reshape(-1) if self.num_records else None
        rb = self.dtype.itemsize
        for c in range(start // self.chunk_records, -(-stop // self.chunk_records)):
            if self._verified[c]:
                continue
            a = c * self.chunk_records
            b = min(a + self.chunk_records, self.num_records)
            got = zlib.crc32(raw[a * rb:b * rb])
            if got != int(self._crcs[c]):
                raise DataFormatError(f"records [{a}, {b}) fail their crc32 checksum: the "
                                      "file changed after it was written (a corrupt copy "
                                      "or disk)", path=self.path, record=a)
            self._verified[c] = True

    def read(self, start: int, stop: int) -> Batch:
        """Records ``[start, stop)`` as a :class:`Batch` (labels float32, ids int64)."""
        if not 0 <= start <= stop <= self.num_records:
            raise ValueError(f"start/stop: expected 0 <= start <= stop <= {self.num_records}, "
                             f"got {start}, {stop}")
        if self.verify_mode is not Verify.NONE:
            self.verify(start, stop)
        rec = self.records[start:stop]
        labels = np.asarray(rec["label"])
        bad = labels > 1
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataFormatError(f"label {int(labels[i])} is not 0 or 1", path=self.path,
                                  record=start + i)
        ids = np.asarray(rec["ids"], np.int64)
        _check_ids(ids, self.table_sizes, self.empty_bags, self.path, start)
        return Batch.from_ids(np.asarray(rec["dense"], np.float32), labels.astype(np.float32),
                              ids, self.feature_names)


def write_batches(path, batches, table_sizes, **writer_options) -> int:
    """Write every batch of the iterable ``batches`` to a new binary file; the record count."""
    with BinaryWriter(path, table_sizes, **writer_options) as w:
        for batch in batches:
            w.write_batch(batch)
        return w.num_records


def convert_text(inputs, output, preprocessor, *, chunk_lines: int = 1 << 16,
                 chunk_records: int = 1 << 16) -> int:
    """Convert Criteo text files (in order) to one binary file; the record count.

    ``preprocessor`` is a :class:`~embedding.data.criteo.Preprocessor`: its
    table sizes and missing-value policy go into the header.
    """
    from embedding.data.criteo import iter_raw_chunks
    from embedding.data.types import MissingCategorical

    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    empty = preprocessor.missing is MissingCategorical.EMPTY
    with BinaryWriter(output, preprocessor.table_sizes, chunk_records=chunk_records,
                      empty_bags=empty) as w:
        for path in inputs:
            for raw in iter_raw_chunks(path, chunk_lines):
                w.write(*preprocessor(raw))
        return w.num_records


def _check_ids(ids: np.ndarray, table_sizes, empty_bags: bool, path, first_record: int) -> None:
    """DataFormatError naming the record when an id lies outside its table (-1: empty bag)."""
    low = -1 if empty_bags else 0
    out = (ids < low) | (ids >= np.asarray(table_sizes))
    if out.any():
        i, f = (int(x) for x in np.argwhere(out)[0])
        raise DataFormatError(f"id {int(ids[i, f])} of feature {f} is outside "
                              f"[{low}, {table_sizes[f]})", path=path, record=first_record + i)
