"""Int8 exports of a trained model's tables, and a model's tables set from one for scoring.

:func:`export_int8` reads each table of a training checkpoint whole —
whatever world size and plan wrote it: a fixed table's rows are assembled
from its weight shards (:func:`~embedding.checkpoint.read_box`), a dynamic
table's live entries from every rank's (:func:`~embedding.train.state.
dynamic_entries`) — quantizes the rows (:mod:`embedding.checkpoint.fused8bit`)
and writes an :mod:`embedding.checkpoint.int8` export. Only the weights are
exported; optimizer state stays in the checkpoint.

:func:`load_export_weights` replaces a loaded model's table weights by an
export's dequantized rows, on every rank for its own shards, so that
``neocomm predict --tables EXPORT`` scores with the int8 tables and the
checkpoint's dense model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from embedding.checkpoint import Checkpoint, CheckpointError, CheckpointMismatchError, read_box
from embedding.checkpoint.fused8bit import (FUSED8BIT, check_format, dequantize_rows,
                                            fused_width, quantize_rows)
from embedding.checkpoint.int8 import (Int8Export, is_int8_export, source_record,
                                       write_int8_export)
from embedding.checkpoint.reshard import shard_box
from embedding.collection import assign
from embedding.train.save import find_checkpoint
from embedding.train.state import shard_pieces
from embedding.train.state import dynamic_entries

__all__ = ["export_int8", "load_export_weights"]

#: Float values read from the checkpoint at a time while exporting a fixed table (16 Mi).
_CHUNK_VALUES = 1 << 24


def export_int8(checkpoint, out, *, tables=None, fmt: str = FUSED8BIT) -> Path:
    """Export the tables of ``checkpoint`` as int8 rows in ``fmt`` under ``out``; returns the
    export's directory (``out/step-<step>``).

    ``checkpoint``: a checkpoint directory, a root of them or a training output
    directory (its latest). ``tables``: names to export (default: every table).
    Raises :class:`~embedding.checkpoint.CheckpointError` for a path that holds
    no training checkpoint, ValueError for an unknown table or format.
    """
    check_format(fmt, "format")
    ckpt = Checkpoint(find_checkpoint(checkpoint))
    if is_int8_export(ckpt):
        raise CheckpointError("this is an int8 export already, not a training checkpoint; "
                              "export from the checkpoint it was made from "
                              f"({ckpt.state['int8_export'].get('source', {}).get('path')})",
                              path=str(ckpt.path))
    saved = {t.name: t for t in ckpt.manifest.tables}
    if not saved:
        raise CheckpointError("the manifest records no embedding tables (not written by the "
                              "trainer?)", path=str(ckpt.path))
    names = list(saved) if tables is None else list(tables)
    for name in names:
        if name not in saved:
            raise ValueError(f"tables: no table {name!r} in checkpoint {ckpt.path}; it has "
                             f"{sorted(saved)}")
    if not names:
        raise ValueError("tables: expected at least one table name, got none")
    return write_int8_export(out, ckpt, (_quantized(ckpt, saved[n]) for n in names), fmt=fmt)


def _quantized(ckpt: Checkpoint, t):
    """``(table, ids or None, fused rows)`` of table ``t`` of ``ckpt``."""
    if t.dynamic:
        entries = dynamic_entries(ckpt, t.name)
        return t, entries["ids"], quantize_rows(entries["weight"])
    if (t.name, "weight") not in ckpt.tensors():
        raise CheckpointError(f"table {t.name!r}: no weight shards in the checkpoint",
                              path=str(ckpt.path))
    fused = np.empty((t.num_rows, fused_width(t.dim)), np.uint8)
    step = max(1, _CHUNK_VALUES // t.dim)
    for r0 in range(0, t.num_rows, step):
        n = min(step, t.num_rows - r0)
        rows = read_box(ckpt, t.name, "weight", (r0, 0), (n, t.dim))
        try:
            fused[r0:r0 + n] = quantize_rows(rows)
        except ValueError as exc:
            raise CheckpointError(f"table {t.name!r} (from row {r0}): {exc}",
                                  path=str(ckpt.path)) from None
    return t, None, fused


def load_export_weights(export, ckpt: Checkpoint, collection, plan) -> list[str]:
    """Set this rank's shards of every table in ``export`` (an :class:`Int8Export` or its path)
    to the export's dequantized rows; returns the names of the tables set.

    ``ckpt`` is the checkpoint the model was loaded from: the export must have
    been made from it (same manifest), and each exported table must match the
    model's (rows, dim, dynamic) — else :class:`CheckpointMismatchError`
    naming the field. Tables the export lacks keep their float32 rows. A
    dynamic table's entries keep their ids; their weights become the export's.
    """
    ex = export if isinstance(export, Int8Export) else Int8Export(export)
    here = source_record(ckpt)
    if ex.source.get("manifest_sha256") != here["manifest_sha256"]:
        raise CheckpointMismatchError(
            f"the export was made from {ex.source.get('path')} (step {ex.source.get('step')}), "
            f"not from this checkpoint {here['path']} (step {here['step']}); its tables would "
            f"not match the dense model", path=str(ex.path), field="source")
    model = {t.name: t for t in collection.tables}
    for name, rec in ex.tables.items():
        t = model.get(name)
        if t is None:
            raise CheckpointMismatchError(f"table {name!r} of the export is not in the model "
                                          f"(it has {sorted(model)})", path=str(ex.path),
                                          field=name)
        for field in ("num_rows", "dim", "dynamic"):
            if getattr(rec, field) != getattr(t, field):
                raise CheckpointMismatchError(
                    f"table {name!r}: {field} is {getattr(rec, field)} in the export, "
                    f"{getattr(t, field)} in the model", path=str(ex.path),
                    field=f"{name}.{field}")
    for s in collection.local_shards():
        if s.table in model and model[s.table].dynamic:
            if s.table not in ex.tables:
                continue
            ids, rows = s.tables.export(s.index)
            values = ex.lookup(s.table, ids)
            weight = s.tables.weight(s.index)
            weight[s.tables.xp.asarray(rows)] = s.tables.xp.asarray(values, weight.dtype)
            continue
        for name, local, shard, _ in shard_pieces(plan, s):  # a packed shard: its members
            if name not in ex.tables:
                continue
            t = model[name]
            offset, shape, stride = shard_box(shard, (t.num_rows, t.dim))
            fused = ex.fused(name)[offset[0]:offset[0] + shape[0] * stride[0]:stride[0]]
            values = dequantize_rows(fused)[:, offset[1]:offset[1] + shape[1]]
            assign(s.weight[local], values.astype(np.dtype(t.dtype), copy=False))
    return sorted(ex.tables)
