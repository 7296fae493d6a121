"""Int8 exports of embedding tables for serving: written as checkpoints, read by table.

An export is a checkpoint directory (``step-<step>`` under a root, written
atomically by :class:`~embedding.checkpoint.CheckpointWriter`, each file
checksummed, ``neocomm checkpoint inspect`` reads it) whose arrays are, per
table ``<t>``:

* ``int8/<t>/rows``: uint8 ``[n, dim + 8]``, one fused row per table row in
  :data:`~embedding.checkpoint.fused8bit.FUSED8BIT` layout (``dim`` codes,
  float32 scale, float32 bias: FBGEMM's byte for byte); ``n`` is the
  table's ``num_rows`` for a fixed table (row ``i`` is id ``i``);
* ``int8/<t>/ids``: int64 ``[n]`` ascending, for a dynamic table only: the
  id of each fused row (its live entries when the source was written).

The manifest's ``tables`` are the source's table configurations, its
``step`` the source's step, and ``state["int8_export"]`` records the
format, the source checkpoint (path, step, world size, SHA-256 of its
manifest) and per table ``num_rows``, ``dim``, ``dynamic`` and the rows
stored. :class:`Int8Export` reads it back.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedding.checkpoint.fused8bit import (FUSED8BIT, check_format, dequantize_rows,
                                            fused_width)
from embedding.checkpoint.reader import Checkpoint, load_checkpoint
from embedding.checkpoint.types import MANIFEST, CheckpointError
from embedding.checkpoint.writer import CheckpointWriter

__all__ = ["EXPORT_KEY", "ExportTable", "Int8Export", "write_int8_export", "is_int8_export",
           "source_record"]

#: The key of the manifest state that marks a checkpoint as an int8 export.
EXPORT_KEY = "int8_export"


@dataclass(frozen=True)
class ExportTable:
    """One exported table: ``num_rows`` x ``dim`` in the source (``dtype``), ``rows`` stored
    (``num_rows`` for a fixed table, the live entries for a dynamic one), in ``format``."""

    name: str
    num_rows: int
    dim: int
    dynamic: bool
    rows: int
    dtype: str
    format: str = FUSED8BIT

    def to_dict(self) -> dict:
        return {"num_rows": self.num_rows, "dim": self.dim, "dynamic": self.dynamic,
                "rows": self.rows, "dtype": self.dtype, "format": self.format}


def is_int8_export(ckpt: Checkpoint) -> bool:
    """Whether the opened checkpoint ``ckpt`` is an int8 export (not a training checkpoint)."""
    return isinstance(ckpt.state.get(EXPORT_KEY), dict)


def source_record(ckpt: Checkpoint) -> dict:
    """What an export records of its source checkpoint ``ckpt``: path, step, world size and
    the SHA-256 of its manifest (which names every file's checksum)."""
    digest = hashlib.sha256((ckpt.path / MANIFEST).read_bytes()).hexdigest()
    return {"path": str(ckpt.path.resolve()), "step": ckpt.step,
            "world_size": ckpt.manifest.world_size, "manifest_sha256": digest}


def write_int8_export(root, source: Checkpoint, tables, *, fmt: str = FUSED8BIT) -> Path:
    """Write an export of ``tables`` taken from ``source`` under ``root``; returns its directory
    (``root/step-<source step>``, replacing an export of the same step).

    ``tables``: ``(TableConfig, ids, fused)`` per table, ``ids`` None for a fixed table
    (``fused`` then has ``num_rows`` rows) or the int64 ids ascending of a dynamic one.
    """
    check_format(fmt)
    arrays, configs, info = {}, [], {}
    for t, ids, fused in tables:
        fused = np.asarray(fused)
        if fused.dtype != np.uint8 or fused.shape[1:] != (fused_width(t.dim),):
            raise ValueError(f"table {t.name!r}: expected uint8 rows of {fused_width(t.dim)} "
                             f"bytes, got {fused.dtype} {fused.shape}")
        if ids is None and fused.shape[0] != t.num_rows:
            raise ValueError(f"table {t.name!r}: a fixed table exports all {t.num_rows} rows, "
                             f"got {fused.shape[0]}")
        arrays[f"int8/{t.name}/rows"] = fused
        if ids is not None:
            ids = np.asarray(ids, np.int64)
            if ids.shape != (fused.shape[0],) or np.any(ids[1:] <= ids[:-1]):
                raise ValueError(f"table {t.name!r}: expected {fused.shape[0]} distinct ids "
                                 f"ascending, one per row")
            arrays[f"int8/{t.name}/ids"] = ids
        configs.append(t)
        info[t.name] = ExportTable(t.name, t.num_rows, t.dim, ids is not None,
                                   int(fused.shape[0]), t.dtype, fmt).to_dict()
    state = {EXPORT_KEY: {"format": fmt, "source": source_record(source), "tables": info}}
    writer = CheckpointWriter(root, source.step)
    writer.write(arrays)
    return writer.commit(tables=configs, state=state)


class Int8Export:
    """An int8 export, opened for reading: per table its fused rows, their dequantized float32
    values, and a lookup by row or id.

    ``path`` is an export directory or a root holding them (the newest is
    opened). Each file's checksum is verified on its first read (``verify``);
    arrays are memory-mapped, so a lookup reads only the rows it asks for.
    """

    def __init__(self, path, *, verify: bool = True):
        self.ckpt = load_checkpoint(path, verify=verify)
        self.path = self.ckpt.path
        meta = self.ckpt.state.get(EXPORT_KEY)
        if not isinstance(meta, dict):
            raise CheckpointError("not an int8 export (a training checkpoint? export its "
                                  "tables with `neocomm checkpoint export`)", path=str(self.path))
        try:
            self.format = check_format(meta.get("format"), f"{self.path}: format")
            self.source = dict(meta["source"])
            self.tables = {name: ExportTable(name, int(d["num_rows"]), int(d["dim"]),
                                             bool(d["dynamic"]), int(d["rows"]), str(d["dtype"]),
                                             check_format(d["format"], f"table {name!r}"))
                           for name, d in meta["tables"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"the export's manifest is malformed: {type(exc).__name__}: "
                                  f"{exc}", path=str(self.path)) from None

    @property
    def step(self) -> int:
        """The training step of the source checkpoint."""
        return self.ckpt.step

    def table(self, name: str) -> ExportTable:
        """The record of table ``name``; ValueError naming it and the tables there are."""
        t = self.tables.get(name)
        if t is None:
            raise ValueError(f"table: no table {name!r} in the export {self.path}; it has "
                             f"{sorted(self.tables)}")
        return t

    def fused(self, name: str) -> np.ndarray:
        """Table ``name``'s fused rows, uint8 ``[rows, dim + 8]`` (memory-mapped, read-only)."""
        self.table(name)
        return self._array(f"int8/{name}/rows")

    def ids(self, name: str) -> np.ndarray | None:
        """The id of each stored row of dynamic table ``name`` (int64 ascending); None for a
        fixed table, whose row ``i`` is id ``i``."""
        return self._array(f"int8/{name}/ids") if self.table(name).dynamic else None

    def rows(self, name: str) -> np.ndarray:
        """Table ``name``'s stored rows dequantized: float32 ``[rows, dim]``."""
        return dequantize_rows(self.fused(name))

    def lookup(self, name: str, ids, *, fused: bool = False) -> np.ndarray:
        """The rows of ``ids`` (int, any shape ``S``) of table ``name``: float32 ``S + [dim]``
        dequantized, or the raw uint8 ``S + [dim + 8]`` fused rows with ``fused=True``.

        A fixed table's ids are its rows: one outside ``[0, num_rows)`` is a
        ValueError naming it. A dynamic table's id that has no entry in the
        export reads as a row of zeros (its fused row: all zero bytes, so
        codes, scale and bias 0).
        """
        t = self.table(name)
        q = np.asarray(ids)
        if q.dtype.kind not in "iu":
            raise TypeError(f"ids: expected integer ids, got {q.dtype}")
        flat = q.reshape(-1).astype(np.int64)
        store = self.fused(name)
        if not t.dynamic:
            bad = (flat < 0) | (flat >= t.num_rows)
            if bad.any():
                raise ValueError(f"ids: id {int(flat[np.argmax(bad)])} is not a row of table "
                                 f"{name!r} (rows 0 to {t.num_rows - 1})")
            out = np.asarray(store[flat])
        else:
            known = self.ids(name)
            pos = np.searchsorted(known, flat)
            pos = np.minimum(pos, max(len(known) - 1, 0))
            hit = (known[pos] == flat) if len(known) else np.zeros(flat.shape, bool)
            out = np.zeros((flat.size, fused_width(t.dim)), np.uint8)
            out[hit] = store[pos[hit]]
        if not fused:
            out = dequantize_rows(out)
        return out.reshape(q.shape + out.shape[1:])

    def _array(self, name: str) -> np.ndarray:
        recs = [r for r in self.ckpt.manifest.files if r.name == name]
        if not recs:
            raise CheckpointError(f"array {name!r} is missing", path=str(self.path))
        return self.ckpt.open_array(recs[0])
